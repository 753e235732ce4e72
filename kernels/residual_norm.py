"""The residual add after a split-K projection, and the next RMSNorm's row scale, in one pass over the row.

At a few rows (one request's 32-token block) XLA splits K in the o_proj and down GEMMs and sums the partials in the
residual add's kernel, but does not fuse the next norm's row reduction into that kernel: an add (2.28 us) and a row
reduction (1.56 us) per residual at 32 rows on the H200 (BENCHMARKS.md, run 24). Here the split is explicit
(`split_k_matmul`: a batched GEMM over slices of K) and one kernel sums the partials, adds the residual and
reduces the new row's squares.

reference  jnp: the partials added in split order, rounded to x's dtype, added to x; the scale from the float32
           sum's squares.
kernel     one program per row, `chunk` columns per step: each step loads every split's partials for its columns,
           adds them in split order, adds x, stores the new row and adds its squares to a float32 vector; the
           vector is summed once at the end. The new row has the reference's bits; the scale differs by float32
           rounding in the order of the squares' sum.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels import is_power_of_two
from jaxllm.kernels.attention_prologue import rms_row_scale


def split_k_matmul(x, w, num_splits: int):
    """x [M, K] @ w [K, N] as float32 partials [S, M, N] over S equal slices of K (the slices of w are free views:
    row-major [K, N] is [S, K / S, N])."""
    rows, depth = x.shape
    if depth % num_splits:
        raise ValueError(f"K = {depth} does not split into {num_splits} equal slices")
    slices = x.reshape(rows, num_splits, depth // num_splits)
    return jnp.einsum("msk,skn->smn", slices, w.astype(x.dtype).reshape(num_splits, depth // num_splits, -1),
                      preferred_element_type=jnp.float32)


def _sum_of_splits(partials):
    return functools.reduce(jnp.add, [partials[s] for s in range(len(partials))])


def residual_add_rms_reference(x, partials, eps):
    """x [M, N], float32 partials [S, M, N] -> (x + their sum [M, N] in x's dtype, f32[M, 1] 1 / rms of it)."""
    out = x + _sum_of_splits(partials).astype(x.dtype)
    return out, rms_row_scale(out.astype(jnp.float32), eps)


def _residual_add_rms_kernel(x_ref, partials_ref, out_ref, scale_ref, *, num_splits, chunk, eps):
    row = pl.program_id(0)
    rows, width = x_ref.shape

    def step(i, squares):
        cols = pl.ds(pl.multiple_of(i * chunk, chunk), chunk)
        added = _sum_of_splits([pltriton.load(partials_ref.at[s * rows + row, cols]) for s in range(num_splits)])
        new = pltriton.load(x_ref.at[row, cols]) + added.astype(x_ref.dtype)
        pltriton.store(out_ref.at[row, cols], new)
        new = new.astype(jnp.float32)
        return squares + new * new

    squares = lax.fori_loop(0, width // chunk, step, jnp.zeros((chunk,), jnp.float32))
    scale_ref[row] = lax.rsqrt(jnp.sum(squares) / width + eps)


def _residual_add_rms_pallas(x, partials, eps, *, chunk, interpret):
    rows, width = x.shape
    raw = pl.BlockSpec(memory_space=pl.ANY)
    out, scale = pl.pallas_call(
        functools.partial(_residual_add_rms_kernel, num_splits=partials.shape[0], chunk=chunk, eps=float(eps)),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((rows,), jnp.float32)],
        grid=(rows,),
        in_specs=[raw, raw],
        out_specs=[raw, raw],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="residual_add_rms",
    )(x, partials.reshape(-1, width))  # [S * M, N]: split s's rows follow split s - 1's
    return out, scale[:, None]


def residual_add_rms(x, partials, eps, *, impl="auto", chunk=1024, interpret=False):
    """x [M, N] plus the sum of float32 partials [S, M, N], and the row scale 1 / rms of the result: ([M, N] in x's
    dtype, f32[M, 1]). impl: "auto" (the kernel where lowered for a CUDA GPU and N is a power of two, the reference
    elsewhere), "pallas" or "reference"; chunk: columns per step (a power of two, at most N)."""
    width = x.shape[1]
    chunk = min(chunk, width)
    if impl == "reference" or (impl == "auto" and not is_power_of_two(width)):
        return residual_add_rms_reference(x, partials, eps)
    if not (is_power_of_two(width) and is_power_of_two(chunk)):
        raise ValueError(f"the kernel needs powers of two for N and chunk, got {width} and {chunk}")
    pallas = functools.partial(_residual_add_rms_pallas, eps=eps, chunk=chunk, interpret=interpret)
    if impl == "pallas":
        return pallas(x, partials)
    if impl != "auto":
        raise ValueError(f"unknown impl {impl!r}; use 'auto', 'pallas' or 'reference'")
    return lax.platform_dependent(x, partials, cuda=pallas,
                                  default=functools.partial(residual_add_rms_reference, eps=eps))
