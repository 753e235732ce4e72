"""The thresholds of the top-k and top-p filters: per row of logits, the smallest logit each filter keeps, and the
probability mass of what they keep.

Top-k keeps the logits >= the k-th largest (ties included); top-p then keeps the smallest set of the largest of
those whose probability, renormalised over what top-k kept, reaches top_p (ties at its edge included): the order of
Hugging Face's TopK and TopP logits warpers and of vLLM. A threshold is returned as an order key (`order_keys`), so
a row keeps exactly the logits whose key is >= it, and 0 keeps everything.

reference  sort each row (XLA). On the GPU a sort is a library call, which cannot join the CUDA graph of the
           denoising loop's body: a branch holding one splits each forward's graph and costs the host a round trip.
kernel     each threshold is searched `bits` at a time from the top key bit: a step is one pass over the logits,
           one program per (row, segment of `segment` logits), that counts (top-k) or sums the probability of
           (top-p) the logits at or above each of the 2^bits - 1 candidates; XLA adds the segments' sums in a
           fixed order and picks the digit. One pass for the maximum, then 32 / bits per filter: every pass
           launches, and a row that does not ask for a filter (top_k = -1, top_p = 1) skips that filter's
           passes' work (an empty program). Segments keep the GPU busy at a few rows (one program per row would
           leave most SMs idle at 32 rows) and depend on the vocabulary alone, so a row's sums do not depend on
           its batch.

kept_mass  the softmax denominator over what a row keeps (the sampler's confidences), by the same segment sums:
           on the GPU, where XLA's reductions may add a row's terms in an order that depends on its batch.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels import is_power_of_two


def order_keys(x):
    """uint32 keys that order like the float32 values x (-0 and +0 alike, -inf lowest; x holds no NaN)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = jnp.where(bits == jnp.uint32(1 << 31), jnp.uint32(0), bits)  # -0 as +0 (XLA simplifies away x + 0.0)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def filter_threshold_reference(logits, top_k, top_p):
    """logits f32[N, V], top_k i32[N] (-1 off), top_p f32[N] (1 off) -> u32[N] threshold keys, by sorting."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)[:, 0]
    probs = jax.nn.softmax(jnp.where(sorted_desc >= kth[:, None], sorted_desc, -jnp.inf), axis=-1)  # top-k's
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability above each sorted entry
    # the smallest prefix whose mass reaches top_p; at least the top logit (a row holding +inf has NaN masses, and
    # keeps its +inf logits, as the kernel does)
    nucleus_size = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (nucleus_size - 1)[:, None], axis=-1)[:, 0]
    # top_p = 1 is off: float32's cumulative mass reaches 1 before the tail ends and would cut it
    return jnp.maximum(order_keys(kth), jnp.where(top_p < 1.0, order_keys(pth), jnp.uint32(0)))


_OFFSET_LIMIT = 2**31  # the kernels' offsets into the logits are int32


def _load(logits_ref, row, seg, i, chunk, segment, allowed_ref=None):
    """Chunk i of a row's segment in float32, -inf past the vocabulary's end, and which of its logits count: those in
    the vocabulary (and allowed, with an allowed_ref)."""
    start = seg * segment + i * chunk
    valid = start + lax.iota(jnp.int32, chunk) < logits_ref.shape[1]
    x = pltriton.load(logits_ref.at[row, pl.ds(start, chunk)], mask=valid, other=-jnp.inf).astype(jnp.float32)
    if allowed_ref is not None:
        valid = valid & (pltriton.load(allowed_ref.at[pl.ds(start, chunk)], mask=valid, other=0) != 0)
    return x, valid


def _segment_maximum_kernel(logits_ref, maximum_ref, *, chunk, segment):
    row, seg = pl.program_id(0), pl.program_id(1)

    def step(i, lanes):
        return jnp.maximum(lanes, _load(logits_ref, row, seg, i, chunk, segment)[0])

    lanes = lax.fori_loop(0, segment // chunk, step, jnp.full((chunk,), -jnp.inf, jnp.float32))
    maximum_ref[row * pl.num_programs(1) + seg] = jnp.max(lanes)


def _sum_in_index_order(lanes):
    """The sum of a power-of-two vector as a tree over its indices (neighbours added, then neighbouring pairs, ...),
    so its order does not depend on how Triton spreads the lanes over threads. Written as a split and an add, not
    as sums over pairs: XLA (interpret mode) merges chained reductions into one of its own order."""
    while lanes.shape[0] > 1:
        even, odd = lax.split(lanes.reshape(-1, 2), (1, 1), axis=1)
        lanes = (even + odd).reshape(-1)
    return jnp.sum(lanes)  # the one value


def _segment_sums_kernel(logits_ref, active_ref, shift_ref, candidates_ref, *refs, chunk, segment, num_candidates,
                         weighted, masked, index_order):
    """For each candidate key c: the sum over the segment's logits with key >= c (and allowed, when masked: an
    allowed ref i8[V] before the output) of 1 (a count) or, weighted, exp(logit - shift). One [chunk] accumulator
    per candidate: a [chunk, candidates] one would make Triton move every step's keys through shared memory, with
    barriers, to match its layout. Each accumulator's lanes are added by Triton's reduction, in an order that follows
    the layout Triton picks for the loads (8 bf16 or 4 float32 values per thread), or with index_order by
    `_sum_in_index_order`, the same for any operand dtypes."""
    allowed_ref, sums_ref = refs if masked else (None, *refs)
    row, seg = pl.program_id(0), pl.program_id(1)
    candidates = [candidates_ref[row * num_candidates + c] for c in range(num_candidates)]
    shift = shift_ref[row]

    def accumulate(i, sums):
        x, valid = _load(logits_ref, row, seg, i, chunk, segment, allowed_ref)
        keys = order_keys(x)
        weights = jnp.exp(x - shift) if weighted else jnp.ones_like(x)
        return tuple(s + jnp.where((keys >= c) & valid, weights, 0.0) for s, c in zip(sums, candidates))

    # a row that does not ask for this filter (active 0, else 1) skips the pass and sums to 0; a multiply: a
    # jnp.where here became a loop bound Triton's verifier rejects (typed i1)
    steps = active_ref[row] * (segment // chunk)
    sums = lax.fori_loop(0, steps, accumulate, tuple(jnp.zeros((chunk,), jnp.float32) for _ in candidates))
    for c, s in enumerate(sums):
        sums_ref[(row * pl.num_programs(1) + seg) * num_candidates + c] = (
            _sum_in_index_order(s) if index_order else jnp.sum(s))


def _in_row_blocks(function, logits, *per_row, segment):
    """function(logits, *per_row) on blocks of rows: offsets past _OFFSET_LIMIT (a row's last segment reaches up
    to `segment` past the vocabulary) run as further calls, each row's result the same in any block."""
    num_rows, vocab = logits.shape
    rows_per_call = (_OFFSET_LIMIT - segment) // vocab
    if rows_per_call == 0:
        raise ValueError(f"a vocabulary of {vocab} exceeds the kernel's 32-bit offsets")
    if num_rows <= rows_per_call:
        return function(logits, *per_row)
    return jnp.concatenate([function(logits[start:start + rows_per_call], *(a[start:start + rows_per_call]
                                                                            for a in per_row))
                            for start in range(0, num_rows, rows_per_call)])


def _segment_call(kernel, out_size, logits, *operands, chunk, segment, interpret, **params):
    """kernel over a grid of (row, segment of the vocabulary) -> f32[out_size]."""
    num_rows, vocab = logits.shape
    raw = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(kernel, chunk=chunk, segment=segment, **params),
        out_shape=jax.ShapeDtypeStruct((out_size,), jnp.float32),
        grid=(num_rows, pl.cdiv(vocab, segment)),
        in_specs=[raw] * (1 + len(operands)),
        out_specs=raw,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="top_k_top_p_" + kernel.__name__.strip("_").removesuffix("_kernel"),
    )(logits, *operands)


def _segment_sums(logits, active, shift, candidates, *, weighted, allowed=None, index_order=False, chunk, segment,
                  interpret):
    """[N, V] logits, active bool[N], shift f32[N], candidates u32[N, C] -> f32[N, C] (see _segment_sums_kernel),
    the segments' sums added one after another: each row's sums depend on that row alone (a reduction's order may
    change with the number of rows), so a request draws the same in any batch."""
    num_rows, vocab = logits.shape
    num_segments, num_candidates = pl.cdiv(vocab, segment), candidates.shape[1]
    operands = [active.astype(jnp.int32), shift, candidates.reshape(-1)]
    if allowed is not None:
        operands.append(allowed.astype(jnp.int8))
    partials = _segment_call(_segment_sums_kernel, num_rows * num_segments * num_candidates, logits, *operands,
                             num_candidates=num_candidates, weighted=weighted, masked=allowed is not None,
                             index_order=index_order, chunk=chunk, segment=segment, interpret=interpret)
    partials = partials.reshape(num_rows, num_segments, num_candidates)
    return functools.reduce(jnp.add, (partials[:, s] for s in range(num_segments)))


def _filter_threshold_pallas(logits, top_k, top_p, *, chunk, segment, bits, interpret):
    num_rows, vocab = logits.shape
    tiling = dict(chunk=chunk, segment=segment, interpret=interpret)

    def segment_sums(active, shift, candidates, weighted):
        return _segment_sums(logits, active, shift, candidates, weighted=weighted, **tiling)

    def largest_key(active, shift, weighted, enough, floor=None):
        """Per row, the largest key t with enough(sum at or above t), decided `bits` at a time from the top bit:
        one pass over the row per step, against the 2^bits - 1 candidates that extend the answer so far. enough
        holds for the candidates up to the answer's own digit, so their count is that digit. With a floor (u32[N]
        keys), only logits at or above it are summed, and the first pass also sums everything at or above it,
        which it hands to enough."""
        answer = jnp.zeros((num_rows,), jnp.uint32)
        digits = jnp.arange(1, 1 << bits, dtype=jnp.uint32)
        everything = None
        for shift_bits in range(32 - bits, -1, -bits):
            candidates = answer[:, None] | (digits << shift_bits)[None, :]
            if floor is not None:  # a candidate below the floor sums what the floor keeps
                candidates = jnp.maximum(candidates, floor[:, None])
            if floor is not None and everything is None:
                sums = segment_sums(active, shift, jnp.concatenate([floor[:, None], candidates], axis=1), weighted)
                everything, sums = sums[:, 0], sums[:, 1:]
            else:
                sums = segment_sums(active, shift, candidates, weighted)
            passed = enough(sums, everything)
            answer = answer | (jnp.sum(passed, axis=1, dtype=jnp.uint32) << shift_bits)
        return jnp.where(active, answer, jnp.uint32(0))

    maximum = jnp.max(_segment_call(_segment_maximum_kernel, num_rows * pl.cdiv(vocab, segment), logits, **tiling)
                      .reshape(num_rows, -1), axis=1)
    maximum = jnp.where(jnp.isfinite(maximum), maximum, 0.0)  # a row of -inf has no exponent to subtract
    # counts of up to 2^24 are exact in float32
    kth = largest_key((top_k > 0) & (top_k < vocab), maximum, False,
                      lambda count, _: count >= top_k.astype(jnp.float32)[:, None])
    # top_p = 1 is off: float32's cumulative mass reaches 1 before the tail ends and would cut it. Its mass is
    # counted over what top-k keeps (kth = 0 where top-k is off: everything)
    pth = largest_key(top_p < 1.0, maximum, True, lambda mass, total: mass >= (top_p * total)[:, None], floor=kth)
    return jnp.maximum(kth, pth)


def _dispatch(impl, pallas, reference, *args):
    if impl == "auto":
        return lax.platform_dependent(*args, cuda=pallas, default=reference)
    if impl == "pallas":
        return pallas(*args)
    if impl == "reference":
        return reference(*args)
    raise ValueError(f"unknown impl {impl!r}; use 'auto', 'pallas' or 'reference'")


def _check_tiling(chunk, segment):
    if not (is_power_of_two(chunk) and is_power_of_two(segment) and segment >= chunk):
        raise ValueError(f"chunk and segment must be powers of two with segment >= chunk, got {chunk} and {segment}")


def filter_threshold(logits, top_k, top_p, *, impl="auto", chunk=1024, segment=8192, bits=4, interpret=False):
    """logits f32[N, V], top_k i32[N] (-1 off), top_p f32[N] (1 off) -> u32[N]: the key of each row's smallest
    kept logit (see order_keys); 0 keeps all.

    impl: "auto" (the kernel where the computation is lowered for a CUDA GPU, the sort elsewhere: chosen at
    lowering time), "pallas" or "reference". chunk: logits per step of a program (a power of two); segment:
    logits per program (a power-of-two multiple of chunk); bits: key bits decided per pass (1, 2 or 4): fewer
    passes against more candidates per logit.
    """
    _check_tiling(chunk, segment)
    if bits not in (1, 2, 4):  # 8 bits: 255 accumulators per thread would spill
        raise ValueError(f"bits must be one of 1, 2, 4, got {bits}")
    pallas = functools.partial(_in_row_blocks, functools.partial(
        _filter_threshold_pallas, chunk=chunk, segment=segment, bits=bits, interpret=interpret), segment=segment)
    return _dispatch(impl, pallas, filter_threshold_reference, logits, top_k, top_p)


def kept_mass_reference(logits, threshold, shift, allowed=None):
    """logits [N, V], threshold u32[N], shift f32[N], allowed bool[V] or None -> f32[N] (XLA's sum)."""
    x = logits.astype(jnp.float32)
    kept = order_keys(x) >= threshold[:, None]
    if allowed is not None:
        kept = kept & allowed
    return jnp.sum(jnp.where(kept, jnp.exp(x - shift[:, None]), 0.0), axis=-1)


def kept_mass(logits, threshold, shift, allowed=None, *, impl="auto", chunk=1024, segment=8192, interpret=False):
    """logits [N, V] (float32 or bfloat16), threshold u32[N] keys, shift f32[N], allowed bool[V] or None -> f32[N]:
    each row's sum of exp(logit - shift) over the logits it keeps (key >= threshold, and allowed): the denominator
    of a softmax over what the filters keep.

    On the GPU ("auto") the kernel of the filters' top-p passes sums it, each row's terms added in an order fixed
    by the vocabulary alone, whatever the batch and whether the logits come as bf16 with a mask or as their masked
    float32 copy. XLA's reduction promises no order: with XLA summing it the sampler's batch-invariance tests
    failed on the H200, with this kernel they pass (engine runs 15-16), and a confidence that moves with the batch
    can move a request's commits. Elsewhere XLA sums it. chunk, segment: as filter_threshold's.
    """
    _check_tiling(chunk, segment)
    tiling = dict(chunk=chunk, segment=segment, interpret=interpret)

    def pallas(logits, threshold, shift):  # allowed is [V], the same for every block of rows
        # index order: the sampler's two branches hand over bf16 logits and a mask, or a float32 copy (the filters,
        # whose operand is always float32, keep Triton's cheaper reduction)
        return _segment_sums(logits, jnp.ones_like(threshold, bool), shift, threshold[:, None], weighted=True,
                             allowed=allowed, index_order=True, **tiling)[:, 0]

    return _dispatch(impl, functools.partial(_in_row_blocks, pallas, segment=segment),
                     functools.partial(kept_mass_reference, allowed=allowed), logits, threshold, shift)
