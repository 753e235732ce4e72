"""Per-request sampling: the user's SamplingParams and the on-device proposal of a token per position.

Every random draw for a request comes from fold_in(fold_in(key(seed), absolute position), block step), never from a
batch-wide key, so no draw depends on the batch. The logits may, in their last bits (XLA tiles a GEMM per row count),
and in bf16 that flips near-ties; EngineConfig.batch_invariant gives a request the same tokens alone or in any batch
(README: Decoding). Greedy (temperature 0, or below MIN_TEMPERATURE) takes the argmax, ties to the lowest token id.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxllm.kernels.top_k_top_p import filter_threshold, kept_segments, order_keys

# A temperature below this samples greedily (as one of 0): logits divided by a tiny temperature overflow float32, and a
# 2e-38 temperature made the row's confidences NaN.
MIN_TEMPERATURE = 1e-5


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    seed: int | None = None  # None: the engine draws one
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must lie in [0, 2], got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must lie in [0, 2**32), got {self.seed}")
        if self.temperature == 0.0:  # greedy ignores the filters: same argmax, and the plain softmax's confidence
            self.top_k, self.top_p = -1, 1.0


def _masked(logits, allowed):
    """float32 logits, -inf where a token may not be proposed (allowed [V] or None: all may)."""
    logits = logits.astype(jnp.float32)
    return logits if allowed is None else jnp.where(allowed.astype(bool), logits, -jnp.inf)


def _confidence(logits, segments, candidates, allowed=None):
    """softmax over each row's kept logits at its candidate, as 1 / (the kept mass at the candidate's logit): for an
    argmax the formula of PyTorch's softmax maximum (exp(0) = 1 over the sum). A candidate ~88 below the maximum
    overflows the sum to inf: probability 0; a row with nothing allowed above -inf gets NaN."""
    batch, window, _ = logits.shape
    # gathered, then masked: a masked float32 copy of the logits feeding the gather would be written out whole
    chosen = jnp.take_along_axis(logits, candidates[..., None], axis=-1)[..., 0].astype(jnp.float32)
    if allowed is not None:
        chosen = jnp.where(allowed.astype(bool)[candidates], chosen, -jnp.inf)
    return 1.0 / segments.row_mass(chosen.reshape(-1)).reshape(batch, window)


def _greedy_proposals(logits, allowed):
    """The argmax and its softmax probability, from one read of the logits."""
    batch, window, vocab = logits.shape
    segments = kept_segments(logits.reshape(-1, vocab), allowed=allowed)
    candidates = segments.row_argmax().reshape(batch, window)
    return candidates, _confidence(logits, segments, candidates, allowed)


def _sampled_proposals(logits, seeds, positions, steps, temperature, top_k, top_p, unscaled_confidence):
    batch, window, vocab = logits.shape
    greedy = temperature <= 0.0
    scale = jnp.where(greedy, 1.0, temperature)[:, None, None]
    scaled = logits / scale
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    rows = lambda x: jnp.broadcast_to(x[:, None], (batch, window)).reshape(-1)  # noqa: E731
    # the branches return one key per row, not the filtered logits: an identity branch would copy the logits
    threshold = jax.lax.cond(
        needs_filter,
        lambda s: filter_threshold(s.reshape(-1, vocab), rows(top_k), rows(top_p)).reshape(batch, window),
        lambda s: jnp.zeros((batch, window), jnp.uint32), scaled)
    # a greedy row's argmax and every row's kept mass come from the segments, as in the greedy branch
    segments = kept_segments(scaled.reshape(-1, vocab), threshold.reshape(-1))
    argmax = segments.row_argmax().reshape(batch, window)

    def gumbel_argmax(s):
        filtered = jnp.where(order_keys(s) >= threshold[..., None], s, -jnp.inf)

        def one(seed, position, step, row):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), step)
            return jnp.argmax(row + jax.random.gumbel(key, (vocab,), jnp.float32)).astype(jnp.int32)
        return jax.vmap(jax.vmap(one, in_axes=(None, 0, 0, 0)))(seeds, positions, steps, filtered)

    # greedy rows with a top-k / top-p filter come here too: draw noise only when some row samples
    sampled = jax.lax.cond(jnp.any(~greedy), gumbel_argmax, lambda s: argmax, scaled)
    candidates = jnp.where(greedy[:, None], argmax, sampled)
    if unscaled_confidence:  # a second pass, sampling rows only: a greedy row's are the logits themselves
        return candidates, _confidence(logits, kept_segments(logits.reshape(-1, vocab)), candidates)
    return candidates, _confidence(scaled, segments, candidates)


def is_plain_greedy(temperature, top_k, top_p):
    """bool[]: every row greedy and unfiltered, so `propose` may take its one-pass branch."""
    return jnp.all((temperature <= 0.0) & (top_k <= 0) & (top_p >= 1.0))


def propose(logits, seeds, positions, steps, temperature, top_k, top_p, allowed=None, *, plain_greedy=None,
            unscaled_confidence=False):
    """A candidate token and its confidence for every position.

    logits [B, Q, V], bfloat16 or float32 (each branch converts them to float32 itself: the greedy branch's one
    pass reads bf16 logits directly, no float32 copy written); seeds u32[B]; positions, steps i32[B, Q]; temperature,
    top_p f32[B]; top_k i32[B]; allowed bool[V] or int8[V] 0 / 1 (None: all) the token ids that may be proposed
    (int8 is what the kernel reads: made once, it costs no conversion per call); plain_greedy: `is_plain_greedy` of
    the rows, where the caller has it already (made once per round by the engine).
    Returns (candidates i32[B, Q], confidence f32[B, Q]): confidence is the candidate's probability under the
    distribution it was drawn from (temperature, top-k and top-p applied; plain softmax when greedy), or with
    unscaled_confidence under the plain softmax of the logits, as the LLaDA reference's low-confidence remasking
    ranks positions (decoding.md §4: fixed_steps).

    A batch of plain greedy requests (the common case) takes a branch of one pass over the logits; any
    sampling or filtering takes the general branch, which computes a greedy row's candidate and confidence from the
    same values in the same order, so a request's output does not depend on its batch. The mask is applied inside
    each branch: a masked copy as the branches' operand would be one more full write and read of the logits.
    """
    if plain_greedy is None:
        plain_greedy = is_plain_greedy(temperature, top_k, top_p)
    candidates, confidence = jax.lax.cond(
        plain_greedy, lambda raw: _greedy_proposals(raw, allowed),
        lambda raw: _sampled_proposals(_masked(raw, allowed), seeds, positions, steps, temperature, top_k, top_p,
                                       unscaled_confidence),
        logits)
    return candidates.astype(jnp.int32), confidence
