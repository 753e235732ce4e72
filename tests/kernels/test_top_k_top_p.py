"""The top-k / top-p thresholds and the mass of what they keep: the Pallas kernels (interpret mode) and the XLA
references against a float64 definition, over ties, masked ids, vocabularies that end mid-chunk and every search
width."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import top_k_top_p
from jaxllm.kernels.top_k_top_p import filter_threshold, kept_segments, order_keys
from tests.cuda_lowering import lowered_for_h100


def _kept(thresholds, logits, top_k, top_p):
    logits = jnp.asarray(logits, jnp.float32)
    threshold = thresholds(logits, jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))
    return np.asarray(order_keys(logits) >= threshold[:, None])


def _kept_by_sorting(row, top_k, top_p):
    """The filters' definition, by sorting in float64: top-p over what top-k keeps."""
    order = np.sort(row)[::-1]
    kth = order[min(top_k, len(row)) - 1] if top_k > 0 else -np.inf
    weights = np.where(order >= kth, np.exp(order - order.max()), 0.0)
    probs = weights / weights.sum()
    mass_before = np.cumsum(probs) - probs
    pth = order[np.sum(mass_before < top_p) - 1] if top_p < 1.0 else -np.inf
    return row >= max(kth, pth)


def test_order_keys_order_like_the_floats_with_both_zeros_alike():
    values = jnp.asarray([-jnp.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, jnp.inf], jnp.float32)
    for keys_of in (order_keys, jax.jit(order_keys)):  # under jit XLA drops an x + 0.0
        keys = np.asarray(keys_of(values)).astype(np.int64)
        assert keys[3] == keys[4] and (np.diff(np.delete(keys, 3)) > 0).all()


# segments of 128 over 300 logits: the last one part-filled, its last chunk wholly past the vocabulary's end
IMPLS = [dict(impl="reference")] + [dict(impl="pallas", interpret=True, chunk=64, segment=128, bits=bits)
                                    for bits in (1, 2, 4)]
# The kernels' tests below run IMPLS[-1] on [4, 300] or [1, 300] logits: compiling one interpret-mode filter takes
# ~5 s on this CPU, and a shape compiled once is a hit in the suite's compilation cache for every later test.
PALLAS, ROWS, VOCAB = IMPLS[-1], 4, 300


@pytest.mark.parametrize("kwargs", IMPLS, ids=lambda kw: kw["impl"] + str(kw.get("bits", "")))
def test_filters_keep_what_sorting_keeps(kwargs):
    thresholds = jax.jit(functools.partial(filter_threshold, **kwargs))  # one compilation for the four cases
    rng = np.random.default_rng(6)
    ties = rng.integers(-4, 4, size=(4, 300)).astype(np.float32)  # many equal logits at every k
    ties[:, :10] = -np.inf  # masked ids
    spread = (rng.normal(size=(4, 300)) * 3).astype(np.float32)
    spread[3, ::7] = -np.inf
    for rows, top_k, top_p in ((ties, [1, 7, 50, -1], [1.0] * 4), (spread, [-1] * 4, [0.01, 0.5, 0.9, 0.999]),
                               (spread, [3, 40, -1, 300], [0.9, 0.3, 1.0, 0.6]), (ties, [-1, 290, 2, 1000], [0.2] * 4)):
        kept = _kept(thresholds, rows, top_k, top_p)
        for row, row_kept, k, p in zip(rows, kept, top_k, top_p):
            np.testing.assert_array_equal(row_kept, _kept_by_sorting(row, k, p), err_msg=f"top_k={k} top_p={p}")


@pytest.mark.parametrize("kwargs", [IMPLS[0], IMPLS[-1]], ids=["reference", "pallas"])
def test_top_p_counts_its_mass_over_what_top_k_keeps_as_hugging_face_does(kwargs):
    """Top-k, then top-p over the renormalised survivors, as Hugging Face's TopK and TopP logits warpers apply them
    (and vLLM): [0.4, 0.35, 0.25] under top_k 2 and top_p 0.5 keeps one token, where top-p over the whole
    distribution would keep two."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    rng = np.random.default_rng(9)
    rows = (rng.normal(size=(2 * ROWS, VOCAB)) * 2).astype(np.float32)
    rows[0, :3], rows[0, 3:] = np.log([0.4, 0.35, 0.25]), -np.inf
    top_k, top_p = [2, 2, 5, 20, 50, 300, -1, 10], [0.5, 0.7, 0.9, 0.3, 0.8, 0.6, 0.95, 1.0]
    thresholds = jax.jit(functools.partial(filter_threshold, **kwargs))
    kept = np.concatenate([_kept(thresholds, rows[half], top_k[half], top_p[half])
                           for half in (slice(0, ROWS), slice(ROWS, None))])
    assert kept[0].sum() == 1
    for row, row_kept, k, p in zip(rows, kept, top_k, top_p):
        scores = torch.from_numpy(row)[None]
        if k > 0:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1.0:
            scores = TopPLogitsWarper(p)(None, scores)
        expected = np.isfinite(scores[0].numpy()) & np.isfinite(row)
        np.testing.assert_array_equal(row_kept & np.isfinite(row), expected, err_msg=f"top_k={k} top_p={p}")


@pytest.mark.parametrize("kwargs", IMPLS[:1] + [dict(impl="pallas", interpret=True)], ids=["reference", "pallas"])
def test_top_p_of_one_keeps_the_whole_distribution(kwargs):
    """A row with top_p = 1 beside a row that filters keeps its tail: float32's cumulative mass reaches 1 early."""
    logits = np.random.default_rng(4).normal(size=(2, 32768)) * 4
    kept = _kept(jax.jit(functools.partial(filter_threshold, **kwargs)), logits, [-1, 50], [1.0, 1.0])
    assert kept[0].all() and kept[1].sum() == 50


def test_auto_runs_the_sort_off_the_gpu_and_the_kernel_on_it():
    logits = jax.ShapeDtypeStruct((64, 157184), jnp.float32)
    settings = (jax.ShapeDtypeStruct((64,), jnp.int32), jax.ShapeDtypeStruct((64,), jnp.float32))
    here = jax.jit(filter_threshold).trace(logits, *settings).lower(lowering_platforms=("cpu",)).as_text()
    assert "stablehlo.sort" in here and "triton" not in here
    gpu = lowered_for_h100(jax.jit(filter_threshold), logits, *settings)
    # the maximum's pass, then 32 / 4 passes per filter (bits=4)
    assert "stablehlo.sort" not in gpu and gpu.count("__gpu$xla.gpu.triton") == 1 + 2 * 8


def test_a_rows_thresholds_do_not_depend_on_its_batch():
    """Each row's sums are its segments' sums added in one order, whatever the number of rows: a seeded request's
    nucleus (and so its draws) must not change with the requests batched beside it."""
    rng = np.random.default_rng(9)
    logits = jnp.asarray(rng.normal(size=(ROWS, VOCAB)) * 2, jnp.float32)
    top_k, top_p = jnp.asarray([-1, 30, 250, 7], jnp.int32), jnp.asarray([0.9, 0.5, 0.999, 0.3], jnp.float32)
    thresholds = jax.jit(functools.partial(filter_threshold, **PALLAS))
    together = np.asarray(thresholds(logits, top_k, top_p))
    for row in range(ROWS):
        alone = thresholds(logits[row:row + 1], top_k[row:row + 1], top_p[row:row + 1])
        assert int(alone[0]) == together[row], f"row {row}"


def test_one_threshold_traces_each_kernel_once_per_configuration(monkeypatch):
    """filter_threshold makes 17 kernel calls (a maximum, then 8 passes of 4 bits for top-k and 8 for top-p), in 4
    configurations (top-p's first pass also sums at its floor). Each configuration's kernel is traced once: an
    engine traces the kernels in every bucket's program, on the CPU too (both branches of platform_dependent), where
    one trace per call took ~1.6 s per filter_threshold."""
    traces = collections.Counter()
    for name in ("_segment_maximum_kernel", "_segment_sums_kernel"):
        kernel = getattr(top_k_top_p, name)

        @functools.wraps(kernel)
        def counted(*refs, kernel=kernel, name=name, **params):
            traces[name] += 1
            return kernel(*refs, **params)

        monkeypatch.setattr(top_k_top_p, name, counted)  # a new function: nothing cached for it yet
    thresholds = functools.partial(filter_threshold, impl="pallas", interpret=True, chunk=64, segment=128)
    jax.jit(thresholds).trace(jax.ShapeDtypeStruct((3, 300), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32),
                              jax.ShapeDtypeStruct((3,), jnp.float32))
    assert traces == {"_segment_maximum_kernel": 1, "_segment_sums_kernel": 3}


def test_more_logits_than_int32_offsets_reach_run_as_blocks_of_rows(monkeypatch):
    """Rows past the kernels' int32 offsets run in further calls, each row's threshold as in one call; the sort
    (off the GPU) has no such limit. A batch of 16384 windows' rows lowers for either."""
    rng = np.random.default_rng(12)
    logits = jnp.asarray(rng.normal(size=(ROWS, VOCAB)) * 2, jnp.float32)
    top_k, top_p = jnp.asarray([-1, 5, 40, 3], jnp.int32), jnp.asarray([0.8, 0.8, 0.5, 1.0], jnp.float32)
    thresholds = functools.partial(filter_threshold, **PALLAS)
    whole = np.asarray(jax.jit(thresholds)(logits, top_k, top_p))
    monkeypatch.setattr(top_k_top_p, "_OFFSET_LIMIT", 3 * VOCAB + 128)  # 3 rows per call: blocks of 3 and 1
    np.testing.assert_array_equal(np.asarray(jax.jit(thresholds)(logits, top_k, top_p)), whole)
    monkeypatch.undo()

    logits = jax.ShapeDtypeStruct((16384, 157184), jnp.float32)  # 2.6e9 logits, 13662 rows per call
    settings = (jax.ShapeDtypeStruct((16384,), jnp.int32), jax.ShapeDtypeStruct((16384,), jnp.float32))
    assert "stablehlo.sort" in jax.jit(filter_threshold).trace(logits, *settings).lower(
        lowering_platforms=("cpu",)).as_text()
    gpu = lowered_for_h100(jax.jit(filter_threshold), logits, *settings)
    assert gpu.count("__gpu$xla.gpu.triton") == 2 * (1 + 2 * 8)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_a_row_holding_inf_keeps_its_inf_logits_under_top_p(impl):
    """A temperature near 0 can scale a logit to +inf: its softmax is NaN, and the row keeps its +inf logits."""
    row = np.random.default_rng(2).normal(size=(1, VOCAB)).astype(np.float32)
    row[0, [17, 200]] = np.inf
    kwargs = dict(impl=impl) if impl == "reference" else PALLAS
    kept = _kept(jax.jit(functools.partial(filter_threshold, **kwargs)), row, [-1], [0.5])
    np.testing.assert_array_equal(np.flatnonzero(kept[0]), [17, 200])


def test_rejects_bad_settings():
    logits, top_k, top_p = jnp.zeros((2, 8)), jnp.ones(2, jnp.int32), jnp.ones(2)
    with pytest.raises(ValueError, match="powers of two"):
        filter_threshold(logits, top_k, top_p, chunk=100)
    with pytest.raises(ValueError, match="segment >= chunk"):
        filter_threshold(logits, top_k, top_p, chunk=1024, segment=512)
    with pytest.raises(ValueError, match="bits"):
        filter_threshold(logits, top_k, top_p, bits=8)
    with pytest.raises(ValueError, match="impl"):
        filter_threshold(logits, top_k, top_p, impl="cuda")


ON_GPU = jax.default_backend() == "gpu"
SEGMENT_IMPLS = [dict(impl="reference", chunk=64, segment=128),
                 dict(impl="pallas", interpret=not ON_GPU, chunk=64, segment=128),
                 dict(impl="pallas", interpret=not ON_GPU, chunk=32, segment=512)]  # 16 chunks, unrolled


@pytest.mark.parametrize("kwargs", SEGMENT_IMPLS, ids=["reference", "pallas", "pallas16"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("vocab", [128, 300, 1000])
def test_kept_segments_hold_each_segments_maximum_first_argmax_and_mass(kwargs, dtype, vocab):
    """Per (row, segment), over the logits at or above the row's threshold and allowed, against float64: the maximum
    and the first id holding it exactly, the sum of exp(logit - maximum); and per row the argmax (ties to the lowest
    id) and the mass at the maximum and below it (terms above 1). Rows: no threshold (0), ties in and across
    segments, -inf logits, a threshold keeping 3, one keeping half, one keeping the largest only."""
    rng = np.random.default_rng(vocab)
    logits = np.array(jnp.asarray(rng.normal(size=(6, vocab)) * 3, dtype).astype(jnp.float32))
    logits[1, [vocab - 1, 67, 5, 3]] = logits[1].max() + 1.0  # ties, two in one lane (3, 67): the first is id 3
    logits[2, ::5] = -np.inf
    allowed = rng.random(vocab) < 0.8
    allowed[[3, 5, 67]] = True
    kth = np.sort(logits, axis=1)[:, ::-1][np.arange(6), [0, 0, 20, 2, vocab // 2, 0]]
    threshold = np.array(order_keys(jnp.asarray(kth)))
    threshold[[0, 1]] = 0
    segments_of = jax.jit(functools.partial(kept_segments, **kwargs))
    segment = kwargs["segment"]
    for mask in (None, allowed):
        got = segments_of(jnp.asarray(logits, dtype), jnp.asarray(threshold), None if mask is None else
                          jnp.asarray(mask))
        keep = (logits >= np.where(threshold == 0, -np.inf, kth)[:, None]) & (True if mask is None else mask)
        kept = np.where(keep, logits.astype(np.float64), -np.inf)
        padded = np.pad(kept, ((0, 0), (0, -vocab % segment)), constant_values=-np.inf).reshape(6, -1, segment)
        maximum = padded.max(axis=-1)
        np.testing.assert_array_equal(np.asarray(got.maximum), maximum)
        np.testing.assert_array_equal(np.asarray(got.argmax),
                                      padded.argmax(axis=-1) + np.arange(padded.shape[1]) * segment)
        shift = np.where(np.isfinite(maximum), maximum, 0.0)
        np.testing.assert_allclose(np.asarray(got.mass), np.exp(padded - shift[..., None]).sum(-1), rtol=2e-6)
        np.testing.assert_array_equal(np.asarray(got.row_argmax()), kept.argmax(axis=1))
        assert mask is not None or int(got.row_argmax()[1]) == 3
        for shift in (kept.max(axis=1), np.median(logits, axis=1)):
            np.testing.assert_allclose(np.asarray(got.row_mass(jnp.asarray(shift, jnp.float32))),
                                       np.exp(kept - shift[:, None]).sum(axis=1), rtol=2e-6)


@pytest.mark.parametrize("kwargs", SEGMENT_IMPLS[:2], ids=["reference", "pallas"])
def test_a_row_keeping_nothing_has_no_finite_confidence_and_its_empty_segments_add_nothing(kwargs):
    """A segment whose logits are all -inf or not allowed: maximum -inf, its first id, mass 0 (not NaN), so the
    row's mass is its other segments'; a row with nothing kept above -inf has a NaN mass at its -inf maximum."""
    logits = np.random.default_rng(4).normal(size=(2, 300)).astype(np.float32)
    logits[0, 128:256] = -np.inf
    logits[1] = -np.inf
    got = jax.jit(functools.partial(kept_segments, **kwargs))(jnp.asarray(logits), jnp.zeros(2, jnp.uint32))
    assert float(got.maximum[0, 1]) == -np.inf and int(got.argmax[0, 1]) == 128 and float(got.mass[0, 1]) == 0.0
    kept = np.delete(logits[0], np.s_[128:256]).astype(np.float64)
    mass = got.row_mass(jnp.asarray([logits[0].max(), -np.inf], jnp.float32))
    assert float(mass[0]) == pytest.approx(np.exp(kept - kept.max()).sum(), rel=2e-6)
    assert np.isnan(float(mass[1])) and int(got.row_argmax()[1]) == 0


def test_kept_segments_of_a_row_are_the_same_in_any_batch_and_from_either_operand(monkeypatch):
    """A row's segments, bit for bit: alone, in a batch, in blocks of rows (past the kernel's int32 offsets), and
    from bf16 logits with a mask (the sampler's greedy branch) or from their masked float32 copy (its other branch),
    whose loads Triton lays out differently, and without a threshold (the greedy branch) as with threshold 0: a
    confidence that moved with any of these could move a request's commits."""
    rng = np.random.default_rng(3)
    vocab = 5000
    logits = jnp.asarray(rng.normal(size=(6, vocab)) * 4, jnp.bfloat16)
    allowed = jnp.asarray(rng.random(vocab) < 0.9)
    masked_f32 = jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
    threshold = jnp.asarray([0, 0, 3_000_000_000, 0, 3_200_000_000, 0], jnp.uint32)
    # 1024-logit chunks: at 64 Triton happened to lay out bf16 and float32 loads alike, and a plain lane sum passed
    tiling = dict(impl="pallas", interpret=not ON_GPU, chunk=1024, segment=2048)
    with_mask = jax.jit(functools.partial(kept_segments, allowed=allowed, **tiling))
    copy = jax.jit(functools.partial(kept_segments, **tiling))

    def assert_same(got, want, message=""):
        for name, a, b in zip(want._fields, got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} {message}")

    together = with_mask(logits, threshold)
    assert_same(copy(masked_f32, threshold), together, "float32 copy")
    unfiltered = np.asarray(threshold) == 0  # no threshold (the greedy branch) as threshold 0 (the other's)
    assert_same(with_mask(logits[unfiltered]), type(together)(*(a[unfiltered] for a in together)), "no threshold")
    for row in range(6):
        alone = with_mask(logits[row:row + 1], threshold[row:row + 1])
        assert_same(alone, type(together)(*(a[row:row + 1] for a in together)), f"row {row}")
    monkeypatch.setattr(top_k_top_p, "_OFFSET_LIMIT", 4 * vocab + 2048)  # 4 rows per call: blocks of 4 and 2
    blocks = jax.jit(functools.partial(kept_segments, allowed=allowed, **tiling))
    assert_same(blocks(logits, threshold), together, "blocks")


@pytest.mark.parametrize("kwargs", SEGMENT_IMPLS[:2], ids=["reference", "pallas"])
def test_nan_logits_give_an_id_in_the_vocabulary_and_a_nan_mass(kwargs):
    """A broken model's NaN logits: whatever the argmax, it names a token (an id past the vocabulary would reach the
    tokenizer), and the confidence is NaN. Rows: all NaN; a last (partial) segment of NaN; one NaN."""
    logits = np.random.default_rng(5).normal(size=(3, 300)).astype(np.float32)
    logits[0] = np.nan
    logits[1, 256:] = np.nan
    logits[2, 10] = np.nan
    got = jax.jit(functools.partial(kept_segments, **kwargs))(jnp.asarray(logits))
    assert ((np.asarray(got.argmax) >= 0) & (np.asarray(got.argmax) < 300)).all()
    assert ((np.asarray(got.row_argmax()) >= 0) & (np.asarray(got.row_argmax()) < 300)).all()
    assert np.isnan(np.asarray(got.row_mass(jnp.zeros(3, jnp.float32)))).all()


def test_kept_segments_reject_a_segment_of_more_than_16_chunks():
    with pytest.raises(ValueError, match="16 chunks"):
        kept_segments(jnp.zeros((2, 64)), jnp.zeros(2, jnp.uint32), chunk=32, segment=1024)


def test_lanes_add_as_a_tree_over_their_indices():
    """kept_segments adds its lanes neighbours first, by index: bit for bit that tree, whatever layout
    Triton gives the lanes (a plain reduction's order follows the layout, which follows the operands' dtypes)."""
    lanes = np.random.default_rng(0).lognormal(sigma=3.0, size=1024).astype(np.float32)
    tree = lanes
    while len(tree) > 1:
        tree = tree[0::2] + tree[1::2]
    assert np.asarray(jax.jit(top_k_top_p._sum_in_index_order)(jnp.asarray(lanes))) == tree[0]
    # the data tell the tree from a left-to-right sum (XLA's sum is no contrast: on the H200 it gave the tree's bits)
    assert functools.reduce(np.add, lanes) != tree[0]
