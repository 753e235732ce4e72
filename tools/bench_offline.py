"""Offline throughput: N random prompts through the engine, and each forward's time against its floor.

    python -m tools.bench_offline --model DIR --num-prompts 8 --input-len 512 --output-len 64 --batch 8
    python -m tools.bench_offline --arch llada2 --size full --batch 1 8 32   # random weights made on the device
    python -m tools.bench_offline --arch llada2 --size full --random-weights --qk-norm-scale 3   # routing spread

Reports output tokens/s, forward passes/s, time per forward, and the floor of one forward: the bytes of weights (only
the experts the batch's tokens touch, for MoE) and KV it must read over the copy bandwidth, and its FLOPs over the
matmul rate (the LM head's on the rows the strategy reads, for fixed_steps); the floor is the larger of the two. The
op floor sums each step's own larger term instead (steps run one after another; see `forward_floor`). Use
fixed_steps so tokens per forward is known.

For MoE models the touched experts are counted, not assumed: the benchmark's own windows (prompt + generated block,
with a random subset of the block still masked, at several denoising steps) are routed through the model and the
distinct experts per layer of the whole batch are averaged. `--steps-per-round` re-times the run at other step caps
(a runtime value: nothing recompiles) to show what each return to the host costs.
"""

import argparse
import functools
import json
import os
import pathlib
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.config import ModelConfig
from jaxllm.models import model_config
from jaxllm.models.layers import DenseMetadata
from tools.device_profile import device_kernel_times, hlo_dump_flags, print_kernel_table

PROFILE_SCOPES = ("paged_attention", "moe_experts", "lm_head", "sampler")
COLUMNS = ["model", "batch", "block_size", "steps_per_round", "rounds", "seconds", "output_tokens_per_s",
           "forwards_per_s", "tokens_per_forward", "ms_per_forward", "ms_spread", "experts_touched", "floor_ms",
           "floor_bound", "gb_per_forward", "floor_ratio", "op_floor_ms", "op_floor_ratio"]

COPY_BANDWIDTH = 4.1e12  # B/s, H200 device-to-device copy (read + write), measured
MATMUL_RATE = 790e12  # FLOP/s, H200 bf16 matmul, measured


def touched_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts hit by num_tokens tokens routed uniformly to top_k of num_experts."""
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


class Step(NamedTuple):
    """A part of the forward with a floor of its own, run `count` times."""

    name: str
    count: int
    bytes: float  # each time
    flops: float  # each time


def forward_steps(cfg: ModelConfig, batch: int, window: int, context: int, weight_bytes: int = 2,
                  kv_bytes: int = 2, experts_touched: float | None = None, expert_weight_bytes: int | None = None,
                  logit_rows: int | None = None) -> list[Step]:
    """The steps of one denoising forward, each with the weight (for MoE, only the experts the batch's tokens touch;
    experts_touched per MoE layer defaults to the expectation under uniform routing) and KV bytes it reads and its
    matmul FLOPs. expert_weight_bytes: bytes per routed-expert weight (1 with int8 / fp8 experts; the other weights
    keep weight_bytes). logit_rows: rows the LM head runs on (default: every window row). Parts of one arithmetic
    intensity are one step (QKV and o_proj; gate/up and down), so the per-step floor is the same as theirs."""
    tokens = batch * window
    hidden, head = cfg.hidden_size, cfg.head_dim
    projections = hidden * (cfg.num_heads + 2 * cfg.num_kv_heads) * head + cfg.num_heads * head * hidden
    kv_bytes_per_layer = (batch * context + tokens) * 2 * cfg.num_kv_heads * head * kv_bytes
    attention_flops = 4 * tokens * (context + window) * cfg.num_heads * head
    steps = [Step("attention projections", cfg.num_layers, projections * weight_bytes, 2 * tokens * projections),
             Step("attention", cfg.num_layers, kv_bytes_per_layer, attention_flops)]
    dense_mlp = 3 * hidden * cfg.intermediate_size
    if cfg.moe is None:
        steps.append(Step("mlp", cfg.num_layers, dense_mlp * weight_bytes, 2 * tokens * dense_mlp))
    else:
        moe = cfg.moe
        num_moe = cfg.num_layers - moe.first_k_dense_replace
        expert = 3 * hidden * moe.moe_intermediate_size
        if experts_touched is None:
            experts_touched = touched_experts(moe.num_experts, moe.num_experts_per_tok, tokens)
        router = hidden * moe.num_experts
        steps += [Step("mlp", moe.first_k_dense_replace, dense_mlp * weight_bytes, 2 * tokens * dense_mlp),
                  Step("router", num_moe, router * weight_bytes, 2 * tokens * router),
                  Step("experts", num_moe,
                       experts_touched * expert * (expert_weight_bytes or weight_bytes)
                       + moe.num_shared_experts * expert * weight_bytes,
                       2 * tokens * (moe.num_experts_per_tok + moe.num_shared_experts) * expert)]
    lm_head = cfg.vocab_size * hidden
    rows = tokens if logit_rows is None else logit_rows
    steps.append(Step("lm head", 1, lm_head * weight_bytes, 2 * rows * lm_head))
    return steps


def forward_floor(cfg: ModelConfig, batch: int, window: int, context: int, **step_options) -> dict:
    """Bytes that must move and FLOPs that must run in one denoising forward (`forward_steps`, whose options it
    takes). floor_ms: the larger of all bytes over the copy bandwidth and all FLOPs over the matmul rate (the
    issue's floor: compute-bound steps hidden behind memory-bound ones). op_floor_ms: each step's own larger term,
    summed -- the floor of running the steps one after another, as one stream does; at batch 32 the dense GEMMs
    and the LM head are compute-bound while the experts stream their weights, and the two floors part."""
    steps = forward_steps(cfg, batch, window, context, **step_options)
    bytes_moved = sum(step.count * step.bytes for step in steps)
    flops = sum(step.count * step.flops for step in steps)
    memory_s, compute_s = bytes_moved / COPY_BANDWIDTH, flops / MATMUL_RATE
    op_floor_s = sum(step.count * max(step.bytes / COPY_BANDWIDTH, step.flops / MATMUL_RATE) for step in steps)
    return dict(bytes=bytes_moved, flops=flops, floor_ms=1e3 * max(memory_s, compute_s),
                bound="memory" if memory_s >= compute_s else "compute", op_floor_ms=1e3 * op_floor_s)


def random_prompts(llm: LLM, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, len(llm.engine.tokenizer), input_len).tolist() for _ in range(num_prompts)]


def run(llm: LLM, prompts: list[list[int]], output_len: int, steps_per_round: int | None = None,
        sampling: dict | None = None) -> dict:
    """Time one generate of the prompts; the first call of a shape must come after a warm-up generate.

    sampling: SamplingParams fields beyond the lengths (temperature, top_k, top_p, seed); None is greedy."""
    engine = llm.engine
    if steps_per_round is not None:
        engine.runner.max_steps_per_round = steps_per_round
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **(sampling or {}))
    forwards_before, decode_before, rounds_before = engine.num_forwards, engine.decode_time, engine.num_decode_rounds
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    forwards = engine.num_forwards - forwards_before
    decode_time = engine.decode_time - decode_before
    generated = sum(len(o.token_ids) for o in outputs)
    return dict(num_prompts=len(prompts), input_len=len(prompts[0]), output_len=output_len,
                steps_per_round=engine.runner.max_steps_per_round, seconds=round(elapsed, 3),
                output_tokens_per_s=round(generated / elapsed, 1), forwards=forwards,
                rounds=engine.num_decode_rounds - rounds_before, forwards_per_s=round(forwards / decode_time, 2),
                ms_per_forward=round(1e3 * decode_time / forwards, 3),
                tokens_per_forward=round(np.mean([o.stats["tokens_per_forward"] for o in outputs]), 3),
                outputs=[o.token_ids for o in outputs])


def first_difference_alone(llm: LLM, prompt: list[int], batch_tokens: list[int], output_len: int,
                           sampling: dict | None = None) -> int | None:
    """Decode `prompt` alone and compare with the tokens it got in a batch: the first position where they differ,
    None where they are equal. Greedy and seeded output must not depend on the batch (README, Decoding); on a GPU
    the bf16 GEMMs may pick other algorithms per batch bucket, which only a run at full size shows."""
    alone = run(llm, [prompt], output_len, sampling=sampling)["outputs"][0]
    differing = [i for i, (a, b) in enumerate(zip(alone, batch_tokens)) if a != b]
    if differing:
        return differing[0]
    return None if len(alone) == len(batch_tokens) else min(len(alone), len(batch_tokens))


def median_run(results: list[dict]) -> dict:
    """The run with the median time per forward (one run of 33 forwards at batch 1 lasts ~0.1 s on the H200, and
    single runs of the same code differed by up to 6%), with the spread of all of them."""
    times = [r["ms_per_forward"] for r in results]
    middle = sorted(results, key=lambda r: r["ms_per_forward"])[(len(results) - 1) // 2]
    return middle | dict(ms_spread=round(max(times) - min(times), 3), ms_per_forward_runs=times)


def measured_touched_experts(llm: LLM, prompts: list[list[int]], outputs: list[list[int]], seed: int,
                             num_states: int = 8) -> float | None:
    """Distinct experts per MoE layer that one denoising forward of this batch routes to, averaged over layers and
    over num_states denoising states (each: prompt + its first generated block, a random part still masked)."""
    engine = llm.engine
    block, mask_id = engine.block_size, engine.mask_token_id
    length = len(prompts[0]) + block
    block_ids = np.arange(length) // block
    mask = jnp.asarray(block_ids[:, None] >= block_ids[None, :])[None]  # block-causal, as prefill + decode see it
    positions = jnp.arange(length, dtype=jnp.int32)[None]

    @jax.jit
    def route(params, tokens):  # i32[1, length] -> {layer path: i32[block, top_k]} window tokens' experts
        model = nnx.merge(engine.runner.graphdef, params)
        model(tokens, None, DenseMetadata(positions, mask))
        routed = nnx.pop(model, nnx.Intermediate)
        return [ids[-block:] for ids in jax.tree.leaves(routed)]  # ids: [length, top_k] (batch 1, flat)

    rng = np.random.default_rng(seed)
    per_state = []
    for state in range(num_states):
        still_masked = rng.permutation(block)[:block - state * block // num_states]  # the same in every request
        used = None
        for prompt, output in zip(prompts, outputs):
            window = np.full(block, mask_id)  # an output shorter than a block leaves the rest of it masked
            window[:len(output[:block])] = output[:block]
            window[still_masked] = mask_id
            layers = route(engine.runner.params, jnp.asarray([prompt + window.tolist()], jnp.int32))
            hits = [np.bincount(np.asarray(ids).ravel(), minlength=engine.model_config.moe.num_experts) > 0
                    for ids in layers]
            used = hits if used is None else [u | h for u, h in zip(used, hits)]
        if not used:
            return None
        per_state.append(np.mean([u.sum() for u in used]))
    return float(np.mean(per_state))


def sharpen_attention(llm: LLM, qk_norm_scale: float) -> None:
    """Multiply the q / k norm weights by qk_norm_scale (attention logits by its square). Random norm weights near
    one leave attention nearly uniform, so a block's mask tokens, alike but for their positions, reach each router
    alike and pick much the same experts (full-size LLaDA2 at batch 1: 35 of 256 per layer, where uniform routing, as
    the issue's floors assume, touches 163); a trained model's attention tells positions apart. At 3: 146."""
    runner = llm.engine.runner
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(runner.params)[0]]
    is_qk_norm = ["q_norm" in path or "k_norm" in path for path in paths]
    if not any(is_qk_norm):
        raise ValueError(f"{llm.engine.model_config.model_type} has no q / k norms to scale")
    runner.weights = [weight * qk_norm_scale if scaled else weight
                      for weight, scaled in zip(runner.weights, is_qk_norm)]


def model_dir_for(args, scratch: pathlib.Path) -> pathlib.Path:
    """--model, or a checkpoint made in scratch (a full-size one with weights is 32 GB)."""
    if args.model:
        return pathlib.Path(args.model)
    from tools.make_checkpoint import make_checkpoint
    return make_checkpoint(scratch, args.arch, size=args.size, dtype="bf16", with_weights=not args.random_weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: make one with --arch/--size)")
    parser.add_argument("--arch", choices=["sdar", "llada2"], default="sdar")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--random-weights", action="store_true", help="make weights on the device, skip the files")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="requests in flight (one run each)")
    parser.add_argument("--num-prompts", type=int, help="prompts per run (default: the batch size)")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--strategy", default="fixed_steps", choices=["fixed_steps", "threshold"])
    parser.add_argument("--denoising-steps", type=int, help="fixed_steps: steps per block (default: block size)")
    parser.add_argument("--threshold", type=float)
    parser.add_argument("--min-logit-rows", type=int, help="fewest rows the LM head runs on (default: the engine's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=["int8", "fp8"])
    parser.add_argument("--qk-norm-scale", type=float, default=1.0,
                        help="multiply the q / k norm weights (e.g. 3 with --random-weights: random weights route a "
                        "block's tokens to few experts unless attention tells their positions apart)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the sampler's fast path)")
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per configuration; the row is the median run, ms_spread their max - min")
    parser.add_argument("--steps-per-round", type=int, nargs="*", default=[],
                        help="also time these step caps (denoising steps per device call) at each batch size")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile one more run per batch size and print the N slowest kernels (GPU)")
    parser.add_argument("--hlo-dump-dir", help="with --profile: keep XLA's optimized HLO here (default: a temporary "
                        "directory), e.g. to see which kernels XLA put into command buffers")
    parser.add_argument("--check-batch-invariance", action="store_true",
                        help="also decode the first prompt alone and report where its tokens first differ from the "
                        "batch's (batch sizes > 1)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the engine's batch_invariant mode (every GEMM, the attention and the experts tiled alike "
                        "at any batch)")
    parser.add_argument("--json", help="append one JSON line per run to this file")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.num_prompts and len(args.batch) > 1:  # one engine holds max(batch) in flight: every row would run at it
        parser.error("--num-prompts takes a single --batch size")
    hlo_dump = None
    if args.profile:
        temporary_dump = None if args.hlo_dump_dir else tempfile.TemporaryDirectory(prefix="bench_offline_hlo_")
        hlo_dump = args.hlo_dump_dir or temporary_dump.name
    if hlo_dump:  # the optimized HLO names each profiled kernel's source; set before JAX starts its backend
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {hlo_dump_flags(hlo_dump)}"

    # one engine: weights made once, a compile per batch size; it reads the checkpoint whole as it starts
    with tempfile.TemporaryDirectory(prefix=f"bench_{args.arch}_") as scratch:
        llm = make_llm(args, model_dir_for(args, pathlib.Path(scratch)), max(args.batch))
    if args.qk_norm_scale != 1:
        sharpen_attention(llm, args.qk_norm_scale)
    cfg = llm.engine.model_config
    default_cap = llm.engine.runner.max_steps_per_round
    print(" | ".join(COLUMNS), flush=True)  # rows print as they finish: a run cut short keeps what it measured
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    timed = functools.partial(run, llm, sampling=sampling)
    for batch in args.batch:
        prompts = random_prompts(llm, args.num_prompts or batch, args.input_len, args.seed)
        timed(prompts, args.output_len)  # the same run first: it compiles every shape the timed run meets
        runs = [median_run([timed(prompts, args.output_len, cap) for _ in range(args.repeats)])
                for cap in [default_cap, *args.steps_per_round]]
        llm.engine.runner.max_steps_per_round = default_cap
        if args.profile:  # before the expert count: the H200 ran the next round 8% slower after that other jit
            forwards_before = llm.engine.num_forwards
            profile = device_kernel_times(functools.partial(timed, prompts, args.output_len), PROFILE_SCOPES, hlo_dump)
            print(f"profile: {cfg.model_type} batch {batch}")
            print_kernel_table(*profile, top=args.profile, per=llm.engine.num_forwards - forwards_before,
                               unit="forward (the run's prefill included)")
        invariance = {}
        if args.check_batch_invariance and batch > 1:
            differs_at = first_difference_alone(llm, prompts[0], runs[0]["outputs"][0], args.output_len, sampling)
            invariance = dict(first_difference_alone=differs_at)
            print(f"batch {batch}: the first prompt decoded alone "
                  f"{'gives the same tokens' if differs_at is None else f'differs from token {differs_at}'}")
        experts = None
        if cfg.moe is not None:
            experts = measured_touched_experts(llm, prompts, runs[0]["outputs"], args.seed)
        block = llm.engine.block_size
        # fixed_steps reads each block's still-masked rows: block, ..., block / steps of them over a block's steps,
        # none in its verifying forward -- block / 2 per request per forward; the threshold strategy's are unknown
        logit_rows = batch * block // 2 if args.strategy == "fixed_steps" else None
        floor = forward_floor(cfg, batch, block, args.input_len + args.output_len // 2, experts_touched=experts,
                              expert_weight_bytes=1 if args.quantization else 2, logit_rows=logit_rows)
        for result in runs:
            del result["outputs"]
            result |= dict(model=cfg.model_type, batch=batch, block_size=llm.engine.block_size,
                           experts_touched=None if experts is None else round(experts, 1),
                           floor_ms=round(floor["floor_ms"], 3), floor_bound=floor["bound"],
                           gb_per_forward=round(floor["bytes"] / 1e9, 2),
                           floor_ratio=round(result["ms_per_forward"] / floor["floor_ms"], 2),
                           op_floor_ms=round(floor["op_floor_ms"], 3),
                           op_floor_ratio=round(result["ms_per_forward"] / floor["op_floor_ms"], 2),
                           quantization=args.quantization, qk_norm_scale=args.qk_norm_scale,
                           batch_invariant=args.batch_invariant,
                           **{k: v for k, v in sampling.items() if k != "seed"}, **invariance)
            print(" | ".join(str(result[c]) for c in COLUMNS), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(result) + "\n")


def make_llm(args, model_dir: pathlib.Path, max_batch: int) -> LLM:
    max_model_len = args.input_len + args.output_len + 64
    page_size = args.block_size or model_config(model_dir).default_block_size  # pages default to one block
    padded_prompt = 1 << (args.input_len - 1).bit_length()  # one prefill step takes every prompt
    options = dict(decoding_strategy=args.strategy, dtype=args.dtype, max_num_seqs=max_batch,
                   max_model_len=max_model_len, max_num_batched_tokens=max_batch * padded_prompt,
                   quantization=args.quantization, num_pages=2 * max_batch * (-(-max_model_len // page_size) + 1),
                   enable_prefix_caching=False,  # the timed pass repeats the warm-up's prompts: do all the work
                   batch_invariant=args.batch_invariant)
    for name in ("block_size", "min_logit_rows"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.strategy == "fixed_steps":
        options["denoising_steps"] = args.denoising_steps  # None: the engine takes the block size
    elif args.threshold is not None:
        options["threshold"] = args.threshold
    return LLM(model_dir, random_weights=args.random_weights, **options)


if __name__ == "__main__":
    main()
