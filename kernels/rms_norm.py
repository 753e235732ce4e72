"""An RMSNorm whose every row comes out with the same bits however many rows are normalised with it.

XLA's norm is not: in full-size LLaDA2 on the H100 a prompt's KV of layer 1 (not of layer 0) came out with other
last bits when the prompt was prefilled beside 7 others, and with the norms on fixed row chunks it did not
(BENCHMARKS.md, run 49). XLA's norm alone gave a row the same bits at 32 to 16384 rows there, so the cause is
likely the code XLA fuses around it per shape (not profiled). On the CPU the norm alone rounds 5% of a 512-row
prompt's elements otherwise among 4096 rows. The engine's `batch_invariant` mode normalises with this:

  Pallas (the GPU): one row per program, its float32 sum of squares in one fixed order.
  reference (elsewhere): `rms_norm` on fixed chunks of rows (`in_row_chunks`), one after another.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxllm.kernels import in_row_chunks, is_power_of_two, pallas_program
from jaxllm.kernels.attention_prologue import rms_norm, rms_row_scale


def invariant_rms_norm_reference(x, weight, eps):
    """rms_norm over rows x [M, H] in fixed chunks of rows."""
    return in_row_chunks(lambda rows: rms_norm(rows, weight, eps), x)


def _rms_norm_kernel(x_ref, weight_ref, out_ref, *, eps):
    row = pl.program_id(0)
    xf = x_ref[row, :].astype(jnp.float32)
    out_ref[row, :] = weight_ref[...] * (xf * rms_row_scale(xf, eps)).astype(out_ref.dtype)


def _invariant_rms_norm_pallas(x, weight, eps, interpret):
    program = pallas_program(_rms_norm_kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), (x.shape[0],),
                             name="invariant_rms_norm", num_warps=4, interpret=interpret, num_raw_inputs=2,
                             eps=float(eps))
    return program(x, weight.astype(x.dtype))


def _default_impl(hidden):
    """Pallas on the GPU where a row is a power of two wide (a Triton tensor), the reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" and is_power_of_two(hidden) else "reference"


@functools.partial(jax.named_call, name="invariant_rms_norm")
def invariant_rms_norm(x, weight, eps, *, impl="auto", interpret=False):
    """`rms_norm(x, weight, eps)` over x [..., H], each row's bits independent of the other rows and their number.

    impl: "pallas", "reference" or "auto" (Pallas on the GPU for a power-of-two H, the reference elsewhere);
    interpret: run the Pallas kernel in interpret mode (CPU tests).
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [H={hidden}], got {weight.shape}")
    impl = _default_impl(hidden) if impl == "auto" else impl
    if impl == "reference":
        out = invariant_rms_norm_reference(x.reshape(-1, hidden), weight, eps)
    elif impl == "pallas":
        if not is_power_of_two(hidden):
            raise ValueError(f"the Pallas norm needs a power-of-two row width, got {hidden}")
        out = _invariant_rms_norm_pallas(x.reshape(-1, hidden), weight, eps, interpret)
    else:
        raise ValueError(f"unknown norm impl {impl!r}; use 'auto', 'pallas' or 'reference'")
    return out.reshape(x.shape)
