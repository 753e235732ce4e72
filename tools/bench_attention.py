"""Benchmark paged block attention (Pallas kernel vs the XLA reference) on a GPU.

Achieved bandwidth counts the committed K/V bytes read plus the window's Q/K/V/O bytes, against the copy ceiling
(a large device-to-device copy, bytes read + written) measured in the same run. Each timed call runs the attention
once per layer of a pool bigger than L2 inside one jitted fori_loop (as the model's layer scan does), so launch
overhead and cache hits stay out of the numbers.

    python tools/bench_attention.py --out runs/bench_attention.json
"""

import argparse
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import paged_attention as pa

MODELS = {"llada2-mini": (16, 4, 128), "sdar-8b": (32, 8, 128)}  # query heads, kv heads, head dim
POOL_BYTES_TARGET = 512 * 2**20  # several times the H200's 60 MB L2


def median_seconds(fn, *, min_reps=3, max_reps=30, budget_s=0.3):
    jax.block_until_ready(fn())  # compile + warm-up
    jax.block_until_ready(fn())
    start = time.perf_counter()
    jax.block_until_ready(fn())
    reps = int(min(max_reps, max(min_reps, budget_s / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_ceiling_bytes_per_s():
    x = jax.random.normal(jax.random.key(0), (256 * 2**20,), jnp.float32)  # 1 GiB
    copy = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / median_seconds(lambda: copy(x), min_reps=10)


def make_problem(model, batch, context, window, page_size, dtype=jnp.bfloat16, seed=0):
    """Random pool with shuffled pages; every request has `context` committed tokens and a full window."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    pages_per_request = -(-(context + window) // page_size)
    layer_bytes = 2 * batch * pages_per_request * page_size * num_kv_heads * head_dim * 2
    num_layers = int(np.clip(math.ceil(POOL_BYTES_TARGET / layer_bytes), 2, 64))
    num_pages = batch * pages_per_request
    keys = jax.random.split(jax.random.key(seed), 5)
    pool_shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    page_table = np.random.default_rng(seed).permutation(num_pages).astype(np.int32).reshape(batch, -1)
    return {
        "q": jax.random.normal(keys[0], (batch, window, num_heads, head_dim), dtype),
        "k": jax.random.normal(keys[1], (batch, window, num_kv_heads, head_dim), dtype),
        "v": jax.random.normal(keys[2], (batch, window, num_kv_heads, head_dim), dtype),
        "k_pages": jax.random.normal(keys[3], pool_shape, dtype),
        "v_pages": jax.random.normal(keys[4], pool_shape, dtype),
        "page_table": jnp.asarray(page_table),
        "context_lens": jnp.full((batch,), context, jnp.int32),
        "window_lens": jnp.full((batch,), window, jnp.int32),
    }


def useful_bytes(problem, context):
    batch, window, num_heads, head_dim = problem["q"].shape
    num_kv_heads, itemsize = problem["k"].shape[2], problem["q"].dtype.itemsize
    committed = 2 * batch * context * num_kv_heads * head_dim * itemsize
    return committed + batch * window * (2 * num_heads + 2 * num_kv_heads) * head_dim * itemsize


def visible_pairs(context, window, block_size):
    return sum(context + min(window, (i // block_size + 1) * block_size) for i in range(window))


def time_attention(problem, *, impl, block_size, tiling_overrides=None):
    """Seconds per attention call, median over calls that each sweep every layer of the pool."""
    num_layers = problem["k_pages"].shape[0]
    if impl == "pallas":
        attention = lambda *a: pa._paged_attention_pallas(
            *a, block_size=block_size, sm_scale=a[0].shape[-1] ** -0.5, sliding_window=None, logit_soft_cap=None,
            interpret=jax.default_backend() != "gpu", tiling_overrides=tiling_overrides)
    elif impl == "floor":  # one tiny elementwise op per layer: what the layer loop itself costs
        attention = lambda x, *a: x * 0.999
    else:
        attention = lambda *a: pa.paged_attention(*a, block_size=block_size, impl=impl)

    @jax.jit
    def sweep(q, k, v, k_pages, v_pages, page_table, context_lens, window_lens):
        def layer_step(layer, x):  # the next layer's queries depend on this layer's output
            return attention(x, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens)
        return jax.lax.fori_loop(0, num_layers, layer_step, q)

    args = [problem[name] for name in ("q", "k", "v", "k_pages", "v_pages", "page_table", "context_lens",
                                       "window_lens")]
    return median_seconds(lambda: sweep(*args)) / num_layers


def measure(problem, row, impl, block_size, **overrides):
    """Seconds per call, or None with the error recorded in `row` (one broken variant must not end the run)."""
    try:
        return time_attention(problem, impl=impl, block_size=block_size, tiling_overrides=overrides or None)
    except Exception as error:  # noqa: BLE001 - report and go on
        row[f"{impl}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        return None


def decode_shapes(args):
    """Shapes in priority order: the target region (batch >= 8, context >= 2k) first."""
    shapes = args.shapes or [(m, b, c) for b in args.batches for c in args.contexts for m in args.models]
    return sorted(shapes, key=lambda shape: not (shape[1] >= 8 and shape[2] >= 2048))


def decode_rows(args, ceiling, deadline):
    rows = []
    for model, batch, context in decode_shapes(args):
        if time.perf_counter() > deadline:
            print(f"time budget reached before {model} B={batch} ctx={context}", flush=True)
            break
        problem = make_problem(model, batch, context, args.block_size, args.page_size)
        row = {"model": model, "batch": batch, "context": context, "bytes": useful_bytes(problem, context)}
        for impl in args.impls:
            seconds = measure(problem, row, impl, args.block_size)
            if seconds:
                row[impl] = {"us": seconds * 1e6, "gbps": row["bytes"] / seconds / 1e9,
                             "pct_ceiling": 100 * row["bytes"] / seconds / ceiling}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del problem
    return sorted(rows, key=lambda row: (row["model"], row["batch"], row["context"]))


def prefill_rows(args, ceiling, deadline):
    rows = []
    window = args.prefill_window
    for context in args.prefill_contexts:
        if time.perf_counter() > deadline:
            break
        problem = make_problem("llada2-mini", 1, context, window, args.page_size)
        num_heads, head_dim = problem["q"].shape[2:]
        flops = 4 * head_dim * num_heads * visible_pairs(context, window, args.block_size)
        row = {"model": "llada2-mini", "batch": 1, "window": window, "context": context,
               "bytes": useful_bytes(problem, context), "flops": flops}
        for impl in args.impls:
            seconds = measure(problem, row, impl, args.block_size)
            if seconds:
                row[impl] = {"us": seconds * 1e6, "tflops": flops / seconds / 1e12,
                             "pct_ceiling": 100 * row["bytes"] / seconds / ceiling}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


TUNING_VARIANTS = {
    "default": {},
    "warps4": {"num_warps": 4},
    "q_tile16_warps4": {"q_tile": 16, "num_warps": 4},
    "key_tile32": {"key_tile": 32},
    "key_tile128": {"key_tile": 128},
}


def tuning_rows(args, ceiling, deadline):
    """Tile-size variants of the Pallas kernel at target shapes (LLaDA2.0-mini heads)."""
    rows = []
    for batch, context in args.tune_shapes:
        problem = make_problem("llada2-mini", batch, context, args.block_size, args.page_size)
        default = pa._choose_tiling(problem["q"], args.page_size, problem["page_table"].shape[1], 4, None)
        variants = dict(TUNING_VARIANTS)
        for name, overrides in variants.items():
            if time.perf_counter() > deadline:
                return rows
            row = {"batch": batch, "context": context, "variant": name, "tiling": {**vars(default), **overrides}}
            seconds = measure(problem, row, "pallas", args.block_size, **overrides)
            if seconds:
                row.update(us=seconds * 1e6, pct_ceiling=100 * useful_bytes(problem, context) / seconds / ceiling)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def page_write_row(num_pages):
    """One 32-token block written into a donated pool pair (4 GiB each at 16384 pages), against copying it."""
    shape = (8, 8, num_pages, 16, 128)
    keys = jax.random.split(jax.random.key(1), 4)
    pools = [jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:2]]
    k, v = (jax.random.normal(key, (1, 32, 8, 128), jnp.bfloat16) for key in keys[2:])
    page_table = jnp.asarray([[7, num_pages - 1]], jnp.int32)
    lens = (jnp.asarray([0], jnp.int32), jnp.asarray([32], jnp.int32))
    write = jax.jit(pa.write_kv_pages, donate_argnums=(0, 1))

    def write_once():
        pools[:] = write(*pools, jnp.int32(3), k, v, page_table, *lens)
        return pools

    write_us = median_seconds(write_once, min_reps=20) * 1e6

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def write_many(k_pages, v_pages):  # 32 writes in one dispatch: the device cost without the host's
        def one(layer, pages):
            return pa.write_kv_pages(*pages, layer % shape[0], k, v, page_table, *lens)
        return jax.lax.fori_loop(0, 32, one, (k_pages, v_pages))

    def write_many_once():
        pools[:] = write_many(*pools)
        return pools

    write_loop_us = median_seconds(write_many_once, min_reps=10) * 1e6 / 32
    copy = jax.jit(lambda a, b: (a + 1, b + 1))
    copy_us = median_seconds(lambda: copy(*pools), min_reps=5) * 1e6
    return {"write_us": write_us, "write_in_loop_us": write_loop_us, "pool_copy_us": copy_us,
            "pool_gib": 2 * pools[0].nbytes / 2**30}


def _cells(row, impl, rate_key, scale):
    result = row.get(impl)
    if not result:
        return f"{'failed' if impl + '_error' in row else '-':>9} {'-':>6} {'-':>5}"
    return f"{result['us']:>9.1f} {result[rate_key] * scale:>6.2f} {result['pct_ceiling']:>5.0f}"


def print_tables(ceiling, decode, prefill, write, tuning):
    print(f"\ncopy ceiling {ceiling / 1e12:.2f} TB/s (read + write); page write (1 block, {write['pool_gib']:.0f} GiB "
          f"donated pool) {write['write_us']:.0f} us per dispatch, {write['write_in_loop_us']:.1f} us inside a jitted loop;"
          f" pool copy {write['pool_copy_us']:.0f} us")
    for row in tuning:
        print(f"tune B={row['batch']} ctx={row['context']} {row['variant']:12} "
              f"{row.get('us', float('nan')):8.1f} us {row.get('pct_ceiling', float('nan')):4.0f}% ceiling")
    print(f"{'model':12} {'B':>3} {'ctx':>6} {'MB':>7} | {'pallas us':>9} {'TB/s':>6} {'%ceil':>5} | "
          f"{'xla us':>9} {'TB/s':>6} {'%ceil':>5} | {'speedup':>7}")
    for row in decode:
        pallas, xla = row.get("pallas"), row.get("reference")
        speedup = xla["us"] / pallas["us"] if pallas and xla else float("nan")
        floor = f" | floor {row['floor']['us']:.1f} us" if "floor" in row else ""
        print(f"{row['model']:12} {row['batch']:>3} {row['context']:>6} {row['bytes'] / 1e6:>7.1f} | "
              f"{_cells(row, 'pallas', 'gbps', 1e-3)} | {_cells(row, 'reference', 'gbps', 1e-3)} | {speedup:>7.1f}{floor}")
    print(f"prefill B=1 Q={prefill[0]['window'] if prefill else '-'} (LLaDA2.0-mini heads): pallas us, TFLOP/s, %ceil"
          f" | xla us, TFLOP/s, %ceil")
    for row in prefill:
        print(f"  ctx {row['context']:>6} | {_cells(row, 'pallas', 'tflops', 1)} | "
              f"{_cells(row, 'reference', 'tflops', 1)}")


def parse_args():
    ints = lambda s: [int(x) for x in s.split(",")]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--batches", type=ints, default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=ints, default=[512, 2048, 8192, 16384])
    parser.add_argument("--shapes", type=lambda s: [(m, *ints(bc.replace("x", ","))) for m, bc in
                                                     (x.split(":") for x in s.split(","))],
                        help="MODEL:BATCHxCONTEXT,... instead of the models x batches x contexts grid")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prefill-window", type=int, default=512)
    parser.add_argument("--prefill-contexts", type=ints, default=[0, 1024, 4096])
    parser.add_argument("--impls", type=lambda s: s.split(","), default=["pallas", "reference"])
    parser.add_argument("--write-pool-pages", type=int, default=16384, help="pages per layer in the write test")
    parser.add_argument("--tune-shapes", type=lambda s: [tuple(ints(x.replace("x", ","))) for x in s.split(",")],
                        default=[], help="BATCHxCONTEXT,... at which to time tile-size variants first, e.g. 8x8192")
    parser.add_argument("--time-budget", type=float, default=240.0,
                        help="seconds from the start after which no new shape is started")
    parser.add_argument("--out", help="write every measurement to this JSON file")
    return parser.parse_args()


def main():
    args = parse_args()
    start = time.perf_counter()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    ceiling = copy_ceiling_bytes_per_s()
    write = page_write_row(args.write_pool_pages)
    deadline = start + args.time_budget
    tuning = tuning_rows(args, ceiling, deadline) if args.tune_shapes else []
    decode = decode_rows(args, ceiling, deadline)
    prefill = prefill_rows(args, ceiling, deadline)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceiling_bytes_per_s": ceiling, "page_write": write, "tuning": tuning, "decode": decode,
                       "prefill": prefill, "device": jax.devices()[0].device_kind}, f, indent=1)
    print_tables(ceiling, decode, prefill, write, tuning)


if __name__ == "__main__":
    main()
