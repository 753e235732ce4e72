"""Decoding strategies as pure updates: each knob changes what gets written, and prompts are never touched."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ConfigError, DecodingConfig
from jaxllm.decoding import WindowState, read_positions, update

M = 1  # mask id
BLOCK = 4


def window(tokens, fixed=None, num_active=1, block_steps=None, post_steps=None):
    tokens = np.asarray(tokens, np.int32)[None]
    n = tokens.shape[1] // BLOCK
    return WindowState(
        tokens=jnp.asarray(tokens), fixed=jnp.asarray(np.zeros_like(tokens, bool) if fixed is None else [fixed]),
        num_active_blocks=jnp.array([num_active], jnp.int32),
        block_steps=jnp.asarray([block_steps or [0] * n], jnp.int32), block_masks=jnp.zeros((1, n), jnp.int32),
        post_steps=jnp.asarray([post_steps or [0] * n], jnp.int32))


def step(state, candidates, confidence, cfg, max_blocks=1):
    new, complete = update(state, jnp.asarray([candidates], jnp.int32), jnp.asarray([confidence], jnp.float32),
                           jnp.array([max_blocks], jnp.int32), cfg, block_size=BLOCK, mask_token_id=M)
    return new, np.asarray(complete[0])


def tokens_of(state):
    return np.asarray(state.tokens[0]).tolist()


def test_threshold_commits_every_confident_mask_and_nothing_else():
    cfg = DecodingConfig("threshold", threshold=0.8)
    new, _ = step(window([M, M, M, M]), [5, 6, 7, 8], [0.9, 0.5, 0.85, 0.1], cfg)
    assert tokens_of(new) == [5, M, 7, M]


def test_threshold_value_changes_what_is_committed():
    low, _ = step(window([M, M, M, M]), [5, 6, 7, 8], [0.9, 0.5, 0.85, 0.1], DecodingConfig("threshold", threshold=0.4))
    assert tokens_of(low) == [5, 6, 7, M]


@pytest.mark.parametrize("strategy, committed", [("threshold", [5, 6, M, M]), ("joint_threshold", [5, M, M, M])])
def test_a_confidence_equal_to_the_threshold_commits_under_threshold_only(strategy, committed):
    """threshold takes c >= tau (decoding.md 3), LLaDA2.1's joint_threshold p > tau (7); 0.5 is exact in f32."""
    new, _ = step(window([M, M, M, M]), [5, 6, 7, 8], [0.9, 0.5, 0.25, 0.1], DecodingConfig(strategy, threshold=0.5))
    assert tokens_of(new) == committed


def test_threshold_always_commits_the_most_confident_mask():
    new, _ = step(window([M, M, M, M]), [5, 6, 7, 8], [0.2, 0.3, 0.1, 0.25], DecodingConfig("threshold", threshold=0.9))
    assert tokens_of(new) == [M, 6, M, M]


@pytest.mark.parametrize("cfg", [DecodingConfig("threshold", threshold=0.9),
                                 DecodingConfig("fixed_steps", denoising_steps=BLOCK),
                                 DecodingConfig("joint_threshold", threshold=0.9, editing_threshold=0.9)],
                         ids=lambda cfg: cfg.strategy)
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_a_block_completes_within_its_steps_whatever_the_confidences(cfg, bad):
    """Confidences that compare with nothing (a model gone NaN) still commit one mask a step, the lowest position
    first as any tie (decoding.md 13: a request that never ends): block_size steps fill the block, and the next
    forward verifies it."""
    state = window([M, M, M, M])
    for filled in range(1, BLOCK + 1):
        state, _ = step(state, [5, 6, 7, 8], [bad] * BLOCK, cfg)
        assert tokens_of(state) == [5, 6, 7, 8][:filled] + [M] * (BLOCK - filled)
    _, complete = step(state, [5, 6, 7, 8], [bad] * BLOCK, cfg)
    assert complete.all()


def test_prompt_positions_and_filled_tokens_are_never_rewritten():
    state = window([40, 41, M, 9], fixed=[True, True, False, False])
    new, _ = step(state, [5, 6, 7, 8], [1.0, 1.0, 1.0, 1.0], DecodingConfig("threshold", threshold=0.5))
    assert tokens_of(new) == [40, 41, 7, 9]


@pytest.mark.parametrize("cfg", [DecodingConfig("threshold", threshold=0.5),
                                 DecodingConfig("fixed_steps", denoising_steps=2), DecodingConfig("joint_threshold")])
def test_a_mask_id_in_the_prompt_is_never_written_and_does_not_hold_the_block_open(cfg):
    """The user's prompt may hold the mask id (token-id prompts, or text the tokenizer reads as the mask token)."""
    state = window([7, M, M, M], fixed=[True, True, False, False])
    for _ in range(BLOCK + 2):
        state, complete = step(state, [5, 6, 8, 9], [1.0] * 4, cfg)
        if complete[0]:
            break
    assert tokens_of(state) == [7, M, 8, 9] and complete[0]


def test_a_block_completes_only_after_a_step_whose_input_had_no_masks():
    cfg = DecodingConfig("threshold", threshold=0.5)
    new, complete = step(window([3, M, 4, 5]), [3, 6, 4, 5], [0.9] * 4, cfg)
    assert tokens_of(new) == [3, 6, 4, 5] and not complete[0]  # this forward saw a mask: its KV is stale
    _, complete = step(new, [3, 6, 4, 5], [0.9] * 4, cfg)
    assert complete[0]


@pytest.mark.parametrize("steps, expected_counts", [(3, [2, 1, 1]), (4, [1, 1, 1, 1]), (2, [2, 2])])
def test_fixed_steps_spreads_the_masks_evenly_over_the_steps(steps, expected_counts):
    cfg = DecodingConfig("fixed_steps", denoising_steps=steps)
    state = window([M, M, M, M])
    confidence = [0.4, 0.3, 0.2, 0.1]
    counts = []
    while (np.asarray(state.tokens) == M).any():
        before = (np.asarray(state.tokens) == M).sum()
        state, _ = step(state, [5, 6, 7, 8], confidence, cfg)
        counts.append(int(before - (np.asarray(state.tokens) == M).sum()))
    assert counts == expected_counts
    assert tokens_of(state) == [5, 6, 7, 8]


def test_fixed_steps_ties_go_to_the_lower_position():
    new, _ = step(window([M, M, M, M]), [5, 6, 7, 8], [0.5] * 4, DecodingConfig("fixed_steps", denoising_steps=4))
    assert tokens_of(new) == [5, M, M, M]


@pytest.mark.parametrize("editing_threshold, edited", [(0.5, True), (0.7, False)])
def test_joint_threshold_edits_filled_tokens_above_the_editing_threshold(editing_threshold, edited):
    cfg = DecodingConfig("joint_threshold", threshold=0.9, editing_threshold=editing_threshold, max_post_steps=4)
    state = window([3, 4, M, 5], fixed=[True, False, False, False])
    new, _ = step(state, [9, 8, 7, 5], [0.6, 0.6, 0.95, 0.6], cfg)
    assert tokens_of(new) == [3, 8 if edited else 4, 7, 5]  # the prompt position 0 is never edited


def test_editing_stops_after_max_post_steps_and_then_the_block_completes():
    cfg = DecodingConfig("joint_threshold", threshold=0.5, editing_threshold=0.0, max_post_steps=2)
    state = window([3, 4, 5, 6])
    flips = ([7, 4, 5, 6], [3, 4, 5, 6], [7, 4, 5, 6])
    history = []
    for candidates in flips:
        state, complete = step(state, candidates, [0.9] * 4, cfg)
        history.append((tokens_of(state)[0], bool(complete[0])))
    assert history == [(7, False), (3, False), (3, True)]


@pytest.mark.parametrize("max_post_steps", [0, 1])
def test_editing_runs_while_the_block_has_masks_whatever_max_post_steps(max_post_steps):
    cfg = DecodingConfig("joint_threshold", threshold=0.9, editing_threshold=0.5, max_post_steps=max_post_steps)
    new, _ = step(window([7, M, M, M]), [9, 20, 21, 22], [0.99, 0.2, 0.1, 0.1], cfg)
    assert tokens_of(new)[0] == 9


def test_add_block_threshold_opens_the_next_block():
    tokens = [M] * 8
    for threshold, opened in ((0.5, True), (0.75, False)):
        cfg = DecodingConfig("threshold", threshold=0.9, buffer_size=2, add_block_threshold=threshold)
        new, _ = step(window(tokens), list(range(10, 18)), [0.95, 0.95, 0.1, 0.1] + [0.1] * 4, cfg, max_blocks=2)
        assert int(new.num_active_blocks[0]) == (2 if opened else 1)


def test_no_block_opens_beyond_max_blocks():
    cfg = DecodingConfig("threshold", threshold=0.5, buffer_size=2, add_block_threshold=0.1)
    new, _ = step(window([M] * 8), list(range(10, 18)), [0.9] * 8, cfg, max_blocks=1)
    assert int(new.num_active_blocks[0]) == 1


@pytest.mark.parametrize("semi_complete, forced", [(0.7, True), (0.8, False)])
def test_semi_complete_threshold_forces_progress_in_the_next_block(semi_complete, forced):
    cfg = DecodingConfig("threshold", threshold=0.9, buffer_size=2, add_block_threshold=0.1,
                         semi_complete_threshold=semi_complete)
    state = window([3, 4, 5, M, M, M, M, M], num_active=2)  # first block 3/4 full
    new, _ = step(state, list(range(10, 18)), [0.5, 0.5, 0.5, 0.2, 0.3, 0.4, 0.2, 0.1], cfg, max_blocks=2)
    second_block = tokens_of(new)[4:]
    assert second_block == ([M, 15, M, M] if forced else [M] * 4)


def test_later_blocks_complete_only_behind_earlier_ones():
    cfg = DecodingConfig("threshold", threshold=0.5, buffer_size=2, add_block_threshold=0.1)
    state = window([3, M, 5, 6, 7, 8, 9, 10], num_active=2)
    _, complete = step(state, [3, 2, 5, 6, 7, 8, 9, 10], [0.1] * 8, cfg, max_blocks=2)
    assert complete.tolist() == [False, False]


@pytest.mark.parametrize("options", [
    dict(strategy="threshold", denoising_steps=4),
    dict(strategy="fixed_steps", threshold=0.9),
    dict(strategy="threshold", editing_threshold=0.5),
    dict(strategy="threshold", add_block_threshold=0.2),
    dict(strategy="fixed_steps", denoising_steps=4, buffer_size=2, semi_complete_threshold=0.3),
    dict(strategy="threshold", threshold=1.5),
    dict(strategy="speculative"),
])
def test_knobs_the_strategy_does_not_read_are_rejected(options):
    with pytest.raises(ConfigError):
        DecodingConfig(**options)


def test_llada21_presets_set_the_published_thresholds():
    quality, speed = DecodingConfig.joint_threshold_preset("quality"), DecodingConfig.joint_threshold_preset("speed")
    assert (quality.threshold, quality.editing_threshold, quality.max_post_steps) == (0.7, 0.5, 16)
    assert (speed.threshold, speed.editing_threshold, speed.max_post_steps) == (0.5, 0.0, 16)
    assert DecodingConfig.joint_threshold_preset("speed", max_post_steps=4).max_post_steps == 4


def test_a_preset_is_an_option_that_explicit_settings_override():
    from jaxllm.config import split_options

    _, speed = split_options(dict(decoding_preset="speed"))
    assert (speed.strategy, speed.threshold, speed.editing_threshold) == ("joint_threshold", 0.5, 0.0)
    _, tuned = split_options(dict(decoding_preset="quality", decoding_strategy="joint_threshold", max_post_steps=4))
    assert (tuned.threshold, tuned.editing_threshold, tuned.max_post_steps) == (0.7, 0.5, 4)
    # an option given as None is one left out: it once wiped the preset's value for the strategy's default
    _, unset = split_options(dict(decoding_preset="speed", threshold=None, editing_threshold=None))
    assert (unset.threshold, unset.editing_threshold) == (0.5, 0.0)
    with pytest.raises(ConfigError):
        split_options(dict(decoding_preset="speed", decoding_strategy="threshold"))
    with pytest.raises(ConfigError):
        split_options(dict(decoding_preset="fastest"))


@pytest.mark.parametrize("cfg", [DecodingConfig("threshold", threshold=0.5, buffer_size=2, add_block_threshold=0.5,
                                                semi_complete_threshold=0.5),
                                 DecodingConfig("fixed_steps", denoising_steps=2, buffer_size=2),
                                 DecodingConfig("joint_threshold", threshold=0.5, editing_threshold=0.3,
                                                max_post_steps=2, buffer_size=2)],
                         ids=["threshold", "fixed_steps", "joint_threshold"])
def test_update_reads_proposals_only_at_read_positions(cfg):
    """The engine proposes tokens only at read_positions (the LM head runs on those rows): whatever stands
    elsewhere, the step writes the same tokens, and a window with nothing to read (a verifying step) completes."""
    rng = np.random.default_rng(0)
    checked_writes = 0
    for _ in range(40):
        tokens = np.where(rng.random(2 * BLOCK) < 0.5, M, rng.integers(2, 9, 2 * BLOCK))
        fixed = (np.arange(2 * BLOCK) < rng.integers(0, 3)).tolist()
        state = window(tokens, fixed, num_active=int(rng.integers(1, 3)), block_steps=[int(rng.integers(0, 2)), 0],
                       post_steps=[int(rng.integers(0, 3)), 0])
        read = np.asarray(read_positions(state, cfg, block_size=BLOCK, mask_token_id=M)[0])
        candidates, confidence = rng.integers(2, 9, 2 * BLOCK), rng.random(2 * BLOCK)
        scrambled = (np.where(read, candidates, rng.integers(2, 9, 2 * BLOCK)),
                     np.where(read, confidence, rng.random(2 * BLOCK)))
        expected, expected_complete = step(state, candidates, confidence, cfg, max_blocks=2)
        got, got_complete = step(state, *scrambled, cfg, max_blocks=2)
        assert tokens_of(got) == tokens_of(expected) and (got_complete == expected_complete).all()
        for name in ("num_active_blocks", "block_steps", "block_masks", "post_steps"):
            np.testing.assert_array_equal(getattr(got, name), getattr(expected, name))
        checked_writes += tokens_of(expected) != tokens_of(state)
    assert checked_writes > 10  # the trials wrote tokens, so the reads mattered

    filled = window([5, 6, 7, 8, 1, 1, 1, 1], num_active=1)
    assert read_positions(filled, cfg, block_size=BLOCK, mask_token_id=M).sum() == (
        4 if cfg.strategy == "joint_threshold" else 0)  # an editing block still reads its filled tokens
