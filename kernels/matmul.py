"""A dense GEMM whose every row comes out with the same bits however many rows are multiplied with it.

XLA picks a GEMM per shape: on the GPU a split of K at few rows (batch 1's 32) and none at many, on the CPU a bf16
product that rounds a row differently beside 32 rows than beside 64. Either way a request's activations change in
the last bits with the batch it shares, and in bf16 that can flip which masked position is most confident, so the
same prompt decodes to other tokens alone than in a batch. The engine's `batch_invariant` mode multiplies by this:

  Pallas (the GPU): grid (M / bm, N / bn); each program sums its [bm, bn] tile over K in block_k slices, in order,
    in float32, and rounds once. The tiles depend on K and N only, never on M, so a row's arithmetic is the same at
    any row count: one fixed GEMM, at some speed (no split of K for few rows, no autotuned tile for many).
  reference (elsewhere): XLA's products of [bm, K] row chunks, one after another (`lax.map`), each accumulated in
    float32 and rounded once: every chunk is the same shape at any row count, so XLA runs the same product on it.
    (On this CPU a whole [M, K] product gives a row other bits at 48 rows than at 64, in bf16 and in float32.) It
    reads w once per chunk, which the GPU's weight-bound GEMMs could not afford.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.kernels import in_row_chunks, pallas_program

BLOCK_M = 64  # rows per tile; M is padded to a multiple of it
_BLOCK_N, _BLOCK_K = 128, 64  # the widest tiles, narrowed to a power of two that divides N and K
_NUM_WARPS, _NUM_STAGES = 4, 3


def _precision(dtype):
    # float32 operands multiply in IEEE float32 (XLA and Triton would otherwise round them to TF32 on the GPU)
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def invariant_matmul_reference(x, w, out_dtype=None):
    """x [M, K] @ w [K, N] in row chunks (`in_row_chunks`), accumulated in float32, rounded once to out_dtype (x's
    dtype by default)."""
    w, out_dtype = w.astype(x.dtype), out_dtype or x.dtype
    return in_row_chunks(lambda chunk: jnp.dot(chunk, w, preferred_element_type=jnp.float32,
                                               precision=_precision(x.dtype)).astype(out_dtype), x)


def _matmul_kernel(x_ref, w_ref, out_ref, *, block_n, block_k):
    rows, cols = pl.ds(pl.program_id(0) * BLOCK_M, BLOCK_M), pl.ds(pl.program_id(1) * block_n, block_n)

    def accumulate(k, acc):
        ks = pl.ds(k * block_k, block_k)
        return acc + jnp.dot(x_ref[rows, ks], w_ref[ks, cols], preferred_element_type=jnp.float32,
                             precision=_precision(x_ref.dtype))

    acc = lax.fori_loop(0, x_ref.shape[1] // block_k, accumulate, jnp.zeros((BLOCK_M, block_n), jnp.float32))
    out_ref[rows, cols] = acc.astype(out_ref.dtype)


def _fit_tile(dim, widest):
    """The largest power of two <= widest that divides dim, or None below 16 (Triton's smallest dot operand)."""
    tile = widest
    while tile >= 16 and dim % tile:
        tile //= 2
    return tile if tile >= 16 else None


def _tiles(depth, width):
    """(block_n, block_k) for w [K, N], or None where Triton cannot tile them."""
    block_n, block_k = _fit_tile(width, _BLOCK_N), _fit_tile(depth, _BLOCK_K)
    return None if block_n is None or block_k is None else (block_n, block_k)


def _invariant_matmul_pallas(x, w, out_dtype, interpret):
    rows, depth = x.shape
    width = w.shape[1]
    block_n, block_k = _tiles(depth, width)
    padded_rows = -(-rows // BLOCK_M) * BLOCK_M
    program = pallas_program(_matmul_kernel, jax.ShapeDtypeStruct((padded_rows, width), out_dtype),
                             (padded_rows // BLOCK_M, width // block_n), name="invariant_matmul",
                             num_warps=_NUM_WARPS, num_stages=_NUM_STAGES, interpret=interpret, block_n=block_n,
                             block_k=block_k)
    return program(jnp.pad(x, ((0, padded_rows - rows), (0, 0))), w.astype(x.dtype))[:rows]


def _default_impl(depth, width):
    """Pallas on the GPU where K and N take tiles of >= 16, the reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" and _tiles(depth, width) else "reference"


@functools.partial(jax.named_call, name="invariant_matmul")
def invariant_matmul(x, w, *, out_dtype=None, impl="auto", interpret=False):
    """x [..., K] @ w [K, N] -> [..., N] in out_dtype (x's dtype by default), each row's bits independent of the
    other rows and of how many there are.

    impl: "pallas", "reference" or "auto" (Pallas on the GPU for K and N divisible by 16, the reference elsewhere);
    interpret: run the Pallas kernel in interpret mode (CPU tests).
    """
    out_dtype = out_dtype or x.dtype
    depth, width = w.shape
    if x.shape[-1] != depth:
        raise ValueError(f"x [..., {x.shape[-1]}] does not match w [{depth}, {width}]")
    impl = _default_impl(depth, width) if impl == "auto" else impl
    if impl == "reference":
        out = invariant_matmul_reference(x.reshape(-1, depth), w, out_dtype)
    elif impl == "pallas":
        if _tiles(depth, width) is None:
            raise ValueError(f"the Pallas matmul needs K and N divisible by 16, got [{depth}, {width}]")
        out = _invariant_matmul_pallas(x.reshape(-1, depth), w, out_dtype, interpret)
    else:
        raise ValueError(f"unknown matmul impl {impl!r}; use 'auto', 'pallas' or 'reference'")
    return out.reshape(*x.shape[:-1], width)
