"""Paged block attention: the Pallas kernel against `paged_attention_reference`.

On CPU the kernel runs in interpret mode (Pallas fills outputs with NaN first, so an element the kernel never
writes fails the comparison); on a GPU the same tests compile it with Triton (outputs there start as whatever
the allocator holds, so an unwritten element must happen to match a fresh random reference to pass). Every case
draws fresh random inputs and poisons with NaN whatever the kernel must not read: the other layer, unused pages,
page slots past the context, window rows past `window_len`. The reference runs on a clean copy (finite values in
those places), so a poisoned value that leaks into the kernel's output shows up as a NaN or a mismatch.

Tolerances: f32 compares at 2e-5 (both sides accumulate in f32 over at most a few hundred keys; observed error
~1e-6). bf16 compares at 2e-2: the kernel feeds bf16 probabilities to the PV matmul (2^-9 relative rounding per
weight) and both outputs round to bf16 (2^-8 relative, i.e. up to ~8e-3 on values of size ~1).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import paged_attention as pa
from jaxllm.kernels.attention_prologue import rope_tables
from tests.cuda_lowering import lowered_for_h100
from tools.bench_attention import median_seconds

INTERPRET = jax.default_backend() != "gpu"
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
NUM_LAYERS, LAYER = 2, 1


@dataclasses.dataclass(frozen=True)
class Case:
    context_lens: tuple[int, ...]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 16
    block_size: int = 8
    num_blocks: int = 1  # window Q = num_blocks * block_size
    window_lens: tuple[int, ...] | None = None  # None: the whole window
    dtype: str = "float32"
    sliding_window: int | None = None
    logit_soft_cap: float | None = None
    num_splits: int | None = None  # None: the dispatcher's heuristic

    @property
    def window(self):
        return self.num_blocks * self.block_size


def make_inputs(case, seed):
    """(clean, poisoned) argument tuples for paged_attention; they differ only where no query may look."""
    rng = np.random.default_rng(seed)
    batch, window, page_size = len(case.context_lens), case.window, case.page_size
    window_lens = case.window_lens or (window,) * batch
    pages_per_request = [-(-(ctx + window) // page_size) for ctx in case.context_lens]
    width = max(pages_per_request) + 1
    num_pages = sum(pages_per_request) + 3  # spare pages stay NaN in the poisoned pool
    page_ids = rng.permutation(num_pages)
    spare_page = int(page_ids[-1])
    page_table = np.full((batch, width), spare_page, np.int32)
    valid_rows = np.zeros((num_pages, page_size), bool)  # pool rows that hold committed KV
    next_page = 0
    for b, (ctx, n) in enumerate(zip(case.context_lens, pages_per_request)):
        page_table[b, :n] = page_ids[next_page:next_page + n]
        next_page += n
        for pos in range(ctx):
            valid_rows[page_table[b, pos // page_size], pos % page_size] = True

    pool_shape = (NUM_LAYERS, case.num_kv_heads, num_pages, page_size, case.head_dim)
    k_pages, v_pages = rng.standard_normal(pool_shape), rng.standard_normal(pool_shape)
    q = rng.standard_normal((batch, window, case.num_heads, case.head_dim))
    if case.logit_soft_cap is not None:
        q *= 3.0  # push scores into the cap's nonlinear range
    k, v = (rng.standard_normal((batch, window, case.num_kv_heads, case.head_dim)) for _ in range(2))
    hidden_pool = np.ones(pool_shape, bool)
    hidden_pool[LAYER] = ~valid_rows[None, :, :, None]
    hidden_window = (np.arange(window)[None, :] >= np.asarray(window_lens)[:, None])[:, :, None, None]

    def build(poison):
        def arr(x, hidden):
            return jnp.asarray(np.where(hidden, np.nan, x) if poison else x, case.dtype)
        return (arr(q, False), arr(k, hidden_window), arr(v, hidden_window), arr(k_pages, hidden_pool),
                arr(v_pages, hidden_pool), jnp.int32(LAYER), jnp.asarray(page_table),
                jnp.asarray(case.context_lens, jnp.int32), jnp.asarray(window_lens, jnp.int32))
    return build(poison=False), build(poison=True)


def run_kernel(case, args):
    kwargs = {"block_size": case.block_size, "sliding_window": case.sliding_window,
              "logit_soft_cap": case.logit_soft_cap}
    if case.num_splits is None:
        attention = functools.partial(pa.paged_attention, impl="pallas", interpret=INTERPRET, **kwargs)
    else:
        attention = functools.partial(pa._paged_attention_pallas, sm_scale=case.head_dim ** -0.5,
                                      interpret=INTERPRET, tiling_overrides={"num_splits": case.num_splits}, **kwargs)
    return jax.jit(attention)(*args)


def run_reference(case, args):
    attention = functools.partial(pa.paged_attention, block_size=case.block_size, impl="reference",
                                  sliding_window=case.sliding_window, logit_soft_cap=case.logit_soft_cap)
    with jax.default_matmul_precision("highest"):  # f32 oracle on GPU too (XLA would pick TF32)
        return jax.jit(attention)(*args)


def check_case(case, seed):
    clean, poisoned = make_inputs(case, seed)
    expected = np.asarray(run_reference(case, clean).astype(jnp.float32))
    out = run_kernel(case, poisoned)
    assert out.shape == expected.shape and out.dtype == jnp.dtype(case.dtype)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), f"{np.isnan(out).sum()} non-finite outputs"
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)


SWEEP = {
    "decode_gqa2": Case(context_lens=(16, 48)),
    "zero_and_ragged_context": Case(context_lens=(0, 24, 40), num_heads=2, num_kv_heads=2, page_size=8),
    "window_longer_than_page": Case(context_lens=(4, 12, 0), num_heads=8, page_size=4, block_size=4, num_blocks=4),
    "page_larger_than_block": Case(context_lens=(8, 40, 72), page_size=32, num_blocks=2),
    "gqa7_padded_group": Case(context_lens=(24, 8), num_heads=14, num_kv_heads=2),
    "gqa8_one_kv_head": Case(context_lens=(40,), num_heads=8, num_kv_heads=1),
    # 64 query heads on one kv head at batch 1: the small-grid narrowing stops at one query per tile
    "gqa64_small_grid": Case(context_lens=(40,), num_heads=64, num_kv_heads=1, head_dim=32),
    "head_dim_256": Case(context_lens=(32, 8), head_dim=256),
    "head_dim_256_bf16": Case(context_lens=(32, 8), head_dim=256, dtype="bfloat16"),
    "head_dim_128_bf16_gqa4": Case(context_lens=(24, 64), num_heads=8, head_dim=128, dtype="bfloat16"),
    "multi_block_partial_window": Case(context_lens=(16, 32, 8), num_blocks=4, window_lens=(32, 20, 13)),
    "padded_batch_slot": Case(context_lens=(24, 0), window_lens=(8, 0)),
    "sliding_window": Case(context_lens=(40, 16), num_blocks=2, sliding_window=12),
    "soft_cap": Case(context_lens=(24, 56), logit_soft_cap=5.0),
    "sliding_soft_cap_bf16": Case(context_lens=(48, 8), num_heads=8, num_blocks=2, sliding_window=20,
                                  logit_soft_cap=8.0, dtype="bfloat16"),
    "prefill_query_tiles": Case(context_lens=(0, 32), num_heads=8, block_size=32, num_blocks=4, page_size=32),
    "window_not_power_of_2": Case(context_lens=(8, 16), num_heads=2, num_kv_heads=2, num_blocks=3),
    "page_256": Case(context_lens=(32, 320), num_heads=2, num_kv_heads=1, page_size=256, block_size=32),
    "splits_uneven": Case(context_lens=(64, 200), num_splits=3),
    "splits_more_than_keys": Case(context_lens=(0, 8), num_blocks=2, window_lens=(16, 5), num_splits=8),
    "split_boundary_inside_window": Case(context_lens=(40, 8), num_blocks=8, window_lens=(64, 50), num_splits=2),
    "splits_sliding_bf16": Case(context_lens=(96, 40), num_blocks=2, sliding_window=30, num_splits=2,
                                dtype="bfloat16"),
    # pages of 64 hold whole 64-key tiles: contiguous page-slice loads, whole and ragged tiles, an unaligned
    # sliding-window start rounded down to a tile
    "page_slices_sliding_window": Case(context_lens=(200, 136, 0), page_size=64, num_blocks=2, sliding_window=100),
    "page_slices_splits_bf16": Case(context_lens=(320, 64), num_heads=8, head_dim=128, page_size=128,
                                    dtype="bfloat16", num_splits=3),
}


@pytest.mark.parametrize("name", sorted(SWEEP))
def test_pallas_matches_reference(name):
    check_case(SWEEP[name], seed=sorted(SWEEP).index(name))


@pytest.mark.parametrize("name", ["decode_gqa2", "multi_block_partial_window", "padded_batch_slot",
                                  "sliding_soft_cap_bf16"])
def test_reference_ignores_what_no_query_may_see(name):
    # the reference is the CPU path: NaN in the pages that pad a page table, in slots past a context or in window
    # rows past window_len must not reach the output
    case = SWEEP[name]
    clean, poisoned = make_inputs(case, seed=7)
    out = np.asarray(run_reference(case, poisoned).astype(jnp.float32))
    np.testing.assert_array_equal(out, np.asarray(run_reference(case, clean).astype(jnp.float32)))


def test_window_pool_rows_follow_the_page_table_and_drop_placeholders():
    page_table = jnp.asarray([[5, 2, 9], [1, 0, 0]], jnp.int32)
    rows = pa.window_pool_rows(page_table, jnp.asarray([4, 0], jnp.int32), jnp.asarray([4, 2], jnp.int32),
                            window=4, page_size=4)
    dropped = np.iinfo(np.int32).max
    assert np.asarray(rows).tolist() == [2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 4, 5, dropped, dropped]


def make_qkv_inputs(case, seed, rotary_dim, page_overrides=None):
    """(clean, poisoned) arguments of paged_attention_from_qkv: make_inputs' pool and page table (with
    page_overrides {(request, page index): page id} applied), a random projection (its k and v columns NaN past
    window_len in the poisoned copy), norm weights and RoPE tables."""
    clean, poisoned = make_inputs(case, seed)
    rng = np.random.default_rng(seed + 1000)
    batch, window = len(case.context_lens), case.window
    q_width = case.num_heads * case.head_dim
    qkv = rng.standard_normal((batch, window, q_width + 2 * case.num_kv_heads * case.head_dim))
    hidden = np.zeros(qkv.shape, bool)
    hidden[:, :, q_width:] = (np.arange(window)[None, :] >= np.asarray(clean[-1])[:, None])[:, :, None]
    q_norm, k_norm = (jnp.asarray(1 + 0.3 * rng.standard_normal(case.head_dim), case.dtype) for _ in range(2))
    positions = np.asarray(case.context_lens)[:, None] + np.arange(window)[None, :]
    cos, sin = rope_tables(jnp.asarray(positions), theta=10000.0, rotary_dim=rotary_dim)
    page_table = np.asarray(clean[6]).copy()
    for (request, index), page in (page_overrides or {}).items():
        page_table[request, index] = page

    def build(args, poison):
        projection = jnp.asarray(np.where(hidden, np.nan, qkv) if poison else qkv, case.dtype)
        return (projection, q_norm, k_norm, cos, sin, *args[3:6], jnp.asarray(page_table), *args[7:])
    return build(clean, poison=False), build(poisoned, poison=True)


@dataclasses.dataclass(frozen=True)
class QkvCase:
    case: Case
    rotary_dim: int = 64  # head_dim is 64 unless the case says otherwise: full RoPE
    tiling: tuple = ()  # (field, value) overrides of the kernel's tiling
    page_overrides: tuple = ()  # ((request, page index), page id): pages past the pool or negative drop writes


QKV_SWEEP = {
    "partial_rope_bf16": QkvCase(SWEEP["head_dim_128_bf16_gqa4"]),
    "gqa7_padded_group_quarter_rope": QkvCase(SWEEP["gqa7_padded_group"], rotary_dim=16),
    "multi_block_partial_window": QkvCase(SWEEP["multi_block_partial_window"]),
    # window tokens of request 0 and 2 on page -1, of request 1 on a page past the pool: their writes must drop
    "dropped_window_pages": QkvCase(SWEEP["multi_block_partial_window"],
                                    page_overrides=(((0, 2), -1), ((2, 1), -1), ((1, 3), 10_000))),
    # several write passes per query tile, a ragged last query tile, one query per tile
    "write_passes": QkvCase(SWEEP["multi_block_partial_window"], tiling=(("q_tile", 16), ("window_key_tile", 4))),
    "ragged_query_tile": QkvCase(SWEEP["window_not_power_of_2"], tiling=(("q_tile", 16),)),
    "one_query_per_tile_splits": QkvCase(SWEEP["decode_gqa2"], tiling=(("q_tile", 1), ("num_splits", 3))),
    "padded_batch_slot": QkvCase(SWEEP["padded_batch_slot"]),
    "prefill_query_tiles": QkvCase(SWEEP["prefill_query_tiles"]),
    "window_not_power_of_2_rope_48": QkvCase(SWEEP["window_not_power_of_2"], rotary_dim=48),  # 24 frequencies
    "splits_sliding_bf16": QkvCase(SWEEP["splits_sliding_bf16"]),
    # unsplit, so the window loop writes: later query tiles' sliding windows start past the window's first keys
    "sliding_query_tiles_unsplit": QkvCase(SWEEP["sliding_window"], tiling=(("q_tile", 4), ("num_splits", 1))),
}


def check_qkv_case(qkv_case, seed):
    """Output against the XLA path on clean inputs; the pool against the XLA write into the poisoned pool (NaN where
    no committed KV lives), so a write to a wrong row, a missing one, or one that should have been dropped fails."""
    case = qkv_case.case
    clean, poisoned = make_qkv_inputs(case, seed, qkv_case.rotary_dim, dict(qkv_case.page_overrides))
    kwargs = {"num_heads": case.num_heads, "eps": 1e-6, "block_size": case.block_size,
              "sliding_window": case.sliding_window, "logit_soft_cap": case.logit_soft_cap}
    tiling = dict(qkv_case.tiling) | ({} if case.num_splits is None else {"num_splits": case.num_splits})
    if tiling:
        attention = functools.partial(pa._paged_attention_from_qkv_pallas, sm_scale=case.head_dim ** -0.5,
                                      interpret=INTERPRET, tiling_overrides=tiling, **kwargs)
    else:
        attention = functools.partial(pa.paged_attention_from_qkv, impl="pallas", interpret=INTERPRET, **kwargs)
    reference = jax.jit(functools.partial(pa.paged_attention_from_qkv, impl="reference", **kwargs))
    with jax.default_matmul_precision("highest"):
        expected_out, *_ = reference(*clean)
        _, *expected_pools = reference(*poisoned)  # the write alone: its attention output is NaN
    out, *pools = jax.jit(attention)(*poisoned)
    tol = TOLERANCE[case.dtype]
    assert out.shape == expected_out.shape and out.dtype == jnp.dtype(case.dtype)
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all(), f"{np.isnan(out).sum()} non-finite outputs"
    np.testing.assert_allclose(out, np.asarray(expected_out.astype(jnp.float32)), atol=tol, rtol=tol)
    for name, want, have in zip(("k_pages", "v_pages"), expected_pools, pools):
        assert have.shape == want.shape and have.dtype == want.dtype
        # k is rounded once in the kernel, after each op in XLA (RoPE's differences then carry the terms' rounding:
        # bf16 at the output tolerance); v passes through exactly
        rounding = 0 if name == "v_pages" else tol
        np.testing.assert_allclose(np.asarray(have.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                                   rtol=rounding, atol=rounding, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_batch_invariant_gives_a_request_the_same_bits_alone_or_in_a_batch(impl):
    """Request 0 alone and beside 31 others, bf16. Without the mode the kernel splits the keys of batch 1's small
    grid in two and not batch 32's, and narrows its query tiles, and the request's output differs."""
    case = Case(context_lens=(200, 64, 120, 256) * 8, num_heads=8, head_dim=128, page_size=32, block_size=32,
                dtype="bfloat16")
    (qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, layer, page_table, context_lens, window_lens), _ = \
        make_qkv_inputs(case, seed=3, rotary_dim=64)
    attention = jax.jit(functools.partial(pa.paged_attention_from_qkv, num_heads=case.num_heads, eps=1e-6,
                                          block_size=case.block_size, impl=impl, interpret=INTERPRET,
                                          batch_invariant=True))
    pools = (k_pages, v_pages, layer)
    batched, *_ = attention(qkv, q_norm, k_norm, cos, sin, *pools, page_table, context_lens, window_lens)
    alone, *_ = attention(qkv[:1], q_norm, k_norm, cos[:1], sin[:1], *pools, page_table[:1], context_lens[:1],
                          window_lens[:1])
    np.testing.assert_array_equal(np.asarray(alone.astype(jnp.float32)), np.asarray(batched[:1].astype(jnp.float32)))


@pytest.mark.parametrize("name", sorted(QKV_SWEEP))
def test_from_qkv_matches_reference(name):
    check_qkv_case(QKV_SWEEP[name], seed=200 + sorted(QKV_SWEEP).index(name))


CROSS_LOWERED = {  # (batch, window, heads, kv_heads, head_dim, page_size, width, dtype, kwargs)
    "llada2_mini_decode_split": (8, 32, 16, 4, 128, 16, 128, "bfloat16", {}),
    "gqa7_two_blocks": (2, 64, 28, 4, 128, 64, 8, "bfloat16", {}),
    "head_dim_256_f32_odd_window": (2, 24, 4, 2, 256, 4, 16, "float32",
                                    {"sliding_window": 16, "logit_soft_cap": 30.0}),
    "prefill_512": (1, 512, 8, 4, 64, 32, 32, "bfloat16", {}),
}


@pytest.mark.skipif(not INTERPRET, reason="the GPU compiles the kernel for real")
@pytest.mark.parametrize("name", sorted(CROSS_LOWERED))
def test_kernel_lowers_to_triton_for_cuda(name):
    """Pallas -> Triton IR on CPU: catches what interpret mode does not check (power-of-2 sizes, dot shapes)."""
    batch, window, heads, kv_heads, head_dim, page_size, width, dtype, kwargs = CROSS_LOWERED[name]
    spec = jax.ShapeDtypeStruct
    args = (spec((batch, window, heads, head_dim), dtype), spec((batch, window, kv_heads, head_dim), dtype),
            spec((batch, window, kv_heads, head_dim), dtype),
            spec((2, kv_heads, batch * width, page_size, head_dim), dtype),
            spec((2, kv_heads, batch * width, page_size, head_dim), dtype), spec((), jnp.int32),
            spec((batch, width), jnp.int32), spec((batch,), jnp.int32), spec((batch,), jnp.int32))
    attention = jax.jit(lambda *a: pa.paged_attention(*a, block_size=min(32, window), impl="pallas",
                                                      **kwargs))
    hlo = lowered_for_h100(attention, *args)
    assert hlo.count("__gpu$xla.gpu.triton") == 1


def qkv_specs(batch, window, heads, kv_heads, head_dim, rotary_dim, width, dtype="bfloat16"):
    spec = jax.ShapeDtypeStruct
    pool = spec((2, kv_heads, batch * width, 32, head_dim), dtype)
    return (spec((batch, window, (heads + 2 * kv_heads) * head_dim), dtype), spec((head_dim,), dtype),
            spec((head_dim,), dtype), spec((batch, window, rotary_dim // 2), jnp.float32),
            spec((batch, window, rotary_dim // 2), jnp.float32), pool, pool, spec((), jnp.int32),
            spec((batch, width), jnp.int32), spec((batch,), jnp.int32), spec((batch,), jnp.int32))


QKV_LOWERED = {  # (batch, window, heads, kv_heads, head_dim, rotary_dim, width)
    "sdar_decode_batch1": (1, 32, 32, 8, 128, 128, 32),
    "llada2_decode_batch32": (32, 32, 16, 4, 128, 64, 32),
    "prefill_512": (1, 512, 32, 8, 128, 128, 32),
}


@pytest.mark.skipif(not INTERPRET, reason="the GPU compiles the kernel for real")
@pytest.mark.parametrize("name", sorted(QKV_LOWERED))
def test_from_qkv_lowers_to_triton_for_cuda(name):
    heads = QKV_LOWERED[name][2]
    attention = jax.jit(lambda *a: pa.paged_attention_from_qkv(*a, num_heads=heads, eps=1e-6, block_size=32,
                                                               impl="pallas"), donate_argnums=(5, 6))
    hlo = lowered_for_h100(attention, *qkv_specs(*QKV_LOWERED[name]))
    assert hlo.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("num_splits", [1, 4])  # the window loop writes, or the last split's pass does
def test_from_qkv_pool_writes_are_masked(num_splits):
    """A dropped token's pool row points past the pool's end, where interpret mode drops the write anyway; on the GPU
    only the store's mask stops it (the flattened [L, K, P*S, D] view would take it as row 0 of the next kv head or
    layer). So both pool stores must carry a mask."""
    kernel_eqns = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            kernel_eqns.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    args = [jnp.zeros(a.shape, a.dtype) for a in qkv_specs(1, 32, 8, 2, 64, 64, 4)]
    attention = functools.partial(pa._paged_attention_from_qkv_pallas, num_heads=8, eps=1e-6, block_size=32,
                                  sm_scale=0.125, sliding_window=None, logit_soft_cap=None, interpret=False,
                                  tiling_overrides={"num_splits": num_splits})
    walk(jax.make_jaxpr(attention)(*args).jaxpr)
    pool_stores = [eqn for eqn in kernel_eqns if "swap" in eqn.primitive.name and eqn.invars[0].aval.ndim == 4]
    assert len(pool_stores) == 2
    assert all(eqn.params["args_tree"].unflatten(eqn.invars)[3] is not None for eqn in pool_stores)


def test_a_models_layers_trace_the_kernel_once(monkeypatch):
    """A model calls the kernel once per layer with the layer index as a runtime operand; its program traces the
    kernel once (each trace took ~85 ms at LLaDA2 batch 32 on the CPU, 20 per program)."""
    traces = []
    kernel = pa._paged_attention_kernel

    @functools.wraps(kernel)
    def counted(*refs, **params):
        traces.append(params["tiling"])
        return kernel(*refs, **params)

    monkeypatch.setattr(pa, "_paged_attention_kernel", counted)
    pa._attention_program.cache_clear()  # programs built with the real kernel before this test
    specs = qkv_specs(2, 32, 8, 2, 64, 64, 4)

    def layers(*args):
        qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, _, *rest = args
        outs = []
        for layer in range(3):
            out, k_pages, v_pages = pa.paged_attention_from_qkv(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages,
                                                                layer, *rest, num_heads=8, eps=1e-6, block_size=32,
                                                                impl="pallas")
            outs.append(out)
        return outs, k_pages, v_pages

    try:
        jax.make_jaxpr(layers)(*specs)
    finally:
        pa._attention_program.cache_clear()  # drop the programs that hold the counting kernel
    assert len(traces) == 1


requires_gpu = pytest.mark.skipif(INTERPRET, reason="needs a GPU (too slow in interpret mode)")

GPU_SWEEP = {
    "llada2_decode_batch8": Case(context_lens=(2048, 1024, 0, 512, 2016, 96, 1536, 32), num_heads=16, num_kv_heads=4,
                                 head_dim=128, block_size=32, dtype="bfloat16"),
    "sdar_buffer_of_4_blocks": Case(context_lens=(4096, 64, 0, 800), num_heads=32, num_kv_heads=8, head_dim=128,
                                    block_size=32, num_blocks=4, window_lens=(128, 96, 0, 64), dtype="bfloat16"),
    "prefill_chunk_512": Case(context_lens=(1024, 0), num_heads=16, num_kv_heads=4, head_dim=128, page_size=64,
                              block_size=32, num_blocks=16, dtype="bfloat16"),
    "gqa7_28_heads_sliding": Case(context_lens=(640, 64), num_heads=28, num_kv_heads=4, head_dim=128, block_size=32,
                                  page_size=32, num_blocks=2, sliding_window=256, dtype="bfloat16"),
}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("name", sorted(GPU_SWEEP))
def test_pallas_matches_reference_at_model_sizes(name):
    check_case(GPU_SWEEP[name], seed=100 + sorted(GPU_SWEEP).index(name))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("name,rotary_dim", [("llada2_decode_batch8", 64), ("sdar_buffer_of_4_blocks", 128),
                                             ("prefill_chunk_512", 64)])
def test_from_qkv_matches_reference_at_model_sizes(name, rotary_dim):
    check_qkv_case(QkvCase(GPU_SWEEP[name], rotary_dim), seed=300 + sorted(GPU_SWEEP).index(name))


@pytest.mark.gpu
@requires_gpu
def test_write_kv_pages_updates_a_donated_pool_in_place():
    """Writing one 32-token block into a donated 2 x 4 GiB pool must cost far less than copying the pool."""
    num_layers, num_kv_heads, num_pages, page_size, head_dim = 8, 8, 16384, 16, 128
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    pools = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (32, num_kv_heads, head_dim), jnp.bfloat16) for key in keys[2:])
    page_table = jnp.asarray([[7, 4242]], jnp.int32)
    context_lens, window_lens = jnp.asarray([0], jnp.int32), jnp.asarray([32], jnp.int32)
    pool_rows = pa.window_pool_rows(page_table, context_lens, window_lens, window=32, page_size=page_size)
    write = jax.jit(pa.write_kv_pages, donate_argnums=(0, 1))

    def write_once():
        nonlocal pools
        pools = write(*pools, jnp.int32(3), k, v, pool_rows)
        return pools

    write_once()  # compile
    write_seconds = median_seconds(write_once, min_reps=20, max_reps=20)
    copy = jax.jit(lambda a, b: (a + 1, b + 1))
    copy_seconds = median_seconds(lambda: copy(*pools), min_reps=5, max_reps=5)
    assert write_seconds < 0.25 * copy_seconds, (write_seconds, copy_seconds)  # a pool copy would be >= 1x
    # positions 0..31: slots 0..15 of page 7, then slots 0..15 of page 4242
    k_pages = pools[0]
    np.testing.assert_array_equal(np.asarray(k_pages[3, :, 7, :].transpose(1, 0, 2)), np.asarray(k[:16]))
    np.testing.assert_array_equal(np.asarray(k_pages[3, :, 4242, :].transpose(1, 0, 2)), np.asarray(k[16:]))


@pytest.mark.gpu
@requires_gpu
def test_from_qkv_updates_a_donated_pool_in_place():
    """One 32-token window written by the fused kernel into a donated 2 x 4 GiB pool must cost far less than copying
    the pool, and its v rows land where the page table says."""
    shape = (8, 8, 16384, 16, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    pools = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys[:2])
    qkv = jax.random.normal(keys[2], (1, 32, (32 + 16) * 128), jnp.bfloat16)
    cos, sin = rope_tables(jnp.arange(32)[None], theta=1e6, rotary_dim=128)
    weight = jnp.ones((128,), jnp.bfloat16)
    page_table = jnp.asarray([[7, 4242]], jnp.int32)
    attention = jax.jit(lambda k_pages, v_pages: pa.paged_attention_from_qkv(
        qkv, weight, weight, cos, sin, k_pages, v_pages, jnp.int32(3), page_table, jnp.asarray([0], jnp.int32),
        jnp.asarray([32], jnp.int32), num_heads=32, eps=1e-6, block_size=32, impl="pallas"), donate_argnums=(0, 1))

    def once():
        nonlocal pools
        _, *pools = attention(*pools)
        return pools

    once()
    seconds = median_seconds(once, min_reps=20, max_reps=20)
    copy = jax.jit(lambda a, b: (a + 1, b + 1))
    copy_seconds = median_seconds(lambda: copy(*pools), min_reps=5, max_reps=5)
    assert seconds < 0.25 * copy_seconds, (seconds, copy_seconds)
    v = np.asarray(qkv[0]).reshape(32, 48, 128)[:, 40:]  # [tokens, kv heads, D]
    np.testing.assert_array_equal(np.asarray(pools[1][3, :, 7]).transpose(1, 0, 2), v[:16])
    np.testing.assert_array_equal(np.asarray(pools[1][3, :, 4242]).transpose(1, 0, 2), v[16:])


def test_small_batch_short_context_is_split_across_programs():
    """Batch 1 at a 512-token context must not leave the H200's 132 SMs to a handful of serial programs."""
    q = jax.ShapeDtypeStruct((1, 32, 32, 128), jnp.bfloat16)  # SDAR-8B decode: one 32-token block, 32/8 heads
    tiling = pa._choose_tiling(q, page_size=32, page_table_width=17, num_kv_heads=8, overrides=None)
    assert tiling.num_splits >= 4, tiling  # 8 kv heads x 1 query tile alone would be 8 programs
    # and narrower query tiles at the engine's width bucket for such contexts: 8 kv heads x one 32-query tile x
    # 8 splits would be 64 programs of 128 rows
    tiling = pa._choose_tiling(q, page_size=32, page_table_width=32, num_kv_heads=8, overrides=None)
    assert 8 * (32 // tiling.q_tile) * tiling.num_splits >= 128 and tiling.num_warps == 4, tiling


def test_with_a_prologue_small_grids_narrow_further_and_window_tiles_fit_shared_memory():
    """With the prologue in the kernel each program also rotates its queries in float32 registers (SDAR batch 1 on
    the H200: 64-row tiles 4.997 ms per forward, 32-row 4.941), and each window tile is five pipelined loads (32-key
    tiles asked for 272 KB of shared memory); a grid not narrowed keeps its pipeline depth."""
    q = jax.ShapeDtypeStruct((1, 32, 32, 128), jnp.bfloat16)
    plain = pa._choose_tiling(q, page_size=32, page_table_width=32, num_kv_heads=8, overrides=None)
    fused = pa._choose_tiling(q, page_size=32, page_table_width=32, num_kv_heads=8, overrides=None, prologue=True)
    assert plain.q_tile * plain.group == 64 and fused.q_tile * fused.group == 32, (plain, fused)
    assert plain.window_key_tile == 32 and fused.window_key_tile == 16, (plain, fused)
    # and, narrowed, a shallow pipeline: two or three key tiles per split (SDAR batch 1 on the H200: 9.4 us per layer
    # at 2 stages, 10.6 at 5)
    assert plain.num_stages == 5 and fused.num_stages == 2, (plain, fused)
    # batch 32 fills the SMs: the same tiles either way but the window tile
    q = jax.ShapeDtypeStruct((32, 32, 16, 128), jnp.bfloat16)
    plain = pa._choose_tiling(q, page_size=32, page_table_width=32, num_kv_heads=4, overrides=None)
    fused = pa._choose_tiling(q, page_size=32, page_table_width=32, num_kv_heads=4, overrides=None, prologue=True)
    assert dataclasses.replace(fused, window_key_tile=plain.window_key_tile) == plain, (plain, fused)


def test_a_grid_that_fills_the_sms_is_not_split():
    """LLaDA2 at batch 32 (32 requests x 4 kv heads = 128 programs of 32 queries) took 43.3 us per layer with two key
    splits and 30.6 with none on the H200 (engine run 17); batch 8 (32 programs) still splits."""
    for batch, unsplit in ((32, True), (8, False)):
        q = jax.ShapeDtypeStruct((batch, 32, 16, 128), jnp.bfloat16)
        tiling = pa._choose_tiling(q, page_size=32, page_table_width=17, num_kv_heads=4, overrides=None)
        assert (tiling.num_splits == 1) == unsplit, (batch, tiling)


def test_auto_runs_a_head_the_kernel_cannot_hold_in_xla_on_the_gpu(monkeypatch):
    """head_dim 96 is not a power of two: on the GPU "auto" must take the reference, not fail to compile."""
    case = Case(context_lens=(24,), head_dim=96)
    clean, _ = make_inputs(case, seed=3)
    expected = run_reference(case, clean)
    monkeypatch.setattr(pa.jax, "default_backend", lambda: "gpu")
    with jax.default_matmul_precision("highest"):  # as the oracle: on a GPU, XLA's f32 default is TF32
        out = jax.jit(functools.partial(pa.paged_attention, block_size=case.block_size, impl="auto"))(*clean)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
