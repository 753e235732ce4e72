"""`jaxllm serve`: load a model, compile its shape buckets and serve the OpenAI-compatible API from one process.

    jaxllm serve --model DIR [--port 8000] [--max-num-seqs 8] [--block-size 4] [--api-key KEY] ...

Engine flags keep vLLM's names where the meaning matches; a flag left out keeps the engine's default. With no
--model the embedded default model is served. The exit status is 1 when the engine failed, at start-up or later.
"""

import argparse
import logging
import os
import pathlib
import sys
import typing

# only light modules here: flags and options are checked before JAX, transformers and Sanic load (seconds), in serve
from jaxllm.config import DEFAULT_MODEL_DIR, ConfigError, split_options
from jaxllm.server import DEFAULT_RESPONSE_TIMEOUT_S, DEFAULT_SSE_KEEPALIVE_S, check_sse_keepalive

if typing.TYPE_CHECKING:
    from sanic import Sanic

logger = logging.getLogger("jaxllm.server")

DEFAULT_MODEL_NAME = "jaxllm-default"
LISTEN_BACKLOG = 1024  # a burst of clients connecting at once must not overflow the accept queue

# (flag, type, help): each sets the EngineConfig / DecodingConfig option of the same name (split_options)
ENGINE_FLAGS = [
    ("--max-model-len", int, "context length (prompt + output) in tokens"),
    ("--max-num-seqs", int, "requests decoded together at most"),
    ("--max-num-batched-tokens", int, "prompt tokens per prefill step"),
    ("--block-size", int, "tokens per diffusion block (default: the model's)"),
    ("--page-size", int, "tokens per KV page; a multiple of the block size"),
    ("--buffer-size", int, "blocks in flight per request"),
    ("--decoding-strategy", str, "threshold | fixed_steps | joint_threshold"),
    ("--decoding-preset", str, "joint_threshold: LLaDA2.1's quality | speed settings (explicit flags override)"),
    ("--threshold", float, "commit masked positions whose confidence reaches this"),
    ("--denoising-steps", int, "fixed_steps: steps per block (default: the block size)"),
    ("--editing-threshold", float, "joint_threshold: rewrite a filled token whose new candidate beats this"),
    ("--max-post-steps", int, "joint_threshold: editing steps after a block has no masks"),
    ("--add-block-threshold", float, "buffer_size > 1: open the next block at this fraction unmasked"),
    ("--semi-complete-threshold", float, "buffer_size > 1 (not fixed_steps): force top-1 once the previous block is "
     "this full"),
    ("--dtype", str, "bfloat16 | float32"),
    ("--quantization", str, "int8 | fp8"),
    ("--num-pages", int, "KV pool size in pages (default: sized from --gpu-memory-utilization)"),
    ("--gpu-memory-utilization", float, "fraction of device memory for weights and KV pages"),
    ("--max-waiting-requests", int, "queued requests at most; more get 429"),
    ("--max-queue-time", float, "seconds a request may wait to be scheduled; later it gets 408 (default: no limit)"),
    ("--max-steps-per-round", int, "denoising steps per device call (default: enough to finish a block); lower "
                                   "lets arriving requests start sooner at some throughput"),
    ("--min-logit-rows", int, "fewest rows the LM head runs on when a step reads fewer positions than the batch "
                              "holds (default 256)"),
    ("--compilation-cache-dir", str, "persistent XLA compilation cache, so a restart compiles nothing"),
    ("--seed", int, "draws seeds for requests that bring none"),
]


def _sse_keepalive(text: str) -> float:
    try:
        return check_sse_keepalive(float(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="jaxllm: a JAX serving engine for diffusion LLMs")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                description=__doc__.splitlines()[0])
    serve.add_argument("--model", help="checkpoint directory (default: the embedded default model)")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the --model value)")
    serve.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                       help="require `Authorization: Bearer KEY` on /v1/* (default: $JAXLLM_API_KEY)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--response-timeout", type=float, default=DEFAULT_RESPONSE_TIMEOUT_S,
                       help="seconds a non-streamed request may generate before it is cut")
    serve.add_argument("--sse-keepalive-interval", type=_sse_keepalive, default=DEFAULT_SSE_KEEPALIVE_S,
                       help="seconds of silence (queued, prefilling) after which a stream gets a `: ping` comment")
    for flag, kind, text in ENGINE_FLAGS:
        serve.add_argument(flag, type=kind, help=text)
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="share KV pages of common prompt prefixes (default: on)")
    serve.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                       help="the same arithmetic for a request alone or in any batch, so the same tokens, "
                            "at some speed (default: off)")
    return parser


def engine_options(args: argparse.Namespace) -> dict:
    names = [flag[2:].replace("-", "_") for flag, _, _ in ENGINE_FLAGS] + ["enable_prefix_caching", "batch_invariant"]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    model_dir = pathlib.Path(args.model) if args.model else DEFAULT_MODEL_DIR
    if not model_dir.is_dir():
        parser.error(f"--model {model_dir} is not a directory")
    try:
        engine_config, decoding_config = split_options(engine_options(args))
    except (ConfigError, TypeError) as error:
        parser.error(str(error))
    from jaxllm.engine.engine import LLMEngine
    from jaxllm.server.app import create_app
    from jaxllm.server.protocol import SamplingDefaults

    app = create_app(lambda: LLMEngine(model_dir, engine_config, decoding_config),
                     model_name=args.served_model_name or args.model or DEFAULT_MODEL_NAME,
                     sampling_defaults=SamplingDefaults.from_model_dir(model_dir), api_key=args.api_key,
                     response_timeout=args.response_timeout, sse_keepalive_s=args.sse_keepalive_interval)
    logger.info("serving %s on http://%s:%d", model_dir, args.host, args.port)
    return run(app, args.host, args.port)


def run(app: "Sanic", host: str, port: int) -> int:
    """Serve until stopped; the exit status: 1 if the engine failed, so that a supervisor restarts the server."""
    app.run(host=host, port=port, single_process=True, access_log=False, backlog=LISTEN_BACKLOG, motd=False)
    return 1 if app.ctx.serving.engine_loop.failure is not None else 0


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("jaxllm", "sanic"):  # libraries (jax, transformers) stay at warnings
        logging.getLogger(name).setLevel(args.log_level.upper())
    sys.exit(serve(args, parser))
