"""A dense GEMM whose every row comes out with the same bits however many rows are multiplied with it.

XLA picks a GEMM per shape: on the GPU a split of K at few rows (batch 1's 32) and none at many, on the CPU a bf16
product that rounds a row differently beside 32 rows than beside 64. Either way a request's activations change in
the last bits with the batch it shares, and in bf16 that can flip which masked position is most confident, so the
same prompt decodes to other tokens alone than in a batch. The engine's `batch_invariant` mode multiplies by this:

  Pallas (the GPU): a [bm, bn] tile's sum over K is S splits, each a float32 sum of its block_k slices in order,
    added in order to a float32 total that is rounded once. The tiles and S depend on K and N only, never on M, so
    a row's arithmetic is the same at any row count. Where there are few row tiles (batch 1's 32 rows: o_proj's
    N = 4096 is 32 programs for 132 SMs), each split is a program of its own and XLA adds their float32 partials in
    the same order; with many, one program adds its S splits itself. The same additions either way, so the same bits:
    one fixed GEMM, at some speed (no autotuned tile).
  reference (elsewhere): XLA's products of [bm, K] row chunks, one after another (`lax.map`), each accumulated in
    float32 and rounded once: every chunk is the same shape at any row count, so XLA runs the same product on it.
    (On this CPU a whole [M, K] product gives a row other bits at 48 rows than at 64, in bf16 and in float32.) It
    reads w once per chunk, which the GPU's weight-bound GEMMs could not afford.
"""

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllm.kernels import in_row_chunks, pallas_program

BLOCK_M = 64  # rows per tile; M is padded to a multiple of it
_BLOCK_N, _BLOCK_K = 128, 64  # the widest tiles, narrowed to a power of two that divides N and K
_NUM_WARPS, _NUM_STAGES = 4, 3
_MIN_PROGRAMS = 128  # about one per SM (132 on an H100 / H200): K splits are added until N's tiles reach it
_MIN_STEPS_PER_SPLIT = 4  # block_k slices per split, so a split's loads still pipeline


def _precision(dtype):
    # float32 operands multiply in IEEE float32 (XLA and Triton would otherwise round them to TF32 on the GPU)
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def invariant_matmul_reference(x, w, out_dtype=None):
    """x [M, K] @ w [K, N] in row chunks (`in_row_chunks`), accumulated in float32, rounded once to out_dtype (x's
    dtype by default)."""
    w, out_dtype = w.astype(x.dtype), out_dtype or x.dtype
    return in_row_chunks(lambda chunk: jnp.dot(chunk, w, preferred_element_type=jnp.float32,
                                               precision=_precision(x.dtype)).astype(out_dtype), x)


def _matmul_kernel(x_ref, w_ref, out_ref, *, block_n, block_k, steps_per_split, splits_per_program):
    """out[p, rows, cols]: the float32 total, from zero, of this program's splits of K, each summed from zero."""
    rows, cols = pl.ds(pl.program_id(0) * BLOCK_M, BLOCK_M), pl.ds(pl.program_id(1) * block_n, block_n)
    first_split = pl.program_id(2) * splits_per_program
    zeros = jnp.zeros((BLOCK_M, block_n), jnp.float32)

    def add_split(split, total):
        def accumulate(step, acc):
            ks = pl.ds(((first_split + split) * steps_per_split + step) * block_k, block_k)
            return acc + jnp.dot(x_ref[rows, ks], w_ref[ks, cols], preferred_element_type=jnp.float32,
                                 precision=_precision(x_ref.dtype))

        return total + lax.fori_loop(0, steps_per_split, accumulate, zeros)

    total = lax.fori_loop(0, splits_per_program, add_split, zeros)
    out_ref[pl.program_id(2), rows, cols] = total.astype(out_ref.dtype)


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


def _partials_are_cheap(splits, rows, depth, itemsize):
    """Whether `splits` float32 partials of `rows` rows, written and read back, cost at most a quarter of w's bytes."""
    return 4 * (2 * splits * rows * 4) <= depth * itemsize


def _num_splits(depth, width, block_n, block_k, itemsize):
    """S, the splits of K for w [K, N]: doubled while N's tiles times S stay under _MIN_PROGRAMS, each split keeps
    _MIN_STEPS_PER_SPLIT slices and one row tile's partials stay cheap. w alone fixes it, and with it the order of a
    row's additions."""
    steps, splits = depth // block_k, 1
    while ((width // block_n) * splits < _MIN_PROGRAMS and steps % (2 * splits) == 0
           and steps // (2 * splits) >= _MIN_STEPS_PER_SPLIT and _partials_are_cheap(2 * splits, BLOCK_M, depth,
                                                                                     itemsize)):
        splits *= 2
    return splits


def _invariant_matmul_pallas(x, w, out_dtype, interpret):
    rows, depth = x.shape
    width = w.shape[1]
    block_n, block_k = _tiles(depth, width)
    w = w.astype(x.dtype)
    splits = _num_splits(depth, width, block_n, block_k, w.dtype.itemsize)
    padded_rows = -(-rows // BLOCK_M) * BLOCK_M
    tiles = (padded_rows // BLOCK_M, width // block_n)
    # a program per split only while the tiles leave SMs idle and the partials' extra traffic stays small
    split_programs = tiles[0] * tiles[1] < _MIN_PROGRAMS and _partials_are_cheap(splits, padded_rows, depth,
                                                                                 w.dtype.itemsize)
    programs_per_tile = splits if split_programs else 1
    partial_dtype = out_dtype if programs_per_tile == 1 else jnp.float32
    program = pallas_program(_matmul_kernel, jax.ShapeDtypeStruct((programs_per_tile, padded_rows, width),
                                                                  partial_dtype),
                             (*tiles, programs_per_tile), name="invariant_matmul", num_warps=_NUM_WARPS,
                             num_stages=_NUM_STAGES, interpret=interpret, block_n=block_n, block_k=block_k,
                             steps_per_split=depth // block_k // splits,
                             splits_per_program=splits // programs_per_tile)
    partials = program(jnp.pad(x, ((0, padded_rows - rows), (0, 0))), w)[:, :rows]
    if programs_per_tile == 1:
        return partials[0]
    # from zero, in order: the additions a program makes when it adds all S splits itself
    return functools.reduce(operator.add, partials, jnp.zeros(partials.shape[1:], jnp.float32)).astype(out_dtype)


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
