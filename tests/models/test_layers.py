"""The float32 router product (three bf16 pieces of the weight on the tensor cores, exact products), and the
projections that apply their input's RMSNorm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.models.layers import Linear, RMSNorm, router_matmul
from jaxllm.quantization import bf16_pieces, cut_router_weight


def test_bf16_pieces_sum_exactly_to_the_float32_weight():
    w = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32) * 0.02
    # extremes of the exponent range (down to 2^-103, the smallest whose pieces are all normal), all 24 bits used
    w = w.at[0, :6].set(jnp.array([1e-30, -3.4e38, 1.0000001, -7.123456e-5, -(2.0 ** -103) * 1.9999999, 0.0]))
    # under jit too: models cut their random router weights in traced init
    for cut in (cut_router_weight, jax.jit(cut_router_weight)):
        pieces = cut(w)
        assert pieces.dtype == jnp.bfloat16 and pieces.shape == (64, 3 * 48)
        hi, mid, lo = (np.asarray(p, np.float32) for p in np.split(np.asarray(pieces), 3, axis=-1))
        np.testing.assert_array_equal(hi + mid + lo, np.asarray(w))
        # each piece is at most 2^-8 of the one before: no bits shared, none wasted
        assert (np.abs(mid) <= np.abs(hi) * 2.0 ** -7).all() and (np.abs(lo) <= np.abs(mid) * 2.0 ** -7).all()
    assert all(p.dtype == jnp.bfloat16 for p in bf16_pieces(w))


@pytest.mark.parametrize("tokens", [1, 32, 300])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_router_product_has_float32_accuracy(tokens, x_dtype):
    """Against a float64 product: within float32 rounding (~1e-6 of the largest logit here); two pieces instead of
    three would miss by ~1e-5, bf16 weights by ~2e-3."""
    key = jax.random.key(tokens)
    x = jax.random.normal(key, (tokens, 2048), jnp.float32).astype(jnp.bfloat16).astype(x_dtype)
    w = jax.random.normal(jax.random.fold_in(key, 1), (2048, 256), jnp.float32) * 0.02
    pieces = cut_router_weight(w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # eagerly too: under jit XLA:CPU may keep excess precision and hide a product rounded to bf16
    for run in (router_matmul, jax.jit(router_matmul)):
        got = np.asarray(run(x, pieces))
        assert got.dtype == np.float32
        assert np.max(np.abs(got - want)) < 3e-6 * np.max(np.abs(want))


def test_router_product_takes_bf16_or_float32_activations():
    with pytest.raises(ValueError, match="bf16 or float32 x"):
        router_matmul(jnp.ones((2, 4), jnp.float16), cut_router_weight(jnp.ones((4, 3), jnp.float32)))


@pytest.mark.parametrize("rows", [32, 300])  # the row scale after the GEMM (few rows) and the norm before it
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_projection_of_the_normed_input_matches_float64(rows, dtype):
    """Linear(x, norm) against float64 rms_norm(x) @ w, rows of very different scales and a non-unit norm weight
    (bf16: ~3e-3 of the largest output on both paths; a dropped row scale or norm weight misses by far more)."""
    key = jax.random.key(rows)
    row_scales = 10.0 ** jax.random.uniform(jax.random.fold_in(key, 1), (rows, 1), minval=-2, maxval=2)
    x = (jax.random.normal(key, (rows, 256)) * row_scales).astype(dtype)
    linear = Linear(256, 192, dtype=dtype, rngs=nnx.Rngs(rows))
    norm = RMSNorm(256, 1e-6, dtype=dtype)
    norm.weight[...] = (1 + jax.random.normal(jax.random.fold_in(key, 2), (256,))).astype(dtype)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, linear.kernel[...], norm.weight[...]))
    want = (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + 1e-6) * g64) @ w64
    for run in (linear, jax.jit(linear)):
        got = run(x, norm)
        assert got.shape == (rows, 192) and got.dtype == dtype
        error = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert error < (1e-5 if dtype == jnp.float32 else 1e-2), error


def test_batch_invariant_norm_gives_a_row_the_same_bits_beside_any_rows():
    """A prompt's rows normalised alone (64 rows) and among 4096: XLA's CPU code rounds ~25% of their elements
    otherwise at 4096 rows, so without the mode this fails; in it the norm is `invariant_rms_norm`."""
    x = jax.random.normal(jax.random.key(0), (4096, 64), jnp.float32).astype(jnp.bfloat16)
    norm = RMSNorm(64, 1e-6, dtype=jnp.bfloat16)
    norm.weight[...] = jax.random.normal(jax.random.key(1), (64,)).astype(jnp.bfloat16)
    norm.batch_invariant = True
    apply = nnx.jit(lambda module, x: module(x))
    alone, among = np.asarray(apply(norm, x[:64])), np.asarray(apply(norm, x))[:64]
    np.testing.assert_array_equal(alone.view(np.uint16), among.view(np.uint16))
    rows = np.asarray(x[:64], np.float64)
    want = rows / np.sqrt((rows ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(norm.weight[...], np.float64)
    np.testing.assert_allclose(np.asarray(alone, np.float64), want, rtol=2e-2, atol=2e-2)  # still the norm
