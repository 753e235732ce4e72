"""PyTorch + transformers eager baseline: one block-diffusion denoise forward on the same shapes as bench_offline.

    python -m tools.bench_torch_forward --arch llada2 --batch 1 8 --block 32 --context 512

Random bf16 weights made on the GPU. Glm4MoeForCausalLM stands in for LLaDA2 and Qwen3ForCausalLM for SDAR
(models.md §1.5, §2). Each timed forward runs `block` new tokens per request over a cache of `context` committed
tokens with a bidirectional in-block mask, then crops the cache back, as a KV-cached dLLM denoise step does.
"""

import argparse
import time

import torch
from transformers import DynamicCache, Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM

from tools.make_checkpoint import build_config


def torch_model(arch: str):
    hf = build_config(arch, "full", "bf16")
    common = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                  intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
                  num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_key_value_heads"],
                  head_dim=hf["head_dim"], rms_norm_eps=hf["rms_norm_eps"], tie_word_embeddings=False,
                  max_position_embeddings=hf["max_position_embeddings"], attn_implementation="sdpa")
    if arch == "sdar":
        config = Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": hf["rope_theta"]})
        model_class = Qwen3ForCausalLM
    else:
        config = Glm4MoeConfig(
            **common, rope_parameters={"rope_type": "default", "rope_theta": hf["rope_theta"],
                                       "partial_rotary_factor": hf["partial_rotary_factor"]},
            moe_intermediate_size=hf["moe_intermediate_size"], num_experts_per_tok=hf["num_experts_per_tok"],
            n_shared_experts=hf["num_shared_experts"], n_routed_experts=hf["num_experts"],
            routed_scaling_factor=hf["routed_scaling_factor"], n_group=hf["n_group"], topk_group=hf["topk_group"],
            first_k_dense_replace=hf["first_k_dense_replace"], norm_topk_prob=True, use_qk_norm=True)
        model_class = Glm4MoeForCausalLM
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = model_class(config)
    return model.eval()


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
    args = parser.parse_args()
    model = torch_model(args.arch)
    print("arch | batch | torch_ms_per_forward")
    for batch in args.batch:
        print(f"{args.arch} | {batch} | {time_forward(model, batch, args.block, args.context, args.reps):.2f}")


if __name__ == "__main__":
    main()
