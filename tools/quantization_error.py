"""What int8 / fp8 expert weights cost in accuracy: logits against the unquantized model in float32.

The model with quantized experts, and for scale the unquantized model in the same dtype, run on random prompts.

Reported per setting: ||logits - ref|| / ||ref|| over every position, and the share of positions whose top token is
unchanged. Attention is block-causal at the model's block size, as in block-diffusion decoding.

  python -m tools.quantization_error --model DIR [--dtype bfloat16] [--prompts 4] [--length 64]
  python -m tools.quantization_error          # on a tiny random LLaDA2 checkpoint made on the fly
"""

import argparse
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.models import load_model, model_config
from jaxllm.models.layers import DenseMetadata
from tools.make_checkpoint import make_checkpoint


@jax.jit
def _logits(graphdef_and_params, tokens, mask):
    graphdef, params = graphdef_and_params
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, _ = model(tokens, None, DenseMetadata(positions=positions, mask=mask))
    return model.logits(hidden)


def block_causal_mask(length: int, block_size: int) -> jax.Array:
    """bool[1, T, T]: query i sees key j when j's block is not after i's."""
    blocks = jnp.arange(length) // block_size
    return (blocks[None, :] <= blocks[:, None])[None]


def model_logits(model_dir, dtype: str, quantization: str | None, tokens: np.ndarray) -> np.ndarray:
    cfg = model_config(model_dir)
    model = load_model(model_dir, cfg, dtype, quantization=quantization)
    mask = block_causal_mask(tokens.shape[1], cfg.default_block_size)
    return np.asarray(_logits(nnx.split(model), jnp.asarray(tokens), mask), np.float32)


def compare(logits: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    return {"relative_error": float(np.linalg.norm(logits - reference) / np.linalg.norm(reference)),
            "top1_agreement": float(np.mean(logits.argmax(-1) == reference.argmax(-1)))}


def quantization_errors(model_dir, *, dtype: str = "bfloat16", modes=("int8", "fp8"), num_prompts: int = 4,
                        length: int = 64, seed: int = 0) -> dict[str, dict[str, float]]:
    """{setting: compare(...)} for the unquantized model in `dtype` and each quantization mode, against float32."""
    vocab = model_config(model_dir).vocab_size
    tokens = np.random.default_rng(seed).integers(0, vocab, (num_prompts, length), dtype=np.int32)
    reference = model_logits(model_dir, "float32", None, tokens)
    results = {dtype: compare(model_logits(model_dir, dtype, None, tokens), reference)}
    for mode in modes:
        results[f"{dtype} + {mode} experts"] = compare(model_logits(model_dir, dtype, mode, tokens), reference)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=pathlib.Path, help="an MoE checkpoint (default: tiny LLaDA2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or make_checkpoint(pathlib.Path(scratch), "llada2", size="tiny", dtype="f32")
        results = quantization_errors(model_dir, dtype=args.dtype, num_prompts=args.prompts, length=args.length,
                                      seed=args.seed)
    print(f"{'setting':<26} {'rel. logit error':>16} {'top-1 agreement':>16}   (vs float32, unquantized)")
    for setting, row in results.items():
        print(f"{setting:<26} {row['relative_error']:16.5f} {row['top1_agreement']:16.3f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
