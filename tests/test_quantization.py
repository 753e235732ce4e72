"""Load-time weight quantization: exact per-element error bounds, the pytree type and the layer error it causes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.quantization import FP8_MAX, QuantizedWeight, dequantize, quantize, quantize_rows

FP8_MIN_NORMAL = 2.0**-6  # e4m3: 3 mantissa bits, smallest normal 2^-6, subnormal spacing 2^-9


def _random_weight(seed, shape=(3, 96, 40)):
    """Random weights with a wide spread of column magnitudes and one all-zero output channel."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=shape) * np.exp(rng.uniform(-4, 2, size=shape[:-2] + (1, shape[-1])))
    w[..., 7] = 0.0
    return w.astype(np.float32)


def test_int8_error_is_at_most_half_a_step_per_element():
    w = _random_weight(0)
    q = quantize(jnp.asarray(w), "int8")
    values, scales = np.asarray(q.values), np.asarray(q.scales)
    assert q.values.dtype == jnp.int8 and values.shape == w.shape and scales.shape == (3, 40)
    assert np.abs(values).max() <= 127
    # each channel's largest weight maps to +-127 exactly
    np.testing.assert_array_equal(np.abs(values).max(axis=1)[:, np.arange(40) != 7], 127)
    error = np.abs(np.asarray(dequantize(q)) - w)
    assert (error <= scales[:, None, :] * (0.5 + 1e-5)).all()
    assert (values[..., 7] == 0).all() and np.isfinite(scales).all()


def test_fp8_error_is_within_half_an_e4m3_ulp_per_element():
    w = _random_weight(1)
    q = quantize(jnp.asarray(w), "fp8")
    scales = np.asarray(q.scales)
    assert q.values.dtype == jnp.float8_e4m3fn and scales.shape == (3, 40)
    scaled = np.abs(w) / scales[:, None, :]  # where each weight lands on the e4m3 grid
    assert np.asarray(q.values, np.float32).max() <= FP8_MAX and np.isfinite(np.asarray(q.values, np.float32)).all()
    error = np.abs(np.asarray(dequantize(q)) - w) / scales[:, None, :]
    normal = scaled >= FP8_MIN_NORMAL
    assert (error[normal] <= 2.0**-4 * scaled[normal] * (1 + 1e-5)).all()  # 3 mantissa bits: half ulp = 2^-4
    assert (error[~normal] <= 2.0**-10 * (1 + 1e-5)).all()  # subnormal spacing 2^-9
    np.testing.assert_array_equal(np.asarray(dequantize(q))[..., 7], 0.0)


def test_quantize_rows_bounds_each_row_by_its_own_scale():
    a = _random_weight(2, shape=(50, 64)).T.copy()  # [64, 50]: rows of very different magnitude, row 7 all zero
    values, scales = quantize_rows(jnp.asarray(a))
    assert values.dtype == jnp.float8_e4m3fn and scales.shape == (64,)
    amax = np.abs(a).max(axis=1)
    np.testing.assert_allclose(np.asarray(scales), np.where(amax > 0, amax / FP8_MAX, 1.0), rtol=1e-6)
    error = np.abs(np.asarray(values, np.float32) * np.asarray(scales)[:, None] - a)
    assert (error <= (2.0**-4 * np.abs(a) + 2.0**-10 * np.asarray(scales)[:, None]) * (1 + 1e-5)).all()


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="int4"):
        quantize(jnp.ones((4, 4)), "int4")


def test_quantized_weight_is_a_pytree_that_crosses_jit():
    q = quantize(jnp.asarray(_random_weight(3)), "int8")
    leaves = jax.tree.leaves(q)
    assert len(leaves) == 2 and leaves[0].dtype == jnp.int8
    doubled = jax.jit(lambda w: QuantizedWeight(w.values, w.scales * 2))(q)
    assert isinstance(doubled, QuantizedWeight) and doubled.shape == q.shape
    np.testing.assert_array_equal(np.asarray(doubled.scales), 2 * np.asarray(q.scales))


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_channel_major_stores_the_transpose_of_the_same_weight(mode):
    w = jnp.asarray(_random_weight(8, shape=(3, 48, 20)))
    plain, channel_major = quantize(w, mode), quantize(w, mode, channel_major=True)
    assert channel_major.values.shape == (3, 20, 48) and channel_major.shape == plain.shape == (3, 48, 20)
    np.testing.assert_array_equal(np.asarray(channel_major.values, np.float32),
                                  np.swapaxes(np.asarray(plain.values, np.float32), 1, 2))
    np.testing.assert_array_equal(np.asarray(dequantize(channel_major)), np.asarray(dequantize(plain)))
    # the layout is static pytree metadata: it survives jit and is part of the tree structure
    doubled = jax.jit(lambda q: QuantizedWeight(q.values, q.scales * 2, q.channel_major))(channel_major)
    assert doubled.channel_major and jax.tree.structure(doubled) != jax.tree.structure(plain)


def test_layer_error_of_quantized_weights_is_small_and_ordered():
    """End to end on a SwiGLU layer: int8 (7-bit mantissa-equivalent) beats fp8 e4m3 (3-bit mantissa)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(64, 256)), jnp.float32)
    w_up = jnp.asarray(rng.normal(size=(256, 128)) / 16, jnp.float32)
    w_down = jnp.asarray(rng.normal(size=(128, 256)) / 11, jnp.float32)

    def layer(up, down):  # a quantized weight as the model's experts see it: up-cast and scaled
        up, down = dequantize(up), dequantize(down)
        return jnp.dot(jax.nn.silu(jnp.dot(x, up, precision="highest")), down, precision="highest")

    exact = np.asarray(layer(w_up, w_down))
    error = {mode: np.linalg.norm(np.asarray(layer(quantize(w_up, mode), quantize(w_down, mode))) - exact)
             / np.linalg.norm(exact) for mode in ("int8", "fp8")}
    # per-element quantization noise: int8 ~ step/sqrt(12) ~ 0.8% of a channel's max, e4m3 ~ 2-3% relative
    assert error["int8"] < 0.02 and error["fp8"] < 0.06 and error["int8"] < error["fp8"]
