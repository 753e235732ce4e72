"""The float32 router product: three bf16 pieces of the weight on the tensor cores, exact products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models.layers import bf16_pieces, float32_matmul


def test_bf16_pieces_sum_exactly_to_the_float32_weight():
    w = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32) * 0.02
    # extremes of the exponent range (down to 2^-103, the smallest whose pieces are all normal), all 24 bits used
    w = w.at[0, :6].set(jnp.array([1e-30, -3.4e38, 1.0000001, -7.123456e-5, -(2.0 ** -103) * 1.9999999, 0.0]))
    pieces = bf16_pieces(w)
    assert all(p.dtype == jnp.bfloat16 for p in pieces)
    total = sum(p.astype(jnp.float32) for p in pieces)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(w))
    # each piece is at most 2^-8 of the one before: no bits shared, none wasted
    hi, mid, lo = (np.abs(np.asarray(p, np.float32)) for p in pieces)
    assert (mid <= hi * 2.0 ** -7).all() and (lo <= mid * 2.0 ** -7).all()


@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_pieces_product_has_float32_accuracy(tokens):
    """Against a float64 product: each path within float32 rounding (~1e-6 of the largest logit here);
    two pieces instead of three would miss by ~1e-5, bf16 weights by ~2e-3."""
    key = jax.random.key(tokens)
    x = jax.random.normal(key, (tokens, 2048), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.fold_in(key, 1), (2048, 256), jnp.float32) * 0.02
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for impl in ("pieces", "float32"):
        # eagerly too: under jit XLA:CPU may keep excess precision and hide a product rounded to bf16
        for run in (float32_matmul, jax.jit(float32_matmul, static_argnums=2)):
            got = np.asarray(run(x, w, impl))
            assert got.dtype == np.float32
            assert np.max(np.abs(got - want)) < 3e-6 * np.max(np.abs(want)), impl


def test_pieces_need_bf16_activations():
    with pytest.raises(ValueError, match="bf16 x"):
        float32_matmul(jnp.ones((2, 4), jnp.float32), jnp.ones((4, 3), jnp.float32), impl="pieces")
