"""The residual add with the next norm's row scale, kernel (interpret mode) against a float64 reference over a sweep
of shapes, dtypes and splits; and split_k_matmul against a plain product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.residual_norm import residual_add_rms, split_k_matmul

EPS = 1e-6


def inputs(rows, width, num_splits, dtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0, 1, (rows, width)), dtype)
    partials = jnp.asarray(rng.normal(0, 0.5, (num_splits, rows, width)), jnp.float32)
    return x, partials


@pytest.mark.parametrize("rows,width,num_splits,chunk", [
    (1, 64, 1, 64), (5, 64, 2, 16), (32, 256, 4, 64), (64, 4096, 4, 1024), (3, 512, 8, 512)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_the_new_row_and_its_scale_match_float64(rows, width, num_splits, chunk, dtype, impl):
    x, partials = inputs(rows, width, num_splits, dtype, seed=rows * width + num_splits)
    got, scale = jax.jit(lambda x, p: residual_add_rms(x, p, EPS, impl=impl, chunk=chunk, interpret=True))(
        x, partials)
    added = np.asarray(partials, np.float64).sum(axis=0)
    want = np.asarray(x, np.float64) + added
    assert got.dtype == x.dtype and got.shape == x.shape and scale.shape == (rows, 1)
    # the sum of the splits rounds to x's dtype before the add, and the add rounds again
    ulp = float(jnp.finfo(dtype).eps)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=4 * ulp * np.abs(want).max())
    # the scale is the stored row's, up to that row's rounding (XLA may fuse the reference's add and square
    # without rounding the sum to bf16 in between)
    got64 = np.asarray(got, np.float64)
    want_scale = 1 / np.sqrt((got64 ** 2).mean(axis=1, keepdims=True) + EPS)
    np.testing.assert_allclose(np.asarray(scale, np.float64), want_scale, rtol=max(2e-6, ulp))


def test_the_kernel_stores_the_references_row_bits():
    x, partials = inputs(32, 256, 4, jnp.bfloat16, seed=3)
    kernel, _ = residual_add_rms(x, partials, EPS, impl="pallas", chunk=64, interpret=True)
    reference, _ = residual_add_rms(x, partials, EPS, impl="reference")
    assert np.array_equal(np.asarray(kernel.view(jnp.uint16)), np.asarray(reference.view(jnp.uint16)))


def test_auto_takes_the_reference_off_the_gpu_and_for_a_width_not_a_power_of_two():
    x, partials = inputs(4, 96, 2, jnp.float32, seed=5)
    got, scale = residual_add_rms(x, partials, EPS)
    want, want_scale = residual_add_rms(x, partials, EPS, impl="reference")
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(scale, want_scale)
    with pytest.raises(ValueError, match="powers of two"):
        residual_add_rms(x, partials, EPS, impl="pallas", interpret=True)


@pytest.mark.parametrize("num_splits", [1, 3, 4])
def test_split_k_partials_sum_to_the_product(num_splits):
    rng = np.random.default_rng(num_splits)
    x = jnp.asarray(rng.normal(0, 1, (7, 96)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 1, (96, 40)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        partials = split_k_matmul(x, w, num_splits)
    assert partials.shape == (num_splits, 7, 40) and partials.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(partials, np.float64).sum(axis=0),
                               np.asarray(x, np.float64) @ np.asarray(w, np.float64), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="equal slices"):
        split_k_matmul(x, w, 5)
