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

`write_kv_pages` scatters the window's K/V into the pool at those positions; rows past
`window_len` are dropped, so padded slots write nothing. Under jit with the pool donated the
scatter updates the pool in place.
"""

import functools

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30


def _check_shapes(q, k, v, k_pages, v_pages, page_table, context_lens, window_lens):
    batch, window, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if k.shape != (batch, window, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k/v must be [B, Q, K, D] = {(batch, window, num_kv_heads, head_dim)}, got {k.shape}, {v.shape}")
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
    ctx_k = k_pages[layer, :, page_table].transpose(0, 1, 3, 2, 4).reshape(batch, width * page_size, num_kv_heads, head_dim)
    ctx_v = v_pages[layer, :, page_table].transpose(0, 1, 3, 2, 4).reshape(batch, width * page_size, num_kv_heads, head_dim)
    keys = jnp.concatenate([ctx_k, k], axis=1).astype(jnp.float32)
    values = jnp.concatenate([ctx_v, v], axis=1).astype(jnp.float32)

    ctx_pos = jnp.broadcast_to(jnp.arange(width * page_size), (batch, width * page_size))
    win_idx = jnp.broadcast_to(jnp.arange(window), (batch, window))
    abs_q = context_lens[:, None] + win_idx
    ctx_visible = _visibility(abs_q, ctx_pos, ctx_pos < context_lens[:, None], same_window=False,
                              block_size=block_size, sliding_window=sliding_window)
    win_visible = _visibility(win_idx, win_idx, win_idx < window_lens[:, None], same_window=True,
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


def write_kv_pages(k_pages, v_pages, layer, k, v, page_table, context_lens, window_lens):
    """Scatter window K/V [B, Q, K, D] into the pool at positions context_len + i (i < window_len)."""
    batch, window, num_kv_heads, head_dim = k.shape
    num_pages, page_size = k_pages.shape[2], k_pages.shape[3]
    pos = context_lens[:, None] + jnp.arange(window)[None, :]  # [B, Q]
    page_idx = jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)
    page = jnp.take_along_axis(page_table, page_idx, axis=1)
    page = jnp.where(jnp.arange(window)[None, :] < window_lens[:, None], page, num_pages)  # OOB -> dropped
    slot = pos % page_size
    page, slot = page.reshape(-1), slot.reshape(-1)
    k_rows = k.reshape(batch * window, num_kv_heads, head_dim).astype(k_pages.dtype)
    v_rows = v.reshape(batch * window, num_kv_heads, head_dim).astype(v_pages.dtype)
    k_pages = k_pages.at[layer, :, page, slot].set(k_rows, mode="drop")
    v_pages = v_pages.at[layer, :, page, slot].set(v_rows, mode="drop")
    return k_pages, v_pages


def _paged_attention_pallas(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens, *,
                            block_size, sm_scale, sliding_window, logit_soft_cap, interpret):
    raise NotImplementedError("the Pallas kernel lands with the kernel issue")


def _default_impl():
    return "pallas" if jax.default_backend() == "gpu" else "reference"


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
      impl: "auto" (Pallas on GPU, reference elsewhere), "pallas" or "reference".
    Returns:
      [B, Q, H, D] in q's dtype.
    """
    _check_shapes(q, k, v, k_pages, v_pages, page_table, context_lens, window_lens)
    if sm_scale is None:
        sm_scale = q.shape[-1] ** -0.5
    impl = _default_impl() if impl == "auto" else impl
    kwargs = dict(block_size=block_size, sm_scale=sm_scale, sliding_window=sliding_window,
                  logit_soft_cap=logit_soft_cap)
    if impl == "reference":
        return paged_attention_reference(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens,
                                         **kwargs)
    if impl == "pallas":
        return _paged_attention_pallas(q, k, v, k_pages, v_pages, layer, page_table, context_lens, window_lens,
                                       interpret=interpret, **kwargs)
    raise ValueError(f"unknown attention impl {impl!r}; use 'auto', 'pallas' or 'reference'")
