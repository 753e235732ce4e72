"""The batch-invariant GEMM: the Pallas kernel (interpret mode on the CPU) against a float64 product over a sweep of
shapes, and each row's bits the same at every row count, for the kernel and for the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import matmul
from jaxllm.kernels.matmul import BLOCK_M, invariant_matmul
from tests.cuda_lowering import lowered_for_h100

INTERPRET = jax.default_backend() != "gpu"
PALLAS = dict(impl="pallas", interpret=INTERPRET)

# (rows, K, N): rows below, at and past a tile and not a multiple of one; K and N whose tiles narrow (48 -> 16, 80)
SHAPES = [(1, 64, 128), (37, 256, 384), (BLOCK_M, 128, 80), (130, 48, 256), (200, 512, 1024)]


def _operands(rows, depth, width, dtype, seed):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (rows, depth), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (depth, width), jnp.float32) / np.sqrt(depth)).astype(dtype)
    return x, w


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pallas_matches_float64_product(shape, dtype):
    x, w = _operands(*shape, dtype, seed=sum(shape))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for out_dtype in (None, jnp.float32):
        product = jax.jit(lambda x, w, out_dtype=out_dtype: invariant_matmul(x, w, out_dtype=out_dtype, **PALLAS))
        out = np.asarray(product(x, w), np.float64)
        assert out.shape == exact.shape and np.isfinite(out).all()
        # one rounding to the output's dtype after a float32 sum
        rounding = 2.0 ** -8 if (out_dtype is None and dtype == "bfloat16") else 2.0 ** -20
        np.testing.assert_allclose(out, exact, atol=4 * rounding * np.abs(exact).max(), rtol=2 * rounding)


def test_leading_axes_are_kept():
    x, w = _operands(2 * 3, 64, 128, "bfloat16", seed=1)
    out = invariant_matmul(x.reshape(2, 3, 64), w, **PALLAS)
    assert out.shape == (2, 3, 128)
    np.testing.assert_array_equal(np.asarray(out).reshape(6, 128), np.asarray(invariant_matmul(x, w, **PALLAS)))


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(impl, dtype):
    """The first rows of a product alone and beside up to 255 others: the same bits (XLA's bf16-out product on this
    CPU gives the first of 256 x [256, 8192] rows other bits at 2 to 48 rows than at 64 or more)."""
    x, w = _operands(256, 256, 8192 if impl == "reference" else 384, dtype, seed=7)
    kwargs = PALLAS if impl == "pallas" else dict(impl="reference")
    product = jax.jit(lambda x, w: invariant_matmul(x, w, **kwargs))
    alone = np.asarray(product(x[:8], w))
    for rows in (9, 48, 64, 65, 256):
        np.testing.assert_array_equal(np.asarray(product(x[:rows], w))[:8], alone, err_msg=f"{rows} rows")


def test_a_rows_bits_do_not_depend_on_whether_its_splits_of_k_run_as_programs_of_their_own():
    """w [8192, 512] in bf16: 4 column tiles, K in 8 splits. At one row tile each split is a program and XLA adds
    the partials; from two (their partials would cost more than a quarter of w's bytes) one program adds a tile's 8
    splits. A row's bits stay the same across the switch."""
    splits = matmul._num_splits(8192, 512, *matmul._tiles(8192, 512), itemsize=2)
    assert splits == 8 and [matmul._partials_are_cheap(splits, rows, 8192, 2) for rows in (64, 128)] == [True, False]
    x, w = _operands(128, 8192, 512, "bfloat16", seed=11)
    for out_dtype in (None, jnp.float32):
        product = jax.jit(lambda x, w, out_dtype=out_dtype: invariant_matmul(x, w, out_dtype=out_dtype, **PALLAS))
        alone = np.asarray(product(x[:8], w))
        for rows in (BLOCK_M, BLOCK_M + 1, 128):
            np.testing.assert_array_equal(np.asarray(product(x[:rows], w))[:8], alone, err_msg=f"{rows} rows")


def test_shapes_it_cannot_tile_are_refused():
    x, w = _operands(4, 40, 128, "bfloat16", seed=2)
    with pytest.raises(ValueError, match="divisible by 16"):
        invariant_matmul(x, w, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="does not match"):
        invariant_matmul(x, w[:32], impl="reference")


@pytest.mark.skipif(not INTERPRET, reason="the GPU compiles the kernel for real")
def test_kernel_lowers_to_triton_for_cuda():
    """Pallas -> Triton IR on the CPU at an LM head's shape (a vocabulary that is not a power of two) and at SDAR's
    o_proj for one row tile (its 4 splits of K as programs of their own)."""
    spec = jax.ShapeDtypeStruct
    product = jax.jit(lambda x, w: invariant_matmul(x, w, impl="pallas"))
    for rows, depth, width in [(1000, 2048, 157184), (32, 4096, 4096)]:
        hlo = lowered_for_h100(product, spec((rows, depth), jnp.bfloat16), spec((depth, width), jnp.bfloat16))
        assert hlo.count("__gpu$xla.gpu.triton") == 1
