"""Between the QKV projection and attention: per-head RMSNorm of q and k, NeoX RoPE, and the window's K/V written
into the page pool, as one Pallas (Triton) kernel.

In XLA this is about seven small kernels per layer (the q/k/v split, two norm fusions, two RoPE concatenates, a
K and a V scatter), ~14 us per layer at 32 tokens on the H200, where the bytes take well under a microsecond.
The kernel runs one program per (block of up to 8 tokens, head): it reads the head's slice of the projection once,
normalises and rotates q and k heads, and stores each head where it goes (q, k, v outputs, and for k and v heads the
pool, which it updates in place through input/output aliasing).

Layouts (T tokens, H query heads, K kv heads, D head dim, R = rotary_dim, L layers, P pages, S page size):
  qkv                  [T, (H + 2K) * D]  the projection's output: q heads, then k heads, then v heads
  q_norm_weight, k_norm_weight  [D]
  cos, sin             f32[T, R/2]        RoPE tables of each token's position (`rope_tables`)
  k_pages, v_pages     [L, K, P, S, D]
  pool_rows            i32[T]             page * S + slot of each token's K/V; rows outside [0, P * S) write nothing
Returns q [T, H, D], k [T, K, D] (normalised, rotated), v [T, K, D] and the pool with layer `layer` written.

Numerics follow the Hugging Face models: the norm in float32, cast to the activations' dtype before the weight;
cos and sin cast to that dtype. The kernel keeps the products in float32 and rounds once at the end, where XLA
may round after each op, so bf16 results can differ from the reference by a rounding step.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels import is_power_of_two
from jaxllm.kernels.paged_attention import write_kv_pages


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis: float32 statistics, cast back to x's dtype before the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_tables(positions, *, theta: float, rotary_dim: int):
    """i32[...] positions -> (cos, sin) f32[..., rotary_dim / 2]."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """NeoX (rotate-half) RoPE over the first 2 * cos.shape[-1] dims of each head. x [..., N, D], cos/sin
    [..., R/2] (one row per position, shared by the N heads)."""
    half = cos.shape[-1]
    cos = jnp.concatenate([cos, cos], axis=-1)[..., None, :].astype(x.dtype)
    sin = jnp.concatenate([sin, sin], axis=-1)[..., None, :].astype(x.dtype)
    rot, passthrough = x[..., :2 * half], x[..., 2 * half:]
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, passthrough], axis=-1)


def qk_norm_rope(qkv, q_norm_weight, k_norm_weight, cos, sin, *, num_heads, num_kv_heads, eps):
    """[..., (H + 2K) * D] -> q [..., H, D], k [..., K, D] (normalised, rotated), v [..., K, D]."""
    head_dim = q_norm_weight.shape[0]
    heads = qkv.reshape(*qkv.shape[:-1], num_heads + 2 * num_kv_heads, head_dim)
    q, k, v = jnp.split(heads, [num_heads, num_heads + num_kv_heads], axis=-2)
    q = apply_rope(rms_norm(q, q_norm_weight, eps), cos, sin)
    k = apply_rope(rms_norm(k, k_norm_weight, eps), cos, sin)
    return q, k, v


def attention_prologue_reference(qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages, layer, pool_rows, *,
                                 num_heads, num_kv_heads, eps):
    q, k, v = qk_norm_rope(qkv, q_norm_weight, k_norm_weight, cos, sin, num_heads=num_heads,
                           num_kv_heads=num_kv_heads, eps=eps)
    k_pages, v_pages = write_kv_pages(k_pages, v_pages, layer, k, v, pool_rows)
    return q, k, v, k_pages, v_pages


# Tokens per program, at most: with one, each (token, head) program handled 128 values, and at 1024 tokens (24,576
# programs per layer) the kernel took 16.4 us per layer on the H200, 6.2 with 8 (engine run 17; no change at 32).
_TOKENS_PER_PROGRAM = 8


def _tokens_per_program(num_tokens):
    """The largest power of two <= _TOKENS_PER_PROGRAM that divides num_tokens (1 for odd counts)."""
    tokens = _TOKENS_PER_PROGRAM
    while num_tokens % tokens:
        tokens //= 2
    return tokens


def _prologue_kernel(layer_ref, qkv_ref, cos_ref, sin_ref, pool_rows_ref, q_norm_ref, k_norm_ref, _k_pages_in,
                     _v_pages_in, q_ref, k_ref, v_ref, k_pages_ref, v_pages_ref, *, num_heads, num_kv_heads, eps,
                     block_tokens):
    """Program (token block, head): the head's D values of block_tokens tokens -> its outputs and, for k and v, the
    pool rows of those tokens (a masked store: tokens whose row lies outside the pool write nothing there).

    The tokens of one call hold distinct pool rows, so no two lanes ever aim at one address. The pool refs are
    [L, K, P*S, D] views aliased to the inputs `_k_pages_in`, `_v_pages_in` (never read here).
    """
    block, head = pl.program_id(0), pl.program_id(1)
    tokens = pl.ds(block * block_tokens, block_tokens)
    head_dim, half = q_norm_ref.shape[0], cos_ref.shape[1]
    dtype = qkv_ref.dtype
    # the head dim in pieces: the two rotated halves, then what RoPE passes through (if any)
    pieces = [(0, half), (half, half)] + ([(2 * half, head_dim - 2 * half)] if head_dim > 2 * half else [])
    x = [qkv_ref[tokens, pl.ds(head * head_dim + start, width)].astype(jnp.float32)  # [tokens, width] each
         for start, width in pieces]
    is_q, is_v = head < num_heads, head >= num_heads + num_kv_heads
    is_k = ~is_q & ~is_v

    inv_rms = jax.lax.rsqrt(sum(jnp.sum(piece * piece, axis=1, keepdims=True) for piece in x) / head_dim + eps)
    normed = []
    for (start, width), piece in zip(pieces, x):
        weight = jnp.where(is_q, q_norm_ref[pl.ds(start, width)], k_norm_ref[pl.ds(start, width)])
        normed.append((piece * inv_rms).astype(dtype).astype(jnp.float32) * weight.astype(jnp.float32)[None, :])
    cos = cos_ref[tokens, pl.ds(0, half)].astype(dtype).astype(jnp.float32)
    sin = sin_ref[tokens, pl.ds(0, half)].astype(dtype).astype(jnp.float32)
    rotated = [normed[0] * cos - normed[1] * sin, normed[1] * cos + normed[0] * sin, *normed[2:]]

    def store(out_ref, head_index, values):
        for (start, width), piece in zip(pieces, values):
            out_ref[tokens, head_index, pl.ds(start, width)] = piece.astype(out_ref.dtype)

    pool_rows, layer = pool_rows_ref[tokens], layer_ref[0]  # i32[tokens]
    in_pool = (pool_rows >= 0) & (pool_rows < k_pages_ref.shape[2])
    # a dropped token's lanes are masked on the GPU; interpret mode writes every index, and drops only those past
    # the end (a negative one would wrap around, and one shared with a kept token could win over its write)
    target_rows = jnp.where(in_pool, pool_rows, k_pages_ref.shape[2])
    kv_head = jnp.where(is_k, head - num_heads, head - num_heads - num_kv_heads)

    @pl.when(is_q)
    def _():
        store(q_ref, head, rotated)

    def store_kv(is_kind, out_ref, pages_ref, values):  # a k or v head: its output, and the pool
        @pl.when(is_kind)
        def _():
            store(out_ref, kv_head, values)
            for (start, width), piece in zip(pieces, values):  # indexed by arrays: a row gather, with a mask
                columns = start + lax.iota(jnp.int32, width)
                pltriton.store(pages_ref.at[layer, kv_head, target_rows[:, None], columns[None, :]],
                               piece.astype(pages_ref.dtype), mask=jnp.broadcast_to(in_pool[:, None], piece.shape))

    store_kv(is_k, k_ref, k_pages_ref, rotated)
    store_kv(is_v, v_ref, v_pages_ref, x)


def _attention_prologue_pallas(qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages, layer, pool_rows, *,
                               num_heads, num_kv_heads, eps, interpret):
    num_tokens = qkv.shape[0]
    num_layers, _, num_pages, page_size, head_dim = k_pages.shape
    pool_shape = (num_layers, num_kv_heads, num_pages * page_size, head_dim)  # pages flattened to rows: free
    out_shape = [jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), qkv.dtype),
                 jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_dim), qkv.dtype),
                 jax.ShapeDtypeStruct((num_tokens, num_kv_heads, head_dim), qkv.dtype),
                 jax.ShapeDtypeStruct(pool_shape, k_pages.dtype), jax.ShapeDtypeStruct(pool_shape, v_pages.dtype)]
    raw = pl.BlockSpec(memory_space=pl.ANY)
    block_tokens = _tokens_per_program(num_tokens)
    kernel = functools.partial(_prologue_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, eps=float(eps),
                               block_tokens=block_tokens)
    q, k, v, k_pages_out, v_pages_out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_tokens // block_tokens, num_heads + 2 * num_kv_heads),
        in_specs=[raw] * 9,
        out_specs=[raw] * 5,
        input_output_aliases={7: 3, 8: 4},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="attention_prologue",
    )(jnp.asarray(layer, jnp.int32).reshape(1), qkv, cos.astype(jnp.float32), sin.astype(jnp.float32),
      pool_rows.astype(jnp.int32), q_norm_weight, k_norm_weight, k_pages.reshape(pool_shape),
      v_pages.reshape(pool_shape))
    return q, k, v, k_pages_out.reshape(k_pages.shape), v_pages_out.reshape(v_pages.shape)


def attention_prologue(qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages, layer, pool_rows, *,
                       num_heads, num_kv_heads, eps, impl="auto", interpret=False):
    """q, k, v of the projected tokens and the pool with their K/V written (layouts: module docstring).

    impl: "auto" (Pallas on GPU where the head pieces have power-of-2 widths, as Triton needs; the reference
    elsewhere), "pallas" or "reference".
    """
    head_dim, half = q_norm_weight.shape[0], cos.shape[-1]
    if qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv must be [T, (H + 2K) * D] = [T, {(num_heads + 2 * num_kv_heads) * head_dim}], "
                         f"got {qkv.shape}")
    if cos.shape != (qkv.shape[0], half) or sin.shape != cos.shape or pool_rows.shape != qkv.shape[:1]:
        raise ValueError(f"cos/sin must be [T, R/2] and pool_rows [T]; got {cos.shape}, {sin.shape}, "
                         f"{pool_rows.shape} for T = {qkv.shape[0]}")
    kernel_fits = is_power_of_two(half) and (head_dim == 2 * half or is_power_of_two(head_dim - 2 * half))
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and kernel_fits else "reference"
    kwargs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
    args = (qkv, q_norm_weight, k_norm_weight, cos, sin, k_pages, v_pages, layer, pool_rows)
    if impl == "reference":
        return attention_prologue_reference(*args, **kwargs)
    if impl == "pallas":
        if not kernel_fits:
            raise ValueError(f"the Pallas kernel needs power-of-2 head pieces: rotary half {half}, "
                             f"passthrough {head_dim - 2 * half}")
        return _attention_prologue_pallas(*args, interpret=interpret, **kwargs)
    raise ValueError(f"unknown attention prologue impl {impl!r}; use 'auto', 'pallas' or 'reference'")
