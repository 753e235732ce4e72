"""Benchmark the MoE expert layer at LLaDA2.0-mini shapes (256 experts, top-8, H=2048, I=512) on one GPU.

The Pallas grouped GEMM (`moe_experts(impl="pallas")`) runs side by side with `lax.ragged_dot` and a
gather-then-dense XLA baseline, for bf16, int8 and fp8 weights, with routing from random logits through
`route_grouped_sigmoid`. Achieved bandwidth counts the touched experts' weights (and scales) plus x and the
output; TFLOP/s counts the routed work only (2 * T * top_k * 3 * H * I). Both are set against ceilings measured
in the same run. The layer's relative error against the float32 reference with bf16 weights is reported too.

  python tools/bench_moe.py --tokens 32 256 2048 8192 --json bench_moe.json [--sweep]
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels.moe import (
    WEIGHT_FORMATS,
    GemmTiles,
    MoeTiles,
    _group_by_expert,
    default_tiles,
    moe_experts,
    moe_experts_reference,
    route_grouped_sigmoid,
)
from jaxllm.quantization import QuantizedWeight, dequantize, quantize

EXPERTS, HIDDEN, INTER, TOP_K = 256, 2048, 512, 8
RAGGED_DOT_MAX_TOKENS = 2048  # XLA expands ragged_dot densely: at 2048 tokens int8 already needs a 32 GiB temporary


# ---------------------------------------------------------------------------------------------- timing

def measure(fn, *args, target_s=0.05, repeats=5):
    """Median seconds per call over `repeats` runs of back-to-back calls lasting about target_s each."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    iters = max(1, min(200, int(target_s / max(time.perf_counter() - start, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return float(np.median(samples))


def compile_all(jobs, workers):
    """{name: (fn, args)} -> {name: compiled executable or the exception}; lowering serial, XLA compiles parallel."""
    lowered = {}
    for name, (fn, args) in jobs.items():
        try:
            lowered[name] = jax.jit(fn).lower(*args)
        except Exception as error:  # noqa: BLE001 - a variant that fails to lower is reported, not fatal
            lowered[name] = error
    def build(item):
        return item if isinstance(item, Exception) else item.compile()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(build, item) for name, item in lowered.items()}
    compiled = {}
    for name, future in futures.items():
        try:
            compiled[name] = future.result()
        except Exception as error:  # noqa: BLE001
            compiled[name] = error
    return compiled


def ceilings():
    """Copy bandwidth (read + write of 1 GiB f32) and 8192^3 matmul rates measured on this device."""
    keys = jax.random.split(jax.random.key(0), 3)
    big = jax.random.uniform(keys[0], (256 * 1024 * 1024,), jnp.float32)
    result = {"copy_GBps": 2 * big.nbytes / measure(jax.jit(lambda a: a * 2.0), big) / 1e9}
    del big
    a = jax.random.normal(keys[1], (8192, 8192), jnp.float32)
    b = jax.random.normal(keys[2], (8192, 8192), jnp.float32)
    for name, dtype in (("bf16_TFLOPs", jnp.bfloat16), ("fp8_TFLOPs", jnp.float8_e4m3fn)):
        matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16))
        result[name] = 2 * 8192**3 / measure(matmul, a.astype(dtype), b.astype(dtype)) / 1e12
    return result


# ---------------------------------------------------------------------------------------------- baselines

def _operands(w):
    """(values, f32 scales [E, N]) of a plain or quantized [E, K, N] weight."""
    if isinstance(w, QuantizedWeight):
        return w.values, w.scales
    return w, jnp.ones((w.shape[0], w.shape[2]), jnp.float32)


def _sort_by_expert(expert_ids, num_experts):
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros(num_experts, jnp.int32).at[flat].add(1)
    return order, flat[order], sizes


def ragged_dot_experts(x, expert_ids, expert_weights, w_gate_up, w_down):
    """Assignments sorted by expert through two `lax.ragged_dot`s, scales applied per row after each."""
    num_tokens, top_k = expert_ids.shape
    (gu_values, gu_scales), (down_values, down_scales) = _operands(w_gate_up), _operands(w_down)
    order, sorted_expert, sizes = _sort_by_expert(expert_ids, gu_values.shape[0])
    gate_up = jax.lax.ragged_dot(x[order // top_k], gu_values, sizes, preferred_element_type=jnp.float32)
    gate_up = gate_up * gu_scales[sorted_expert]  # [A, 2I]
    act = (jax.nn.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]).astype(x.dtype)
    rows = jax.lax.ragged_dot(act, down_values, sizes, preferred_element_type=jnp.float32)
    rows = rows * down_scales[sorted_expert]  # [A, H]
    rows = jnp.zeros_like(rows).at[order].set(rows).reshape(num_tokens, top_k, -1)
    return jnp.sum(rows * expert_weights[..., None], axis=1).astype(x.dtype)


def gather_dense_experts(x, expert_ids, expert_weights, w_gate_up, w_down, *, capacity):
    """Tokens gathered into [E, capacity, H] per-expert batches, then batched dense GEMMs over every expert.

    `capacity` is the largest group of this routing (known to the benchmark), so no token is dropped.
    """
    num_tokens, top_k = expert_ids.shape
    (gu_values, gu_scales), (down_values, down_scales) = _operands(w_gate_up), _operands(w_down)
    num_experts = gu_values.shape[0]
    order, sorted_expert, sizes = _sort_by_expert(expert_ids, num_experts)
    rank = jnp.arange(order.shape[0]) - (jnp.cumsum(sizes) - sizes)[sorted_expert]
    slot = sorted_expert * capacity + rank  # [A]
    slot_token = jnp.full(num_experts * capacity, num_tokens).at[slot].set(order // top_k)
    padded_x = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    batches = padded_x[slot_token].reshape(num_experts, capacity, -1)  # [E, cap, H]
    gate_up = jnp.einsum("ech,ehn->ecn", batches, gu_values.astype(x.dtype), preferred_element_type=jnp.float32)
    gate_up = gate_up * gu_scales[:, None, :]
    act = (jax.nn.silu(gate_up[..., :INTER]) * gate_up[..., INTER:]).astype(x.dtype)
    out = jnp.einsum("eci,eih->ech", act, down_values.astype(x.dtype), preferred_element_type=jnp.float32)
    out = (out * down_scales[:, None, :]).reshape(num_experts * capacity, -1)
    slot_of = jnp.zeros_like(slot).at[order].set(slot).reshape(num_tokens, top_k)
    return jnp.sum(out[slot_of] * expert_weights[..., None], axis=1).astype(x.dtype)


# ---------------------------------------------------------------------------------------------- the layer

def make_weights(seed):
    """(weights, kernel_weights): {mode: (w_gate_up, w_down)} for bf16, int8 and fp8. `weights` are [E, K, N], as
    the XLA baselines take them; `kernel_weights`, for the Pallas kernels, hold the 1-byte weights channel-major, the
    layout the engine quantizes to (kernels/moe.py, `_weight_on_left`)."""
    keys = jax.random.split(jax.random.key(seed), 2)
    w_gate_up = (jax.random.normal(keys[0], (EXPERTS, HIDDEN, 2 * INTER)) / HIDDEN**0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[1], (EXPERTS, INTER, HIDDEN)) / INTER**0.5).astype(jnp.bfloat16)
    weights = {"bf16": (w_gate_up, w_down)}
    kernel_weights = dict(weights)
    for mode in ("int8", "fp8"):
        weights[mode] = (quantize(w_gate_up, mode), quantize(w_down, mode))
        kernel_weights[mode] = (quantize(w_gate_up, mode, channel_major=True),
                                quantize(w_down, mode, channel_major=True))
    return weights, kernel_weights


def make_batch(num_tokens, seed):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (num_tokens, HIDDEN), jnp.bfloat16)
    logits = jax.random.normal(keys[1], (num_tokens, EXPERTS), jnp.float32)
    bias = jnp.zeros((EXPERTS,), jnp.float32)  # a load-balanced router: every expert equally likely
    expert_weights, expert_ids = route_grouped_sigmoid(logits, bias, top_k=TOP_K, n_group=8, topk_group=4,
                                                       routed_scaling_factor=2.5, norm_topk_prob=True)
    return x, expert_ids, expert_weights


def weight_bytes_per_expert(w_gate_up, w_down):
    total = 0
    for w in (w_gate_up, w_down):
        values, scales = (w.values, w.scales) if isinstance(w, QuantizedWeight) else (w, None)
        total += values[0].nbytes + (0 if scales is None else scales[0].nbytes)
    return total


def sweep_tiles(num_tokens):
    """Alternative tilings to time next to `default_tiles`, around the regime the default picks (each list starts
    with the regime's previous default). In the 16-row regime 1-byte weights want deeper k tiles than bf16 (MoE run 8:
    64 x 256 gate/up tiles on 8 warps, 1.64-1.66x bf16 at 32 tokens); some of those tiles need too much shared memory
    for bf16 and fail to compile there. Up to 32 tokens the 16-row tiles are also timed with rows for every token
    (bf16's default there since engine run 11; int8's lost at 32 rows), beside gate/up tiles for two blocks per SM."""
    block_m = default_tiles(num_tokens, TOP_K, EXPERTS, HIDDEN, INTER).block_m
    if block_m <= 32:  # memory-bound: bf16's 16-row default, the 1-byte default, run 7's 1-byte default, then
        # neighbours of the 1-byte one
        sixteen_rows = [MoeTiles(16, GemmTiles(128, 128, 4, 3), GemmTiles(256, 64, 4, 3)),
                        MoeTiles(16, GemmTiles(64, 256, 8, 3), GemmTiles(128, 128, 4, 3)),
                        MoeTiles(16, GemmTiles(32, 256, 4, 3), GemmTiles(128, 128, 4, 3)),
                        MoeTiles(16, GemmTiles(64, 256, 8, 4), GemmTiles(128, 128, 4, 3)),
                        MoeTiles(16, GemmTiles(128, 256, 8, 3), GemmTiles(128, 128, 4, 3)),
                        MoeTiles(16, GemmTiles(64, 512, 8, 2), GemmTiles(128, 128, 4, 3)),
                        MoeTiles(16, GemmTiles(64, 256, 8, 3), GemmTiles(128, 256, 4, 2))]
        every_token = [dataclasses.replace(tiles, block_m=block_m) for tiles in sixteen_rows[:2]] + [
            MoeTiles(block_m, GemmTiles(64, 128, 4, 2), GemmTiles(256, 64, 4, 3))]  # 2 blocks per SM (engine run 14)
        return sixteen_rows + (every_token if block_m > 16 else [])
    if block_m == 64:
        return [MoeTiles(64, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 4, 3)),
                MoeTiles(64, GemmTiles(64, 64, 4, 4), GemmTiles(128, 64, 4, 4)),
                MoeTiles(128, GemmTiles(64, 64, 8, 3), GemmTiles(128, 64, 8, 3)),
                MoeTiles(32, GemmTiles(64, 128, 4, 4), GemmTiles(128, 64, 4, 4)),
                MoeTiles(32, GemmTiles(128, 128, 4, 3), GemmTiles(256, 64, 4, 3)),
                MoeTiles(64, GemmTiles(128, 128, 8, 3), GemmTiles(256, 64, 8, 3)),
                MoeTiles(64, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 3)),
                MoeTiles(16, GemmTiles(128, 128, 4, 3), GemmTiles(256, 64, 4, 3))]
    return [MoeTiles(128, GemmTiles(64, 64, 8, 3), GemmTiles(128, 64, 8, 3)),
            MoeTiles(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 4)),
            MoeTiles(128, GemmTiles(128, 64, 8, 3), GemmTiles(256, 64, 8, 4)),
            MoeTiles(128, GemmTiles(128, 32, 8, 5), GemmTiles(256, 32, 8, 5)),
            # 64-row tiles halve the padding of each expert's last tile (25% -> 13% of rows at 8192 tokens) but double
            # the weight-tile reads: 1.41-1.61 against 1.28 ms in MoE run 5
            MoeTiles(64, GemmTiles(128, 64, 4, 4), GemmTiles(256, 64, 4, 4)),
            MoeTiles(64, GemmTiles(256, 64, 8, 3), GemmTiles(256, 64, 8, 3)),
            MoeTiles(64, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 4))]


def tiles_label(tiles):
    g, d = tiles.gate_up, tiles.down
    return (f"bm{tiles.block_m} gu{g.block_n}x{g.block_k}w{g.num_warps}s{g.num_stages} "
            f"dn{d.block_n}x{d.block_k}w{d.num_warps}s{d.num_stages}")


def variants(num_tokens, weights, kernel_weights, capacity, sweep):
    """{(weights, impl): (fn, weight pair)} to time at this token count."""
    jobs = {}
    for mode, pair in weights.items():
        jobs[(mode, "pallas")] = (functools.partial(moe_experts, impl="pallas"), kernel_weights[mode])
        if num_tokens <= RAGGED_DOT_MAX_TOKENS:
            jobs[(mode, "ragged_dot")] = (ragged_dot_experts, pair)
        jobs[(mode, "gather_dense")] = (functools.partial(gather_dense_experts, capacity=capacity), pair)
    jobs[("fp8", "pallas_fp8act")] = (functools.partial(moe_experts, impl="pallas", fp8_activations=True),
                                      kernel_weights["fp8"])
    for tiles in sweep_tiles(num_tokens) if sweep else []:
        for mode in ("bf16", "int8") if num_tokens <= 256 else ("bf16",):
            jobs[(mode, f"pallas {tiles_label(tiles)}")] = (functools.partial(moe_experts, impl="pallas", tiles=tiles),
                                                            kernel_weights[mode])
    return jobs


def bench_tokens(num_tokens, weights, kernel_weights, peaks, sweep, workers):
    x, expert_ids, expert_weights = make_batch(num_tokens, seed=num_tokens)
    ids = np.asarray(expert_ids)
    touched = len(np.unique(ids))
    capacity = int(np.bincount(ids.ravel(), minlength=EXPERTS).max())
    flops = 2 * ids.size * 3 * HIDDEN * INTER
    jobs = variants(num_tokens, weights, kernel_weights, capacity, sweep)
    compiled = compile_all({key: (fn, (x, expert_ids, expert_weights, *pair)) for key, (fn, pair) in jobs.items()},
                           workers)
    # the grouping metadata alone (inside the pallas time) of each weight format's default tiles
    group_ms = {}
    for weight_format in WEIGHT_FORMATS:
        block_m = default_tiles(*ids.shape, EXPERTS, HIDDEN, INTER, weight_format).block_m
        grouping = jax.jit(functools.partial(_group_by_expert, num_experts=EXPERTS, block_m=block_m))
        group_ms[weight_format] = measure(grouping, expert_ids) * 1e3
    print(f"[{num_tokens}] touched experts {touched}, largest group {capacity}, grouping (ms) {group_ms}", flush=True)
    rows, outputs = [], {}
    for (mode, impl), executable in compiled.items():
        weight_format = "plain" if mode == "bf16" else "fp8_activations" if impl == "pallas_fp8act" else "upcast"
        row = {"tokens": num_tokens, "weights": mode, "impl": impl, "touched_experts": touched,
               "group_ms": group_ms[weight_format]}
        if isinstance(executable, Exception):
            row["error"] = f"{type(executable).__name__}: {str(executable)[:300]}"
            print(f"[{num_tokens} {mode} {impl}] FAILED {row['error']}", flush=True)
            rows.append(row)
            continue
        args = (x, expert_ids, expert_weights, *jobs[(mode, impl)][1])
        seconds = measure(executable, *args)
        outputs[(mode, impl)] = executable(*args)
        moved = touched * weight_bytes_per_expert(*jobs[(mode, impl)][1]) + 2 * x.nbytes
        peak = peaks["fp8_TFLOPs"] if impl == "pallas_fp8act" else peaks["bf16_TFLOPs"]
        row.update(ms=seconds * 1e3, GBps=moved / seconds / 1e9, TFLOPs=flops / seconds / 1e12,
                   bw_frac=moved / seconds / 1e9 / peaks["copy_GBps"], compute_frac=flops / seconds / 1e12 / peak)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows, outputs, (x, expert_ids, expert_weights)


def accuracy(outputs, batch, weights):
    """||out - ref|| / ||ref|| with ref = the float32 reference on the bf16 weights."""
    ref = np.asarray(jax.jit(moe_experts_reference)(*batch, *weights["bf16"]), np.float32)
    result = {}
    for (mode, impl), out in outputs.items():
        if impl in ("pallas", "pallas_fp8act"):
            result[f"{mode} {impl}"] = float(np.linalg.norm(np.asarray(out, np.float32) - ref) / np.linalg.norm(ref))
    for mode in ("int8", "fp8"):  # quantization alone: the reference with the dequantized weights, in f32
        deq = [dequantize(w, jnp.float32) for w in weights[mode]]
        out = np.asarray(jax.jit(moe_experts_reference)(batch[0].astype(jnp.float32), *batch[1:], *deq))
        result[f"{mode} weights, f32 reference"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    return result


def summary_table(rows, peaks):
    best = {}
    for row in rows:
        if "ms" in row and row["impl"].startswith("pallas") and row["impl"] != "pallas_fp8act":
            key = (row["tokens"], row["weights"])
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = row
    ragged = {(r["tokens"], r["weights"]): r["ms"] for r in rows if r["impl"] == "ragged_dot" and "ms" in r}
    lines = [(f"ceilings: copy {peaks['copy_GBps']:.0f} GB/s, bf16 {peaks['bf16_TFLOPs']:.0f} TFLOP/s, "
              f"fp8 {peaks['fp8_TFLOPs']:.0f} TFLOP/s"),
             f"{'T':>5} {'w':>4} {'impl':<17} {'ms':>8} {'GB/s':>6} {'%bw':>4} {'TF/s':>6} {'%pk':>4} {'rdot/x':>6}"]
    for row in rows:
        if "ms" not in row or not (row["impl"] in ("ragged_dot", "gather_dense", "pallas_fp8act")
                                   or best.get((row["tokens"], row["weights"])) is row):
            continue
        speedup = ragged.get((row["tokens"], row["weights"]), float("nan")) / row["ms"]
        impl = "pallas" if row["impl"].startswith("pallas ") else row["impl"]
        lines.append(f"{row['tokens']:>5} {row['weights']:>4} {impl:<17} {row['ms']:8.3f} {row['GBps']:6.0f} "
                     f"{100 * row['bw_frac']:4.0f} {row['TFLOPs']:6.1f} {100 * row['compute_frac']:4.0f} "
                     f"{speedup:6.1f}")
    chosen = sorted({(k, v["impl"]) for k, v in best.items()})
    lines.append("pallas rows are the fastest tiling: " + "; ".join(f"{t} {w}: {i}" for (t, w), i in chosen))
    groupings = sorted({(r["tokens"], r["weights"], r["group_ms"]) for r in rows if r["impl"] == "pallas"})
    lines.append("grouping (expert groups and padding metadata) ms, default tiles: " + ", ".join(
        f"{tokens} {weights}: {ms:.3f}" for tokens, weights, ms in groupings))
    lines += _targets(best, ragged)
    return "\n".join(lines)


def _targets(best, ragged):
    """The brief's targets, from the fastest Pallas tiling of each (tokens, weights)."""
    def get(tokens, mode, field):
        return best[(tokens, mode)][field] if (tokens, mode) in best else float("nan")
    vs_ragged = [ragged[key] / row["ms"] for key, row in best.items() if key in ragged]
    return [f"target bw >= 60% at 32 tokens (bf16): {100 * get(32, 'bf16', 'bw_frac'):.0f}%",
            f"target compute >= 50% at 8192 tokens (bf16): {100 * get(8192, 'bf16', 'compute_frac'):.0f}%",
            f"target int8 >= 1.6x bf16 at 32 tokens: {get(32, 'bf16', 'ms') / get(32, 'int8', 'ms'):.2f}x",
            f"target >= 5x ragged_dot: min {min(vs_ragged, default=float('nan')):.1f}x"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 2048, 8192])
    parser.add_argument("--accuracy-tokens", type=int, default=256, help="token count of the accuracy check")
    parser.add_argument("--sweep", action="store_true", help="time other tilings too")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="parallel compiles")
    args = parser.parse_args()

    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    peaks = ceilings()
    print(json.dumps(peaks), flush=True)
    weights, kernel_weights = make_weights(seed=0)
    rows, errors = [], {}
    for num_tokens in args.tokens:
        token_rows, outputs, batch = bench_tokens(num_tokens, weights, kernel_weights, peaks, args.sweep, args.workers)
        rows += token_rows
        if num_tokens == args.accuracy_tokens:
            errors = accuracy(outputs, batch, weights)
            print("relative error vs f32 reference with bf16 weights:", json.dumps(errors), flush=True)
        del outputs
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": peaks, "rows": rows, "relative_error": errors,
                       "default_tiles": {t: dataclasses.asdict(default_tiles(t, TOP_K, EXPERTS, HIDDEN, INTER))
                                         for t in args.tokens}}, f, indent=1)
    print(summary_table(rows, peaks))


if __name__ == "__main__":
    main()
