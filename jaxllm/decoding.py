"""Block-diffusion decoding strategies as pure on-device updates of a request's window.

A window holds `buffer_size` blocks of `block_size` tokens at absolute, block-aligned positions; the first
`num_active_blocks` are being denoised, the rest are placeholders. Each step, given a candidate token and its
confidence (sampling.propose) at the positions it reads (`read_positions`), a strategy writes some masked positions
(mask -> token) and, for editing strategies, rewrites some filled ones (token -> token):

  threshold        every masked position with confidence >= threshold; the front block with masks (and a block
                   whose predecessor is at least semi_complete_threshold full) always takes its most confident one
  fixed_steps      k_t = M // S + (t < M % S) most confident masked positions at step t of S (M = initial masks)
  joint_threshold  threshold for masks, plus any filled, non-prompt position whose candidate differs with
                   confidence > editing_threshold, for at most max_post_steps mask-free steps (LLaDA2.1)

A block is complete after a step whose input had no masks in it or any earlier window block and that changed
nothing there: the forward of that step wrote its KV from its final tokens. Prompt positions are never written.
Ties in confidence go to the lower position.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.config import DecodingConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WindowState:
    """Per-request window state; B requests, Q = N * block_size positions, N = buffer_size blocks."""

    tokens: jax.Array  # i32[B, Q] the mask id where masked
    fixed: jax.Array  # bool[B, Q] prompt positions inside the window
    num_active_blocks: jax.Array  # i32[B] blocks in flight; 0 for an idle batch slot
    block_steps: jax.Array  # i32[B, N] steps each block has been denoised (keys the sampler; t of fixed_steps)
    block_masks: jax.Array  # i32[B, N] masks each block had at its first step
    post_steps: jax.Array  # i32[B, N] mask-free steps that still edited the block (joint_threshold)


def _per_block(x, block_size):
    return x.reshape(x.shape[0], -1, block_size, *x.shape[2:])


def _top_k_positions(confidence, eligible, k):
    """bool[B, N, S]: the k[b, n] most confident eligible positions of each block (ties to the lower position)."""
    size = confidence.shape[-1]
    conf_i, conf_j = confidence[..., :, None], confidence[..., None, :]
    lower = jnp.arange(size)[None, :] < jnp.arange(size)[:, None]  # [i, j]: j before i
    beats = eligible[..., None, :] & ((conf_j > conf_i) | ((conf_j == conf_i) & lower))
    rank = beats.sum(axis=-1)
    return eligible & (rank < k[..., None])


def _threshold_transfer(confidence, eligible, threshold, force, strict):
    """Masked positions at or above threshold (strict: above it); where forced, also the block's most confident one,
    by rank, so that it is taken whatever the confidences are. `threshold` accepts c >= threshold (decoding.md §3),
    LLaDA2.1's joint_threshold only p > threshold (§7)."""
    above = (confidence > threshold) if strict else (confidence >= threshold)
    most_confident = _top_k_positions(confidence, eligible & force[..., None], jnp.ones(force.shape, jnp.int32))
    return (eligible & above) | most_confident


def _forced_blocks(is_mask, fixed, active, semi_complete_threshold):
    """bool[B, N]: blocks that must take at least one token this step (progress guarantee)."""
    has_masks = is_mask.any(axis=-1) & active
    first_with_masks = has_masks & (jnp.cumsum(has_masks, axis=1) == 1)
    if semi_complete_threshold is None:
        return first_with_masks
    progress = _progress(is_mask, fixed)
    predecessor_full = jnp.pad(progress[:, :-1], ((0, 0), (1, 0))) >= semi_complete_threshold
    return first_with_masks | (has_masks & predecessor_full)


def _progress(is_mask, fixed):
    """f32[B, N]: fraction of each block's generated positions already filled."""
    open_positions = jnp.maximum((~fixed).sum(axis=-1), 1)
    return 1.0 - is_mask.sum(axis=-1) / open_positions


def _window_masks(state: WindowState, cfg: DecodingConfig, block_size: int, mask_token_id: int):
    """Per block [B, N, S]: tokens, fixed, is_mask, eligible (masked, in an active block); per block [B, N]: active,
    editing_on (joint_threshold: the block may still rewrite filled positions; else None)."""
    tokens, fixed = _per_block(state.tokens, block_size), _per_block(state.fixed, block_size)
    active = jnp.arange(tokens.shape[1])[None, :] < state.num_active_blocks[:, None]  # [B, N]
    is_mask = (tokens == mask_token_id) & ~fixed  # a prompt may hold the mask id itself: it stays as given
    # max_post_steps caps only the mask-free steps: while a block still has masks, T2T edits it regardless
    editing_on = (active & ((state.post_steps < cfg.max_post_steps) | is_mask.any(axis=-1))
                  if cfg.strategy == "joint_threshold" else None)
    return tokens, fixed, is_mask, is_mask & active[..., None], active, editing_on


def read_positions(state: WindowState, cfg: DecodingConfig, *, block_size: int, mask_token_id: int):
    """bool[B, Q]: the positions whose candidate and confidence `update` reads (masked positions of active blocks;
    with joint_threshold also the filled, non-prompt positions of blocks still editing). A step proposes tokens for
    these only: none in a verifying forward, unless its block may still edit."""
    _, fixed, _, eligible, _, editing_on = _window_masks(state, cfg, block_size, mask_token_id)
    read = eligible if editing_on is None else eligible | (editing_on[..., None] & ~fixed)
    return read.reshape(state.tokens.shape)


def update(state: WindowState, candidates, confidence, max_blocks, cfg: DecodingConfig, *, block_size: int,
           mask_token_id: int):
    """One decoding step. candidates i32[B, Q], confidence f32[B, Q], max_blocks i32[B]; only their values at
    `read_positions` matter.

    Returns (new state, complete bool[B, N]) where complete marks the window's leading run of finished blocks.
    """
    tokens, fixed, is_mask, eligible, active, editing_on = _window_masks(state, cfg, block_size, mask_token_id)
    cand = _per_block(candidates, block_size)
    # NaN compares with nothing: as the lowest confidence, the ranks still pick k positions and forced progress holds
    conf = _per_block(jnp.where(jnp.isnan(confidence), -jnp.inf, confidence), block_size)
    masks_in = is_mask.sum(axis=-1)
    block_masks = jnp.where(state.block_steps == 0, masks_in, state.block_masks)

    if cfg.strategy == "fixed_steps":
        steps = cfg.denoising_steps
        k = block_masks // steps + (state.block_steps < block_masks % steps)
        write = _top_k_positions(conf, eligible, k)
    else:
        force = _forced_blocks(is_mask, fixed, active, cfg.semi_complete_threshold)
        write = _threshold_transfer(conf, eligible, cfg.threshold, force, strict=cfg.strategy == "joint_threshold")
    post_steps = state.post_steps
    if editing_on is not None:
        write |= (editing_on[..., None] & ~fixed & ~is_mask & (cand != tokens) & (conf > cfg.editing_threshold))

    new_tokens = jnp.where(write, cand, tokens)
    changed = (new_tokens != tokens).any(axis=-1)
    stable = active & (masks_in == 0) & ~changed
    complete = jnp.cumprod(stable, axis=1).astype(bool)
    stepping = active & ~complete
    if cfg.strategy == "joint_threshold":
        post_steps = post_steps + (stepping & (masks_in == 0) & changed)

    num_active = state.num_active_blocks
    if cfg.add_block_threshold is not None:
        last = jnp.maximum(num_active - 1, 0)
        progress = _progress((new_tokens == mask_token_id) & ~fixed, fixed)
        last_progress = jnp.take_along_axis(progress, last[:, None], axis=1)[:, 0]
        num_active = num_active + ((num_active > 0) & (num_active < max_blocks)
                                   & (last_progress >= cfg.add_block_threshold))

    new_state = WindowState(
        tokens=new_tokens.reshape(state.tokens.shape), fixed=state.fixed, num_active_blocks=num_active,
        block_steps=state.block_steps + stepping, block_masks=block_masks, post_steps=post_steps)
    return new_state, complete


def max_steps_per_block(cfg: DecodingConfig, block_size: int) -> int:
    """Steps that always finish a front block: one write per step at least, plus the verifying forward."""
    if cfg.strategy == "fixed_steps":
        return min(cfg.denoising_steps, block_size) + 1
    if cfg.strategy == "joint_threshold":
        return block_size + cfg.max_post_steps + 1
    return block_size + 1
