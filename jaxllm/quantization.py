"""Load-time weight quantization: int8 and fp8 (e4m3) with per-output-channel scales.

A weight w[..., K, N] (K is contracted, N indexes output channels) becomes values[..., K, N] (int8 or
float8_e4m3fn) and scales f32[..., N] with w ~= values * scales[..., None, :]. A per-output-channel scale is
constant along K, so it factors out of the reduction: x @ w ~= (x @ values) * scales, and kernels apply it once,
after accumulating.

  int8  symmetric: scale = max_K |w| / 127, values = round(w / scale)     ->  |w - deq| <= scale / 2
  fp8   scale = max_K |w| / 448 (e4m3's largest finite), values = round-to-nearest-even cast of w / scale
                                                                          ->  |w - deq| <= 2^-4 |w| (normals)
`quantize_rows` does the same per row of an activation matrix, for the fp8 x fp8 path.

`channel_major=True` stores the values as [..., N, K] instead: each output channel's K values contiguous, the
layout the MoE kernels read 1-byte tiles fastest from (kernels/moe.py); the weight's logical shape stays [..., K, N].

`cut_router_weight` goes the other way, losslessly: a float32 weight as three bf16 pieces that sum to it, so a bf16
GEMM with float32 accumulation multiplies by it to float32 accuracy (LLaDA2's router, models/layers.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

QUANTIZATION_MODES = ("int8", "fp8")
INT8_MAX = 127.0
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


@functools.partial(jax.tree_util.register_dataclass, data_fields=["values", "scales"],
                   meta_fields=["channel_major"])
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A quantized [..., K, N] weight; accepted wherever the kernels take a plain weight array."""

    values: jax.Array  # int8 | float8_e4m3fn [..., K, N], or [..., N, K] if channel_major
    scales: jax.Array  # f32[..., N]
    channel_major: bool = False

    @property
    def shape(self):
        """The logical [..., K, N] shape, whatever the storage layout."""
        shape = self.values.shape
        return (*shape[:-2], shape[-1], shape[-2]) if self.channel_major else shape

    def kn_values(self):
        """The values as [..., K, N] (a transpose for channel-major storage)."""
        return jnp.swapaxes(self.values, -1, -2) if self.channel_major else self.values

    @property
    def ndim(self):
        return self.values.ndim


def _quantize_along(a, axis, mode):
    """Quantize `a` with one scale per slice along `axis` (the reduced axis); returns (values, f32 scales)."""
    a = a.astype(jnp.float32)
    format_max = INT8_MAX if mode == "int8" else FP8_MAX
    amax = jnp.abs(a).max(axis=axis, keepdims=True)
    scales = jnp.where(amax > 0, amax / format_max, 1.0)  # an all-zero slice keeps scale 1 and values 0
    # a / scale can land a rounding error above format_max; clip so e4m3 (which has no inf) never turns NaN
    scaled = jnp.clip(a / scales, -format_max, format_max)
    values = jnp.round(scaled).astype(jnp.int8) if mode == "int8" else scaled.astype(jnp.float8_e4m3fn)
    return values, jnp.squeeze(scales, axis)


def quantize(w, mode, *, channel_major=False):
    """[..., K, N] float weight -> QuantizedWeight with one f32 scale per output channel (per [..., N])."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization mode must be one of {QUANTIZATION_MODES}, got {mode!r}")
    if w.ndim < 2:
        raise ValueError(f"quantize needs a [..., K, N] weight, got shape {w.shape}")
    values, scales = _quantize_along(w, -2, mode)
    if channel_major:
        values = jnp.swapaxes(values, -1, -2)
    return QuantizedWeight(values=values, scales=scales, channel_major=channel_major)


def dequantize(weight, dtype=jnp.float32):
    """QuantizedWeight (or a plain array, passed through) -> [..., K, N] array of `dtype`."""
    if not isinstance(weight, QuantizedWeight):
        return weight.astype(dtype)
    return (weight.kn_values().astype(jnp.float32) * jnp.expand_dims(weight.scales, -2)).astype(dtype)


def quantize_rows(a):
    """[R, D] activations -> (float8_e4m3fn [R, D], f32[R] scales), one scale per row (per token)."""
    return _quantize_along(a, 1, "fp8")


def bf16_pieces(w):
    """float32 w -> three bf16 arrays whose float32 sum is w: each piece is the top 8 significant bits of what the
    earlier ones left (bit masks, not rounding conversions, which XLA may fold away). Exact for |w| >= 2^-103;
    below, the last piece would be subnormal and may flush to zero (an error under 2^-126); -0.0 comes back +0.0."""
    pieces, rest = [], w.astype(jnp.float32)
    for _ in range(3):
        top = lax.bitcast_convert_type(lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000),
                                       jnp.float32)
        pieces.append(top.astype(jnp.bfloat16))  # exact: top holds 8 significant bits
        rest = rest - top  # exact: the bits below top's
    return pieces


def cut_router_weight(w):
    """float32 w [..., N] -> bf16 [..., 3N]: its bf16_pieces hi | mid | lo along the last axis, the operand of
    `router_matmul`."""
    return jnp.concatenate(bf16_pieces(w), axis=-1)
