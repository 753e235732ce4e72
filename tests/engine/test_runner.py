"""The device step's LM head on the positions a strategy reads: row buckets, and which rows get which proposal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import DecodingConfig
from jaxllm.decoding import WindowState
from jaxllm.engine.runner import RoundInputs, StepSpec, logit_row_buckets, proposals_at_read_positions, read_row_inputs
from jaxllm.sampling import propose


def test_lm_head_row_buckets():
    assert logit_row_buckets(1024, 256) == [0, 256, 512, 768, 1024]  # LLaDA2 batch 32
    assert logit_row_buckets(512, 256) == [0, 256, 384, 512]
    assert logit_row_buckets(32, 256) == [0, 32]  # batch 1: all rows, or none
    assert logit_row_buckets(8, 1) == [0, 2, 4, 6, 8]


def test_each_read_row_gets_its_own_proposal_from_the_smallest_bucket_that_holds_the_reads():
    """A stand-in LM head proposes token row + num_rows * (its bucket's index): every read position gets its own
    row's proposal, computed in the smallest bucket that holds all reads (a bucket too small would leave reads
    without a proposal and stall the engine; one too large only costs time, which no engine test would see)."""
    batch, window, block = 2, 4, 4
    num_rows = batch * window
    buckets = logit_row_buckets(num_rows, 1)  # [0, 2, 4, 6, 8]
    vocab = num_rows * len(buckets) + 1
    mask_id = vocab - 1

    class Head:
        def head(self, hidden):  # hidden [R, 1] holds each row's index
            token = hidden[:, 0].astype(jnp.int32) + num_rows * buckets.index(hidden.shape[0])
            return 30.0 * jax.nn.one_hot(token, vocab)

    spec = StepSpec(decoding=DecodingConfig("threshold", threshold=0.5), block_size=block, mask_token_id=mask_id,
                    vocab_size=vocab, num_real_tokens=vocab, min_logit_rows=1)
    hidden = jnp.arange(num_rows, dtype=jnp.float32).reshape(batch, window, 1)
    zeros, blocks = jnp.zeros(batch, jnp.int32), jnp.zeros((batch, 1), jnp.int32)

    @jax.jit
    def propose(tokens, read):
        state = WindowState(tokens, jnp.zeros_like(read), jnp.ones(batch, jnp.int32), blocks, blocks, blocks)
        inputs = RoundInputs(state, zeros, jnp.zeros((batch, 1), jnp.int32), jnp.ones(batch, jnp.int32),
                             jnp.arange(batch, dtype=jnp.uint32), jnp.zeros(batch, jnp.float32),
                             jnp.full(batch, -1, jnp.int32), jnp.ones(batch, jnp.float32), jnp.int32(1))
        positions = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (batch, window))
        rows = read_row_inputs(inputs, positions, spec=spec)
        return proposals_at_read_positions(Head(), hidden, read, state, rows, spec=spec)

    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(40):
        read = rng.random((batch, window)) < rng.random()
        tokens = np.where(read, mask_id, rng.integers(0, num_rows, (batch, window))).astype(np.int32)
        candidates, confidence = (np.asarray(x) for x in propose(tokens, read))
        count = int(read.sum())
        bucket = min(b for b in buckets if b >= count)
        seen.add(bucket)
        rows = np.arange(num_rows).reshape(batch, window)
        np.testing.assert_array_equal(candidates[read], rows[read] + num_rows * buckets.index(bucket))
        assert (confidence[read] > 0.99).all()
        if count == 0:  # the LM head did not run: the window stays as it is
            np.testing.assert_array_equal(candidates, tokens)
    assert seen == set(buckets)


def test_a_read_row_samples_with_its_requests_seed_its_position_and_its_blocks_step():
    """Seeded sampling draws from (seed, absolute position, the step of the position's block): the step's rows, two
    blocks per window at different steps, sample as propose does for each one alone."""
    batch, window, block, vocab = 2, 8, 4, 50
    num_rows = batch * window
    table = jnp.asarray(np.random.default_rng(1).normal(size=(num_rows, vocab)), jnp.float32)

    class Head:
        def head(self, hidden):  # hidden [R, 1] holds each row's index
            return table[hidden[:, 0].astype(jnp.int32)]

    spec = StepSpec(decoding=DecodingConfig("threshold", threshold=0.5), block_size=block, mask_token_id=vocab - 1,
                    vocab_size=vocab, num_real_tokens=vocab, min_logit_rows=1)
    seeds = jnp.array([11, 12], jnp.uint32)
    block_steps = jnp.array([[3, 7], [1, 5]], jnp.int32)
    context_lens = jnp.array([8, 40], jnp.int32)
    temperature = jnp.ones(batch, jnp.float32)
    read = np.random.default_rng(2).random((batch, window)) < 0.6
    state = WindowState(jnp.full((batch, window), vocab - 1, jnp.int32), jnp.zeros((batch, window), bool),
                        jnp.full(batch, 2, jnp.int32), block_steps, block_steps, jnp.zeros_like(block_steps))
    inputs = RoundInputs(state, context_lens, jnp.zeros((batch, 1), jnp.int32), jnp.full(batch, 2, jnp.int32), seeds,
                         temperature, jnp.full(batch, -1, jnp.int32), jnp.ones(batch, jnp.float32), jnp.int32(1))
    positions = context_lens[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]
    hidden = jnp.arange(num_rows, dtype=jnp.float32).reshape(batch, window, 1)
    rows = read_row_inputs(inputs, positions, spec=spec)
    candidates, _ = jax.jit(lambda r: proposals_at_read_positions(Head(), hidden, r, state, rows, spec=spec))(read)
    propose_one = jax.jit(propose)
    allowed = jnp.arange(vocab) != vocab - 1  # as the engine: never the mask id
    alone = [[int(propose_one(table[b * window + q][None, None], seeds[b:b + 1], positions[b:b + 1, q:q + 1],
                              block_steps[b:b + 1, q // block, None], temperature[b:b + 1], jnp.array([-1]),
                              jnp.ones(1), allowed)[0][0, 0]) for q in range(window)] for b in range(batch)]
    np.testing.assert_array_equal(np.asarray(candidates)[read], np.asarray(alone)[read])


@pytest.mark.parametrize("strategy, softmax_temperature", [("threshold", 0.5), ("fixed_steps", 1.0)])
def test_the_confidence_a_strategy_ranks_by(strategy, softmax_temperature):
    """threshold strategies compare the probability under the distribution drawn from (temperature 0.5 here, as
    LLaDA2 / SDAR do); fixed_steps ranks by the plain softmax p(x0), whatever the temperature (decoding.md 4)."""
    batch, window, block, vocab = 1, 4, 4, 50
    table = jnp.asarray(np.random.default_rng(3).normal(size=(window, vocab)) * 2, jnp.float32)

    class Head:
        def head(self, hidden):
            return table[hidden[:, 0].astype(jnp.int32)]

    decoding = DecodingConfig(strategy, **({"denoising_steps": block} if strategy == "fixed_steps" else {}))
    spec = StepSpec(decoding=decoding, block_size=block, mask_token_id=vocab - 1, vocab_size=vocab,
                    num_real_tokens=vocab - 1, min_logit_rows=1)
    state = WindowState(jnp.full((batch, window), vocab - 1, jnp.int32), jnp.zeros((batch, window), bool),
                        jnp.ones(batch, jnp.int32), *(jnp.zeros((batch, 1), jnp.int32),) * 3)
    inputs = RoundInputs(state, jnp.zeros(batch, jnp.int32), jnp.zeros((batch, 1), jnp.int32),
                         jnp.ones(batch, jnp.int32), jnp.array([4], jnp.uint32), jnp.full(batch, 0.5, jnp.float32),
                         jnp.full(batch, -1, jnp.int32), jnp.ones(batch, jnp.float32), jnp.int32(1))
    positions = jnp.arange(window, dtype=jnp.int32)[None]
    hidden = jnp.arange(window, dtype=jnp.float32).reshape(batch, window, 1)
    rows = read_row_inputs(inputs, positions, spec=spec)
    read = jnp.ones((batch, window), bool)
    candidates, confidence = (np.asarray(x[0]) for x in jax.jit(
        lambda: proposals_at_read_positions(Head(), hidden, read, state, rows, spec=spec))())
    logits = np.asarray(table, np.float64)[:, :vocab - 1] / softmax_temperature
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    np.testing.assert_allclose(confidence, probabilities[np.arange(window), candidates], rtol=1e-5)
