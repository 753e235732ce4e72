"""The batch-invariant RMSNorm: the Pallas kernel (interpret mode on the CPU) against a float64 norm over a sweep of
shapes, and each row's bits the same at every row count, for the kernel and for the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels.rms_norm import invariant_rms_norm
from tests.cuda_lowering import lowered_for_h100

INTERPRET = jax.default_backend() != "gpu"
PALLAS = dict(impl="pallas", interpret=INTERPRET)
EPS = 1e-6


def _operands(rows, hidden, dtype, seed):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = (3 * jax.random.normal(kx, (rows, hidden), jnp.float32)).astype(dtype)
    weight = jax.random.normal(kw, (hidden,), jnp.float32).astype(dtype)
    return x, weight


@pytest.mark.parametrize("impl", ["pallas", "reference"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape", [(1, 64), (37, 256), (130, 2048)], ids=lambda s: "x".join(map(str, s)))
def test_matches_float64_norm(shape, dtype, impl):
    x, weight = _operands(*shape, dtype, seed=sum(shape))
    kwargs = PALLAS if impl == "pallas" else dict(impl="reference")
    out = np.asarray(jax.jit(lambda x, w: invariant_rms_norm(x, w, EPS, **kwargs))(x, weight), np.float64)
    xd = np.asarray(x, np.float64)
    exact = xd / np.sqrt((xd ** 2).mean(-1, keepdims=True) + EPS) * np.asarray(weight, np.float64)
    assert out.shape == exact.shape and np.isfinite(out).all()
    # bf16: the normalised row and its product with the weight each round once
    rounding = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -22
    np.testing.assert_allclose(out, exact, rtol=3 * rounding, atol=3 * rounding * np.abs(exact).max())


@pytest.mark.parametrize("impl", ["pallas", "reference"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(impl):
    """The first rows alone and beside up to 4095 others (XLA's norm on this CPU gives 64 rows other bits among
    4096: tests/models/test_layers.py)."""
    x, weight = _operands(4096, 64, "bfloat16", seed=3)
    kwargs = PALLAS if impl == "pallas" else dict(impl="reference")
    norm = jax.jit(lambda x, w: invariant_rms_norm(x, w, EPS, **kwargs))
    alone = np.asarray(norm(x[:8], weight)).view(np.uint16)
    for rows in (9, 64, 65, 300) + ((4096,) if impl == "reference" else ()):  # interpret mode: a program per row
        np.testing.assert_array_equal(np.asarray(norm(x[:rows], weight))[:8].view(np.uint16), alone,
                                      err_msg=f"{rows} rows")


def test_leading_axes_are_kept_and_bad_shapes_refused():
    x, weight = _operands(6, 64, "bfloat16", seed=1)
    out = invariant_rms_norm(x.reshape(2, 3, 64), weight, EPS, **PALLAS)
    np.testing.assert_array_equal(np.asarray(out).reshape(6, 64), np.asarray(invariant_rms_norm(x, weight, EPS,
                                                                                                  **PALLAS)))
    with pytest.raises(ValueError, match="power-of-two"):
        invariant_rms_norm(x[:, :48], weight[:48], EPS, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="weight must be"):
        invariant_rms_norm(x, weight[:32], EPS)


@pytest.mark.skipif(not INTERPRET, reason="the GPU compiles the kernel for real")
def test_kernel_lowers_to_triton_for_cuda():
    spec = jax.ShapeDtypeStruct
    norm = jax.jit(lambda x, w: invariant_rms_norm(x, w, EPS, impl="pallas"))
    hlo = lowered_for_h100(norm, spec((1024, 2048), jnp.bfloat16), spec((2048,), jnp.bfloat16))
    assert hlo.count("__gpu$xla.gpu.triton") == 1
