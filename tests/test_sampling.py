"""The on-device proposal: filters, greedy ties, and per-request seeded draws."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import sampling
from jaxllm.kernels.top_k_top_p import filter_threshold, kept_segments
from jaxllm.sampling import SamplingParams, propose
from tests.cuda_lowering import lowered_for_h100


def run(logits, seeds, temperature, top_k=-1, top_p=1.0, positions=None, allowed=None, dtype=jnp.float32):
    """temperature: one value for every row or one per row."""
    logits = jnp.asarray(logits, dtype)
    batch, window, _ = logits.shape
    positions = jnp.zeros((batch, window), jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
    return propose(logits, jnp.asarray(seeds, jnp.uint32), positions, jnp.zeros((batch, window), jnp.int32),
                   jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (batch,)), jnp.full(batch, top_k, jnp.int32),
                   jnp.full(batch, top_p, jnp.float32), None if allowed is None else jnp.asarray(allowed))


def test_greedy_picks_the_lowest_id_on_ties_and_reports_softmax_confidence():
    candidates, confidence = run([[[1.0, 3.0, 3.0, 0.0]]], [0], 0.0)
    assert int(candidates[0, 0]) == 1
    expected = np.exp(3.0) / np.exp([1.0, 3.0, 3.0, 0.0]).sum()
    assert float(confidence[0, 0]) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.8),
                                      dict(temperature=0.7, top_k=5)], ids=["greedy", "top_p", "top_k"])
def test_bf16_logits_propose_as_their_float32_copy(settings):
    """The engine hands propose the LM head's bf16 output: each branch reads it as float32, exactly."""
    logits = np.array(jnp.asarray(np.random.default_rng(2).normal(size=(2, 16, 300)) * 3, jnp.bfloat16))
    logits[0, 3, :5] = logits[0, 3].max()  # ties
    allowed = np.arange(300) % 7 != 0
    from_bf16 = run(logits, [5, 6], positions=np.arange(16)[None].repeat(2, 0), allowed=allowed, dtype=jnp.bfloat16,
                    **settings)
    from_f32 = run(logits.astype(np.float32), [5, 6], positions=np.arange(16)[None].repeat(2, 0), allowed=allowed,
                   **settings)
    for a, b in zip(from_bf16, from_f32):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_top_k_one_always_draws_the_argmax():
    logits = np.random.default_rng(0).normal(size=(1, 64, 50))
    candidates, confidence = run(logits[:, :, :], [3], 1.5, top_k=1)
    assert (np.asarray(candidates[0]) == logits[0].argmax(-1)).all()
    assert np.allclose(confidence, 1.0)


def test_top_p_draws_only_from_the_nucleus():
    logits = np.log(np.array([[[0.5, 0.3, 0.15, 0.05]] * 200]))
    candidates, _ = run(logits, [11], 1.0, top_p=0.7, positions=np.arange(200)[None])
    assert set(np.asarray(candidates[0]).tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7


def test_a_seed_gives_the_same_draws_in_any_batch_slot():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, 8, 100))
    alone, _ = run(logits, [42], 1.0, positions=np.arange(8)[None])
    batched, _ = run(np.concatenate([rng.normal(size=(1, 8, 100)), logits]), [7, 42], 1.0,
                     positions=np.stack([np.arange(8), np.arange(8)]))
    assert (np.asarray(batched[1]) == np.asarray(alone[0])).all()
    other, _ = run(logits, [43], 1.0, positions=np.arange(8)[None])
    assert (np.asarray(other[0]) != np.asarray(alone[0])).any()


@pytest.mark.parametrize("filters", ["auto", "kernel"])
def test_a_filtering_request_gets_the_same_proposals_in_any_batch(filters, monkeypatch):
    """Each request's top_p equals the float32 mass of a prefix of its first row, the edge where two ways of
    summing disagree: its proposals and their confidences (the nucleus is their denominator) must not depend on how
    many rows the batch holds (a choice of filter method by batch size broke this). "auto" is the platform's
    filter (the sort off the GPU, the kernel on it); "kernel" the Pallas kernel everywhere (interpret mode on CPU)."""
    if filters == "kernel":
        monkeypatch.setattr(sampling, "filter_threshold", functools.partial(
            filter_threshold, impl="pallas", interpret=jax.default_backend() != "gpu", chunk=256, segment=1024))
    rng = np.random.default_rng(8)
    batch, window, vocab = 4, 32, 4096
    logits = (rng.normal(size=(batch, window, vocab)) * 3).astype(np.float32)
    first_rows = np.sort(logits[:, 0].astype(np.float64), axis=-1)[:, ::-1]
    mass = np.cumsum(np.exp(first_rows) / np.exp(first_rows).sum(-1, keepdims=True), axis=-1)
    top_p = mass[np.arange(batch), rng.integers(1, 200, batch)].astype(np.float32)
    positions = np.tile(np.arange(window, dtype=np.int32), (batch, 1))

    propose_jitted = jax.jit(lambda *args: propose(*args))  # its own cache: the other case's filter is not reused

    def proposals(rows):
        return propose_jitted(jnp.asarray(logits[rows]), jnp.asarray(rows, jnp.uint32), jnp.asarray(positions[rows]),
                       jnp.zeros((len(rows), window), jnp.int32), jnp.ones(len(rows)), jnp.full(len(rows), -1),
                       jnp.asarray(top_p[rows]))

    together = proposals(list(range(batch)))
    for b in range(batch):
        alone = proposals([b])
        for both, one in zip(together, alone):
            np.testing.assert_array_equal(np.asarray(both[b]), np.asarray(one[0]), err_msg=f"request {b}")


def _beside(logits, neighbour, dtype, allowed):
    """propose for the rows of logits [1, Q, V] alone (greedy) and as the second row beside a row with the neighbour's
    settings: the two (candidates, confidence)."""
    alone = run(logits, [5], 0.0, allowed=allowed, dtype=dtype)
    settings = dict(temperature=[0.0, 0.0], top_k=[-1, -1], top_p=[1.0, 1.0])
    for name, value in neighbour.items():
        settings[name][0] = value
    window = logits.shape[1]
    logits2 = np.concatenate([np.random.default_rng(7).normal(size=logits.shape), logits])
    mixed = propose(
        jnp.asarray(logits2, dtype), jnp.asarray([9, 5], jnp.uint32), jnp.zeros((2, window), jnp.int32),
        jnp.zeros((2, window), jnp.int32), *(jnp.asarray(settings[key], kind) for key, kind in
                                             (("temperature", jnp.float32), ("top_k", jnp.int32),
                                              ("top_p", jnp.float32))),
        None if allowed is None else jnp.asarray(allowed))
    return [np.asarray(a[0]) for a in alone], [np.asarray(m[1]) for m in mixed]


def _segments_from(segments, monkeypatch):
    """"kernel": the sampler's segment pass as the Pallas kernel on every platform (interpret mode off the GPU), so
    the combine runs over the kernel's own results on the CPU too; "auto": the platform's."""
    if segments == "kernel":
        monkeypatch.setattr(sampling, "kept_segments", functools.partial(
            kept_segments, impl="pallas", interpret=jax.default_backend() != "gpu", chunk=1024, segment=8192))


@pytest.mark.parametrize("segments", ["auto", "kernel"])
@pytest.mark.parametrize("neighbour", [dict(temperature=1.0), dict(top_k=50), dict(top_p=0.9)])
@pytest.mark.parametrize("dtype, masked", [(jnp.float32, False), (jnp.bfloat16, True)], ids=["f32", "bf16_masked"])
def test_a_greedy_row_gets_the_same_proposal_beside_a_sampling_or_filtering_row(neighbour, dtype, masked, segments,
                                                                                monkeypatch):
    """Plain greedy batches take their own branch; a greedy row in a batch that samples or filters must get the same
    bits (a 32k vocabulary: there the float32 cumulative mass reaches 1 before the tail ends), also as the engine
    calls it: bf16 logits, which the greedy branch reads with the token mask and the other as a masked float32 copy."""
    _segments_from(segments, monkeypatch)
    vocab = 32768
    logits = np.random.default_rng(2).normal(size=(1, 8, vocab)) * 4
    allowed = np.arange(vocab) % 11 != 3 if masked else None
    (alone_candidates, alone_confidence), (mixed_candidates, mixed_confidence) = _beside(
        logits, neighbour, dtype, allowed)
    np.testing.assert_array_equal(mixed_candidates, alone_candidates)
    np.testing.assert_array_equal(mixed_confidence, alone_confidence)


@pytest.mark.parametrize("segments", ["auto", "kernel"])
def test_a_row_with_nothing_allowed_above_minus_inf_gets_no_infinite_confidence(segments, monkeypatch):
    """Both branches take such a row's argmax as -inf (its confidence NaN), not a disallowed id's finite logit
    (whose confidence would be inf: the most confident position of its window)."""
    _segments_from(segments, monkeypatch)
    logits = np.full((1, 4, 64), -np.inf)
    logits[..., :3] = 2.0  # only disallowed ids are finite
    (_, alone), (_, mixed) = _beside(logits, dict(temperature=1.0), jnp.float32, np.arange(64) >= 3)
    assert not np.isinf(alone).any()
    np.testing.assert_array_equal(mixed, alone)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_disallowed_tokens_are_never_proposed(temperature):
    logits = np.tile(np.log([0.6, 0.3, 0.1]), (1, 300, 1))
    allowed = np.array([False, True, True])
    candidates, confidence = run(logits, [1], temperature, positions=np.arange(300)[None], allowed=allowed)
    assert 0 not in set(np.asarray(candidates).ravel().tolist())
    expected = np.where(np.asarray(candidates) == 1, 0.75, 0.25)  # the softmax over the allowed ids
    assert np.allclose(confidence, expected, rtol=1e-6)


@pytest.mark.parametrize("batch, dtype", [(1, jnp.bfloat16), (8, jnp.float32)])  # the engine hands over bf16
def test_propose_lowers_for_the_gpu_without_a_sort_or_a_float_sum_in_xla(batch, dtype):
    """XLA:GPU sorts a 157k vocabulary with a library call that cannot join the CUDA graph of the denoising loop's
    body; a sort anywhere in propose splits that graph and costs the host a round trip every forward. Lowered for
    the GPU the filters are Triton kernels (a maximum pass, then 32 / 4 search passes per filter), and so is each
    branch's sum for the confidences: with XLA's sum there, the batch-invariance tests above failed on the H200
    (inferred to be that sum, whose order XLA chooses; the sampler's other reductions are exact or in a fixed
    order)."""
    window, vocab = 32, 157184
    shapes = [((batch, window, vocab), dtype), ((batch,), jnp.uint32), ((batch, window), jnp.int32),
              ((batch, window), jnp.int32), ((batch,), jnp.float32), ((batch,), jnp.int32), ((batch,), jnp.float32),
              ((vocab,), jnp.bool_)]
    text = lowered_for_h100(jax.jit(propose), *(jax.ShapeDtypeStruct(*s) for s in shapes))
    assert "stablehlo.sort" not in text
    assert text.count("stablehlo.custom_call") == text.count("__gpu$xla.gpu.triton") == 1 + 2 * 8 + 2
    assert not re.findall(r"applies stablehlo.add across dimensions = \[[0-9, ]+\] : \(tensor<[0-9x]+xf32>", text)


@pytest.mark.parametrize("bad", [dict(max_tokens=-1), dict(temperature=-1), dict(top_k=0), dict(top_p=0.0),
                                 dict(stop=[""]), dict(seed=-1)])
def test_invalid_sampling_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_a_temperature_too_small_to_divide_by_samples_greedily():
    """Logits over a 2e-38 temperature overflow float32 (every confidence NaN); below MIN_TEMPERATURE a request is
    greedy: the argmax and its softmax confidence."""
    logits = 20 * np.random.default_rng(5).standard_normal((1, 4, 64))
    params = SamplingParams(temperature=2e-38, seed=1)
    candidates, confidence = run(logits, [1], params.temperature)
    greedy_candidates, greedy_confidence = run(logits, [1], 0.0)
    assert np.isfinite(np.asarray(confidence)).all()
    np.testing.assert_array_equal(np.asarray(candidates), np.asarray(greedy_candidates))
    np.testing.assert_array_equal(np.asarray(confidence), np.asarray(greedy_confidence))
