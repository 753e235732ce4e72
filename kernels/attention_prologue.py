"""Between the QKV projection and attention: per-head RMSNorm of q and k and NeoX RoPE.

The pure-jnp functions are the model's XLA path and the reference; `rotated_head_tile` is the same arithmetic
inside a Pallas-Triton kernel, where the attention kernel (`paged_attention_from_qkv`) applies it to the heads it
reads straight from the projection. In XLA this step was about seven small kernels per layer (~14 us at 32 tokens on
the H200), and as a kernel of its own 3.6 us per SDAR layer at batch 1 (engine run 20), where its bytes take well
under a microsecond.

Layouts (T tokens, H query heads, K kv heads, D head dim, R = rotary_dim):
  qkv                  [T, (H + 2K) * D]  the projection's output: q heads, then k heads, then v heads
  q_norm_weight, k_norm_weight  [D]
  cos, sin             f32[T, R/2]        RoPE tables of each token's position (`rope_tables`)

Numerics follow the Hugging Face models: the norm in float32, cast to the activations' dtype before the weight;
cos and sin cast to that dtype. The kernel keeps the products in float32 and rounds once at the end, where XLA
may round after each op, so bf16 results can differ from the reference by a rounding step.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton


def rms_row_scale(xf, eps):
    """1 / rms over the last axis of float32 xf, keeping that axis (size 1)."""
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis: float32 statistics, cast back to x's dtype before the weight."""
    xf = x.astype(jnp.float32)
    return weight * (xf * rms_row_scale(xf, eps)).astype(x.dtype)


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


def rope_rows(cos, sin, head_dim, dtype):
    """f32[..., R/2] tables -> (cos, signed sin) [..., D] in `dtype` for `rotated_head_tile`: cos over both rotated
    halves and 1 past R; -sin over the first half, sin over the second, 0 past R (the casts the reference makes)."""
    passthrough = head_dim - 2 * cos.shape[-1]
    ones = jnp.ones((*cos.shape[:-1], passthrough), jnp.float32)
    cos_row = jnp.concatenate([cos, cos, ones], axis=-1).astype(dtype)
    sin_row = jnp.concatenate([-sin, sin, jnp.zeros_like(ones)], axis=-1).astype(dtype)
    return cos_row, sin_row


def rotated_head_tile(qkv_ref, tokens, head_start, norm_ref, cos_ref, sin_ref, *, rotary_half, eps, mask=None):
    """In a Pallas-Triton kernel: f32 [N, D] rows `tokens` i32[N] of the heads starting at columns `head_start`
    i32[N] of qkv_ref [T, (H + 2K) * D], RMS-normalised with norm_ref's weight [D] and rotated by RoPE with the
    token's `rope_rows` (cos_ref, sin_ref [T, D]), rounded as `qk_norm_rope` rounds (the norm cast to qkv's dtype
    before the weight) and left in float32 (the caller rounds once). Rows where `mask` [N, 1] is False read zeros.

    Rotate-half without slicing the tile: each dim's partner (d + R/2 in the first half, d - R/2 in the second,
    itself past R, where the signed sin is 0) is a second gather of the same rows: out = normed * cos + partner *
    signed sin.
    """
    head_dim, dtype = norm_ref.shape[0], qkv_ref.dtype
    dims = lax.iota(jnp.int32, head_dim)
    partner = jnp.where(dims < rotary_half, dims + rotary_half, jnp.where(dims < 2 * rotary_half, dims - rotary_half,
                                                                          dims))
    other = None if mask is None else 0.0

    def load(columns):
        return pltriton.load(qkv_ref.at[tokens[:, None], head_start[:, None] + columns[None, :]], mask=mask,
                             other=other).astype(jnp.float32)

    x, x_partner = load(dims), load(partner)
    inv_rms = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / head_dim + eps)

    def normed(values, columns):
        weight = pltriton.load(norm_ref.at[columns]).astype(jnp.float32)
        return (values * inv_rms).astype(dtype).astype(jnp.float32) * weight[None, :]

    def table(ref):
        return pltriton.load(ref.at[tokens[:, None], dims[None, :]]).astype(jnp.float32)

    return normed(x, dims) * table(cos_ref) + normed(x_partner, partner) * table(sin_ref)
