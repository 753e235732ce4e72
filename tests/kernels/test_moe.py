"""MoE routing and the grouped-GEMM expert kernel against independent oracles.

On CPU the Pallas kernels run in interpret mode, whose outputs start as NaN: a row tile the kernel fails to
write shows up as NaN in the combined output. On the GPU the same file runs the compiled kernels.
"""

import functools
import zlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxllm.kernels.moe import (
    _PALLAS_GROUPING_MAX_ASSIGNMENTS,
    GemmTiles,
    MoeTiles,
    _group_by_expert,
    _num_row_tiles,
    _plus_shared,
    _routed_expert,
    _upcast,
    default_tiles,
    moe_experts,
    moe_experts_reference,
    route_grouped_sigmoid,
    route_softmax_topk,
)
from jaxllm.quantization import QuantizedWeight, dequantize, quantize
from tests.cuda_lowering import lowered_for_h100

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
gpu = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")

HIDDEN, INTER = 128, 64
# several column tiles and K steps per GEMM, so the loops and column offsets are exercised at test size
SMALL_TILES = MoeTiles(16, gate_up=GemmTiles(32, 32, 4, 2), down=GemmTiles(32, 32, 4, 2))
# the persistent down kernel over 32-row grouped tiles, 4 column tiles x 2 K slices per item; in interpret mode each
# of its 3 programs walks several items
PERSISTENT_TILES = MoeTiles(32, gate_up=GemmTiles(16, 64, 4, 3), down=GemmTiles(32, 32, 4, 3), persistent_down=True)


# ---------------------------------------------------------------------------------------------- routing oracles

def _sigmoid(a):
    return 1.0 / (1.0 + np.exp(-a))


def _grouped_sigmoid_oracle(logits, bias, top_k, n_group, topk_group, scale, norm):
    num_tokens, num_experts = logits.shape
    group_width = num_experts // n_group
    weights, ids = np.zeros((num_tokens, top_k)), np.zeros((num_tokens, top_k), np.int64)
    for t in range(num_tokens):
        scores = _sigmoid(logits[t].astype(np.float64))
        choice = scores + bias
        group_score = [np.sort(choice[g * group_width:(g + 1) * group_width])[-2:].sum() for g in range(n_group)]
        kept = np.argsort(group_score)[::-1][:topk_group]
        allowed = np.concatenate([np.arange(g * group_width, (g + 1) * group_width) for g in kept])
        best = allowed[np.argsort(choice[allowed])[::-1][:top_k]]
        w = scores[best]
        weights[t], ids[t] = (w / w.sum() if norm else w) * scale, best
    return weights, ids


def _softmax_topk_oracle(logits, top_k, norm):
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = z / z.sum(axis=1, keepdims=True)
    ids = np.argsort(-probs, axis=1)[:, :top_k]
    weights = np.take_along_axis(probs, ids, axis=1)
    return (weights / weights.sum(axis=1, keepdims=True) if norm else weights), ids


@pytest.mark.parametrize("norm", [True, False])
def test_route_grouped_sigmoid_matches_numpy_oracle(norm):
    rng = np.random.default_rng(0)
    # continuous random logits and bias: ties between experts or groups have probability zero
    logits = rng.normal(size=(64, 256)).astype(np.float32) * 2
    bias = rng.normal(size=256).astype(np.float32) * 0.1
    weights, ids = route_grouped_sigmoid(jnp.asarray(logits), jnp.asarray(bias), top_k=8, n_group=8, topk_group=4,
                                         routed_scaling_factor=2.5, norm_topk_prob=norm)
    want_weights, want_ids = _grouped_sigmoid_oracle(logits, bias.astype(np.float64), 8, 8, 4, 2.5, norm)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-5, atol=1e-6)


def test_route_softmax_topk_matches_numpy_oracle():
    logits = np.random.default_rng(1).normal(size=(64, 128)).astype(np.float32) * 3
    for norm in (True, False):
        weights, ids = route_softmax_topk(jnp.asarray(logits), top_k=8, norm_topk_prob=norm)
        want_weights, want_ids = _softmax_topk_oracle(logits.astype(np.float64), 8, norm)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- expert oracles

def _numpy_experts(x, ids, weights, w_gate_up, w_down):
    """Per (token, choice) loop in float64: the independent check of moe_experts_reference."""
    inter = w_gate_up.shape[2] // 2
    out = np.zeros((x.shape[0], w_down.shape[2]))
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            gate_up = x[t] @ w_gate_up[ids[t, c]]
            act = gate_up[:inter] * _sigmoid(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, c] * (act @ w_down[ids[t, c]])
    return out


def test_reference_matches_per_token_loop():
    rng = np.random.default_rng(2)
    x, ids, weights, w_gate_up, w_down = _case_arrays(rng, 11, 3, 6, "random")
    out = moe_experts_reference(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(w_gate_up),
                                jnp.asarray(w_down))
    want = _numpy_experts(x, ids, weights, w_gate_up, w_down)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_auto_runs_widths_the_kernels_cannot_tile_in_xla_on_the_gpu(monkeypatch):
    """Widths with no power-of-two tile >= 16 (hidden 24, inter 20): on the GPU "auto" must take the reference,
    not fail to build the kernels' tiles."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(5, 24)).astype(np.float32)
    ids = _routing(rng, 5, 2, 4, "random").astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(5, 2)).astype(np.float32)
    w_gate_up = (rng.normal(size=(4, 24, 40)) / np.sqrt(24)).astype(np.float32)
    w_down = (rng.normal(size=(4, 20, 24)) / np.sqrt(20)).astype(np.float32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    out = moe_experts(*map(jnp.asarray, (x, ids, weights, w_gate_up, w_down)))
    np.testing.assert_allclose(np.asarray(out), _numpy_experts(x, ids, weights, w_gate_up, w_down), rtol=1e-5,
                               atol=1e-5)


# ---------------------------------------------------------------------------------------------- kernel sweep

def _routing(rng, num_tokens, top_k, num_experts, pattern):
    if pattern == "random":  # distinct experts per token, ragged group sizes
        return np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :top_k]
    if pattern == "subset":  # only experts 2, 5, 11 (of 16) are used: the rest are empty
        used = np.array([2, 5, 11])
        return np.stack([rng.choice(used, top_k, replace=False) for _ in range(num_tokens)])
    if pattern == "ends":  # only the first, middle and last experts: the id bounds, most experts untouched
        used = np.array([0, num_experts // 2, num_experts - 1])
        return np.stack([rng.choice(used, top_k, replace=False) for _ in range(num_tokens)])
    if pattern == "one_expert":  # every token on expert E-2: one group spanning several row tiles
        return np.full((num_tokens, top_k), num_experts - 2)
    raise ValueError(pattern)


def _case_arrays(rng, num_tokens, top_k, num_experts, pattern):
    x = rng.normal(size=(num_tokens, HIDDEN)).astype(np.float32)
    ids = _routing(rng, num_tokens, top_k, num_experts, pattern).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, size=(num_tokens, top_k)).astype(np.float32)
    w_gate_up = (rng.normal(size=(num_experts, HIDDEN, 2 * INTER)) / np.sqrt(HIDDEN)).astype(np.float32)
    w_down = (rng.normal(size=(num_experts, INTER, HIDDEN)) / np.sqrt(INTER)).astype(np.float32)
    return x, ids, weights, w_gate_up, w_down


def _as_weight(w, mode, dtype):
    """mode: None (plain `dtype`), "int8" / "fp8", or either + "_channel_major" (values stored [E, N, K])."""
    if mode is None:
        return jnp.asarray(w, dtype)
    return quantize(jnp.asarray(w), mode.removesuffix("_channel_major"), channel_major=mode.endswith("_channel_major"))


def _tolerance(dtype):
    """(rtol, atol as a multiple of rms(ref)) for the kernel against the float32 reference on the same weights.

    float32: only the summation order differs (a few ulps over K <= 128 terms). bf16: the kernel rounds the
    SwiGLU output, each expert's output row and the result to bf16 (unit roundoff 2^-8 each) and the reference
    rounds its result once: four roundings, 2^-6 of the magnitude. Rows of opposite sign can cancel, hence the
    atol term at the scale of a typical output. Dequantization is exact in both, so quantized weights and
    fp8 activations (quantized identically in both) add nothing.
    """
    return (1e-4, 1e-4) if dtype == jnp.float32 else (2.0**-6, 2.0**-6)


CASES = {
    # name: (tokens, top_k, experts, routing, x dtype, weight mode, fp8 activations, tiles)
    "ragged_f32": (37, 4, 8, "random", jnp.float32, None, False, SMALL_TILES),
    "ragged_bf16": (37, 4, 8, "random", jnp.bfloat16, None, False, SMALL_TILES),
    "empty_experts_bf16": (29, 2, 16, "subset", jnp.bfloat16, None, False, SMALL_TILES),
    "one_expert_f32": (40, 1, 8, "one_expert", jnp.float32, None, False, SMALL_TILES),
    "one_token_f32": (1, 4, 8, "random", jnp.float32, None, False, SMALL_TILES),
    "block_m32_bf16": (53, 4, 8, "random", jnp.bfloat16, None, False,
                       MoeTiles(32, gate_up=GemmTiles(16, 64, 4, 3), down=GemmTiles(64, 16, 4, 3))),
    "default_tiles_bf16": (37, 4, 8, "random", jnp.bfloat16, None, False, None),
    "persistent_down_bf16": (53, 4, 8, "random", jnp.bfloat16, None, False, PERSISTENT_TILES),
    "persistent_down_one_expert_f32": (40, 1, 8, "one_expert", jnp.float32, None, False, PERSISTENT_TILES),
    "persistent_down_empty_experts_f32": (45, 2, 16, "subset", jnp.float32, None, False, PERSISTENT_TILES),
    # 25 rows per expert: grouped 64-row tiles, the persistent down kernel
    "default_tiles_persistent_down_bf16": (100, 4, 16, "random", jnp.bfloat16, None, False, None),
    # tokens that fit one tile: every_token grouping (an expert's tile computes every token; padding rows past T)
    "default_tiles_every_token_bf16": (32, 2, 16, "subset", jnp.bfloat16, None, False, None),
    "fp8_every_token_padded_bf16": (20, 4, 8, "random", jnp.bfloat16, "fp8_channel_major", False,
                                    MoeTiles(32, gate_up=GemmTiles(32, 32, 4, 2), down=GemmTiles(32, 32, 4, 2))),
    "fp8_activations_every_token_bf16": (12, 4, 8, "random", jnp.bfloat16, "fp8_channel_major", True, SMALL_TILES),
    "default_tiles_compute_regime_int8": (200, 4, 8, "random", jnp.bfloat16, "int8", False, None),
    # the 1-byte default of <= 16 rows per expert, shrunk to these dims (64 x 128 gate/up); the full-size tiles are
    # checked to lower in test_full_size_layer_lowers_to_triton_for_cuda
    "default_tiles_memory_regime_int8_channel_major": (5, 4, 8, "random", jnp.bfloat16, "int8_channel_major", False,
                                                       None),
    "int8_bf16": (37, 4, 8, "random", jnp.bfloat16, "int8", False, SMALL_TILES),
    "int8_f32_empty_experts": (29, 2, 16, "subset", jnp.float32, "int8", False, SMALL_TILES),
    "fp8_bf16": (37, 4, 8, "random", jnp.bfloat16, "fp8", False, SMALL_TILES),
    "fp8_f32_one_expert": (40, 1, 8, "one_expert", jnp.float32, "fp8", False, SMALL_TILES),
    "fp8_activations_bf16": (37, 4, 8, "random", jnp.bfloat16, "fp8", True, SMALL_TILES),
    "int8_channel_major_bf16": (37, 4, 8, "random", jnp.bfloat16, "int8_channel_major", False, SMALL_TILES),
    "int8_channel_major_f32_empty_experts": (29, 2, 16, "subset", jnp.float32, "int8_channel_major", False,
                                             SMALL_TILES),
    "int8_channel_major_block_m32_one_expert": (40, 1, 8, "one_expert", jnp.bfloat16, "int8_channel_major", False,
                                                MoeTiles(32, gate_up=GemmTiles(16, 64, 4, 3),
                                                         down=GemmTiles(64, 16, 4, 3))),
    "fp8_channel_major_bf16": (37, 4, 8, "random", jnp.bfloat16, "fp8_channel_major", False, SMALL_TILES),
    "fp8_activations_channel_major_bf16": (37, 4, 8, "random", jnp.bfloat16, "fp8_channel_major", True,
                                           SMALL_TILES),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pallas_matches_reference(name):
    num_tokens, top_k, num_experts, pattern, dtype, mode, fp8_activations, tiles = CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x, ids, weights, w_gate_up, w_down = _case_arrays(rng, num_tokens, top_k, num_experts, pattern)
    args = (jnp.asarray(x, dtype), jnp.asarray(ids), jnp.asarray(weights),
            _as_weight(w_gate_up, mode, dtype), _as_weight(w_down, mode, dtype))

    run = jax.jit(lambda *a: moe_experts(*a, impl="pallas", interpret=INTERPRET, fp8_activations=fp8_activations,
                                         tiles=tiles))
    out = np.asarray(run(*args), np.float32)
    ref = np.asarray(moe_experts_reference(*args, fp8_activations=fp8_activations), np.float32)

    assert out.shape == (num_tokens, HIDDEN) and not np.isnan(out).any()
    rtol, atol = _tolerance(dtype)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol * np.sqrt(np.mean(ref**2)))


# Every-token cases leave experts untouched and choose some only once (one token; the id bounds), so a tile that skips
# a chosen expert or runs an unchosen one fails; several column and k tiles move the shared tile's offsets. Grouped
# cases take ceil(T / bm) shared tiles, the last one partly padding or (48 tokens, 16-row tiles) full; 2304
# assignments fill 18 chunks of the grouping kernels' 32 (the rest count nothing).
MULTI_TILE = MoeTiles(32, gate_up=GemmTiles(32, 32, 4, 2), down=GemmTiles(32, 32, 4, 2))
SHARED_CASES = {  # name: (tokens, top_k, experts, routing, x dtype, routed weight mode, shared width / expert width,
    #                      tiles, in the kernels)
    "every_token_f32": (20, 4, 8, "random", jnp.float32, None, 1, None, True),
    "every_token_bf16": (32, 4, 8, "random", jnp.bfloat16, None, 1, None, True),
    "one_token_f32": (1, 4, 16, "random", jnp.float32, None, 1, None, True),
    "id_bounds_f32": (6, 2, 16, "ends", jnp.float32, None, 1, None, True),
    "several_tiles_f32": (20, 2, 16, "random", jnp.float32, None, 1, MULTI_TILE, True),
    "grouped_f32": (40, 4, 8, "random", jnp.float32, None, 1, SMALL_TILES, True),
    "grouped_whole_tiles_bf16": (48, 2, 16, "random", jnp.bfloat16, None, 1, SMALL_TILES, True),
    "grouped_several_tiles_f32": (40, 2, 16, "random", jnp.float32, None, 1, MULTI_TILE, True),
    "grouped_many_chunks_f32": (256, 9, 16, "random", jnp.float32, None, 1, SMALL_TILES, True),
    "persistent_down_f32": (53, 4, 8, "random", jnp.float32, None, 1, PERSISTENT_TILES, True),
    "beyond_a_decode_batch_f32": (1025, 2, 8, "random", jnp.float32, None, 1, SMALL_TILES, False),
    "int8_routed_bf16": (20, 4, 8, "random", jnp.bfloat16, "int8_channel_major", 1, None, False),
    "wider_shared_f32": (20, 4, 8, "random", jnp.float32, None, 2, None, False),
}


@pytest.mark.parametrize("name", list(SHARED_CASES))
def test_a_shared_expert_runs_in_the_kernels_or_in_xla(name):
    """Up to a decode batch of tokens, plain weights run a shared expert of the experts' width as more row tiles of
    their kernels (no GEMM of its own in XLA); elsewhere XLA computes it. Either way: routed + shared, as the
    reference."""
    num_tokens, top_k, num_experts, pattern, dtype, mode, width, tiles, in_kernels = SHARED_CASES[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    x, ids, weights, w_gate_up, w_down = _case_arrays(rng, num_tokens, top_k, num_experts, pattern)
    inter = w_down.shape[1] * width
    shared = (jnp.asarray(rng.normal(size=(HIDDEN, 2 * inter)) / np.sqrt(HIDDEN), dtype),
              jnp.asarray(rng.normal(size=(inter, HIDDEN)) / np.sqrt(inter), dtype))
    args = (jnp.asarray(x, dtype), jnp.asarray(ids), jnp.asarray(weights),
            _as_weight(w_gate_up, mode, dtype), _as_weight(w_down, mode, dtype))

    def run(*a):
        return moe_experts(*a, impl="pallas", interpret=INTERPRET, shared=shared, tiles=tiles)

    out = np.asarray(jax.jit(run)(*args), np.float32)
    # the float32 oracle: what the kernels round to bf16 (SwiGLU outputs, each expert's rows, the sum) it does not
    f32 = (args[0].astype(jnp.float32), *args[1:3], *(_as_weight(w, mode, jnp.float32) for w in (w_gate_up, w_down)))
    ref = np.asarray(moe_experts(*f32, impl="reference", shared=jax.tree.map(lambda w: w.astype(jnp.float32), shared)))
    routed_only = np.asarray(moe_experts(*f32, impl="reference"))
    assert np.abs(ref - routed_only).max() > 0.1 * np.abs(ref).max()  # the shared expert weighs in
    rtol, atol = _tolerance(dtype)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol * np.sqrt(np.mean(ref**2)))
    outside_kernels = [eqn.primitive.name for eqn in _equations(run, *args, into_kernels=False)]
    assert outside_kernels.count("dot_general") == (0 if in_kernels else 2), outside_kernels


def test_batch_invariant_kernels_give_a_token_the_same_bits_beside_any_tokens():
    """The first 8 tokens alone (by default every-token tiles) and beside 92 or 1032 others (by default grouped and
    half-height tiles; past 1024 tokens the shared expert in XLA). Without the mode the 1040 tokens' rows differ
    here; the 100 tokens' do not (interpret mode's CPU products keep a row's bits at any tile height, where the
    GPU's need not)."""
    rng = np.random.default_rng(5)
    x, ids, weights, w_gate_up, w_down = _case_arrays(rng, 1040, 4, 16, "random")
    shared = (jnp.asarray(rng.normal(size=(HIDDEN, 2 * INTER)) / np.sqrt(HIDDEN), jnp.bfloat16),
              jnp.asarray(rng.normal(size=(INTER, HIDDEN)) / np.sqrt(INTER), jnp.bfloat16))
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(w_gate_up, jnp.bfloat16),
            jnp.asarray(w_down, jnp.bfloat16))
    run = jax.jit(lambda *a: moe_experts(*a, impl="pallas", interpret=INTERPRET, shared=shared, batch_invariant=True))
    alone = np.asarray(run(*(a[:8] for a in args[:3]), *args[3:]), np.float32)
    for num_tokens in (100, 1040):
        beside = np.asarray(run(*(a[:num_tokens] for a in args[:3]), *args[3:]), np.float32)[:8]
        np.testing.assert_array_equal(beside, alone, err_msg=f"{num_tokens} tokens")
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    ref = np.asarray(moe_experts(*(a[:8] for a in f32[:3]), *f32[3:], impl="reference",
                                 shared=jax.tree.map(lambda w: w.astype(jnp.float32), shared)))
    rtol, atol = _tolerance(jnp.bfloat16)
    np.testing.assert_allclose(alone, ref, rtol=rtol, atol=atol * np.sqrt(np.mean(ref**2)))


def test_shared_tiles_come_first_and_run_no_routed_expert():
    """The first S row tiles are the shared expert's: no routed expert there (a program would compute one and have
    its rows overwritten, costing a weight read), then the routed tiles in order, grouped or every-token."""
    tile_expert = jnp.asarray([3, 5, -1], jnp.int32)
    grouped = [int(_routed_expert(tile_expert, jnp.int32(row), False, 2)) for row in range(5)]
    assert grouped == [-1, -1, 3, 5, -1]
    assert [int(_routed_expert(tile_expert, jnp.int32(row), False, 0)) for row in range(3)] == [3, 5, -1]
    chosen = jnp.asarray([0, 2, 2], jnp.int32)  # every-token: tile 1 + e is expert e's if some assignment chose e
    assert [int(_routed_expert(chosen, jnp.int32(row), True, 1)) for row in range(4)] == [-1, 0, -1, 2]


def test_xla_shared_expert_rounds_no_more_than_the_kernels_shared_tile():
    """Where XLA computes the shared expert (quantized experts, more than 1024 tokens) it keeps float32 GEMM outputs
    and rounds only the SwiGLU output to bf16, as the kernels' tile does. Rounding the GEMM outputs to bf16 too gave
    0.019 of the rms at LLaDA2's widths (0.0078 now) and failed the quantized full-size test on the H200."""
    hidden, inter = 2048, 512
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (32, hidden), jnp.bfloat16)
    shared = ((jax.random.normal(keys[1], (hidden, 2 * inter)) / np.sqrt(hidden)).astype(jnp.bfloat16),
              (jax.random.normal(keys[2], (inter, hidden)) / np.sqrt(inter)).astype(jnp.bfloat16))
    routed = jax.random.normal(keys[0], (32, hidden), jnp.float32)
    out = _plus_shared(routed, x, shared)
    assert out.dtype == jnp.float32  # the caller rounds once
    gate, up = jnp.split(x.astype(jnp.float32) @ shared[0].astype(jnp.float32), 2, axis=-1)
    shared_exact = (jax.nn.silu(gate) * up) @ shared[1].astype(jnp.float32)
    error = jnp.max(jnp.abs(out - routed - shared_exact)) / jnp.sqrt(jnp.mean(shared_exact**2))
    assert error < 0.012, error


@pytest.mark.parametrize("method", ["pallas", "count"])
@pytest.mark.parametrize("pattern", ["random", "subset", "one_expert", "tile_plus_one"])
def test_grouping_visits_only_filled_tiles(pattern, method):
    rng = np.random.default_rng(3)
    num_experts, block_m = 16, 32  # tiles of >= 32 rows count their filled rows (half-height tiles)
    if pattern == "tile_plus_one":  # the worst case for padding: every expert holds block_m + 1 rows
        ids = np.repeat(np.arange(num_experts), block_m + 1)[rng.permutation(num_experts * (block_m + 1))]
        ids = ids.reshape(-1, 1)
    else:
        ids = _routing(rng, 45, 2 if pattern == "subset" else 3, num_experts, pattern)
    groups = jax.tree.map(np.asarray, _group_by_expert(jnp.asarray(ids, jnp.int32), num_experts, block_m, method,
                                                       interpret=True))

    sizes = np.bincount(ids.ravel(), minlength=num_experts)
    filled_tiles = int(np.sum(-(-sizes // block_m)))
    assert filled_tiles <= len(groups.tile_expert) == _num_row_tiles(ids.size, num_experts, block_m)
    # exactly the filled tiles are visited, in expert order, each expert once per tile it fills
    np.testing.assert_array_equal(groups.tile_expert[:filled_tiles], np.repeat(np.arange(num_experts),
                                                                               -(-sizes // block_m)))
    assert (groups.tile_expert[filled_tiles:] == -1).all()
    # every assignment has its own row, inside a tile of its expert, and that row reads its token
    rows = groups.assignment_row.ravel()
    assert len(np.unique(rows)) == ids.size
    np.testing.assert_array_equal(groups.tile_expert[rows // block_m], ids.ravel())
    np.testing.assert_array_equal(groups.row_token[rows], np.arange(ids.size) // ids.shape[1])
    # each tile's filled rows are counted, and they come first in the tile (a half-height tile computes only those)
    filled = np.bincount(rows // block_m, minlength=len(groups.tile_expert))
    np.testing.assert_array_equal(groups.tile_rows, filled)
    assert (rows % block_m < groups.tile_rows[rows // block_m]).all()
    assert ((0 <= groups.row_token) & (groups.row_token < ids.shape[0])).all()  # padding rows read a real token
    assert _group_by_expert(jnp.asarray(ids, jnp.int32), num_experts, 16, method,
                            interpret=True).tile_rows is None  # full height


@pytest.mark.parametrize("num_tokens, block_m", [(32, 32), (5, 16), (1, 16)])
@pytest.mark.parametrize("pattern", ["random", "subset", "one_expert"])
def test_every_token_grouping_visits_each_touched_expert_once(num_tokens, block_m, pattern):
    rng = np.random.default_rng(num_tokens)
    num_experts = 16
    ids = _routing(rng, num_tokens, 1 if pattern == "one_expert" else 3, num_experts, pattern)
    groups = jax.tree.map(np.asarray, _group_by_expert(jnp.asarray(ids, jnp.int32), num_experts, block_m, "auto"))

    touched = np.isin(np.arange(num_experts), ids)
    np.testing.assert_array_equal(groups.tile_expert, np.where(touched, np.arange(num_experts), -1))
    rows = groups.assignment_row.ravel()
    np.testing.assert_array_equal(groups.tile_expert[rows // block_m], ids.ravel())
    np.testing.assert_array_equal(groups.row_token[rows], np.arange(ids.size) // ids.shape[1])
    assert (groups.row_token < num_tokens).all()


def test_default_tiles_hold_every_token_of_one_window_for_plain_weights_only():
    """Engine run 11: 32-row tiles at <= 32 tokens made LLaDA2's batch 1 faster with bf16 experts; int8's gate/up was
    slower at 32 rows than at 16 (fp8 x fp8 unmeasured), so those keep 16."""
    shape = (8, 256, 2048, 512)  # top-k, experts, hidden, expert width
    assert default_tiles(32, *shape).block_m == 32 and default_tiles(20, *shape).block_m == 32
    assert default_tiles(33, *shape).block_m == 16
    for weights in ("upcast", "fp8_activations"):
        assert default_tiles(32, *shape, weights).block_m == 16
    with pytest.raises(ValueError, match="weight format"):
        default_tiles(32, *shape, "int4")


def test_the_persistent_down_kernel_takes_grouped_plain_tiles_only():
    """Engine run 22: at LLaDA2 batch 32 (1024 tokens, 64-row grouped tiles) the persistent down kernel ran 186 us
    against the grid kernel's 203 (routed experts alone). Other regimes keep the grid kernel; tiles that ask for it
    where the grouping has no filled-row counts (every-token tiles) or the weights carry scales are refused."""
    shape = (8, 256, 2048, 512)
    assert default_tiles(1024, *shape).persistent_down
    assert not any(default_tiles(tokens, *shape).persistent_down for tokens in (32, 256, 8192))
    assert not any(default_tiles(1024, *shape, weights).persistent_down for weights in ("upcast", "fp8_activations"))
    x, ids, weights = jnp.ones((16, HIDDEN)), jnp.zeros((16, 2), jnp.int32), jnp.ones((16, 2))
    w_gate_up, w_down = jnp.ones((4, HIDDEN, 2 * INTER)), jnp.ones((4, INTER, HIDDEN))
    with pytest.raises(ValueError, match="persistent_down"):  # 16 tokens fit one 32-row tile: every-token grouping
        moe_experts(x, ids, weights, w_gate_up, w_down, impl="pallas", interpret=True, tiles=PERSISTENT_TILES)
    x, ids, weights = jnp.ones((64, HIDDEN)), jnp.zeros((64, 2), jnp.int32), jnp.ones((64, 2))
    with pytest.raises(ValueError, match="persistent_down"):  # grouped tiles, but int8 weights with their scales
        moe_experts(x, ids, weights, quantize(w_gate_up, "int8"), quantize(w_down, "int8"), impl="pallas",
                    interpret=True, tiles=PERSISTENT_TILES)


def test_every_token_gate_up_tiles_fit_two_blocks_per_sm():
    """Engine run 14: at batch 1 the 216 KB gate/up tiles fit one block per SM, so ~148 programs queued on the H200's
    132 SMs; tiles whose pipeline buffers fit twice in an SM's 228 KB took 51.8 -> 44.9 us per layer."""
    tiles = default_tiles(32, 8, 256, 2048, 512)
    gate_up = tiles.gate_up  # each stage holds an x tile and a gate and an up weight tile, bf16
    stage_bytes = 2 * (tiles.block_m * gate_up.block_k + 2 * gate_up.block_k * gate_up.block_n)
    assert 2 * gate_up.num_stages * stage_bytes <= 228 * 1024


def test_every_token_grouping_refuses_tokens_beyond_one_tile():
    with pytest.raises(ValueError, match="fit one"):
        _group_by_expert(jnp.zeros((17, 2), jnp.int32), 8, 16, "every_token")


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m, pattern", [
    (1024, 8, 256, 64, "random"), (256, 8, 256, 16, "random"), (7, 3, 5, 16, "random"), (40, 2, 8, 64, "random"),
    (45, 3, 16, 16, "subset"), (40, 4, 8, 16, "one_expert"), (300, 2, 64, 32, "random")])
def test_grouping_kernels_equal_grouping_by_counting(num_tokens, top_k, num_experts, block_m, pattern):
    """The engine's batch sizes (batch 32's 1024 tokens, the kernels' bound, and batch 8's 256 at LLaDA2's top-8 of
    256), odd shapes (experts and chunks not powers of two), empty experts, one expert for everything: identical
    groups, padding rows included."""
    ids = jnp.asarray(_routing(np.random.default_rng(num_tokens), num_tokens, top_k, num_experts, pattern))
    by_kernels = _group_by_expert(ids, num_experts, block_m, "pallas", interpret=True)
    by_counting = _group_by_expert(ids, num_experts, block_m, "count")
    for field, kernels, counted in zip(by_kernels._fields, by_kernels, by_counting):
        if counted is None:
            assert kernels is None, field
            continue
        np.testing.assert_array_equal(np.asarray(kernels), np.asarray(counted), err_msg=field)


def test_rejects_bad_shapes_and_fp8_activations_without_fp8_weights():
    rng = np.random.default_rng(4)
    x, ids, weights, w_gate_up, w_down = (jnp.asarray(a) for a in _case_arrays(rng, 5, 2, 4, "random"))
    with pytest.raises(ValueError, match="w_down"):
        moe_experts(x, ids, weights, w_gate_up, w_down[:, :-1], impl="reference")
    with pytest.raises(ValueError, match="fp8_activations"):
        moe_experts(x, ids, weights, quantize(w_gate_up, "int8"), quantize(w_down, "int8"), impl="pallas",
                    interpret=True, fp8_activations=True)


# ---------------------------------------------------------------------------------------------- CUDA lowering

def _weight_struct(shape, mode, channel_major):
    if mode == "bf16":
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    stored = (shape[0], shape[2], shape[1]) if channel_major else shape
    values = jax.ShapeDtypeStruct(stored, jnp.int8 if mode == "int8" else jnp.float8_e4m3fn)
    return QuantizedWeight(values, jax.ShapeDtypeStruct((shape[0], shape[2]), jnp.float32), channel_major)


@pytest.mark.parametrize("num_tokens", [32, 256, 2048, 8192])
def test_full_size_layer_lowers_to_triton_for_cuda(num_tokens):
    """LLaDA2.0-mini expert shapes, every weight format: Pallas -> Triton IR must succeed (no GPU needed), and up to
    the grouping holds no sort at any size (XLA:GPU runs large sorts as library calls, which split the denoising
    loop's CUDA graph)."""
    experts, hidden, inter, top_k = 256, 2048, 512, 8
    for mode, fp8_activations, channel_major in (("bf16", False, False), ("int8", False, False),
                                                 ("int8", False, True), ("fp8", False, True), ("fp8", True, True)):
        run = jax.jit(lambda *a, fp8=fp8_activations: moe_experts(*a[:5], impl="pallas", fp8_activations=fp8,
                                                                  shared=a[5:]))
        args = (jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16),
                jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32),
                jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32),
                _weight_struct((experts, hidden, 2 * inter), mode, channel_major),
                _weight_struct((experts, inter, hidden), mode, channel_major),
                # a shared expert: in the kernels up to 1024 tokens of plain weights, in XLA otherwise
                jax.ShapeDtypeStruct((hidden, 2 * inter), jnp.bfloat16), jax.ShapeDtypeStruct((inter, hidden),
                                                                                             jnp.bfloat16))
        text = lowered_for_h100(run, *args)
        weights = "plain" if mode == "bf16" else "fp8_activations" if fp8_activations else "upcast"
        grouped = num_tokens > default_tiles(num_tokens, top_k, experts, hidden, inter, weights).block_m
        # the expert kernels, and where the tokens do not fit one row tile the two grouping kernels up to a decode
        # batch's assignments (XLA groups a prefill's)
        kernels = 4 if grouped and num_tokens * top_k <= _PALLAS_GROUPING_MAX_ASSIGNMENTS else 2
        assert text.count("__gpu$xla.gpu.triton") == kernels, (mode, fp8_activations, channel_major)
        in_kernels = num_tokens <= 1024 and mode == "bf16" and not fp8_activations
        assert text.count("stablehlo.dot_general") == (0 if in_kernels else 2), (mode, num_tokens)
        assert "stablehlo.sort" not in text
        # the shared expert's row tiles find their tokens in the kernel: no concatenate kernel builds them
        assert "stablehlo.concatenate" not in text, (mode, num_tokens)


def _equations(fn, *args, into_kernels=True) -> list:
    """Every equation of fn's jaxpr, nested jaxprs included (a Pallas kernel's body unless into_kernels is False), in
    program order."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.append(eqn)
            if into_kernels or eqn.primitive.name != "pallas_call":
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _pallas_operand_counts(fn, *args) -> list[int]:
    """Operands of each pallas_call in fn's jaxpr, in program order."""
    return [len(eqn.invars) for eqn in _equations(fn, *args) if eqn.primitive.name == "pallas_call"]


def test_decode_batches_group_in_two_kernels_and_prefills_in_xla():
    """Up to batch 32's 8192 assignments the groups come from the two kernels, with no scatter in XLA: inside the
    engine's while-loop XLA hoists a scatter's constant operand (its zeros) and copies it back every iteration (~4
    copies per MoE layer in the H200's HLO). Beyond that (prefills; the kernels' per-program load of every chunk's
    counts took 2.2 ms a layer at 16384 tokens) XLA counts, behind a barrier: without it XLA fused the grouping
    arithmetic into every element of the combine (a 34 us fusion per layer on the H200)."""
    def route_and_group(logits, block_m=16):
        _, ids = route_grouped_sigmoid(logits, jnp.zeros(64), top_k=4, n_group=4, topk_group=2,
                                       routed_scaling_factor=1.0, norm_topk_prob=True, impl="reference")
        return _group_by_expert(ids, 64, block_m, interpret=True)

    most_tokens = _PALLAS_GROUPING_MAX_ASSIGNMENTS // 4  # at top-4
    decode = _equations(route_and_group, jnp.ones((most_tokens, 64)), into_kernels=False)
    names = [eqn.primitive.name for eqn in decode]
    assert "top_k" in names and not [n for n in names if n.startswith("scatter")], names
    assert [eqn.params["name"] for eqn in decode if eqn.primitive.name == "pallas_call"] == ["moe_group_count",
                                                                                             "moe_group_rows"]
    prefill = [eqn.primitive.name for eqn in _equations(route_and_group, jnp.ones((most_tokens + 1, 64)),
                                                        into_kernels=False)]
    assert "pallas_call" not in prefill and "optimization_barrier" in prefill


def test_unscaled_operands_pass_no_scale_arrays():
    """bf16 weights and activations carry no unit-scale arrays (each would be an extra buffer and multiply)."""
    x = jnp.ones((8, HIDDEN), jnp.float32)
    ids, weights = jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2), jnp.float32)
    plain = (jnp.ones((4, HIDDEN, 2 * INTER)), jnp.ones((4, INTER, HIDDEN)))
    run = functools.partial(moe_experts, impl="pallas", interpret=True, tiles=SMALL_TILES)
    assert _pallas_operand_counts(run, x, ids, weights, *plain) == [4, 3]  # tile table, rows, x | act, weights
    int8 = [quantize(w, "int8") for w in plain]
    assert _pallas_operand_counts(run, x, ids, weights, *int8) == [5, 4]  # + per-column weight scales


def test_a_models_layers_trace_each_kernel_once(monkeypatch):
    """A model's MoE layers call the router and expert kernels on the same shapes; its program traces each kernel
    once, not once per layer (LLaDA2's 19 layers at batch 32 traced in 1.95 s on the CPU, in 0.26 once)."""
    from jaxllm.kernels import moe

    traces = []
    for name in ("_route_kernel", "_group_count_kernel", "_group_rows_kernel", "_gate_up_kernel",
                 "_persistent_down_kernel"):
        kernel = getattr(moe, name)

        @functools.wraps(kernel)
        def counted(*refs, kernel=kernel, name=name, **params):
            traces.append(name)
            return kernel(*refs, **params)

        monkeypatch.setattr(moe, name, counted)  # a new function: no program built for it yet
    spec = jax.ShapeDtypeStruct
    num_tokens, num_experts = 64, 16

    def layers(x, logits, w_gate_up, w_down):
        for _ in range(3):
            weights, ids = route_grouped_sigmoid(logits, jnp.zeros(num_experts), top_k=4, n_group=4, topk_group=2,
                                                 routed_scaling_factor=1.0, norm_topk_prob=True, impl="pallas",
                                                 interpret=True)
            x = moe_experts(x, ids, weights, w_gate_up, w_down, impl="pallas", interpret=True, tiles=PERSISTENT_TILES)
        return x

    jax.make_jaxpr(layers)(spec((num_tokens, HIDDEN), jnp.float32), spec((num_tokens, num_experts), jnp.float32),
                           spec((num_experts, HIDDEN, 2 * INTER), jnp.float32),
                           spec((num_experts, INTER, HIDDEN), jnp.float32))
    assert sorted(traces) == ["_gate_up_kernel", "_group_count_kernel", "_group_rows_kernel",
                              "_persistent_down_kernel", "_route_kernel"]


# ---------------------------------------------------------------------------------------------- GPU only

@gpu
@requires_gpu
def test_e4m3_upcast_is_exact_for_every_byte():
    """The kernels' bit-arithmetic e4m3 -> bf16 up-cast (inline PTX, GPU only) against XLA's convert, bit for bit: all
    256 bytes but e4m3fn's two NaN codes, each at several positions of the 4-byte groups the PTX unpacks."""
    codes = jax.random.permutation(jax.random.key(3), jnp.arange(256 * 4, dtype=jnp.int32) % 256)
    tile = jax.lax.bitcast_convert_type(codes.astype(jnp.uint8).reshape(32, 32), jnp.float8_e4m3fn)

    def kernel(tile_ref, out_ref):
        out_ref[...] = _upcast(tile_ref[...], jnp.bfloat16, interpret=False)

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(tile.shape, jnp.bfloat16))(tile)
    expected = tile.astype(jnp.bfloat16)
    out_bits, expected_bits = (np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16)) for a in (out, expected))
    checked = ~np.isnan(np.asarray(expected, np.float32))
    np.testing.assert_array_equal(out_bits[checked], expected_bits[checked])


@gpu
@requires_gpu
@pytest.mark.parametrize("mode", [None, "int8", "fp8", "int8_channel_major", "fp8_channel_major"])
@pytest.mark.parametrize("num_tokens", [32, 256, 1024, 8192])
def test_full_size_layer_on_gpu(mode, num_tokens):
    """LLaDA2.0-mini layer with its real router, its shared expert (in the kernels up to 1024 tokens of bf16 experts)
    and the default tiles (one token count per tiling regime; 256 and 1024: grouped, with the shared expert's row
    tiles)."""
    experts, hidden, inter = 256, 2048, 512
    keys = jax.random.split(jax.random.key(num_tokens), 6)
    x = jax.random.normal(keys[0], (num_tokens, hidden), jnp.bfloat16)
    logits = jax.random.normal(keys[1], (num_tokens, experts), jnp.float32)
    weights, ids = route_grouped_sigmoid(logits, jnp.zeros(experts), top_k=8, n_group=8, topk_group=4,
                                         routed_scaling_factor=2.5, norm_topk_prob=True)
    w_gate_up = (jax.random.normal(keys[2], (experts, hidden, 2 * inter)) / np.sqrt(hidden)).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[3], (experts, inter, hidden)) / np.sqrt(inter)).astype(jnp.bfloat16)
    w_gate_up, w_down = _as_weight(w_gate_up, mode, jnp.bfloat16), _as_weight(w_down, mode, jnp.bfloat16)
    shared_keys = jax.random.split(keys[5])
    shared = ((jax.random.normal(shared_keys[0], (hidden, 2 * inter)) / np.sqrt(hidden)).astype(jnp.bfloat16),
              (jax.random.normal(shared_keys[1], (inter, hidden)) / np.sqrt(inter)).astype(jnp.bfloat16))

    out = np.asarray(jax.jit(lambda *a: moe_experts(*a, impl="pallas", shared=shared))(
        x, ids, weights, w_gate_up, w_down), np.float32)
    # the float32 oracle on the same (dequantized) weights: it rounds nothing the kernels round to bf16
    f32 = functools.partial(dequantize, dtype=jnp.float32)
    ref = np.asarray(moe_experts(f32(x), ids, weights, f32(w_gate_up), f32(w_down), impl="reference",
                                 shared=tuple(map(f32, shared))))
    rtol, atol = _tolerance(jnp.bfloat16)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol * np.sqrt(np.mean(ref**2)))


def test_grouped_routing_breaks_ties_as_top_k_does():
    """Group scores and group selection by comparisons must pick what lax.top_k picks, ties included (equal experts
    inside a group, equal groups across the top-k boundary)."""
    rng = np.random.default_rng(5)
    logits = rng.integers(-3, 4, size=(64, 32)).astype(np.float32)  # few distinct values: ties everywhere
    bias = np.zeros(32, np.float32)
    weights, ids = route_grouped_sigmoid(jnp.asarray(logits), jnp.asarray(bias), top_k=4, n_group=8, topk_group=3,
                                         routed_scaling_factor=1.0, norm_topk_prob=False)

    def with_top_k(logits):  # the same routing with lax.top_k for the group scores and the kept groups
        scores = jax.nn.sigmoid(logits)
        grouped = scores.reshape(64, 8, 4)
        _, kept = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), 3)
        kept_mask = jnp.any(kept[:, :, None] == jnp.arange(8), axis=1)
        choice = jnp.where(jnp.repeat(kept_mask, 4, axis=1), scores, -jnp.inf)
        return jax.lax.top_k(choice, 4)[1]

    np.testing.assert_array_equal(np.asarray(ids), np.asarray(with_top_k(jnp.asarray(logits))))


def test_grouped_routing_rejects_groups_of_one_expert():
    with pytest.raises(ValueError, match="groups of at least two"):
        route_grouped_sigmoid(jnp.zeros((4, 8)), jnp.zeros(8), top_k=2, n_group=8, topk_group=2,
                              routed_scaling_factor=1.0, norm_topk_prob=True)


def test_grouped_routing_rejects_more_experts_than_the_kept_groups_hold():
    """4 groups of 8 keeping 1: only 8 experts can be chosen; the kernel would repeat expert 0 for the ninth."""
    with pytest.raises(ValueError, match="exceeds"):
        route_grouped_sigmoid(jnp.zeros((4, 32)), jnp.zeros(32), top_k=9, n_group=4, topk_group=1,
                              routed_scaling_factor=1.0, norm_topk_prob=True)


ROUTER_CASES = {  # (tokens, experts, n_group, topk_group, top_k, integer logits: ties everywhere, norm)
    "llada2_shape": (37, 256, 8, 4, 8, False, True),
    "llada2_shape_unnormalised": (16, 256, 8, 4, 8, False, False),
    "ties": (64, 32, 8, 3, 4, True, False),
}


@pytest.mark.parametrize("name", sorted(ROUTER_CASES))
def test_pallas_router_matches_reference(name):
    """The one-kernel router picks the reference's experts in the reference's order (ties included) with the same
    weights; outputs of interpret mode start as NaN, so an unwritten slot fails."""
    tokens, experts, n_group, topk_group, top_k, ties, norm = ROUTER_CASES[name]
    rng = np.random.default_rng(sorted(ROUTER_CASES).index(name))
    logits = rng.integers(-3, 4, size=(tokens, experts)) if ties else rng.normal(size=(tokens, experts)) * 2
    bias = np.zeros(experts) if ties else np.abs(rng.normal(size=experts)) * 0.1
    kwargs = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                  norm_topk_prob=norm)
    args = (jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32))
    want_weights, want_ids = route_grouped_sigmoid(*args, impl="reference", **kwargs)
    weights, ids = route_grouped_sigmoid(*args, impl="pallas", interpret=INTERPRET, **kwargs)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-6, atol=1e-7)


def test_router_lowers_to_triton_for_cuda():
    route = jax.jit(functools.partial(route_grouped_sigmoid, top_k=8, n_group=8, topk_group=4,
                                      routed_scaling_factor=2.5, norm_topk_prob=True, impl="pallas"))
    text = lowered_for_h100(route, jax.ShapeDtypeStruct((32, 256), jnp.float32),
                            jax.ShapeDtypeStruct((256,), jnp.float32))
    assert text.count("__gpu$xla.gpu.triton") == 1
