"""Paged block attention for block diffusion, and the page writes that feed it.

A forward step runs, per request, a *window* of Q query tokens at absolute positions
`context_len + i` (i < Q). `context_len` is a multiple of `block_size`: everything before the
window is committed KV in the page pool; the window is one or more in-flight blocks (or a prompt
chunk during prefill). Query i attends to

  (a) every committed key j < context_len, read through the page table, and
  (b) window key j when j < window_len and j // block_size <= i // block_size
      (bidirectional inside a block, causal across blocks),

optionally restricted to a sliding window (q_pos - k_pos < sliding_window) and with tanh logit
soft-capping. Softmax accumulates in float32. A query that sees no key (a padded batch slot)
returns zeros, never NaN.

Layouts (axis letters: B batch, Q window tokens, H query heads, K kv heads, D head dim,
L layers, P pages, S page size, W page-table width):
  q           [B, Q, H, D]        H = K * group; any group size
  k, v        [B, Q, K, D]        fresh K/V of the window tokens
  k_pages     [L, K, P, S, D]     the pool, every layer; v_pages alike
  page_table  i32[B, W]           page ids of each request's positions [0, W*S)
  context_lens, window_lens  i32[B]

`write_kv_pages` scatters the window's K/V into the pool at the rows `window_pool_rows` gives
those positions; rows past `window_len` are dropped, so padded slots write nothing. Under jit with the pool donated
the scatter updates the pool in place (H200: ~18 us per block write inside a jitted loop, against
5.4 ms to copy an 8 GiB pool).

The model calls `paged_attention_from_qkv`: the same kernel reading q and the window's K/V straight from the QKV
projection, applying the per-head q/k RMSNorm and RoPE as it loads them (`attention_prologue.rotated_head_tile`) and
writing the window's K/V into the pool (one program per query tile, its tokens), so no separate
prologue kernel runs (it took ~3.6 us per SDAR layer at batch 1). On the H200 the engine runs level with the separate
prologue kernel it replaced (engine run 21: SDAR batch 1 4.879 both, LLaDA2 batches 1 and 8 within 10 us, batch 32
+92 us).

The Pallas-Triton kernel runs one program per (query tile, key split, kv head, request). A program
holds TQ window queries x the (power-of-2 padded) head group as M = TQ*Gp rows and walks the committed
K/V straight from the pool through the page table (GPU Pallas has no scalar prefetch): a key tile reads
the ids of the few pages it covers as scalars (one contiguous page slice when a page holds whole tiles),
or gathers them row by row when it spans many small pages. Tiles that lie wholly inside
the committed range skip every bounds mask; the ragged last tile and the window's own K/V (under the
block-causal mask) are masked. The online softmax runs in float32 in log2 units (bare exp2). When the
grid would be too small to fill the GPU, the keys are split across programs and their normalised
partial outputs are merged with their log-sum-exps in XLA.
"""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels import in_row_chunks, is_power_of_two
from jaxllm.kernels.attention_prologue import qk_norm_rope, rope_rows, rotated_head_tile

# JAX 0.11 warns at every Pallas-Triton lowering; this kernel is Triton by design (see jax-gpu.md), so silence
# exactly that warning.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

MASK_VALUE = -1e30
LOG2E = 1.4426950408889634
_TARGET_PROGRAMS = 256  # about two programs per H200 SM (132)
_MIN_SPLIT_KEYS = 128  # two key tiles: shorter splits cost more in partial-output traffic and merging than they win
# A grid of fewer programs than this, counted with the splits of the static key range, narrows its query tiles down
# to _MIN_SMALL_GRID_ROWS rows. Batch 1 at page-table width 32 (the engine's bucket for 512-1024-token contexts): SDAR
# (8 kv heads) 64 -> 128 programs of 64 rows, LLaDA2 (4 kv heads) 32 -> 128 programs of 32 rows. At a 512-token
# context on the H200 the kernel then took 6.5 / 5.8 us where 128-row tiles took 8.3 / 8.2 (BENCHMARKS.md, run 12).
_MIN_PROGRAMS = 128
_MIN_SMALL_GRID_ROWS = 32
_MAX_SCALAR_PAGES = 4  # a committed tile spanning more pages gathers its page ids as a vector
_PROLOGUE_WINDOW_BYTES = 128 * 1024  # shared memory for the pipelined window loads of the prologue (H200: 227 KB)


def _check_shapes(q, k, v, k_pages, v_pages, page_table, context_lens, window_lens):
    batch, window, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if k.shape != (batch, window, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v must be [B, Q, K, D] = {(batch, window, num_kv_heads, head_dim)}, "
                         f"got {k.shape}, {v.shape}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if k_pages.ndim != 5 or k_pages.shape[1] != num_kv_heads or k_pages.shape[4] != head_dim:
        raise ValueError(f"k_pages must be [L, K={num_kv_heads}, P, S, D={head_dim}], got {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages {v_pages.shape} must match k_pages {k_pages.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be [B={batch}, W], got {page_table.shape}")
    if context_lens.shape != (batch,) or window_lens.shape != (batch,):
        raise ValueError(f"context_lens and window_lens must be [B={batch}]")


def _visibility(q_pos, k_pos, k_valid, *, same_window, block_size, sliding_window):
    """bool mask [B, Q, N]: which keys each query may see."""
    if same_window:  # window keys: block-causal on window-relative index
        visible = (k_pos[:, None, :] // block_size) <= (q_pos[:, :, None] // block_size)
    else:  # committed keys: all visible
        visible = jnp.ones((q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]), bool)
    visible &= k_valid[:, None, :]
    if sliding_window is not None:
        visible &= (q_pos[:, :, None] - k_pos[:, None, :]) < sliding_window
    return visible


def paged_attention_reference(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens, *,
                              block_size, sm_scale, sliding_window=None, logit_soft_cap=None):
    """Pure-jnp paged block attention (float32 math); the oracle and the CPU path."""
    batch, window, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    page_size = k_pages.shape[3]
    width = page_table.shape[1]

    # committed keys: one gather straight from the pool, [B, W, K, S, D] -> [B, W*S, K, D]
    ctx_shape = (batch, width * page_size, num_kv_heads, head_dim)
    ctx_k = k_pages[layer, :, page_table].transpose(0, 1, 3, 2, 4).reshape(ctx_shape)
    ctx_v = v_pages[layer, :, page_table].transpose(0, 1, 3, 2, 4).reshape(ctx_shape)
    ctx_pos = jnp.broadcast_to(jnp.arange(width * page_size), (batch, width * page_size))
    win_idx = jnp.broadcast_to(jnp.arange(window), (batch, window))
    # keys past a context or window are zeroed, not just masked: the runner pads page tables with page 0, and a
    # 0 weight times a non-finite value in such a page would still be NaN
    ctx_valid, win_valid = ctx_pos < context_lens[:, None], win_idx < window_lens[:, None]
    valid = jnp.concatenate([ctx_valid, win_valid], axis=1)[..., None, None]
    keys = jnp.where(valid, jnp.concatenate([ctx_k, k], axis=1).astype(jnp.float32), 0.0)
    values = jnp.where(valid, jnp.concatenate([ctx_v, v], axis=1).astype(jnp.float32), 0.0)

    abs_q = context_lens[:, None] + win_idx
    ctx_visible = _visibility(abs_q, ctx_pos, ctx_valid, same_window=False,
                              block_size=block_size, sliding_window=sliding_window)
    win_visible = _visibility(win_idx, win_idx, win_valid, same_window=True,
                              block_size=block_size, sliding_window=sliding_window)
    visible = jnp.concatenate([ctx_visible, win_visible], axis=2)  # [B, Q, N]

    qf = q.astype(jnp.float32).reshape(batch, window, num_kv_heads, group, head_dim)
    scores = jnp.einsum("bqkgd,bnkd->bkgqn", qf, keys) * sm_scale
    if logit_soft_cap is not None:
        scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
    scores = jnp.where(visible[:, None, None], scores, MASK_VALUE)
    row_max = scores.max(axis=-1, keepdims=True)
    probs = jnp.where(visible[:, None, None], jnp.exp(scores - row_max), 0.0)
    denom = probs.sum(axis=-1, keepdims=True)
    out = jnp.einsum("bkgqn,bnkd->bqkgd", probs / jnp.where(denom == 0, 1.0, denom), values)
    return out.reshape(batch, window, num_heads, head_dim).astype(q.dtype)


def window_pool_rows(page_table, context_lens, window_lens, window, page_size):
    """i32[B * Q]: the pool row (page * S + slot) of each window token's K/V; tokens past window_len get the largest
    int32, a row past the end of any pool, which writes nothing."""
    pos = context_lens[:, None] + jnp.arange(window)[None, :]  # [B, Q]
    page_idx = jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)
    rows = jnp.take_along_axis(page_table, page_idx, axis=1) * page_size + pos % page_size
    dropped = jnp.iinfo(jnp.int32).max
    return jnp.where(jnp.arange(window)[None, :] < window_lens[:, None], rows, dropped).reshape(-1)


def write_kv_pages(k_pages, v_pages, layer, k, v, pool_rows):
    """Scatter K/V rows [T, K, D] into layer `layer` of the pool at pool_rows i32[T]; rows outside the pool write
    nothing."""
    shape = k_pages.shape
    pool_shape = (shape[0], shape[1], shape[2] * shape[3], shape[4])  # pages flattened to rows: free
    pool_rows = jnp.where(pool_rows < 0, pool_shape[2], pool_rows)  # indexing would wrap a negative row around
    k_pages = k_pages.reshape(pool_shape).at[layer, :, pool_rows].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.reshape(pool_shape).at[layer, :, pool_rows].set(v.astype(v_pages.dtype), mode="drop")
    return k_pages.reshape(shape), v_pages.reshape(shape)


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Static tile sizes of one kernel instance; every tensor the kernel touches is a power of 2."""
    q_tile: int          # window queries per program (TQ)
    group: int           # query heads per kv head, padded to a power of 2 (Gp)
    key_tile: int        # committed keys per loop step (TK)
    window_key_tile: int  # window keys per loop step
    num_splits: int      # programs sharing one (request, kv head, query tile), each on a slice of the keys
    num_warps: int
    num_stages: int
    scalar_page_ids: bool  # read a committed tile's page ids as scalars (the tile spans <= _MAX_SCALAR_PAGES pages)


def _next_pow2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def _choose_tiling(q, page_size, page_table_width, num_kv_heads, overrides, prologue=False, batch_invariant=False):
    batch, window, num_heads, head_dim = q.shape
    group = _next_pow2(num_heads // num_kv_heads)
    row_bytes = head_dim * q.dtype.itemsize
    # 128 query rows x 64 keys keeps a [M, D] f32 accumulator plus [M, TK] scores in registers at D*bytes <= 256
    rows = 128 if row_bytes <= 256 else 64
    key_tile = 64 if row_bytes <= 256 else (32 if row_bytes <= 512 else 16)
    q_tile = max(min(rows // group, _next_pow2(window)), -(-16 // group))  # dots need M >= 16
    # no split shorter than _MIN_SPLIT_KEYS of the static key range
    max_splits = max(1, (page_table_width * page_size + window) // _MIN_SPLIT_KEYS)
    # with a prologue every program also normalises and rotates its [M, D] queries in float32 registers: SDAR batch 1
    # ran 4.997 ms per forward at 64-row tiles, 4.941 at 32 (H200, engine run 20), so small grids narrow further
    min_programs = 2 * _MIN_PROGRAMS if prologue else _MIN_PROGRAMS
    widest_q_tile = q_tile
    # batch_invariant: the tiles of a full grid at any batch, so a query's sums run in one order (no split merge)
    while (not batch_invariant and q_tile > 1 and q_tile * group > _MIN_SMALL_GRID_ROWS
           and batch * num_kv_heads * -(-window // q_tile) * max_splits < min_programs):
        q_tile //= 2
    # enough programs to cover the SMs twice, but no split where the unsplit grid already gives each SM about one:
    # LLaDA2 at batch 32 (128 programs) took 43.3 us with 2 splits, 30.6 with none (tools/bench_attention.py, H200)
    programs = batch * num_kv_heads * -(-window // q_tile)
    num_splits = 1
    if not batch_invariant and programs < _MIN_PROGRAMS:
        num_splits = max(1, min(-(-_TARGET_PROGRAMS // programs), max_splits))
    # Triton's pipeliner prefetches loads behind one level of indirection (page id -> K/V rows) only
    # (num_stages - 1) // 2 tiles ahead: 5 stages keep two K/V tiles in flight, 3 or 4 stages only one. One
    # 8-warp program fills an SM's registers, so that prefetch depth is all that hides HBM latency.
    num_stages = (5 if q.dtype.itemsize == 2 else 3) if row_bytes <= 256 else 2
    window_key_tile = min(key_tile, max(16, _next_pow2(window)))
    # with a prologue a window tile is five [TKW, D] loads (the heads, their rotate-half partners, v, cos, sin), of
    # which Triton's pipeliner keeps num_stages in shared memory beside the committed loop's: SDAR's 32 x 128 bf16
    # tiles asked for 272 KB in all on the H200 (227 KB available). The byte budget is a heuristic, not a count.
    while prologue and window_key_tile > 16 and 5 * window_key_tile * row_bytes * num_stages > _PROLOGUE_WINDOW_BYTES:
        window_key_tile //= 2
    # A narrowed grid with a prologue walks two or three key tiles per split, too few to gain from a deep pipeline,
    # while every stage's buffers take shared memory a second program on the SM would need (at 5 stages probably one
    # program per SM, so SDAR batch 1's 256 programs, 160 with keys, take two waves of the H200's 132 SMs; not
    # counted). At 2 stages (window tiles as chosen for 5) the kernel took 9.4 us per SDAR layer against 10.6 (3
    # stages 9.9, 4 10.1); the forward 4.876 ms against 4.904 (means of six and five runs in three calls), LLaDA2 batch
    # 1 5.805 against 5.875 (BENCHMARKS.md run 28).
    if prologue and q_tile < widest_q_tile:
        num_stages = 2
    tiling = _Tiling(q_tile=q_tile, group=group, key_tile=key_tile, window_key_tile=window_key_tile,
                     num_splits=num_splits,
                     num_warps=8 if q_tile * group >= 128 else 4, num_stages=num_stages, scalar_page_ids=True)
    tiling = dataclasses.replace(tiling, **(overrides or {}))
    # tiles start at multiples of key_tile, so each tile covers whole pages or lies inside one
    pages_per_tile = tiling.key_tile // page_size
    aligned = page_size % tiling.key_tile == 0 or (tiling.key_tile % page_size == 0
                                                   and pages_per_tile <= _MAX_SCALAR_PAGES)
    return dataclasses.replace(tiling, scalar_page_ids=tiling.scalar_page_ids and aligned)


def _key_ranges(context_len, window_len, first_query, *, tiling, block_size, sliding_window):
    """Committed [c_lo, c_lo + count) and window [w_lo, w_lo + count) key ranges some query of this tile can see.

    c_lo is a multiple of key_tile (the sliding-window mask hides the extra keys), so committed tiles are aligned.
    """
    last_query = first_query + tiling.q_tile - 1
    c_lo, c_hi = jnp.int32(0), context_len
    w_lo = jnp.int32(0)
    w_hi = jnp.minimum(window_len, (last_query // block_size + 1) * block_size)  # block-causal bound
    if sliding_window is not None:
        c_lo = jnp.maximum(context_len + first_query - sliding_window + 1, 0) // tiling.key_tile * tiling.key_tile
        w_lo = jnp.maximum(first_query - sliding_window + 1, 0)
    return c_lo, jnp.maximum(c_hi - c_lo, 0), w_lo, jnp.maximum(w_hi - w_lo, 0)


def _split_range(num_committed, num_window, split, *, tiling):
    """This split's share of the keys [committed ++ window], in key_tile-aligned chunks.

    Returns (offset into the committed range, committed count, offset into the window range, window count).
    """
    total = num_committed + num_window
    chunk = pl.cdiv(pl.cdiv(total, tiling.num_splits), tiling.key_tile) * tiling.key_tile
    begin = split * chunk
    end = jnp.minimum(begin + chunk, total)
    committed_count = jnp.maximum(jnp.minimum(end, num_committed) - begin, 0)
    window_begin = jnp.maximum(begin, num_committed)
    return begin, committed_count, window_begin - num_committed, jnp.maximum(end - window_begin, 0)


def _online_softmax_step(carry, q, k, v, visible, *, sm_scale, logit_soft_cap):
    """Fold one key tile into the running (acc [M, D], row max [M], row sum [M]), all float32.

    Scores are kept in log2 units (natural-log scores times log2(e)), so every exponential is a bare exp2.
    `visible` is None for a tile every query sees whole.
    """
    acc, row_max, row_sum = carry
    # HIGHEST keeps f32 inputs in IEEE f32 (Triton's default would be TF32); bf16 dots are unaffected
    dot = functools.partial(jax.lax.dot_general, precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
    scores = dot(q, k, (((1,), (1,)), ((), ())))
    if logit_soft_cap is None:
        scores = scores * (sm_scale * LOG2E)
    else:
        scores = (logit_soft_cap * LOG2E) * jnp.tanh(scores * (sm_scale / logit_soft_cap))
    if visible is not None:
        # -inf on hidden keys with a finite running max: hidden keys add exp2(-inf) = 0 and never a NaN
        scores = jnp.where(visible, scores, -jnp.inf)
    new_max = jnp.maximum(row_max, scores.max(axis=1))
    rescale = jnp.exp2(row_max - new_max)
    probs = jnp.exp2(scores - new_max[:, None])
    row_sum = row_sum * rescale + probs.sum(axis=1)
    pv = dot(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())))
    return acc * rescale[:, None] + pv, new_max, row_sum


@dataclasses.dataclass(frozen=True)
class _Prologue:
    """The kernel makes q and the window's K/V from the QKV projection itself (`paged_attention_from_qkv`)."""
    num_heads: int
    window: int  # Q: the projection holds B * Q rows
    rotary_half: int  # R / 2
    eps: float


def _paged_attention_kernel(layer_ref, page_table_ref, context_lens_ref, window_lens_ref, *refs, tiling, block_size,
                            page_size, sm_scale, sliding_window, logit_soft_cap, prologue):
    """One program: query tile `q_tile` of request `b`, kv head `kv_head`, key slice `split`.

    Refs without a prologue: q_ref [TQ, Gp, D] block; k_ref, v_ref the whole [B, Q, K, D] window K/V; k_pages_ref,
    v_pages_ref the whole pool viewed as [L, K, P*S, D]; out_ref [TQ, Gp, D] (final output, or this split's
    normalised partial), lse_ref [TQ, Gp] (only with splits: log2-sum-exp2 of this split's log2-unit scores).
    With a prologue, q_ref, k_ref, v_ref are replaced by qkv_ref [B*Q, (H+2K)*D], the norm weights [D], the
    `rope_rows` cos and signed sin [B*Q, D] and pool_rows i32[B*Q]; q and the window's K/V are normalised and rotated
    on loading (`rotated_head_tile`), and one program per query tile also writes its tokens' K/V into the pool
    through k_pages_out, v_pages_out (aliased to the pool inputs; the committed rows this kernel reads are never
    window rows).
    """
    q_tile, split, kv_head, b = (pl.program_id(axis) for axis in range(4))
    refs = list(refs)
    if prologue is None:
        q_ref, k_ref, v_ref, k_pages_ref, v_pages_ref, out_ref, *lse_ref = refs
        window, dtype = k_ref.shape[1], q_ref.dtype
    else:
        qkv_ref, q_norm_ref, k_norm_ref, cos_ref, sin_ref, pool_rows_ref, k_pages_ref, v_pages_ref, out_ref = refs[:9]
        lse_ref, (k_pages_out, v_pages_out) = refs[9:-2], refs[-2:]
        window, dtype = prologue.window, qkv_ref.dtype
    head_dim, num_kv_heads = k_pages_ref.shape[3], k_pages_ref.shape[1]
    num_rows, key_tile = tiling.q_tile * tiling.group, tiling.key_tile
    layer, context_len, window_len = layer_ref[0], context_lens_ref[b], window_lens_ref[b]
    page_table_width, num_pool_rows = page_table_ref.shape[1], k_pages_ref.shape[2]

    first_query = q_tile * tiling.q_tile
    query_idx = first_query + jax.lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0) // tiling.group  # [M, 1]
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)  # [1, D]
    if prologue is None:
        q = q_ref[...].reshape(num_rows, head_dim)  # [M, D]

        def window_kv(row, valid):
            k = pltriton.load(k_ref.at[b, row[:, None], kv_head, cols], mask=valid[:, None], other=0.0)
            v = pltriton.load(v_ref.at[b, row[:, None], kv_head, cols], mask=valid[:, None], other=0.0)
            return k.astype(dtype), v.astype(dtype)
    else:
        group = prologue.num_heads // num_kv_heads
        rotate = functools.partial(rotated_head_tile, qkv_ref, cos_ref=cos_ref, sin_ref=sin_ref,
                                   rotary_half=prologue.rotary_half, eps=prologue.eps)
        k_start = (prologue.num_heads + kv_head) * head_dim  # first column of this kv head's k, then its v
        v_start = k_start + num_kv_heads * head_dim

        def window_kv(row, valid):
            tokens = b * window + row
            k = rotate(tokens, jnp.full(row.shape, k_start, jnp.int32), k_norm_ref, mask=valid[:, None])
            v = pltriton.load(qkv_ref.at[tokens[:, None], v_start + cols], mask=valid[:, None], other=0.0)
            return k.astype(dtype), v.astype(dtype)

        def write_window_kv(row, valid, k, v):
            """Store the window K/V of window rows `row` where `valid` into the pool."""
            pool_row = pltriton.load(pool_rows_ref.at[b * window + row])
            in_pool = valid & (pool_row >= 0) & (pool_row < num_pool_rows)
            # a dropped token's lanes are masked on the GPU; interpret mode writes every index and drops only those
            # past the end (a negative one would wrap around)
            target = jnp.where(in_pool, pool_row, num_pool_rows)[:, None]
            mask = jnp.broadcast_to(in_pool[:, None], k.shape)
            pltriton.store(k_pages_out.at[layer, kv_head, target, cols], k.astype(k_pages_out.dtype), mask=mask)
            pltriton.store(v_pages_out.at[layer, kv_head, target, cols], v.astype(v_pages_out.dtype), mask=mask)

        # Who writes a query tile's tokens. Unsplit (batch 32, prefills), its program, as the window loop loads them: a
        # query tile's window range holds all its tokens (the block-causal bound lies past its last query, a sliding
        # window starts before its first). Split (batch 1 and 8), the last split's programs, in a pass of their own:
        # the key range splits into chunks of whole key tiles, so the last split holds the fewest keys (often none).
        # On the H200, us per layer alone (BENCHMARKS.md run 35): LLaDA2 batch 32 25.0 as loaded against 26.9 in a
        # pass; batch 1 8.0 as loaded against 6.9, SDAR batch 1 10.5 against 9.7. A writer at the first split had
        # trailed the others (SDAR batch 1 +96 us per forward).
        write_while_loading = tiling.num_splits == 1
        write_tile = min(_next_pow2(tiling.q_tile), tiling.window_key_tile)

        def write_pass(t, carry):
            offset = first_query + t * write_tile + jax.lax.iota(jnp.int32, write_tile)
            valid = (offset < window) & (offset < first_query + tiling.q_tile)
            row = jnp.minimum(offset, window - 1)
            write_window_kv(row, valid, *window_kv(row, valid))
            return carry

        if not write_while_loading:
            @pl.when(split == tiling.num_splits - 1)
            def _():
                jax.lax.fori_loop(0, pl.cdiv(tiling.q_tile, write_tile), write_pass, 0)
        # row m holds query first_query + m // Gp of head g = m % Gp; padding rows repeat real ones (sliced off)
        row_in_tile = jax.lax.iota(jnp.int32, num_rows)
        q_token = b * window + jnp.minimum(first_query + row_in_tile // tiling.group, window - 1)
        q_head = kv_head * group + jnp.minimum(row_in_tile % tiling.group, group - 1)
        q = rotate(q_token, q_head * head_dim, q_norm_ref).astype(dtype)
    c_lo, num_committed, w_lo, num_window = _key_ranges(context_len, window_len, first_query, tiling=tiling,
                                                         block_size=block_size, sliding_window=sliding_window)
    begin, committed_count, window_offset, window_count = _split_range(num_committed, num_window, split,
                                                                       tiling=tiling)
    step = functools.partial(_online_softmax_step, sm_scale=sm_scale, logit_soft_cap=logit_soft_cap)

    def first_row_of_page(page_idx):
        """Pool row of the first slot of this request's page `page_idx` (a scalar)."""
        page = page_table_ref[b, jnp.minimum(page_idx, page_table_width - 1)]
        return jnp.clip(page, 0, num_pool_rows // page_size - 1) * page_size

    def load_committed(first_pos, valid):
        """K, V [TK, D] of committed positions first_pos + [0, TK); rows where `valid` is False are not read."""
        mask, other = (None, None) if valid is None else (valid[:, None], 0.0)
        if tiling.scalar_page_ids and page_size % key_tile == 0:  # the tile is a contiguous run of one page's rows
            start = first_row_of_page(first_pos // page_size) + first_pos % page_size
            rows = (pl.ds(start, key_tile), slice(None))
        elif tiling.scalar_page_ids:  # the tile covers a few whole pages: one scalar page id each
            key_offsets = jax.lax.iota(jnp.int32, key_tile)
            row = first_row_of_page(first_pos // page_size) + key_offsets
            for i in range(1, key_tile // page_size):
                page_rows = first_row_of_page(first_pos // page_size + i) + key_offsets - i * page_size
                row = jnp.where(key_offsets >= i * page_size, page_rows, row)
            rows = (row[:, None], cols)
        else:  # a tile spans many pages: gather the page ids row by row
            pos = first_pos + jax.lax.iota(jnp.int32, key_tile)
            page = page_table_ref[b, jnp.minimum(pos // page_size, page_table_width - 1)]
            row = jnp.minimum(jnp.maximum(page, 0) * page_size + pos % page_size, num_pool_rows - 1)
            rows = (row[:, None], cols)
        k = pltriton.load(k_pages_ref.at[(layer, kv_head, *rows)], mask=mask, other=other)
        v = pltriton.load(v_pages_ref.at[(layer, kv_head, *rows)], mask=mask, other=other)
        return k.astype(dtype), v.astype(dtype)

    def committed_tile(t, carry, *, whole):
        """Tile t of this split's committed keys; a `whole` tile lies inside committed_count (no bounds mask)."""
        key_offsets = jax.lax.iota(jnp.int32, key_tile)  # [TK]
        first_pos = c_lo + begin + t * key_tile
        valid = None if whole else t * key_tile + key_offsets < committed_count
        k, v = load_committed(first_pos, valid)
        visible = None if whole else valid[None, :]
        if sliding_window is not None:
            in_window = context_len + query_idx - (first_pos + key_offsets)[None, :] < sliding_window
            visible = in_window if visible is None else visible & in_window
        return step(carry, q, k, v, visible)

    def window_tile(t, carry):
        offset = t * tiling.window_key_tile + jax.lax.iota(jnp.int32, tiling.window_key_tile)  # [TKW]
        key_idx = w_lo + window_offset + offset
        valid = offset < window_count
        row = jnp.minimum(key_idx, window - 1)
        k, v = window_kv(row, valid)
        if prologue is not None and write_while_loading:
            write_window_kv(row, valid & (key_idx >= first_query) & (key_idx < first_query + tiling.q_tile), k, v)
        visible = valid[None, :] & (key_idx[None, :] // block_size <= query_idx // block_size)
        if sliding_window is not None:
            visible = visible & (query_idx - key_idx[None, :] < sliding_window)
        return step(carry, q, k, v, visible)

    carry = (jnp.zeros((num_rows, head_dim), jnp.float32), jnp.full((num_rows,), MASK_VALUE, jnp.float32),
             jnp.zeros((num_rows,), jnp.float32))
    num_whole_tiles = committed_count // key_tile
    carry = jax.lax.fori_loop(0, num_whole_tiles, functools.partial(committed_tile, whole=True), carry)
    carry = jax.lax.fori_loop(num_whole_tiles, pl.cdiv(committed_count, key_tile),  # the ragged last tile
                              functools.partial(committed_tile, whole=False), carry)
    carry = jax.lax.fori_loop(0, pl.cdiv(window_count, tiling.window_key_tile), window_tile, carry)
    acc, row_max, row_sum = carry
    seen = row_sum > 0  # a row that saw no key (padded slot, empty split) yields zeros
    out = acc / jnp.where(seen, row_sum, 1.0)[:, None]
    out_ref[...] = out.reshape(out_ref.shape).astype(out_ref.dtype)
    if lse_ref:
        lse = jnp.where(seen, row_max + jnp.log2(jnp.where(seen, row_sum, 1.0)), MASK_VALUE)
        lse_ref[0][...] = lse.reshape(lse_ref[0].shape)


def _combine_splits(partial_out, partial_lse):
    """[N, B, Q, K, G, D] normalised partials + [N, B, Q, K, G] log2-sum-exp2s -> [B, Q, K, G, D] float32.

    Written over the N splits one by one, all elementwise, so that XLA fuses the merge into one kernel: reductions
    over the split axis became two (the weights' maximum, then the weighted sum). On the H200 at batch 1: one
    1.8-2.1 us kernel where the two took 1.6-2.1 + 1.1 us per layer (BENCHMARKS.md, run 13).
    """
    splits = range(partial_out.shape[0])
    top = functools.reduce(jnp.maximum, [partial_lse[n] for n in splits])
    # empty splits carry MASK_VALUE -> weight 0 (or all 1 for a row no split saw: its partials are 0)
    weights = [jnp.exp2(partial_lse[n] - top)[..., None] for n in splits]
    return functools.reduce(jnp.add, [w * partial_out[n] for n, w in zip(splits, weights)]) / functools.reduce(
        jnp.add, weights)


def _attention_call(window_operands, k_pages, v_pages, layer, page_table, context_lens, window_lens, *, q_shape,
                    dtype, tiling, interpret, prologue, block_size, sm_scale, sliding_window, logit_soft_cap):
    """The kernel over the queries and window K/V given as window_operands (q5, k, v; or with a prologue the
    projection, norm weights, cos, sin and pool rows): ([B, Q, H, D] output, the pool outputs with a prologue)."""
    batch, window, num_heads, head_dim = q_shape
    num_layers, num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if not is_power_of_two(head_dim):
        raise ValueError(f"the Pallas kernel needs a power-of-2 head_dim, got {head_dim}")
    pool_shape = (num_layers, num_kv_heads, num_pages * page_size, head_dim)  # pages flattened to rows: free
    params = dict(block_size=block_size, page_size=page_size, sm_scale=float(sm_scale), sliding_window=sliding_window,
                  logit_soft_cap=None if logit_soft_cap is None else float(logit_soft_cap))
    program, num_outputs = _attention_program(
        batch, -(-window // tiling.q_tile), num_kv_heads, head_dim, jnp.dtype(dtype), pool_shape,
        (jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)), len(window_operands), tiling, prologue, interpret,
        tuple(sorted(params.items())))
    outs = program(jnp.asarray(layer, jnp.int32).reshape(1), page_table.astype(jnp.int32),
                   context_lens.astype(jnp.int32), window_lens.astype(jnp.int32), *window_operands,
                   k_pages.reshape(pool_shape), v_pages.reshape(pool_shape))
    out = outs[0] if tiling.num_splits == 1 else _combine_splits(*outs[:2])
    out = out.astype(dtype)[:, :window, :, :num_heads // num_kv_heads].reshape(q_shape)
    return out, [pool.reshape(k_pages.shape) for pool in outs[num_outputs:]]


@functools.cache
def _attention_program(batch, num_q_tiles, num_kv_heads, head_dim, dtype, pool_shape, pool_dtypes,
                       num_window_operands, tiling, prologue, interpret, params):
    """The pallas_call of `_attention_call` and its number of attention outputs (the pool outputs follow), built once
    per static configuration as `pallas_program` builds the others (this one has blocked operands and aliased pool
    outputs). A model's layers differ only in the layer index, a runtime operand, so its program traces the kernel
    once, not once per layer (LLaDA2 batch 32, 20 layers: 1.80 -> 0.25 s on this CPU)."""
    out_dims = (num_q_tiles * tiling.q_tile, num_kv_heads, tiling.group)
    tile = _query_tile(tiling, head_dim)
    query_tile_spec = pl.BlockSpec(tile, lambda t, s, h, b: (b, t, h, 0, 0))  # queries in, outputs out
    if tiling.num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((batch, *out_dims, head_dim), dtype)]
        out_specs = [query_tile_spec]
    else:  # float32 partials per split, merged by _combine_splits
        out_shape = [jax.ShapeDtypeStruct((tiling.num_splits, batch, *out_dims, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((tiling.num_splits, batch, *out_dims), jnp.float32)]
        out_specs = [pl.BlockSpec((pl.squeezed, *tile), lambda t, s, h, b: (s, b, t, h, 0, 0)),
                     pl.BlockSpec((pl.squeezed, *tile[:-1]), lambda t, s, h, b: (s, b, t, h, 0))]
    raw = pl.BlockSpec(memory_space=pl.ANY)  # indexed in-kernel (no scalar prefetch on GPU)
    num_outputs, aliases = len(out_shape), {}
    if prologue is None:  # q5 in query tiles; the window's k and v indexed in-kernel
        window_specs = [query_tile_spec, raw, raw]
    else:  # everything indexed in-kernel; the pool comes back written, in place
        window_specs = [raw] * num_window_operands
        out_shape += [jax.ShapeDtypeStruct(pool_shape, pool_dtype) for pool_dtype in pool_dtypes]
        out_specs += [raw, raw]
        first_pool_operand = 4 + num_window_operands
        aliases = {first_pool_operand: num_outputs, first_pool_operand + 1: num_outputs + 1}
    program = pl.pallas_call(
        functools.partial(_paged_attention_kernel, tiling=tiling, prologue=prologue, **dict(params)),
        out_shape=out_shape,
        grid=(num_q_tiles, tiling.num_splits, num_kv_heads, batch),  # query tiles sharing K/V launch together
        in_specs=[*[raw] * 4, *window_specs, raw, raw],
        out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="paged_block_attention",
    )
    return program, num_outputs


def _query_tile(tiling, head_dim):
    """One program's [TQ, Gp, D] tile of [B, Q, K, Gp, D] queries and outputs."""
    return pl.squeezed, tiling.q_tile, pl.squeezed, tiling.group, head_dim


def _paged_attention_pallas(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens, *,
                            tiling_overrides=None, **kwargs):
    """Pallas-Triton kernel; `tiling_overrides` ({field: value} of _Tiling) is for tests and benchmarks."""
    batch, window, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    tiling = _choose_tiling(q, k_pages.shape[3], page_table.shape[1], num_kv_heads, tiling_overrides)
    padded_window = -(-window // tiling.q_tile) * tiling.q_tile
    q5 = q.reshape(batch, window, num_kv_heads, group, head_dim)
    if (padded_window, tiling.group) != (window, group):
        q5 = jnp.pad(q5, ((0, 0), (0, padded_window - window), (0, 0), (0, tiling.group - group), (0, 0)))
    out, _ = _attention_call([q5, k, v], k_pages, v_pages, layer, page_table, context_lens, window_lens,
                             q_shape=q.shape, dtype=q.dtype, tiling=tiling, prologue=None, **kwargs)
    return out


def _paged_attention_from_qkv_pallas(qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages, layer,
                                     page_table, context_lens, window_lens, *, num_heads, eps, tiling_overrides=None,
                                     batch_invariant=False, **kwargs):
    batch, window, _ = qkv.shape
    _, num_kv_heads, _, page_size, head_dim = k_pages.shape
    q_shape = (batch, window, num_heads, head_dim)
    tiling = _choose_tiling(jax.ShapeDtypeStruct(q_shape, qkv.dtype), page_size, page_table.shape[1], num_kv_heads,
                            tiling_overrides, prologue=True, batch_invariant=batch_invariant)
    pool_rows = window_pool_rows(page_table, context_lens, window_lens, window, page_size)
    tokens = batch * window
    cos_rows, sin_rows = rope_rows(cos.reshape(tokens, -1), sin.reshape(tokens, -1), head_dim, qkv.dtype)
    operands = [qkv.reshape(tokens, -1), q_norm_weight, k_norm_weight, cos_rows, sin_rows, pool_rows]
    out, (k_pages, v_pages) = _attention_call(
        operands, k_pages, v_pages, layer, page_table, context_lens, window_lens, q_shape=q_shape, dtype=qkv.dtype,
        tiling=tiling, prologue=_Prologue(num_heads, window, cos.shape[-1], float(eps)), **kwargs)
    return out, k_pages, v_pages


def _default_impl(head_dim: int) -> str:
    """The kernel on the GPU where Triton can hold a head (a power-of-two head_dim); XLA elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" and is_power_of_two(head_dim) else "reference"


@functools.partial(jax.named_call, name="paged_attention")
def paged_attention(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens, *,
                    block_size, sm_scale=None, sliding_window=None, logit_soft_cap=None,
                    impl="auto", interpret=False):
    """Block-causal attention of a window of queries over paged committed KV plus fresh window KV.

    Args:
      q: [B, Q, H, D] queries; k, v: [B, Q, K, D] window keys/values.
      k_pages, v_pages: [L, K, P, S, D] page pool; layer: int32 scalar selecting L.
      page_table: i32[B, W]; context_lens: i32[B] committed tokens (multiple of block_size);
      window_lens: i32[B] valid window tokens (the rest are placeholders, invisible as keys).
      impl: "auto" (Pallas on GPU for a power-of-two head_dim, reference elsewhere), "pallas" or "reference".
    Returns:
      [B, Q, H, D] in q's dtype.
    """
    _check_shapes(q, k, v, k_pages, v_pages, page_table, context_lens, window_lens)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    impl = _default_impl(q.shape[-1]) if impl == "auto" else impl
    kwargs = {"block_size": block_size, "sm_scale": sm_scale, "sliding_window": sliding_window,
              "logit_soft_cap": logit_soft_cap}
    if impl == "reference":
        return paged_attention_reference(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens,
                                         **kwargs)
    if impl == "pallas":
        return _paged_attention_pallas(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens,
                                       interpret=interpret, **kwargs)
    raise ValueError(f"unknown attention impl {impl!r}; use 'auto', 'pallas' or 'reference'")


def paged_attention_from_qkv_reference(qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages, layer,
                                       page_table, context_lens, window_lens, *, num_heads, eps, batch_invariant=False,
                                       **kwargs):
    """The XLA path of `paged_attention_from_qkv`: `qk_norm_rope`, `write_kv_pages`, `paged_attention_reference`.
    batch_invariant: the norms and RoPE on fixed chunks of tokens and the attention one request at a time
    (`in_row_chunks`), where XLA's CPU code for the whole batch rounds a token otherwise at 1024 tokens than at 64."""
    batch, window, _ = qkv.shape
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]

    def norm_rope(qkv, cos, sin):
        return qk_norm_rope(qkv, q_norm_weight, k_norm_weight, cos, sin, num_heads=num_heads,
                            num_kv_heads=num_kv_heads, eps=eps)

    if batch_invariant:
        tokens = batch * window
        q, k, v = jax.tree.map(lambda a: a.reshape(batch, window, *a.shape[1:]), in_row_chunks(
            norm_rope, qkv.reshape(tokens, -1), cos.reshape(tokens, -1), sin.reshape(tokens, -1)))
    else:
        q, k, v = norm_rope(qkv, cos, sin)
    pool_rows = window_pool_rows(page_table, context_lens, window_lens, window, page_size)
    k_pages, v_pages = write_kv_pages(k_pages, v_pages, layer, k.reshape(batch * window, *k.shape[2:]),
                                      v.reshape(batch * window, *v.shape[2:]), pool_rows)

    def attend(q, k, v, page_table, context_lens, window_lens):
        return paged_attention_reference(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens,
                                         **kwargs)

    args = (q, k, v, page_table, context_lens, window_lens)
    out = in_row_chunks(attend, *args, chunk=1) if batch_invariant else attend(*args)
    return out, k_pages, v_pages


@functools.partial(jax.named_call, name="paged_attention")
def paged_attention_from_qkv(qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages, layer, page_table,
                             context_lens, window_lens, *, num_heads, eps, block_size, sm_scale=None,
                             sliding_window=None, logit_soft_cap=None, impl="auto", interpret=False,
                             batch_invariant=False):
    """`paged_attention` straight from the QKV projection: per-head RMSNorm of q and k and RoPE
    (`kernels/attention_prologue.py`), the window's K/V written into the pool, and attention, in one kernel.

    Args:
      qkv: [B, Q, (H + 2K) * D] the projection (q heads, then k heads, then v heads); q_norm_weight, k_norm_weight
        [D]; cos, sin: f32[B, Q, R/2] RoPE tables of the window's positions (`rope_tables`).
      The pool, layer, page table and lengths as in `paged_attention`; the window's K/V go to the pool rows the page
      table gives their positions (`window_pool_rows`), placeholders past window_len write nothing.
      batch_invariant: a request's output has the same bits at any batch size: the Pallas kernel tiles every batch
        as a full grid (no narrowed query tiles, no split of the keys), more slowly at small batches; the reference
        runs in fixed chunks (`paged_attention_from_qkv_reference`).
    Returns:
      ([B, Q, H, D] in qkv's dtype, k_pages, v_pages): under jit with the pool donated it is updated in place.
    """
    batch, window, width = qkv.shape
    num_kv_heads, head_dim = k_pages.shape[1], k_pages.shape[4]
    if width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv must be [B, Q, (H + 2K) * D] = [{batch}, {window}, "
                         f"{(num_heads + 2 * num_kv_heads) * head_dim}], got {qkv.shape}")
    if cos.shape[:2] != (batch, window) or sin.shape != cos.shape or 2 * cos.shape[2] > head_dim:
        raise ValueError(f"cos/sin must be [B={batch}, Q={window}, R/2 <= D/2], got {cos.shape}, {sin.shape}")
    if q_norm_weight.shape != (head_dim,) or k_norm_weight.shape != (head_dim,):
        raise ValueError(f"norm weights must be [D={head_dim}], got {q_norm_weight.shape}, {k_norm_weight.shape}")
    kv_shape = jax.ShapeDtypeStruct((batch, window, num_kv_heads, head_dim), qkv.dtype)
    _check_shapes(jax.ShapeDtypeStruct((batch, window, num_heads, head_dim), qkv.dtype), kv_shape, kv_shape, k_pages,
                  v_pages, page_table, context_lens, window_lens)
    if sm_scale is None:
        sm_scale = head_dim ** -0.5
    impl = _default_impl(head_dim) if impl == "auto" else impl
    args = (qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages, layer, page_table, context_lens,
            window_lens)
    kwargs = {"num_heads": num_heads, "eps": eps, "block_size": block_size, "sm_scale": sm_scale,
              "sliding_window": sliding_window, "logit_soft_cap": logit_soft_cap}
    if impl == "reference":
        return paged_attention_from_qkv_reference(*args, batch_invariant=batch_invariant, **kwargs)
    if impl == "pallas":
        return _paged_attention_from_qkv_pallas(*args, interpret=interpret, batch_invariant=batch_invariant, **kwargs)
    raise ValueError(f"unknown attention impl {impl!r}; use 'auto', 'pallas' or 'reference'")
