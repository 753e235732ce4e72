"""PyTorch + transformers eager baseline: one block-diffusion denoise forward on the same shapes as bench_offline.

    python -m tools.bench_torch_forward --arch llada2 --batch 1 8 --block 32 --context 512

Random bf16 weights made on the GPU. Glm4MoeForCausalLM stands in for LLaDA2 and Qwen3ForCausalLM for SDAR
(models.md §1.5, §2). Each timed forward runs `block` new tokens per request over a cache of `context` committed
tokens with a bidirectional in-block mask, then crops the cache back, as a KV-cached dLLM denoise step does.
"""

import argparse
import time

import torch
from transformers import DynamicCache

from tools.make_checkpoint import build_config
from tools.torch_stand_ins import stand_in


def torch_model(arch: str, qk_norm_scale: float = 1.0):
    model_class, config = stand_in(build_config(arch, "full", "bf16"))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = model_class(config)
    if qk_norm_scale != 1:
        scale_qk_norms(model, qk_norm_scale)
    return model.eval()


@torch.no_grad()
def scale_qk_norms(model, scale: float) -> None:
    """Multiply the q / k norm weights by scale, as bench_offline's --qk-norm-scale does to jaxllm's."""
    norms = [weight for name, weight in model.named_parameters() if ".q_norm." in name or ".k_norm." in name]
    if not norms:
        raise ValueError(f"{type(model).__name__} has no q / k norms to scale")
    for weight in norms:
        weight.mul_(scale)


@torch.no_grad()
def time_forward(model, batch: int, block: int, context: int, reps: int) -> float:
    vocab = model.config.vocab_size
    cache = DynamicCache()
    prompt = torch.randint(4, vocab, (batch, context), device="cuda")
    model(prompt, past_key_values=cache, use_cache=True)
    tokens = torch.randint(4, vocab, (batch, block), device="cuda")
    mask = torch.ones(batch, 1, block, context + block, dtype=torch.bool, device="cuda")
    positions = torch.arange(context, context + block, device="cuda").expand(batch, block)

    def forward():
        model(tokens, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        cache.crop(context)

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["sdar", "llada2"], required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--qk-norm-scale", type=float, default=1.0, help="as bench_offline's")
    args = parser.parse_args()
    model = torch_model(args.arch, args.qk_norm_scale)
    print("arch | batch | torch_ms_per_forward")
    for batch in args.batch:
        print(f"{args.arch} | {batch} | {time_forward(model, batch, args.block, args.context, args.reps):.2f}")


if __name__ == "__main__":
    main()
