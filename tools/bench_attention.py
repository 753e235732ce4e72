"""Benchmark paged block attention (Pallas kernel vs the XLA reference) on a GPU.

Achieved bandwidth counts the committed K/V bytes read plus the window's Q/K/V/O bytes, against the copy ceiling
(a large device-to-device copy, bytes read + written) measured in the same run. Each timed call runs the attention
over every layer of a pool bigger than L2, at least 64 calls, inside one jitted fori_loop (as the model's layer loop
does), so launch overhead and cache hits stay out of the numbers.

    python tools/bench_attention.py --out runs/bench_attention.json                  # the issue's sweep, page 32
    python tools/bench_attention.py --tune --baseline old_paged_attention.py         # tile variants, old vs new
    XLA_FLAGS=--xla_dump_to=/tmp/xd python tools/bench_attention.py --ptx-stats /tmp/xd  # what Triton emitted
"""

import argparse
import concurrent.futures
import functools
import glob
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import paged_attention as pa

MODELS = {"llada2-mini": (16, 4, 128), "sdar-8b": (32, 8, 128)}  # query heads, kv heads, head dim
POOL_BYTES_TARGET = 512 * 2**20  # several times the H200's 60 MB L2
MIN_CALLS_PER_SWEEP = 64
IMPL_LABELS = {"pallas": "pallas", "xla": "xla", "baseline": "baseline", "floor": "loop floor"}

# (model, batch, context) -> {variant name: tiling overrides}; "baseline" times the --baseline kernel file and
# "pool_4.5GiB" the default tiling on K and V pools of 4.5 GiB each (Pallas then computes 64-bit offsets)
GENERAL_VARIANTS = {
    "default": {}, "baseline": {}, "pool_4.5GiB": {}, "stages3": {"num_stages": 3}, "stages7": {"num_stages": 7},
    "warps4": {"num_warps": 4}, "key_tile32": {"key_tile": 32}, "gather_page_ids": {"scalar_page_ids": False},
    "q_tile16_warps4_stages3": {"q_tile": 16, "num_warps": 4, "num_stages": 3},
    "q_tile16_warps4_stages5": {"q_tile": 16, "num_warps": 4, "num_stages": 5},
}
SPLIT_VARIANTS = {"default": {}, "baseline": {}, **{f"splits{n}": {"num_splits": n} for n in (1, 2, 4, 8, 16)},
                  "splits8_q_tile16_warps4": {"num_splits": 8, "q_tile": 16, "num_warps": 4}}
TUNE_SHAPES = {("llada2-mini", 8, 8192): GENERAL_VARIANTS, ("sdar-8b", 1, 512): SPLIT_VARIANTS,
               ("llada2-mini", 1, 2048): {"default": {}, "baseline": {}, "splits4": {"num_splits": 4},
                                          "splits8": {"num_splits": 8}, "splits32": {"num_splits": 32}}}


def median_seconds(fn, *, min_reps=3, max_reps=20, budget_s=0.2):
    jax.block_until_ready(fn())  # warm-up (compiled before)
    start = time.perf_counter()
    jax.block_until_ready(fn())
    reps = int(min(max_reps, max(min_reps, budget_s / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_ceiling_bytes_per_s(calls=16):
    """Read + write rate of `a + 1` on 1 GiB f32, `calls` back-to-back dispatches per sample, so that the dispatch and
    the final sync are spread over many copies as they are over many attention calls (one call alone read ~3.2 TB/s
    on the H200, against ~4.2 with back-to-back calls)."""
    x = jax.random.normal(jax.random.key(0), (256 * 2**20,), jnp.float32)  # 1 GiB
    copy = jax.jit(lambda a: a + 1.0)

    def copies():
        for _ in range(calls):
            out = copy(x)
        return out

    return 2 * x.nbytes * calls / median_seconds(copies, min_reps=5)


def make_problem(model, batch, context, window, page_size, *, pool_bytes=POOL_BYTES_TARGET, dtype=jnp.bfloat16,
                 seed=0):
    """Random pool with shuffled pages; every request has `context` committed tokens and a full window."""
    num_heads, num_kv_heads, head_dim = MODELS[model]
    pages_per_request = -(-(context + window) // page_size)
    layer_bytes = 2 * batch * pages_per_request * page_size * num_kv_heads * head_dim * 2
    num_layers = int(np.clip(math.ceil(pool_bytes / layer_bytes), 2, 256))
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


def load_kernel_module(path):
    """A paged_attention module from a file (e.g. the previous commit's), for side-by-side timing."""
    spec = importlib.util.spec_from_file_location("baseline_paged_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention_fn(impl, block_size, tiling_overrides=None, baseline=None):
    """attention(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens) for one impl."""
    if impl in ("pallas", "baseline"):
        module = pa if impl == "pallas" else baseline
        return lambda *a: module._paged_attention_pallas(
            *a, block_size=block_size, sm_scale=a[0].shape[-1] ** -0.5, sliding_window=None, logit_soft_cap=None,
            interpret=jax.default_backend() != "gpu", tiling_overrides=tiling_overrides)
    if impl == "floor":  # one tiny elementwise op per layer: what the layer loop itself costs
        return lambda x, *a: x * 0.999
    if impl == "xla":
        return lambda *a: pa.paged_attention(*a, block_size=block_size, impl="reference")
    raise ValueError(f"unknown impl {impl!r}")


PROBLEM_ARGS = ("q", "k", "v", "k_pages", "v_pages", "page_table", "context_lens", "window_lens")


def calls_per_sweep(problem) -> int:
    """Attention calls in one timed call: every layer of the pool, repeated until there are at least
    MIN_CALLS_PER_SWEEP, so one dispatch and sync (~0.1 ms) stay a small share even for a few large layers."""
    num_layers = problem["k_pages"].shape[0]
    return num_layers * -(-MIN_CALLS_PER_SWEEP // num_layers)


def compile_sweep(problem, attention):
    """A compiled call that runs `attention` over the pool's layers calls_per_sweep times in all, each call's q
    being the last output."""
    num_layers = problem["k_pages"].shape[0]

    def sweep(q, k, v, k_pages, v_pages, page_table, context_lens, window_lens):
        def layer_step(step, x):
            return attention(x, k, v, k_pages, v_pages, step % num_layers, page_table, context_lens, window_lens)
        return jax.lax.fori_loop(0, calls_per_sweep(problem), layer_step, q)

    return jax.jit(sweep).lower(*(problem[name] for name in PROBLEM_ARGS)).compile()


def time_variants(problem, attentions):
    """{name: seconds per attention call or an error string}; compiles run in parallel threads, timing serially."""
    num_calls = calls_per_sweep(problem)
    args = [problem[name] for name in PROBLEM_ARGS]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(compile_sweep, problem, attention) for name, attention in attentions.items()}
    results = {}
    for name, future in futures.items():
        try:  # one broken variant must not end the run
            results[name] = median_seconds(functools.partial(future.result(), *args)) / num_calls
        except Exception as error:  # noqa: BLE001 - report and go on
            results[name] = f"{type(error).__name__}: {str(error)[:300]}"
    return results


def rate_cells(seconds, bytes_moved, ceiling):
    if not isinstance(seconds, float):
        return {"error": seconds}
    rate = bytes_moved / seconds
    return {"us": seconds * 1e6, "tbps": rate / 1e12, "pct_ceiling": 100 * rate / ceiling}


def decode_shapes(args):
    """Shapes in priority order: the target region (batch >= 8, context >= 2k) first."""
    shapes = args.shapes or [(m, b, c) for b in args.batches for c in args.contexts for m in args.models]
    shapes = [(page, *shape) for page in args.page_sizes for shape in shapes]
    return sorted(shapes, key=lambda shape: not (shape[2] >= 8 and shape[3] >= 2048))


def decode_rows(args, ceiling, deadline, baseline):
    rows = []
    for page_size, model, batch, context in decode_shapes(args):
        if time.perf_counter() > deadline:
            print(f"time budget reached before page {page_size} {model} B={batch} ctx={context}", flush=True)
            break
        problem = make_problem(model, batch, context, args.block_size, page_size)
        bytes_moved = useful_bytes(problem, context)
        row = {"model": model, "page_size": page_size, "batch": batch, "context": context, "bytes": bytes_moved}
        seconds = time_variants(problem, {impl: attention_fn(impl, args.block_size, baseline=baseline)
                                          for impl in args.impls})
        row.update({impl: rate_cells(s, bytes_moved, ceiling) for impl, s in seconds.items()})
        print(json.dumps(row), flush=True)
        rows.append(row)
        del problem
    return sorted(rows, key=lambda row: (row["page_size"], row["model"], row["batch"], row["context"]))


def prefill_rows(args, ceiling, deadline):
    rows = []
    window, page_size = args.prefill_window, args.page_sizes[0]
    for context in args.prefill_contexts:
        if time.perf_counter() > deadline:
            break
        problem = make_problem("llada2-mini", 1, context, window, page_size)
        num_heads, head_dim = problem["q"].shape[2:]
        flops = 4 * head_dim * num_heads * visible_pairs(context, window, args.block_size)
        row = {"model": "llada2-mini", "page_size": page_size, "batch": 1, "window": window, "context": context,
               "flops": flops}
        seconds = time_variants(problem, {impl: attention_fn(impl, args.block_size) for impl in ("pallas", "xla")})
        for impl, s in seconds.items():
            row[impl] = {"us": s * 1e6, "tflops": flops / s / 1e12} if isinstance(s, float) else {"error": s}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def tuning_rows(args, ceiling, deadline, baseline):
    """Tiling variants of the Pallas kernel (and the baseline file) at fixed shapes."""
    rows = []
    page_size = args.page_sizes[0]
    for (model, batch, context), variants in TUNE_SHAPES.items():
        if time.perf_counter() > deadline:
            break
        variants = {name: overrides for name, overrides in variants.items() if name != "baseline" or baseline}
        problem = make_problem(model, batch, context, args.block_size, page_size)
        table_args = (problem["q"], page_size, problem["page_table"].shape[1], problem["k"].shape[2])
        tilings = {name: vars((baseline if name == "baseline" else pa)._choose_tiling(*table_args, overrides or None))
                   for name, overrides in variants.items()}
        seconds = time_variants(problem, {
            name: attention_fn("baseline" if name == "baseline" else "pallas", args.block_size, overrides or None,
                               baseline)
            for name, overrides in variants.items() if name != "pool_4.5GiB"})
        bytes_moved = useful_bytes(problem, context)
        if "pool_4.5GiB" in variants:
            del problem
            problem = make_problem(model, batch, context, args.block_size, page_size, pool_bytes=9 * 2**30)
            seconds.update(time_variants(problem, {"pool_4.5GiB": attention_fn("pallas", args.block_size)}))
        del problem
        for name, s in seconds.items():
            row = {"model": model, "page_size": page_size, "batch": batch, "context": context, "variant": name,
                   "tiling": tilings[name], **rate_cells(s, bytes_moved, ceiling)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def page_write_row(num_pages):
    """One 32-token block written into a donated pool pair (4 GiB each at 16384 pages), against copying it."""
    shape = (8, 8, num_pages, 16, 128)
    keys = jax.random.split(jax.random.key(1), 4)
    pools = [jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:2]]
    k, v = (jax.random.normal(key, (32, 8, 128), jnp.bfloat16) for key in keys[2:])
    page_table = jnp.asarray([[7, num_pages - 1]], jnp.int32)
    lens = (jnp.asarray([0], jnp.int32), jnp.asarray([32], jnp.int32))
    pool_rows = pa.window_pool_rows(page_table, *lens, window=32, page_size=shape[3])
    write = jax.jit(pa.write_kv_pages, donate_argnums=(0, 1))

    def write_once():
        pools[:] = write(*pools, jnp.int32(3), k, v, pool_rows)
        return pools

    write_us = median_seconds(write_once, min_reps=20) * 1e6

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def write_many(k_pages, v_pages):  # 32 writes in one dispatch: the device cost without the host's
        def one(layer, pages):
            return pa.write_kv_pages(*pages, layer % shape[0], k, v, pool_rows)
        return jax.lax.fori_loop(0, 32, one, (k_pages, v_pages))

    def write_many_once():
        pools[:] = write_many(*pools)
        return pools

    write_loop_us = median_seconds(write_many_once, min_reps=10) * 1e6 / 32
    copy = jax.jit(lambda a, b: (a + 1, b + 1))
    copy_us = median_seconds(lambda: copy(*pools), min_reps=5) * 1e6
    return {"write_us": write_us, "write_in_loop_us": write_loop_us, "pool_copy_us": copy_us,
            "pool_gib": 2 * pools[0].nbytes / 2**30}


PTX_PATTERNS = {  # instruction families worth knowing about in the kernel's PTX (static counts)
    "wgmma": r"wgmma\.mma_async", "mma.sync": r"\bmma\.sync", "cp.async": r"cp\.async\.c[ag]",
    "tma": r"cp\.async\.bulk", "ld.global": r"ld\.global", "ld.global.v4": r"ld\.global[.\w]*\.v4",
    "ld.shared": r"ld\.shared", "st.shared": r"st\.shared", "ldmatrix": r"ldmatrix", "stmatrix": r"stmatrix",
    "ex2": r"ex2\.approx", "local (spills)": r"(ld|st)\.local", "bar.sync": r"bar\.sync|barrier\.sync",
    "shfl": r"shfl\.sync", "64-bit int math": r"(mad|mul|add)\.(lo\.|wide\.)?[su]64",
}


def ptx_stats(dump_dir):
    """Static instruction counts (and ptxas's register/spill report) of the Pallas kernel in XLA's PTX dump."""
    stats = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "**", "*.ptx"), recursive=True)):
        text = open(path).read()
        for match in re.finditer(r"\.entry\s+(\w*paged\w*)\s*\(", text):
            end = text.find(".entry", match.end())
            body = text[match.start():end if end >= 0 else len(text)]
            counts = {name: len(re.findall(pattern, body)) for name, pattern in PTX_PATTERNS.items()}
            stats.append({"file": os.path.basename(path), "kernel": match.group(1), **counts,
                          "ptxas": ptxas_report(path, match.group(1))})
    return stats


def ptxas_report(path, kernel):
    ptxas = shutil.which("ptxas") or next(iter(glob.glob("/usr/local/cuda*/bin/ptxas")), None)
    if not ptxas:
        return "ptxas not found"
    result = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
    lines = result.stderr.splitlines()
    found = [i for i, line in enumerate(lines) if kernel in line]
    return " | ".join(lines[found[0]:found[0] + 4]) if found else result.stderr[-400:]


def _cells(cells):
    if not cells or "us" not in cells:
        return f"{'failed' if cells else '-':>9} {'-':>6} {'-':>5}"
    return f"{cells['us']:>9.1f} {cells['tbps']:>6.2f} {cells['pct_ceiling']:>5.0f}"


def print_tables(ceiling, decode, prefill, tuning, impls):
    print(f"\ncopy ceiling {ceiling / 1e12:.2f} TB/s (read + write, 1 GiB f32)")
    for row in tuning:
        print(f"tune {row['model']:11} p{row['page_size']} B={row['batch']:<2} ctx={row['context']:<5} "
              f"{row['variant']:24} {row.get('us', float('nan')):8.1f} us {row.get('pct_ceiling', float('nan')):4.0f}%"
              f" ceiling {row.get('error', '')[:80]}")
    others = [impl for impl in impls if impl != "pallas"]  # each with its time over the Pallas kernel's
    if decode:
        print(f"{'model':11} {'page':>4} {'B':>3} {'ctx':>6} {'MB':>7} | {'pallas us':>9} {'TB/s':>6} {'%ceil':>5} | "
              + " | ".join(f"{IMPL_LABELS[impl] + ' us':>9} {'TB/s':>6} {'%ceil':>5} {'x':>5}" for impl in others))
    for row in decode:
        pallas = row.get("pallas", {})
        cells = []
        for impl in others:
            other = row.get(impl, {})
            ratio = other["us"] / pallas["us"] if "us" in other and "us" in pallas else float("nan")
            cells.append(f"{_cells(other)} {ratio:>5.1f}")
        print(f"{row['model']:11} {row['page_size']:>4} {row['batch']:>3} {row['context']:>6} "
              f"{row['bytes'] / 1e6:>7.1f} | {_cells(pallas)} | " + " | ".join(cells))
    for row in prefill:
        pallas, xla = row.get("pallas", {}), row.get("xla", {})
        print(f"prefill B=1 Q={row['window']} ctx {row['context']:>5} (LLaDA2.0-mini heads): pallas "
              f"{pallas.get('us', float('nan')):.1f} us {pallas.get('tflops', float('nan')):.0f} TFLOP/s | xla "
              f"{xla.get('us', float('nan')):.1f} us {xla.get('tflops', float('nan')):.0f} TFLOP/s")


def ints(text):
    return [int(x) for x in text.split(",")]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--batches", type=ints, default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=ints, default=[512, 2048, 8192, 16384])
    parser.add_argument("--shapes", type=lambda s: [(m, *ints(bc.replace("x", ","))) for m, bc in
                                                     (x.split(":") for x in s.split(","))],
                        help="MODEL:BATCHxCONTEXT,... instead of the models x batches x contexts grid")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--page-sizes", type=ints, default=[32], help="the engine runs page = block = 32")
    parser.add_argument("--impls", type=lambda s: s.split(","), default=["pallas", "xla"],
                        help="pallas, xla, baseline, floor; the table gives each one's time over pallas's")
    parser.add_argument("--baseline", help="a paged_attention.py file (e.g. the previous commit's) for impl baseline")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode sweep")
    parser.add_argument("--prefill-window", type=int, default=512)
    parser.add_argument("--prefill-contexts", type=ints, default=[], help="e.g. 0,1024,4096")
    parser.add_argument("--tune", action="store_true", help="time the tiling variants of TUNE_SHAPES first")
    parser.add_argument("--page-write", type=int, metavar="NUM_PAGES", default=0,
                        help="also time one block write into a donated pool pair of NUM_PAGES pages (16384: 4 GiB)")
    parser.add_argument("--ptx-stats", metavar="DUMP_DIR",
                        help="compile the kernel at the first --shapes entry and report its PTX from XLA's dump there "
                             "(run with XLA_FLAGS=--xla_dump_to=DUMP_DIR)")
    parser.add_argument("--time-budget", type=float, default=150.0,
                        help="seconds from the start after which no new shape is started")
    parser.add_argument("--out", help="write every measurement to this JSON file")
    return parser.parse_args()


def print_ptx_stats(args):
    model, batch, context = (args.shapes or [("llada2-mini", 8, 8192)])[0]
    problem = make_problem(model, batch, context, args.block_size, args.page_sizes[0])
    compile_sweep(problem, attention_fn("pallas", args.block_size))
    rows = ptx_stats(args.ptx_stats)
    for row in rows:
        print(json.dumps(row), flush=True)
    if not rows:
        ptx_files = glob.glob(os.path.join(args.ptx_stats, "**", "*.ptx"), recursive=True)
        entries = [re.findall(r"\.entry\s+(\w+)", open(path).read()) for path in ptx_files]
        print(f"no *paged* kernel in {len(ptx_files)} PTX files; entries: {entries}"[:2000])


def main():
    args = parse_args()
    start = time.perf_counter()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    if args.ptx_stats:
        return print_ptx_stats(args)
    baseline = load_kernel_module(args.baseline) if args.baseline else None
    ceiling = copy_ceiling_bytes_per_s()
    deadline = start + args.time_budget
    tuning = tuning_rows(args, ceiling, deadline, baseline) if args.tune else []
    decode = [] if args.no_decode else decode_rows(args, ceiling, deadline, baseline)
    prefill = prefill_rows(args, ceiling, deadline)
    write = page_write_row(args.page_write) if args.page_write else None
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceiling_bytes_per_s": ceiling, "tuning": tuning, "decode": decode, "prefill": prefill,
                       "page_write": write, "device": jax.devices()[0].device_kind, "jax": jax.__version__}, f,
                      indent=1)
    print_tables(ceiling, decode, prefill, tuning, args.impls)
    if write:
        print(f"page write (one block, {write['pool_gib']:.1f} GiB donated pool pair): {write['write_us']:.0f} us per "
              f"dispatch, {write['write_in_loop_us']:.1f} us inside a jitted loop; "
              f"pool copy {write['pool_copy_us']:.0f} us")


if __name__ == "__main__":
    main()
