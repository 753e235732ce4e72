"""Mixture-of-experts: routing and the expert SwiGLU layer as a Pallas (Triton) grouped GEMM.

Routing (float32, on device):
  route_grouped_sigmoid  LLaDA2 / DeepSeek-V3 style: s = sigmoid(logits); selection scores s + bias;
                         keep the `topk_group` groups whose top-2 selection scores sum highest; top-k
                         of the selection scores inside them; weights are the *unbiased* s of the
                         chosen experts, optionally normalised, times `routed_scaling_factor`.
  route_softmax_topk     softmax over experts, top-k, optionally renormalised.

Experts (axis letters: T tokens, C chosen experts per token, A = T*C assignments, E experts, H hidden,
I expert width, R row tiles, bm rows per tile):
  x               [T, H]
  expert_ids      i32[T, C]    in [0, E)
  expert_weights  f32[T, C]
  w_gate_up       [E, H, 2I]   gate in [..., :I], up in [..., I:]
  w_down          [E, I, H]
  out[t] = sum_c w[t,c] * (silu(x[t] @ Wg[e]) * (x[t] @ Wu[e])) @ Wd[e],  e = expert_ids[t, c]
Either weight may be a `jaxllm.quantization.QuantizedWeight` (int8 or e4m3 values [E, K, N], or channel-major
[E, N, K], the faster layout; f32 scales [E, N]); the scale is applied after the K reduction. With
`fp8_activations` (fp8 weights only) x and the SwiGLU output are quantized per row to e4m3 too and the GEMMs run
fp8 x fp8 on the tensor cores.

Pallas path, all on device with static shapes:
  1. group the A assignments by expert and give expert e the padded rows [start_e, start_e + ceil(n_e/bm)*bm);
     the padded total is at most R*bm rows (`_num_row_tiles`), so every array has a static shape. When all T
     tokens fit one row tile (decode batches of one window) nothing is grouped: each touched expert's tile holds
     every token, and the rows no assignment reads are computed and never read; the kernels then find whether
     their tile's expert was chosen from the assignments themselves;
  2. gate_up kernel, grid (S+R, I/bn): row tile r gathers its tokens' rows of x and multiplies them by its expert's
     gate and up columns (tile_expert[r - S]; every-token, expert r - S if chosen) -> act[(S+R)*bm, I] =
     silu(gate) * up;
  3. down kernel, grid (S+R, H/bn): act rows @ that expert's w_down -> out_rows[(S+R)*bm, H]; where the tiles say
     `persistent_down`, one program per SM instead walks the (row tile, column tile) items in one flat loop;
  4. out[t] = sum_c w[t,c] * out_rows[S*bm + row of (t, c)] (a gather and a sum over C), plus out_rows[t].
S is 0, or with a shared expert (`shared=`, every token at weight 1) of the experts' width ceil(T / bm): its row
tiles hold the tokens in order and come first in the grid (so their programs start in the first wave). That holds
for plain weights and T up to _SHARED_IN_KERNELS_MAX_TOKENS; elsewhere XLA computes the shared expert and adds it.
Row tiles that hold no rows (past the last group; an untouched expert's, every-token) have tile_expert = -1 and
return at once, so empty experts and unused padding cost no weight reads: a batch touches only its experts'
weights, once per row tile.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels import in_row_chunks, is_power_of_two, pallas_program
from jaxllm.kernels.matmul import invariant_matmul
from jaxllm.quantization import QuantizedWeight, dequantize, quantize_rows


def route_grouped_sigmoid_reference(router_logits, expert_bias, *, top_k, n_group, topk_group, routed_scaling_factor,
                                    norm_topk_prob):
    """f32[T, E] logits -> (f32[T, top_k] weights, i32[T, top_k] expert ids), in XLA (the CPU path)."""
    num_tokens, num_experts = router_logits.shape
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    choice = scores + expert_bias.astype(jnp.float32)[None, :]
    grouped = choice.reshape(num_tokens, n_group, num_experts // n_group)
    # The two small top-ks by comparisons, not lax.top_k: on the GPU each top_k is a sort kernel (~3 us per call at
    # 32 tokens on the H200), and these fuse into the surrounding elementwise work. Same values and ties as top_k.
    first = jnp.argmax(grouped, axis=-1)[..., None]  # each group's best expert (the lowest index among equals)
    runner_up = jnp.max(jnp.where(jnp.arange(grouped.shape[-1]) == first, -jnp.inf, grouped), axis=-1)
    group_scores = jnp.max(grouped, axis=-1) + runner_up  # [T, n_group]: sum of each group's top two
    # group g is kept if fewer than topk_group groups rank above it (higher score, or equal and a lower index)
    above = (group_scores[:, None, :] > group_scores[:, :, None]) | (
        (group_scores[:, None, :] == group_scores[:, :, None]) & (jnp.arange(n_group) < jnp.arange(n_group)[:, None]))
    group_kept = jnp.sum(above, axis=-1) < topk_group  # [T, n_group]
    choice = jnp.where(jnp.repeat(group_kept, num_experts // n_group, axis=1), choice, -jnp.inf)
    _, expert_ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids.astype(jnp.int32)


def _route_kernel(logits_ref, bias_ref, weights_ref, ids_ref, *, top_k, n_group, topk_group, routed_scaling_factor,
                  norm_topk_prob):
    """One token per program: its E router logits -> its top_k (weight, expert) pairs.

    The same steps as the reference, on [n_group, E / n_group] and [E] views of one row: each group's top two by
    argmax and masked max, the kept groups by a rank count, then top_k rounds of take-the-first-max over the kept
    experts (lax.top_k's order and ties). With one warp per token every reduction stays inside the warp.
    """
    token = pl.program_id(0)
    num_experts = logits_ref.shape[1]
    group_size = num_experts // n_group
    scores = jax.nn.sigmoid(logits_ref[token, :])  # [E]
    choice = scores + bias_ref[...]
    grouped = choice.reshape(n_group, group_size)
    in_group = lax.broadcasted_iota(jnp.int32, (n_group, group_size), 1)
    first = jnp.argmax(grouped, axis=1)[:, None]
    runner_up = jnp.max(jnp.where(in_group == first, -jnp.inf, grouped), axis=1)
    group_scores = jnp.max(grouped, axis=1) + runner_up  # [G]
    group_row = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 0)
    group_col = lax.broadcasted_iota(jnp.int32, (n_group, n_group), 1)
    above = (group_scores[None, :] > group_scores[:, None]) | (
        (group_scores[None, :] == group_scores[:, None]) & (group_col < group_row))
    group_kept = jnp.sum(above.astype(jnp.int32), axis=1) < topk_group  # [G]
    expert = lax.iota(jnp.int32, num_experts)
    expert_group = lax.broadcasted_iota(jnp.int32, (num_experts, n_group), 0) // group_size
    kept = jnp.sum(((expert_group == lax.broadcasted_iota(jnp.int32, (num_experts, n_group), 1))
                    & group_kept[None, :]).astype(jnp.int32), axis=1) > 0  # [E]
    remaining = jnp.where(kept, choice, -jnp.inf)
    slot = lax.iota(jnp.int32, top_k)
    ids, weights = jnp.zeros((top_k,), jnp.int32), jnp.zeros((top_k,), jnp.float32)
    for rank in range(top_k):
        best = jnp.argmax(remaining).astype(jnp.int32)
        ids = jnp.where(slot == rank, best, ids)
        weights = jnp.where(slot == rank, jnp.sum(jnp.where(expert == best, scores, 0.0)), weights)
        remaining = jnp.where(expert == best, -jnp.inf, remaining)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights) + 1e-20)
    weights_ref[token, :] = weights * routed_scaling_factor
    ids_ref[token, :] = ids


def _route_grouped_sigmoid_pallas(router_logits, expert_bias, *, top_k, n_group, topk_group, routed_scaling_factor,
                                  norm_topk_prob, interpret):
    num_tokens = router_logits.shape[0]
    program = pallas_program(
        _route_kernel, [jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32),
                        jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)], (num_tokens,),
        name="moe_route", num_warps=1, interpret=interpret, num_raw_inputs=2, top_k=top_k, n_group=n_group,
        topk_group=topk_group, routed_scaling_factor=float(routed_scaling_factor), norm_topk_prob=norm_topk_prob)
    return program(router_logits.astype(jnp.float32), expert_bias.astype(jnp.float32))


def route_grouped_sigmoid(router_logits, expert_bias, *, top_k, n_group, topk_group, routed_scaling_factor,
                          norm_topk_prob, impl="auto", interpret=False, batch_invariant=False):
    """f32[T, E] logits -> (f32[T, top_k] weights, i32[T, top_k] expert ids).

    impl: "auto" (the Pallas kernel on GPU where E, E / n_group, n_group and top_k are powers of two, as Triton's
    tensors must be; XLA elsewhere), "pallas" or "reference". On the GPU XLA runs the routing as ~7 kernels per
    call, the kernel as one. batch_invariant: the reference on fixed chunks of tokens (`in_row_chunks`): XLA's CPU
    code normalises a token's weights otherwise at 1024 tokens than at 64; the kernel takes one token per program.
    """
    kwargs = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
                  norm_topk_prob=norm_topk_prob)
    num_experts = router_logits.shape[1]
    if num_experts % n_group or num_experts // n_group < 2:
        raise ValueError(f"{num_experts} experts must split into {n_group} groups of at least two (a group scores "
                         f"its top two)")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"top_k={top_k} exceeds the {topk_group} kept groups' {topk_group * (num_experts // n_group)} "
                         f"experts")
    fits = all(is_power_of_two(n) for n in (num_experts, num_experts // n_group, n_group, top_k))
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and fits else "reference"
    if impl == "reference":
        if batch_invariant:
            return in_row_chunks(lambda logits: route_grouped_sigmoid_reference(logits, expert_bias, **kwargs),
                                 router_logits)
        return route_grouped_sigmoid_reference(router_logits, expert_bias, **kwargs)
    if impl == "pallas":
        if not fits:
            raise ValueError(f"the Pallas router needs powers of two: {num_experts} experts, {n_group} groups, "
                             f"top {top_k}")
        return _route_grouped_sigmoid_pallas(router_logits, expert_bias, interpret=interpret, **kwargs)
    raise ValueError(f"unknown routing impl {impl!r}; use 'auto', 'pallas' or 'reference'")


def route_softmax_topk(router_logits, *, top_k, norm_topk_prob):
    """f32[T, E] logits -> (f32[T, top_k] weights, i32[T, top_k] expert ids)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, expert_ids.astype(jnp.int32)


def _check_inputs(x, expert_ids, expert_weights, w_gate_up, w_down, fp8_activations, shared=None):
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {x.shape}")
    num_tokens, hidden = x.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != num_tokens or expert_weights.shape != expert_ids.shape:
        raise ValueError(f"expert_ids and expert_weights must both be [T={num_tokens}, C], got "
                         f"{expert_ids.shape} and {expert_weights.shape}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids must be integers, got {expert_ids.dtype}")
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] != hidden or w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up must be [E, H={hidden}, 2I], got {w_gate_up.shape}")
    num_experts, _, two_inter = w_gate_up.shape
    if w_down.shape != (num_experts, two_inter // 2, hidden):
        raise ValueError(f"w_down must be [E, I, H] = {(num_experts, two_inter // 2, hidden)}, got {w_down.shape}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if isinstance(w, QuantizedWeight) and w.scales.shape != (w.shape[0], w.shape[2]):
            raise ValueError(f"{name} scales must be [E, N] = {(w.shape[0], w.shape[2])}, got {w.scales.shape}")
    is_fp8 = [isinstance(w, QuantizedWeight) and w.values.dtype == jnp.float8_e4m3fn for w in (w_gate_up, w_down)]
    if fp8_activations and not all(is_fp8):
        raise ValueError("fp8_activations needs both expert weights quantized to fp8 (quantize(w, 'fp8'))")
    if shared is not None:
        shared_gate_up, shared_down = shared
        if (shared_gate_up.ndim != 2 or shared_gate_up.shape[0] != hidden or shared_gate_up.shape[1] % 2
                or shared_down.shape != (shared_gate_up.shape[1] // 2, hidden)):
            raise ValueError(f"shared weights must be [H={hidden}, 2I'] and [I', H], got {shared_gate_up.shape} and "
                             f"{shared_down.shape}")


def _fp8_round_trip(a):
    """[R, D] -> the f32 values that per-row e4m3 quantization represents."""
    values, scales = quantize_rows(a)
    return values.astype(jnp.float32) * scales[:, None]


def moe_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down, *, fp8_activations=False):
    """Every expert on every token, combined with a dense [T, E] weight matrix (float32 math).

    Quantized weights are dequantized exactly. With fp8_activations, x and every (token, expert) row of the
    SwiGLU output, first rounded to x's dtype as the kernel stores it, go through per-row e4m3 quantization.
    """
    num_tokens = x.shape[0]
    num_experts, _, two_inter = w_gate_up.shape
    inter = two_inter // 2
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32)
    combine = combine.at[jnp.arange(num_tokens)[:, None], expert_ids].add(expert_weights.astype(jnp.float32))
    x32 = _fp8_round_trip(x) if fp8_activations else x.astype(jnp.float32)
    highest = lax.Precision.HIGHEST  # the oracle stays float32 on GPUs too (no TF32)
    gate_up = jnp.einsum("th,ehn->ten", x32, dequantize(w_gate_up), precision=highest)
    act = jax.nn.silu(gate_up[..., :inter]) * gate_up[..., inter:]  # [T, E, I]
    if fp8_activations:
        act = _fp8_round_trip(act.astype(x.dtype).reshape(-1, inter)).reshape(act.shape)
    out = jnp.einsum("tei,eih,te->th", act, dequantize(w_down), combine, precision=highest)
    return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class GemmTiles:
    """Static tiling of one grouped GEMM: Triton block sizes and launch parameters."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class MoeTiles:
    """Rows per tile of the expert-sorted assignments, and the tiling of the two GEMMs. persistent_down: the down
    GEMM runs as `_persistent_down_kernel` (plain weights in grouped tiles of >= _HALF_TILE_MIN_BLOCK_M rows only)."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    persistent_down: bool = False


def _fit_block(dim, preferred):
    """The largest power of two <= preferred that divides dim (Triton tiles are powers of two, >= 16)."""
    block = preferred
    while dim % block:
        block //= 2
    if block < 16:
        raise ValueError(f"dimension {dim} has no power-of-two tile >= 16 <= {preferred}; pad it to a multiple of 16")
    return block


WEIGHT_FORMATS = ("plain", "upcast", "fp8_activations")


def default_tiles(num_tokens, top_k, num_experts, hidden, inter, weights="plain"):
    """Tiles by the mean rows per expert: small tiles stream weights at decode sizes, large ones feed tensor cores.

    Picked from the H200 sweeps in tools/bench_moe.py and, for one decode window, tools/bench_moe_decode.py
    (LLaDA2.0-mini shapes, JAX 0.11.2). weights: "plain" (the activations' dtype), "upcast" (int8 or e4m3 weights
    that the kernels up-cast to the activations' dtype) or "fp8_activations" (e4m3 x e4m3 products, tiled as plain).
    Up to _EVERY_TOKEN_MAX_TOKENS tokens a plain weight's row tile grows to hold them all, so the grouping is only
    which experts are touched (`_group_by_expert`): LLaDA2 batch 1 2.732 -> 2.632 ms per forward (engine run 11).
    Up-cast weights keep 16 rows: their gate/up kernel took 48 us per layer at 32 rows against 37 at 16 (H200, 32
    tokens, 48 experts), more than the grouping saves; fp8 x fp8 at 32 rows is unmeasured, so it keeps 16 too.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; use one of {WEIGHT_FORMATS}")
    upcast_weights = weights == "upcast"
    rows_per_expert = num_tokens * top_k / num_experts
    persistent_down = False
    if rows_per_expert <= 16 and upcast_weights:  # memory-bound, 1-byte weights: deep k tiles keep bytes in flight,
        # 8 warps share the up-cast of a 64 x 256 tile (MoE run 8)
        block_m, gate_up, down = 16, GemmTiles(64, 256, 8, 3), GemmTiles(128, 128, 4, 3)
    elif rows_per_expert <= 16:  # memory-bound: one 16-row tile per touched expert, wide weight tiles
        block_m, gate_up, down = 16, GemmTiles(128, 128, 4, 3), GemmTiles(256, 64, 4, 3)
    elif rows_per_expert <= 96:
        block_m, gate_up, down = 64, GemmTiles(128, 64, 4, 4), GemmTiles(256, 64, 4, 4)
        if weights == "plain":  # 256-wide weight tiles (512-byte row segments) on 8 warps in 3 stages (216 KB): at
            # LLaDA2 batch 32's layer alone the routed gate/up 281 -> 270 us (261 on ideal groups; XLA's read-only
            # pass over the same weights 258), the layer 449 -> 440, the forward 11.531 -> 11.335 / 11.323 ms
            # (engine run 38)
            gate_up = GemmTiles(256, 64, 8, 3)
        if weights == "plain" and num_tokens > block_m:  # grouped plain tiles: `_persistent_down_kernel`, whose 5
            # stages keep two K slices in flight behind each item's expert id. LLaDA2 batch 32 on the H200: the
            # routed down GEMM 203 -> 186 us per layer alone (4 stages: 199), 12.167 -> 11.922 / 11.833 ms per
            # forward (engine run 22)
            persistent_down, down = True, GemmTiles(256, 64, 4, 5)
    elif upcast_weights:  # compute-bound; the wider tiles below were 5-10% slower for these at 8192 tokens
        block_m, gate_up, down = 128, GemmTiles(64, 64, 8, 3), GemmTiles(128, 64, 8, 3)
    else:  # compute-bound
        block_m, gate_up, down = 128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 3)
    if num_tokens <= _EVERY_TOKEN_MAX_TOKENS and weights == "plain":
        block_m = max(block_m, 1 << (num_tokens - 1).bit_length())
        if rows_per_expert <= 16:
            # 64 x 64 weight tiles in 4 stages (80 KB of shared memory): two blocks per SM. The 128 x 128 tiles
            # (216 KB) fit one, so ~37 touched experts x 4 column tiles = ~148 programs queued on 132 SMs: gate/up
            # 51.8 -> 44.9 us per layer alone (tools/bench_moe_decode.py), LLaDA2 batch 1 2.472 -> 2.406 ms per
            # forward (engine run 14, H200; measured at LLaDA2's shapes only)
            gate_up = GemmTiles(64, 64, 4, 4)
    return MoeTiles(
        block_m,
        dataclasses.replace(gate_up, block_n=_fit_block(inter, gate_up.block_n),
                            block_k=_fit_block(hidden, gate_up.block_k)),
        dataclasses.replace(down, block_n=_fit_block(hidden, down.block_n), block_k=_fit_block(inter, down.block_k)),
        persistent_down,
    )


def _check_tiles(tiles, hidden, inter):
    for name, gemm, n, k in (("gate_up", tiles.gate_up, inter, hidden), ("down", tiles.down, hidden, inter)):
        if n % gemm.block_n or k % gemm.block_k:
            raise ValueError(f"{name} tiles {gemm} must divide N={n} and K={k}")
    if tiles.block_m < 16 or not is_power_of_two(tiles.block_m):
        raise ValueError(f"block_m must be a power of two >= 16, got {tiles.block_m}")


def _num_row_tiles(num_assignments, num_experts, block_m):
    """Static bound on the row tiles the expert groups fill.

    Expert e's n_e rows fill ceil(n_e / bm) <= (n_e + bm - 1) / bm tiles. Summed over the at most min(E, A)
    non-empty experts that is at most (A + min(E, A) * (bm - 1)) / bm; and no tile is empty, so also at most A.
    """
    busy_experts = min(num_experts, num_assignments)
    return min(num_assignments, (num_assignments + busy_experts * (block_m - 1)) // block_m)


class ExpertGroups(NamedTuple):
    row_token: jax.Array  # i32[R * bm]  token of each padded row; padding rows read token 0, and nobody reads them
    tile_expert: jax.Array  # i32[R]  expert of each row tile; -1 for a tile without rows
    assignment_row: jax.Array  # i32[T, C]  padded row that holds assignment (t, c)
    # every_token only: i32[T*C] the experts chosen. The kernels test their tile's expert against these themselves,
    # so tile_expert (one XLA reduction kernel per layer) is left for XLA to drop
    expert_ids: jax.Array | None = None
    # grouped tiles of >= _HALF_TILE_MIN_BLOCK_M rows only: i32[R] rows of each tile that hold an assignment (0 for
    # a tile without rows); the kernels run a tile filled at most half at half height
    tile_rows: jax.Array | None = None


# Up to this many assignments (batch 32 of 32-token windows at top-8) the groups come from the two Pallas kernels of
# `_group_by_expert_pallas`, whose second kernel loads every chunk's counts in each program (64 KB of L2 per program
# at this bound); beyond it (prefills) from XLA's count method. In one prefill of 16384 tokens the kernel took 2.2 ms a
# layer on the H200 (engine run 33).
_PALLAS_GROUPING_MAX_ASSIGNMENTS = 8192
# Assignments per chunk of count: its [chunks, chunk, E] and [chunks, chunk, chunk] compares stay A * (E + chunk).
# Not tuned: timed alone, every grouping was dispatch-bound (engine run 17, call 2).
_COUNT_CHUNK = 128
# Up to this many tokens (one 32-token window) `default_tiles` makes a plain weight's row tile hold every token, and
# the groups are only which experts are touched: one small kernel where the comparisons take ~5 per layer. The rows
# of a touched expert's tile that no assignment reads cost tensor-core work only: its weights are read once either way.
_EVERY_TOKEN_MAX_TOKENS = 32
# Up to this many tokens (batch 32 of 32-token windows) a shared expert of plain weights runs in the experts' kernels
# as ceil(T / bm) row tiles, each reading its weights, where XLA took three kernels of its own: 12 against 16.5 us
# per LLaDA2 layer at batch 8 on the H200 (engine run 16); the whole layer at 1024 tokens 535 -> 521 us (engine run
# 17). Larger batches keep XLA's GEMMs: unmeasured there.
_SHARED_IN_KERNELS_MAX_TOKENS = 1024
# Grouped row tiles of at least this many rows whose assignments fill at most half of them run at half height: half
# the tensor-core work and output rows (at batch 32 of LLaDA2, ~32 rows per expert in 64-row tiles, about half the
# tiles): LLaDA2 batch 32 13.60 -> 13.13 ms per forward on the H200, batch 8 unchanged (engine run 18).
_HALF_TILE_MIN_BLOCK_M = 32
# The token count whose tiles the batch-invariant expert kernels take at every token count
_INVARIANT_TILES_TOKENS = 1024


def _group_by_expert(expert_ids, num_experts, block_m, method="auto", interpret=False):
    """Order the assignments by expert into per-expert groups padded to whole row tiles.

    An assignment's row is its group's padded start plus the number of earlier assignments to the same expert,
    counted per chunk of _COUNT_CHUNK assignments (a count per chunk and expert, summed over the earlier chunks, plus
    the earlier ones in its own chunk); each row's token is scattered into it. method: "pallas" (two kernels, see
    `_group_by_expert_pallas`), "count" (the same in XLA: the reference, and the method for prefills), "every_token"
    (T <= block_m only: expert e's tile, rows [e*bm, e*bm + T), holds every token, visited when some assignment chose
    e), or "auto" (every_token where the tokens fit one tile, else pallas up to _PALLAS_GROUPING_MAX_ASSIGNMENTS,
    else count). pallas and count give identical groups. Nothing sorts: XLA:GPU runs a large sort as a library call,
    which splits the denoising loop's CUDA graph, and its sort of 8192 assignments took 32 us per layer on the H200.

    count's result passes an optimization barrier so XLA computes it once instead of fusing the counting into every
    element of its consumers. Its one scatter may cost a copy of R * bm indices inside a while-loop (XLA hoists the
    scatter's constant operand and copies it back every iteration), which is why decode batches take the kernels.
    """
    num_tokens, top_k = expert_ids.shape
    num_assignments = num_tokens * top_k
    if method == "auto":
        method = ("every_token" if num_tokens <= block_m else
                  "pallas" if num_assignments <= _PALLAS_GROUPING_MAX_ASSIGNMENTS else "count")
    if method == "pallas":
        row_token, tile_expert, assignment_row, tile_rows = _group_by_expert_pallas(expert_ids, num_experts, block_m,
                                                                                    interpret)
        return ExpertGroups(row_token, tile_expert, assignment_row,
                            tile_rows=tile_rows if block_m >= _HALF_TILE_MIN_BLOCK_M else None)
    flat_expert = expert_ids.reshape(-1).astype(jnp.int32)  # [A]
    expert = jnp.arange(num_experts, dtype=jnp.int32)
    group_sizes = jnp.sum(flat_expert[:, None] == expert, axis=0, dtype=jnp.int32)  # [E]
    if method == "every_token":
        if num_tokens > block_m:
            raise ValueError(f"every_token grouping needs the {num_tokens} tokens to fit one {block_m}-row tile")
        in_tile = jnp.arange(block_m, dtype=jnp.int32)
        row_token = jnp.tile(jnp.where(in_tile < num_tokens, in_tile, 0), num_experts)
        assignment_row = expert_ids.astype(jnp.int32) * block_m + jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
        # no barrier: nothing here is worth computing once for many consumers (the rows are one multiply-add)
        return ExpertGroups(row_token, jnp.where(group_sizes > 0, expert, -1), assignment_row, flat_expert)
    if method != "count":
        raise ValueError(f"unknown grouping method {method!r}; use 'auto', 'every_token', 'pallas' or 'count'")
    num_row_tiles = _num_row_tiles(num_assignments, num_experts, block_m)
    assignment = jnp.arange(num_assignments)
    padded_sizes = (group_sizes + block_m - 1) // block_m * block_m
    padded_ends = jnp.cumsum(padded_sizes)  # [E]
    padded_starts = padded_ends - padded_sizes

    tile_start = jnp.arange(num_row_tiles) * block_m  # [R]
    # the expert owning a tile is the number of groups (empty ones included) that end at or before its first row
    tile_expert = jnp.sum(padded_ends[None, :] <= tile_start[:, None], axis=1, dtype=jnp.int32)
    tile_expert = jnp.where(tile_start < padded_ends[-1], tile_expert, -1)

    # rank in group = same-expert assignments in earlier chunks (a per-chunk count and a cumsum over chunks) plus
    # those earlier in its own chunk: A * (E + chunk) compares
    chunk = _COUNT_CHUNK
    num_chunks = -(-num_assignments // chunk)
    chunked = jnp.pad(flat_expert, (0, num_chunks * chunk - num_assignments),
                      constant_values=num_experts).reshape(num_chunks, chunk)  # padding matches no expert
    chunk_counts = jnp.sum(chunked[:, :, None] == expert, axis=1, dtype=jnp.int32)  # [chunks, E]
    before_chunk = jnp.cumsum(chunk_counts, axis=0) - chunk_counts
    lane = jnp.arange(chunk)
    earlier_in_chunk = jnp.sum((chunked[:, None, :] == chunked[:, :, None]) & (lane < lane[:, None]), axis=2,
                               dtype=jnp.int32)  # [chunks, chunk]
    rank_in_group = (jnp.take_along_axis(before_chunk, jnp.minimum(chunked, num_experts - 1), axis=1)
                     + earlier_in_chunk).reshape(-1)[:num_assignments]
    assignment_row = padded_starts[flat_expert] + rank_in_group
    # rows are distinct: a scatter of each assignment's token (padding rows keep token 0)
    row_token = jnp.zeros(num_row_tiles * block_m, jnp.int32).at[assignment_row].set(
        assignment // top_k, unique_indices=True)
    tile_rows = None
    if block_m >= _HALF_TILE_MIN_BLOCK_M:  # smaller tiles run at full height: nothing to count
        safe_expert = jnp.maximum(tile_expert, 0)
        rows_left = group_sizes[safe_expert] - (tile_start - padded_starts[safe_expert])  # the group's, from here on
        tile_rows = jnp.where(tile_expert >= 0, jnp.clip(rows_left, 0, block_m), 0).astype(jnp.int32)
    return lax.optimization_barrier(ExpertGroups(row_token.astype(jnp.int32), tile_expert,
                                                 assignment_row.reshape(num_tokens, top_k).astype(jnp.int32),
                                                 tile_rows=tile_rows))


def _scatter(ref, index, value, mask):
    """ref[index] = value where mask. Masked-off lanes aim past the end: the GPU skips them either way, and interpret
    mode's scatter drops out-of-range updates, where lanes sharing a clamped index would race to write old values."""
    pltriton.store(ref.at[jnp.where(mask, index, ref.shape[0])], value, mask=mask)


def _group_count_kernel(ids_ref, counts_ref, ranks_ref, *, chunk):
    # expert ids i32[A] -> counts i32[NC, E'] (chunk c's assignments per expert; E' lanes, a power of two >= E),
    # ranks i32[NC * chunk] (each assignment's earlier same-expert assignments in its chunk). Program c: chunk c.
    num_assignments, lanes = ids_ref.shape[0], counts_ref.shape[1]
    first = pl.program_id(0) * chunk
    index = first + lax.iota(jnp.int32, chunk)
    # lanes past the assignments take expert E', which no expert lane matches; they come last in their chunk, so no
    # real assignment counts them
    expert = jnp.where(index < num_assignments, ids_ref[jnp.minimum(index, num_assignments - 1)], lanes)
    chosen = expert[:, None] == lax.broadcasted_iota(jnp.int32, (chunk, lanes), 1)
    counts_ref[pl.program_id(0), :] = jnp.sum(chosen.astype(jnp.int32), axis=0)
    lane = lax.iota(jnp.int32, chunk)
    earlier_same = (expert[None, :] == expert[:, None]) & (lane[None, :] < lane[:, None])
    ranks_ref[pl.ds(first, chunk)] = jnp.sum(earlier_same.astype(jnp.int32), axis=1)


def _group_rows_kernel(ids_ref, counts_ref, ranks_ref, row_token_ref, assignment_row_ref, tile_expert_ref,
                       tile_rows_ref, *, chunk, top_k, block_m, tiles_per_program):
    # The count kernel's outputs -> the groups (`ExpertGroups`): program c places chunk c's assignments (their rows,
    # and each row's token) and describes row tiles [c * tiles_per_program, (c + 1) * tiles_per_program) (their
    # expert, filled rows, and token 0 in their padding rows). Every row is written by exactly one program.
    num_assignments, lanes = ids_ref.shape[0], counts_ref.shape[1]
    num_row_tiles = tile_expert_ref.shape[0]
    program = pl.program_id(0)
    counts = counts_ref[...]  # [NC, E']
    group_sizes = jnp.sum(counts, axis=0)  # [E']; 0 in the lanes past E
    before_chunk = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, counts.shape, 0) < program, counts, 0), axis=0)
    padded_sizes = (group_sizes + block_m - 1) // block_m * block_m
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    expert_lane = lax.iota(jnp.int32, lanes)

    index = program * chunk + lax.iota(jnp.int32, chunk)
    real = index < num_assignments
    assignment = jnp.minimum(index, num_assignments - 1)
    own_group = ids_ref[assignment][:, None] == expert_lane[None, :]  # [chunk, E']: gathers by one-hot sums
    row = (jnp.sum(jnp.where(own_group, (padded_starts + before_chunk)[None, :], 0), axis=1)
           + ranks_ref[pl.ds(program * chunk, chunk)])
    _scatter(assignment_row_ref, index, row, real)
    _scatter(row_token_ref, row, assignment // top_k, real)

    tile = program * tiles_per_program + lax.iota(jnp.int32, tiles_per_program)
    tile_start = tile * block_m
    occupied = tile_start < jnp.sum(padded_sizes)
    # the expert owning a tile is the number of groups (empty ones included) that end at or before its first row
    tile_expert = jnp.where(occupied, jnp.sum((padded_ends[None, :] <= tile_start[:, None]).astype(jnp.int32), axis=1),
                            -1)
    owner = expert_lane[None, :] == tile_expert[:, None]  # [tiles, E']
    rows_left = jnp.sum(jnp.where(owner, (group_sizes + padded_starts)[None, :], 0), axis=1) - tile_start
    tile_rows = jnp.where(occupied, jnp.clip(rows_left, 0, block_m), 0)
    in_grid = tile < num_row_tiles
    _scatter(tile_expert_ref, tile, tile_expert, in_grid)
    _scatter(tile_rows_ref, tile, tile_rows, in_grid)
    row_in_tile = lax.iota(jnp.int32, block_m)
    padding = (row_in_tile[None, :] >= tile_rows[:, None]) & in_grid[:, None]  # [tiles, bm]: the rows no one holds
    _scatter(row_token_ref, tile_start[:, None] + row_in_tile[None, :], jnp.zeros(padding.shape, jnp.int32), padding)


def _group_by_expert_pallas(expert_ids, num_experts, block_m, interpret):
    """`_group_by_expert`'s count method as two Pallas kernels, no XLA between them: per chunk of _COUNT_CHUNK
    assignments its counts per expert and in-chunk ranks, then per chunk the rows of its assignments and of a slice
    of the row tiles. Returns (row_token, tile_expert, assignment_row, tile_rows)."""
    num_tokens, top_k = expert_ids.shape
    num_assignments = num_tokens * top_k
    chunk = _COUNT_CHUNK
    num_chunks = 1 << (-(-num_assignments // chunk) - 1).bit_length()  # a power of two: the counts load whole
    lanes = 1 << (num_experts - 1).bit_length()
    num_row_tiles = _num_row_tiles(num_assignments, num_experts, block_m)
    tiles_per_program = 1 << (-(-num_row_tiles // num_chunks) - 1).bit_length()
    flat_ids = expert_ids.reshape(-1).astype(jnp.int32)
    counts, ranks = pallas_program(
        _group_count_kernel, [jax.ShapeDtypeStruct((num_chunks, lanes), jnp.int32),
                              jax.ShapeDtypeStruct((num_chunks * chunk,), jnp.int32)], (num_chunks,),
        name="moe_group_count", num_warps=4, interpret=interpret, num_raw_inputs=1, chunk=chunk)(flat_ids)
    row_token, assignment_row, tile_expert, tile_rows = pallas_program(
        _group_rows_kernel, [jax.ShapeDtypeStruct((num_row_tiles * block_m,), jnp.int32),
                             jax.ShapeDtypeStruct((num_assignments,), jnp.int32),
                             jax.ShapeDtypeStruct((num_row_tiles,), jnp.int32),
                             jax.ShapeDtypeStruct((num_row_tiles,), jnp.int32)], (num_chunks,),
        name="moe_group_rows", num_warps=8, interpret=interpret, num_raw_inputs=3, chunk=chunk, top_k=top_k,
        block_m=block_m, tiles_per_program=tiles_per_program)(flat_ids, counts, ranks)
    return row_token, tile_expert, assignment_row.reshape(num_tokens, top_k), tile_rows


# e4m3 weight tiles are up-cast to bf16 by bit arithmetic, 4 values per PTX instance (one 32-bit register in, two
# bf16 pairs out): byte permutes, logic ops and one bf16x2 FMA per pair, where Triton's convert goes e4m3 -> f16 ->
# bf16 with one F2F conversion instruction per value (sm_90 SASS). The fp8 layer measured 7-9% faster with it on the
# H200 (bench_moe, 32 to 2048 tokens). For int8 Triton already emits byte permutes and a bf16x2 add, and the same
# kind of PTX measured no faster, so int8 keeps the plain astype.
#
# e4m3 s.eeee.mmm placed as bf16 bits s << 15 | eeeemmm << 4 reads 2^(e-127) (1.mmm) (or the subnormal
# 2^-126 0.mmm), so times 2^120 it is the e4m3 value 2^(e-7) (1.mmm), exactly. (e4m3fn's NaN is never a weight.)
_E4M3_TO_BF16_PTX = """{
.reg .b32 zero, body, signs, scale, negzero, pair, bits, sign;
mov.b32 zero, 0;
mov.b32 body, 0x07F007F0;
mov.b32 signs, 0x80008000;
mov.b32 scale, 0x7B807B80;
mov.b32 negzero, 0x80008000;
prmt.b32 pair, $2, zero, 0x1404;
shr.b32 bits, pair, 4;
and.b32 sign, pair, signs;
lop3.b32 bits, bits, body, sign, 0xEA;
fma.rn.bf16x2 $0, bits, scale, negzero;
prmt.b32 pair, $2, zero, 0x3424;
shr.b32 bits, pair, 4;
and.b32 sign, pair, signs;
lop3.b32 bits, bits, body, sign, 0xEA;
fma.rn.bf16x2 $1, bits, scale, negzero;
}"""


def _upcast(tile, dtype, interpret):
    """A weight tile in the product's dtype; e4m3 to bf16 by the PTX above on the GPU."""
    if tile.dtype == dtype:
        return tile
    if tile.dtype != jnp.float8_e4m3fn or dtype != jnp.bfloat16 or interpret:  # interpret mode runs no PTX
        return tile.astype(dtype)
    (out,) = pltriton.elementwise_inline_asm(_E4M3_TO_BF16_PTX, args=[tile], constraints="=r,=r,r", pack=4,
                                             result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape, dtype)])
    return out


def _dot(lhs, rhs, dtype, interpret):
    """f32-accumulated tile product in `dtype`; an int8 or e4m3 weight tile is up-cast to it first."""
    lhs, rhs = (_upcast(a, dtype, interpret) for a in (lhs, rhs))
    # Triton multiplies f32 tiles in TF32 unless asked for HIGHEST (IEEE f32); bf16 and fp8 tiles keep the default
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return jnp.dot(lhs, rhs, preferred_element_type=jnp.float32, precision=precision)


def _weight_on_left(channel_major, rows_dtype):
    """Whether a channel-major weight tile [bn, bk] is the tile product's left operand (accumulators [bn, bm]).

    Either way both operands are K-contiguous in shared memory, where a [K, N] 1-byte tile leaves it one byte per
    load instruction (offline sm_90 compile: 256 byte loads per k-step in gate/up, against 16 ldmatrix for a
    channel-major tile). Up-cast weights go right: 1.13x faster than [K, N] int8 at 32 tokens, 1.8x faster in the
    engine's gate/up at batch 1 (H200, BENCHMARKS MoE and engine run 6). Products of two fp8 tiles go left: the
    same at 32 to 2048 tokens, 1.84 against 2.13 ms at 8192."""
    return channel_major and rows_dtype == jnp.float8_e4m3fn


def _weight_product(rows, w_ref, expert, ks, cols, channel_major, interpret):
    """rows[bm, bk] @ W[expert][ks, cols] in f32: [bm, bn], or its transpose [bn, bm] where `_weight_on_left`."""
    if _weight_on_left(channel_major, rows.dtype):
        return _dot(w_ref[expert, cols, ks], rows.T, rows.dtype, interpret)
    if channel_major:
        return _dot(rows, w_ref[expert, cols, ks].T, rows.dtype, interpret)
    return _dot(rows, w_ref[expert, ks, cols], rows.dtype, interpret)


def _split_scale_refs(refs, has_row_scale, has_col_scale):
    """(row-scale ref or None, weight ref, column-scale ref or None, output ref) from a kernel's trailing refs: a
    unit scale is not passed at all, so bf16 weights and activations carry no scale arrays and no multiplies."""
    refs = list(refs)
    row_scale_ref = refs.pop(0) if has_row_scale else None
    w_ref = refs.pop(0)
    col_scale_ref = refs.pop(0) if has_col_scale else None
    (out_ref,) = refs
    return row_scale_ref, w_ref, col_scale_ref, out_ref


def _all_lanes(ref):
    """A 1-D i32 ref whole in registers, over a power of two of lanes as Triton needs: (lane index, value, whether
    the lane is one of the ref's; the others repeat its last value)."""
    size = ref.shape[0]
    lanes = lax.iota(jnp.int32, 1 << max(size - 1, 0).bit_length())
    return lanes, ref[jnp.minimum(lanes, size - 1)], lanes < size


def _routed_expert(experts_ref, row_tile, every_token, num_shared_tiles):
    """The routed expert of this program's row tile, -1 for none. experts_ref is tile_expert i32[R] (-1 past the
    last group), or with every_token the chosen experts i32[A]: tile e is expert e's if some assignment chose e. A
    shared expert takes the first num_shared_tiles tiles, so that its programs start in the first wave instead of
    trailing the grid; the routed tiles follow them."""
    routed_tile = row_tile - num_shared_tiles
    if not every_token:
        return jnp.where(routed_tile >= 0, experts_ref[jnp.maximum(routed_tile, 0)], -1)
    lanes, chosen, real = _all_lanes(experts_ref)
    touched = jnp.max(jnp.where(real & (chosen == routed_tile), 1, 0))
    return jnp.where(touched > 0, routed_tile, -1)  # a shared tile (negative) matches no choice


def _run_routed(tile, expert, tile_rows_ref, row_tile, block_m, num_shared_tiles):
    """tile(height) for this program's routed expert: at half height where a tile_rows_ref says its assignments
    fill at most half of the tile's rows (they come first), else at full height."""
    if tile_rows_ref is None:
        pl.when(expert >= 0)(lambda: tile(block_m))
        return
    filled = tile_rows_ref[jnp.maximum(row_tile - num_shared_tiles, 0)]
    half = filled <= block_m // 2
    pl.when((expert >= 0) & half)(lambda: tile(block_m // 2))
    pl.when((expert >= 0) & ~half)(lambda: tile(block_m))


def _gate_up_kernel(experts_ref, row_token_ref, x_ref, *refs, block_m, tiles, inter, has_x_scale, has_w_scale,
                    num_shared_tiles, channel_major, every_token, half_tiles, interpret):
    # tile_expert i32[R] (or with every_token the chosen experts i32[A]), row_token i32[R*bm], x [T, H],
    # (x_scale f32[T]), w [E, H, 2I] or channel-major [E, 2I, H], (w_scale f32[E, 2I]), (shared [1, H, 2I]: S row
    # tiles of the tokens in order before the routed ones, their tokens the row index, padding rows token 0)
    # -> act [(S+R)*bm, I]; this program: rows [r*bm, (r+1)*bm) x act columns [j*bn, (j+1)*bn)
    refs = list(refs)
    tile_rows_ref = refs.pop(0) if half_tiles else None
    shared_ref = refs.pop(-2) if num_shared_tiles else None
    x_scale_ref, w_ref, w_scale_ref, act_ref = _split_scale_refs(refs, has_x_scale, has_w_scale)
    row_tile, col_tile = pl.program_id(0), pl.program_id(1)
    expert = _routed_expert(experts_ref, row_tile, every_token, num_shared_tiles)

    def tile(w_ref, expert, w_scale_ref, channel_major, height, shared_tile=False):
        rows = pl.ds(row_tile * block_m, height)
        if shared_tile:
            tokens = row_tile * block_m + lax.iota(jnp.int32, height)
            tokens = jnp.where(tokens < x_ref.shape[0], tokens, 0)
        else:
            tokens = row_token_ref[pl.ds((row_tile - num_shared_tiles) * block_m, height)]  # i32[height]
        gate_cols = pl.ds(col_tile * tiles.block_n, tiles.block_n)
        up_cols = pl.ds(inter + col_tile * tiles.block_n, tiles.block_n)

        def accumulate(k, carry):
            gate, up = carry
            ks = pl.ds(k * tiles.block_k, tiles.block_k)
            x_tile = x_ref[tokens, ks]  # [bm, bk], gathered token rows
            gate += _weight_product(x_tile, w_ref, expert, ks, gate_cols, channel_major, interpret)
            up += _weight_product(x_tile, w_ref, expert, ks, up_cols, channel_major, interpret)
            return gate, up

        transposed = _weight_on_left(channel_major, x_ref.dtype)
        zeros = jnp.zeros((tiles.block_n, height) if transposed else (height, tiles.block_n), jnp.float32)
        gate, up = lax.fori_loop(0, x_ref.shape[1] // tiles.block_k, accumulate, (zeros, zeros))
        if transposed:
            gate, up = gate.T, up.T
        if x_scale_ref is not None:
            x_scale = x_scale_ref[tokens][:, None]
            gate, up = gate * x_scale, up * x_scale
        if w_scale_ref is not None:
            gate = gate * w_scale_ref[expert, gate_cols][None, :]
            up = up * w_scale_ref[expert, up_cols][None, :]
        act_ref[rows, gate_cols] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(act_ref.dtype)

    _run_routed(lambda height: tile(w_ref, expert, w_scale_ref, channel_major, height), expert, tile_rows_ref,
                row_tile, block_m, num_shared_tiles)
    if shared_ref is not None:
        pl.when(row_tile < num_shared_tiles)(lambda: tile(shared_ref, 0, None, False, block_m, shared_tile=True))


def _down_kernel(experts_ref, act_ref, *refs, block_m, tiles, has_act_scale, has_w_scale, num_shared_tiles,
                 channel_major, every_token, half_tiles, interpret):
    # tile_expert i32[R] (or with every_token the chosen experts i32[A]), act [(S+R)*bm, I], (act_scale
    # f32[R*bm], never with a shared tile), w [E, I, H] or channel-major [E, H, I], (w_scale f32[E, H]),
    # (shared [1, I, H]) -> out [(S+R)*bm, H]
    refs = list(refs)
    tile_rows_ref = refs.pop(0) if half_tiles else None
    shared_ref = refs.pop(-2) if num_shared_tiles else None
    act_scale_ref, w_ref, w_scale_ref, out_ref = _split_scale_refs(refs, has_act_scale, has_w_scale)
    row_tile, col_tile = pl.program_id(0), pl.program_id(1)
    expert = _routed_expert(experts_ref, row_tile, every_token, num_shared_tiles)

    def tile(w_ref, expert, w_scale_ref, channel_major, height):
        rows = pl.ds(row_tile * block_m, height)
        cols = pl.ds(col_tile * tiles.block_n, tiles.block_n)

        def accumulate(k, acc):
            ks = pl.ds(k * tiles.block_k, tiles.block_k)
            return acc + _weight_product(act_ref[rows, ks], w_ref, expert, ks, cols, channel_major, interpret)

        transposed = _weight_on_left(channel_major, act_ref.dtype)
        acc_shape = (tiles.block_n, height) if transposed else (height, tiles.block_n)
        acc = lax.fori_loop(0, act_ref.shape[1] // tiles.block_k, accumulate, jnp.zeros(acc_shape, jnp.float32))
        if transposed:
            acc = acc.T
        if act_scale_ref is not None:
            acc = acc * act_scale_ref[rows][:, None]
        if w_scale_ref is not None:
            acc = acc * w_scale_ref[expert, cols][None, :]
        out_ref[rows, cols] = acc.astype(out_ref.dtype)

    _run_routed(lambda height: tile(w_ref, expert, w_scale_ref, channel_major, height), expert, tile_rows_ref,
                row_tile, block_m, num_shared_tiles)
    if shared_ref is not None:
        pl.when(row_tile < num_shared_tiles)(lambda: tile(shared_ref, 0, None, False, block_m))


def _persistent_down_kernel(tile_expert_ref, tile_rows_ref, act_ref, w_ref, *refs, block_m, tiles, num_programs,
                            num_shared_tiles, interpret):
    # tile_expert i32[R], tile_rows i32[R], act [(S+R)*bm, I], w [E, I, H], (shared [1, I, H]) -> out [(S+R)*bm, H]
    # One program per SM. An item is a (row tile, column tile) pair; program p takes items p, p + P, p + 2P, ...
    shared_ref, out_ref = refs if num_shared_tiles else (None, refs[0])
    program = pl.program_id(0)
    num_col_tiles, num_k_steps = w_ref.shape[2] // tiles.block_n, w_ref.shape[1] // tiles.block_k
    row_in_tile, col_in_tile = lax.iota(jnp.int32, block_m), lax.iota(jnp.int32, tiles.block_n)

    def walk(num_items, first_row_tile, weight_tile, filled_rows):
        """This program's items of row tiles first_row_tile + [0, num_items / C) in one loop over (item, K slice):
        Triton's pipeliner then loads an item's first K slices during the previous item's last, where a loop per
        item (the grid kernel, or run 19's column walk) refills the pipeline at every item."""
        def step(t, acc):
            item = program + lax.div(t, num_k_steps) * num_programs
            k = lax.rem(t, num_k_steps)
            tile, col_tile = lax.div(item, num_col_tiles), lax.rem(item, num_col_tiles)
            ks, cols = pl.ds(k * tiles.block_k, tiles.block_k), pl.ds(col_tile * tiles.block_n, tiles.block_n)
            first_row = (first_row_tile + tile) * block_m
            acc = jnp.where(k == 0, 0.0, acc) + _dot(act_ref[pl.ds(first_row, block_m), ks],
                                                     weight_tile(tile, ks, cols), act_ref.dtype, interpret)

            @pl.when(k == num_k_steps - 1)
            def _():  # only the rows that hold assignments: a half-filled tile writes half the bytes
                mask = jnp.broadcast_to((row_in_tile < filled_rows(tile))[:, None], (block_m, tiles.block_n))
                pltriton.store(out_ref.at[(first_row + row_in_tile)[:, None], (cols.start + col_in_tile)[None, :]],
                               acc.astype(out_ref.dtype), mask=mask)
            return acc

        my_items = jnp.maximum(num_items - program + num_programs - 1, 0) // num_programs
        lax.fori_loop(0, my_items * num_k_steps, step, jnp.zeros((block_m, tiles.block_n), jnp.float32))

    if shared_ref is not None:  # the shared expert's S tiles of the tokens in order, first (see _routed_expert)
        walk(num_shared_tiles * num_col_tiles, 0, lambda tile, ks, cols: shared_ref[0, ks, cols],
             lambda tile: block_m)
    _, experts, real = _all_lanes(tile_expert_ref)
    num_filled = jnp.sum(jnp.where(real & (experts >= 0), 1, 0))  # the filled tiles are a prefix
    # the expert id is loaded per K slice: picking it out of `experts` in registers instead ran 206 against 186 us
    walk(num_filled * num_col_tiles, num_shared_tiles, lambda tile, ks, cols: w_ref[tile_expert_ref[tile], ks, cols],
         lambda tile: tile_rows_ref[tile])


def _persistent_program_count(interpret):
    """One program per SM (the H200: 132); in interpret mode 3, so that every program walks several items."""
    if interpret:
        return 3
    return getattr(jax.devices()[0], "core_count", None) or 132


def _experts_operand(groups: ExpertGroups) -> jax.Array:
    return groups.tile_expert if groups.expert_ids is None else groups.expert_ids


def _half_tile_operand(groups: ExpertGroups) -> list:
    return [] if groups.tile_rows is None else [groups.tile_rows]


def _scaled_operands(row_scale, w_values, w_scales) -> list:
    """The operands after the activations: a unit scale (None) is left out."""
    return [x for x in (row_scale, w_values, w_scales) if x is not None]


def _gate_up(groups, x, x_scale, w_values, w_scales, channel_major, *, act_dtype, tiles, interpret, shared=None,
             num_shared_tiles=0):
    """[(S+R)*bm, I] = silu(x[rows] @ Wg[e]) * (x[rows] @ Wu[e]) per row tile; a None scale is 1. A shared expert's
    weights [H, 2I] take the first S = num_shared_tiles row tiles, holding the tokens in order (padding rows read
    token 0): the kernel counts their tokens itself, where a concatenate of them before the groups' row_token was
    a kernel of its own (25 us per LLaDA2 forward at batch 32 on the H100, engine run 44)."""
    num_rows = num_shared_tiles * tiles.block_m + groups.row_token.shape[0]
    inter = w_values.shape[1 if channel_major else 2] // 2
    program = pallas_program(
        _gate_up_kernel, jax.ShapeDtypeStruct((num_rows, inter), act_dtype),
        (num_rows // tiles.block_m, inter // tiles.gate_up.block_n), name="moe_gate_up",
        num_warps=tiles.gate_up.num_warps, num_stages=tiles.gate_up.num_stages, interpret=interpret,
        block_m=tiles.block_m, tiles=tiles.gate_up, inter=inter, has_x_scale=x_scale is not None,
        has_w_scale=w_scales is not None, num_shared_tiles=num_shared_tiles, channel_major=channel_major,
        every_token=groups.expert_ids is not None, half_tiles=groups.tile_rows is not None)
    return program(_experts_operand(groups), groups.row_token, x, *_half_tile_operand(groups),
                   *_scaled_operands(x_scale, w_values, w_scales), *([] if shared is None else [shared[None]]))


def _down(groups, act, act_scale, w_values, w_scales, channel_major, *, out_dtype, tiles, interpret, shared=None,
          num_shared_tiles=0):
    """[(S+R)*bm, H] = act[rows] @ Wd[e] per row tile; a None scale is 1. A shared expert's weights [I, H] take the
    first S = num_shared_tiles row tiles (see _gate_up). With tiles.persistent_down, rows of a grouped tile past its
    filled rows are not written."""
    num_rows, hidden = act.shape[0], w_values.shape[1 if channel_major else 2]
    if tiles.persistent_down:
        if groups.tile_rows is None or act_scale is not None or w_scales is not None or channel_major:
            raise ValueError(f"persistent_down needs plain weights in grouped tiles of >= {_HALF_TILE_MIN_BLOCK_M} "
                             f"rows")
        num_programs = _persistent_program_count(interpret)
        operands = [groups.tile_expert, groups.tile_rows, act, w_values, *([] if shared is None else [shared[None]])]
        program = pallas_program(
            _persistent_down_kernel, jax.ShapeDtypeStruct((num_rows, hidden), out_dtype), (num_programs,),
            name="moe_down", num_warps=tiles.down.num_warps, num_stages=tiles.down.num_stages, interpret=interpret,
            num_raw_inputs=len(operands), block_m=tiles.block_m, tiles=tiles.down, num_programs=num_programs,
            num_shared_tiles=num_shared_tiles)
        return program(*operands)
    program = pallas_program(
        _down_kernel, jax.ShapeDtypeStruct((num_rows, hidden), out_dtype),
        (num_rows // tiles.block_m, hidden // tiles.down.block_n), name="moe_down", num_warps=tiles.down.num_warps,
        num_stages=tiles.down.num_stages, interpret=interpret, block_m=tiles.block_m, tiles=tiles.down,
        has_act_scale=act_scale is not None, has_w_scale=w_scales is not None, num_shared_tiles=num_shared_tiles,
        channel_major=channel_major, every_token=groups.expert_ids is not None,
        half_tiles=groups.tile_rows is not None)
    return program(_experts_operand(groups), act, *_half_tile_operand(groups),
                   *_scaled_operands(act_scale, w_values, w_scales), *([] if shared is None else [shared[None]]))


def _values_and_scales(w):
    """Kernel operands of a weight: (values [E, K, N] or channel-major [E, N, K], f32 scales [E, N] or None for a
    plain weight, whether the values are channel-major)."""
    if isinstance(w, QuantizedWeight):
        return w.values, w.scales, w.channel_major
    return w, None, False


def _moe_experts_pallas(x, expert_ids, expert_weights, w_gate_up, w_down, *, fp8_activations, tiles, interpret,
                        shared=None, batch_invariant=False):
    num_tokens, hidden = x.shape
    num_experts, _, two_inter = w_gate_up.shape
    if tiles is None:
        weights = ("fp8_activations" if fp8_activations else "upcast" if isinstance(w_gate_up, QuantizedWeight)
                   else "plain")
        tiles = default_tiles(_INVARIANT_TILES_TOKENS if batch_invariant else num_tokens, expert_ids.shape[1],
                              num_experts, hidden, two_inter // 2, weights)
        if batch_invariant:  # the grid down kernel: the persistent one needs half-height tiles
            tiles = dataclasses.replace(tiles, persistent_down=False)
    _check_tiles(tiles, hidden, two_inter // 2)
    method = "auto"
    if batch_invariant:  # grouped rows at any token count: an every-token tile is a product of another height
        method = "pallas" if num_tokens * expert_ids.shape[1] <= _PALLAS_GROUPING_MAX_ASSIGNMENTS else "count"
    groups = _group_by_expert(expert_ids, num_experts, tiles.block_m, method=method, interpret=interpret)
    if batch_invariant:  # full-height tiles only: a half-filled tile's rows otherwise multiply at half height
        groups = groups._replace(tile_rows=None)
    # plain weights take a shared expert of the experts' width as more row tiles: its weights stream beside the
    # routed ones instead of in two XLA GEMMs, a SiLU-multiply and an add of their own
    in_kernels = (shared is not None and (batch_invariant or num_tokens <= _SHARED_IN_KERNELS_MAX_TOKENS)
                  and not fp8_activations
                  and not any(isinstance(w, QuantizedWeight) for w in (w_gate_up, w_down))
                  and shared[1].shape[0] == two_inter // 2)
    shared_gate_up, shared_down = shared if in_kernels else (None, None)
    num_shared_tiles = -(-num_tokens // tiles.block_m) if in_kernels else 0

    if fp8_activations:
        x_in, x_scale = quantize_rows(x)
    else:
        x_in, x_scale = x, None
    act = _gate_up(groups, x_in, x_scale, *_values_and_scales(w_gate_up), act_dtype=x.dtype, tiles=tiles,
                   interpret=interpret, shared=shared_gate_up, num_shared_tiles=num_shared_tiles)  # [(S+R)*bm, I]
    if fp8_activations:
        act, act_scale = quantize_rows(act)
    else:
        act_scale = None
    out_rows = _down(groups, act, act_scale, *_values_and_scales(w_down), out_dtype=x.dtype, tiles=tiles,
                     interpret=interpret, shared=shared_down, num_shared_tiles=num_shared_tiles)  # [(S+R)*bm, H]

    routed = out_rows[num_shared_tiles * tiles.block_m + groups.assignment_row].astype(jnp.float32)  # [T, C, H]
    weighted = routed * expert_weights.astype(jnp.float32)[..., None]
    if batch_invariant:  # the C terms added in order, element by element, where XLA's reduction may tile them
        out = functools.reduce(jnp.add, [weighted[:, c] for c in range(weighted.shape[1])])
    else:
        out = jnp.sum(weighted, axis=1)
    if in_kernels:
        return (out + out_rows[:num_tokens].astype(jnp.float32)).astype(x.dtype)
    return _plus_shared(out, x, shared, batch_invariant).astype(x.dtype)


def _plus_shared(routed, x, shared, batch_invariant=False):
    """routed + the shared SwiGLU expert in XLA (one [H, 2I] GEMM, silu(gate) * up, the down GEMM), at least as
    precise as the kernels' shared tile: float32 GEMM outputs, the SwiGLU output in x's dtype, the shared term kept
    in float32 and added to routed in float32, one rounding to routed's dtype. (Rounding both GEMMs' outputs to
    bf16 gave the shared term 2.5x the kernels' error and put 2 of 65536 outputs of the quantized full-size test
    past its bf16 tolerance on the H200.) routed alone without one."""
    if shared is None:
        return routed
    w_gate_up, w_down = shared
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None

    def product(a, w):  # float32
        if batch_invariant:
            return invariant_matmul(a, w, out_dtype=jnp.float32)
        return jnp.dot(a, w.astype(a.dtype), precision=precision, preferred_element_type=jnp.float32)

    gate, up = jnp.split(product(x, w_gate_up), 2, axis=-1)
    shared_out = product((jax.nn.silu(gate) * up).astype(x.dtype), w_down)
    return (routed.astype(jnp.float32) + shared_out).astype(routed.dtype)


def _default_impl(hidden, inter):
    """Pallas on the GPU where both widths take a power-of-two tile >= 16 (`_fit_block`), the reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" and hidden % 16 == 0 and inter % 16 == 0 else "reference"


@functools.partial(jax.named_call, name="moe_experts")
def moe_experts(x, expert_ids, expert_weights, w_gate_up, w_down, *, impl="auto", interpret=False,
                fp8_activations=False, tiles=None, shared=None, batch_invariant=False):
    """Routed SwiGLU experts, plus a shared expert every token takes. Shapes in the module docstring; returns [T, H]
    in x's dtype.

    Args:
      impl: "pallas", "reference", or "auto" (Pallas on the GPU for widths that are multiples of 16, the reference
        elsewhere).
      interpret: run the Pallas kernels in interpret mode (CPU tests).
      fp8_activations: with fp8 weights, quantize activations per row to e4m3 and run fp8 x fp8 GEMMs;
        otherwise quantized weights are up-cast in-kernel to x's dtype. Either way 1-byte weights run fastest
        channel-major, `quantize(w, mode, channel_major=True)` (see `_weight_on_left`).
      tiles: a MoeTiles for the Pallas kernels; None picks `default_tiles` by shape.
      shared: (w_gate_up [H, 2I'], w_down [I', H]) plain weights of a shared expert, or None. The Pallas path runs
        it in its kernels up to _SHARED_IN_KERNELS_MAX_TOKENS tokens of plain routed weights with I' = I; elsewhere
        (and in the reference) it is computed in XLA (`_plus_shared`) and added to the routed output in float32.
      batch_invariant: a token's output has the same bits at any token count. The Pallas path then tiles every
        token count alike (full-height grouped tiles of 1024 tokens' tiling, the shared expert in its kernels, or
        `invariant_matmul`), more slowly at small ones; the reference runs on chunks of INVARIANT_CHUNK_ROWS
        tokens (`in_row_chunks`), each reading every expert's weights.
    """
    _check_inputs(x, expert_ids, expert_weights, w_gate_up, w_down, fp8_activations, shared)
    impl = _default_impl(x.shape[1], w_gate_up.shape[2] // 2) if impl == "auto" else impl
    if impl == "reference":
        def reference(x, expert_ids, expert_weights):
            routed = moe_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down,
                                           fp8_activations=fp8_activations)
            return _plus_shared(routed, x, shared)

        if batch_invariant:
            return in_row_chunks(reference, x, expert_ids, expert_weights)
        return reference(x, expert_ids, expert_weights)
    if impl == "pallas":
        return _moe_experts_pallas(x, expert_ids, expert_weights, w_gate_up, w_down, fp8_activations=fp8_activations,
                                   tiles=tiles, interpret=interpret, shared=shared, batch_invariant=batch_invariant)
    raise ValueError(f"unknown moe impl {impl!r}; use 'auto', 'pallas' or 'reference'")
