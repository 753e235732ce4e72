"""Generate text offline with the jitted engine and print tokens/s and tokens per forward.

    python tools/generate.py                                   # the embedded default model
    python tools/generate.py --model DIR --prompt "def fib(n):" --max-tokens 64 --threshold 0.9
    python tools/generate.py --decoding-strategy joint_threshold --decoding-preset speed --buffer-size 2
"""

import argparse
import time

import jax

from jaxllm import LLM, SamplingParams
from jaxllm.server.cli import ENGINE_FLAGS

# the decoding flags of `jaxllm serve`, by its names; left out, the engine's defaults (--strategy: an older name)
DECODING_FLAGS = {"--block-size", "--buffer-size", "--decoding-strategy", "--decoding-preset", "--threshold",
                  "--denoising-steps", "--editing-threshold", "--max-post-steps", "--add-block-threshold",
                  "--semi-complete-threshold", "--quantization"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF checkpoint directory (default: the embedded default model)")
    parser.add_argument("--prompt", action="append", help="repeat for a batch (default: a few code prompts)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    for flag, kind, text in ENGINE_FLAGS:
        if flag in DECODING_FLAGS:
            parser.add_argument(*([flag, "--strategy"] if flag == "--decoding-strategy" else [flag]), type=kind,
                                help=text)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help="default: bfloat16 on an accelerator, float32 on the CPU (where bf16 runs ~2x slower)")
    parser.add_argument("--max-model-len", type=int, default=512, help="prompt + output tokens per request")
    args = parser.parse_args()

    prompts = args.prompt or ['def parse_args(argv):\n    """', "def ", "class Stack:\n    def push(self, item):\n"]
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    options = {name: getattr(args, name) for name in (flag[2:].replace("-", "_") for flag in DECODING_FLAGS)
               if getattr(args, name) is not None}
    options |= dict(dtype=dtype, max_num_seqs=len(prompts), max_model_len=args.max_model_len,
                    enable_prefix_caching=False)  # the timed run repeats the warm-up's prompts: time their prefill too
    llm = LLM(args.model, **options)
    if args.chat:
        prompts = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    llm.generate(prompts, params)  # the same run first: it compiles every shape the timed run meets
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs):
        shown = prompt if isinstance(prompt, str) else llm.engine.tokenizer.decode(prompt)
        print(f"--- prompt ---\n{shown}\n--- completion ({output.finish_reason}) ---\n{output.text}\n")
    generated = sum(len(o.token_ids) for o in outputs)
    forwards = sum(o.forward_passes for o in outputs)
    per_forward = f"{generated / forwards:.2f}" if forwards else "no"
    print(f"{generated} tokens in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s; each request took part in "
          f"{forwards / len(outputs):.1f} forward passes on average: {per_forward} tokens per forward")


if __name__ == "__main__":
    main()
