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

kept_segments  per row and segment of the vocabulary, over the logits a row keeps: the largest, the id of its
           first occurrence, and the sum of exp(logit - largest) -- one read of the logits gives the sampler a
           greedy row's argmax and any candidate's softmax probability. On the GPU every load of a segment is in
           flight at once and its terms are added in an order fixed by the vocabulary alone, where XLA's
           reductions may add a row's terms in an order that depends on its batch.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxllm.kernels import is_power_of_two, pallas_program


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


def _segment_sums_kernel(logits_ref, active_ref, shift_ref, candidates_ref, sums_ref, *, chunk, segment,
                         num_candidates, weighted):
    """For each candidate key c: the sum over the segment's logits with key >= c of 1 (a count) or, weighted,
    exp(logit - shift). One [chunk] accumulator per candidate: a [chunk, candidates] one would make Triton move every
    step's keys through shared memory, with barriers, to match its layout."""
    row, seg = pl.program_id(0), pl.program_id(1)
    candidates = [candidates_ref[row * num_candidates + c] for c in range(num_candidates)]
    shift = shift_ref[row]

    def accumulate(i, sums):
        x, valid = _load(logits_ref, row, seg, i, chunk, segment)
        keys = order_keys(x)
        weights = jnp.exp(x - shift) if weighted else jnp.ones_like(x)
        return tuple(s + jnp.where((keys >= c) & valid, weights, 0.0) for s, c in zip(sums, candidates))

    # a row that does not ask for this filter (active 0, else 1) skips the pass and sums to 0; a multiply: a
    # jnp.where here became a loop bound Triton's verifier rejects (typed i1)
    steps = active_ref[row] * (segment // chunk)
    sums = lax.fori_loop(0, steps, accumulate, tuple(jnp.zeros((chunk,), jnp.float32) for _ in candidates))
    for c, s in enumerate(sums):
        sums_ref[(row * pl.num_programs(1) + seg) * num_candidates + c] = jnp.sum(s)


def _kept_segments_kernel(logits_ref, *refs, chunk, segment, thresholded, masked):
    """One (row, segment): its kept logits' maximum, the first id holding it, and the sum of exp(logit - maximum).
    The segment's chunks are loaded unrolled, all in flight at once and each read once, then kept in registers for
    the three results; lane i of the accumulator adds chunk after chunk, and the lanes add as a tree over their
    indices: one order whatever the operand's dtype (Triton lays out bf16 and float32 loads differently) or batch."""
    refs = list(refs)
    threshold_ref = refs.pop(0) if thresholded else None
    allowed_ref = refs.pop(0) if masked else None
    maximum_ref, argmax_ref, mass_ref = refs
    row, seg = pl.program_id(0), pl.program_id(1)
    chunks = []
    for i in range(segment // chunk):
        x, valid = _load(logits_ref, row, seg, i, chunk, segment, allowed_ref)
        if thresholded:  # without, ~7 fewer integer operations per logit in a pass bound by them and exp's
            valid = valid & (order_keys(x) >= threshold_ref[row])
        chunks.append(jnp.where(valid, x, -jnp.inf))
    lane_maximum, lane_chunk = chunks[0], jnp.zeros((chunk,), jnp.int32)
    for i, x in enumerate(chunks[1:], 1):
        lane_chunk = jnp.where(x > lane_maximum, i, lane_chunk)  # strictly greater: ties keep the lower id
        lane_maximum = jnp.maximum(lane_maximum, x)
    maximum = jnp.max(lane_maximum)
    ids = lane_chunk * chunk + lax.iota(jnp.int32, chunk)
    first_id = jnp.min(jnp.where(lane_maximum == maximum, ids, segment))  # a segment of -inf: its first id
    first_id = jnp.where(first_id < segment, first_id, 0)  # NaN matches nothing: an id still in the vocabulary
    shift = jnp.where(maximum > -jnp.inf, maximum, 0.0)  # nothing kept: every term exp(-inf) = 0, not NaN
    lanes = jnp.exp(chunks[0] - shift)
    for x in chunks[1:]:
        lanes = lanes + jnp.exp(x - shift)
    out = row * pl.num_programs(1) + seg
    maximum_ref[out] = maximum
    argmax_ref[out] = seg * segment + first_id
    mass_ref[out] = _sum_in_index_order(lanes)


def _in_row_blocks(function, logits, *per_row, segment):
    """function(logits, *per_row) -> arrays with rows first (or a tuple of them), on blocks of rows: offsets past
    _OFFSET_LIMIT (a row's last segment reaches up to `segment` past the vocabulary) run as further calls, each row's
    result the same in any block."""
    num_rows, vocab = logits.shape
    rows_per_call = (_OFFSET_LIMIT - segment) // vocab
    if rows_per_call == 0:
        raise ValueError(f"a vocabulary of {vocab} exceeds the kernel's 32-bit offsets")
    if num_rows <= rows_per_call:
        return function(logits, *per_row)
    blocks = [function(logits[start:start + rows_per_call], *(a[start:start + rows_per_call] for a in per_row))
              for start in range(0, num_rows, rows_per_call)]
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *blocks)


def _segment_call(kernel, out_shape, logits, *operands, chunk, segment, interpret, num_warps=4, **params):
    """kernel over a grid of (row, segment of the vocabulary) -> out_shape (per (row, segment) results, flat). One
    filter_threshold makes 17 such calls of 4 configurations, and an engine traces both branches of
    `lax.platform_dependent` in each of its programs, on the CPU too: built once per configuration
    (`pallas_program`), the kernels traced 4 times there instead of 17 (~1.6 s per filter_threshold; an engine test's
    tracing 12.0 -> 5.9 s)."""
    num_rows, vocab = logits.shape
    program = pallas_program(kernel, out_shape, (num_rows, pl.cdiv(vocab, segment)),
                             name="top_k_top_p_" + kernel.__name__.strip("_").removesuffix("_kernel"),
                             num_warps=num_warps, interpret=interpret, num_raw_inputs=1 + len(operands), chunk=chunk,
                             segment=segment, **params)
    return program(logits, *operands)


def _segment_sums(logits, active, shift, candidates, *, weighted, chunk, segment, interpret):
    """[N, V] logits, active bool[N], shift f32[N], candidates u32[N, C] -> f32[N, C] (see _segment_sums_kernel),
    the segments' sums added one after another: each row's sums depend on that row alone (a reduction's order may
    change with the number of rows), so a request draws the same in any batch."""
    num_rows, vocab = logits.shape
    num_segments, num_candidates = pl.cdiv(vocab, segment), candidates.shape[1]
    out_shape = jax.ShapeDtypeStruct((num_rows * num_segments * num_candidates,), jnp.float32)
    partials = _segment_call(_segment_sums_kernel, out_shape, logits, active.astype(jnp.int32), shift,
                             candidates.reshape(-1), num_candidates=num_candidates, weighted=weighted, chunk=chunk,
                             segment=segment, interpret=interpret)
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

    out_shape = jax.ShapeDtypeStruct((num_rows * pl.cdiv(vocab, segment),), jnp.float32)
    maximum = jnp.max(_segment_call(_segment_maximum_kernel, out_shape, logits, **tiling)
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


class KeptSegments(NamedTuple):
    """Per row and segment of the vocabulary, over the logits the row keeps (-inf and 0 where it keeps none). NaN
    logits give an argmax somewhere in the vocabulary and a NaN mass (on the GPU the maximum skips NaN; XLA's
    reference takes it)."""
    maximum: jax.Array  # f32[N, S] the largest
    argmax: jax.Array  # i32[N, S] the first id holding it
    mass: jax.Array  # f32[N, S] the sum of exp(logit - maximum)

    def row_argmax(self):
        """i32[N]: the first id holding the row's largest kept logit (as jnp.argmax over the kept logits)."""
        first_segment = jnp.argmax(self.maximum, axis=1)
        return jnp.take_along_axis(self.argmax, first_segment[:, None], axis=1)[:, 0]

    def row_mass(self, shift):
        """f32[N]: the sum of exp(logit - shift) over the row's kept logits, the segments added one after another
        (an order of the vocabulary's alone). A shift ~88 below the maximum overflows it to inf; a shift of -inf
        (a row that keeps only -inf) gives NaN."""
        terms = jnp.exp(self.maximum - shift[:, None]) * self.mass  # a segment keeping nothing: 0 * 0
        return functools.reduce(jnp.add, (terms[:, s] for s in range(terms.shape[1])))


def _kept_logits(logits, threshold, allowed):
    if threshold is not None:
        logits = jnp.where(order_keys(logits) >= threshold[:, None], logits, -jnp.inf)
    return logits if allowed is None else jnp.where(allowed.astype(bool), logits, -jnp.inf)


def kept_segments_reference(logits, threshold=None, allowed=None, *, segment):
    """XLA's reductions over the logits reshaped to [N, S, segment] (padded with -inf)."""
    num_rows, vocab = logits.shape
    num_segments = pl.cdiv(vocab, segment)
    x = _kept_logits(logits.astype(jnp.float32), threshold, allowed)
    x = jnp.pad(x, ((0, 0), (0, num_segments * segment - vocab)), constant_values=-jnp.inf)
    x = x.reshape(num_rows, num_segments, segment)
    maximum = jnp.max(x, axis=-1)
    shift = jnp.where(maximum > -jnp.inf, maximum, 0.0)
    argmax = jnp.argmax(x, axis=-1).astype(jnp.int32) + jnp.arange(num_segments, dtype=jnp.int32) * segment
    return KeptSegments(maximum, argmax, jnp.sum(jnp.exp(x - shift[..., None]), axis=-1))


def kept_segments(logits, threshold=None, allowed=None, *, impl="auto", chunk=1024, segment=8192, num_warps=4,
                  interpret=False):
    """logits [N, V] (float32 or bfloat16), threshold u32[N] keys or None (keep all), allowed bool[V] or int8[V] 0 / 1
    (what the kernel reads; a bool mask is converted on each call) or None -> KeptSegments over the logits with key >=
    threshold (and allowed), in one read of the logits.

    The sampler's confidences are softmax probabilities: with segments from the same logits, a row's argmax and
    its kept mass are bit for bit the same in any batch and from bf16 logits with a mask (its greedy branch) as
    from their masked float32 copy (its other branch). A confidence that moved with the batch could move a
    request's commits (XLA's sum there failed the sampler's batch-invariance tests on the H200, engine runs 15-16).
    impl: as filter_threshold's; chunk: logits per load; segment: logits per program, loaded at once (a
    power-of-two multiple of chunk, at most 16 chunks: all in registers); num_warps: per program. H200, 157184
    logits, bf16 with a mask (runs/s19/sampler_fused.py): chunk 1024, segment 8192, 4 warps was the fastest tiling
    tried at 1024, 256 and 32 rows (segment 4096 4-5% slower, 8 warps 25-50% slower).
    """
    _check_tiling(chunk, segment)
    if segment > 16 * chunk:
        raise ValueError(f"segment {segment} holds more than 16 chunks of {chunk}: too many registers")
    per_row = () if threshold is None else (threshold,)

    def pallas(logits, *per_row):  # allowed is [V], the same for every block of rows
        num_rows, vocab = logits.shape
        size = num_rows * pl.cdiv(vocab, segment)
        operands = [*per_row] + ([] if allowed is None else [allowed.astype(jnp.int8)])
        out_shape = (jax.ShapeDtypeStruct((size,), jnp.float32), jax.ShapeDtypeStruct((size,), jnp.int32),
                     jax.ShapeDtypeStruct((size,), jnp.float32))
        results = _segment_call(_kept_segments_kernel, out_shape, logits, *operands, thresholded=bool(per_row),
                                masked=allowed is not None, chunk=chunk, segment=segment, num_warps=num_warps,
                                interpret=interpret)
        return tuple(r.reshape(num_rows, -1) for r in results)

    def reference(logits, *per_row):
        threshold = per_row[0] if per_row else None
        return tuple(kept_segments_reference(logits, threshold, allowed, segment=segment))

    segments = _dispatch(impl, functools.partial(_in_row_blocks, pallas, segment=segment), reference,
                         logits, *per_row)
    return KeptSegments(*segments)
