"""The device side of a step: pack a batch into bucket-shaped arrays, run the jitted step, bring back small outputs.

Two jitted functions, one compile per shape bucket:
  prefill        writes the KV of prompt chunks [B, C] into their pages; nothing comes back.
  denoise_round  a lax.while_loop of denoising steps over every request's window [B, Q]: forward, logits and
                 proposals at the positions the strategy reads, strategy update, until some request's front block is
                 complete or the step cap is hit. Buckets of many rows compile it with cuBLAS GEMMs
                 (CUBLAS_GEMM_MIN_ROWS).
                 Only the window tokens and counters come back; logits never leave the device.
Weights are split from the NNX graph once and passed as a flat list of arrays; the KV pool is donated and updated in
place.
"""

import bisect
import dataclasses
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm import decoding
from jaxllm.config import DecodingConfig
from jaxllm.decoding import WindowState
from jaxllm.engine.scheduler import DecodeBatch, DecodeResult, PrefillBatch
from jaxllm.models.layers import AttentionMetadata, KVCache
from jaxllm.sampling import is_plain_greedy, propose


def powers_of_two(low: int, high: int) -> list[int]:
    """low, 2*low, ... up to the first value >= high."""
    sizes = [low]
    while sizes[-1] < high:
        sizes.append(sizes[-1] * 2)
    return sizes


def pad_to_bucket(value: int, buckets: list[int], limit_name: str) -> int:
    index = bisect.bisect_left(buckets, value)
    if index == len(buckets):
        raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}; raise {limit_name}")
    return buckets[index]


# Decode buckets of at least this many window rows compile XLA's dense GEMMs as cuBLAS calls (XLA's Triton GEMMs
# off). At those rows XLA's autotuner picks Triton split-K GEMMs that run slower inside the forward than cuBLAS does.
# H100, LLaDA2.0-mini at 256 rows, us per GEMM, weights read from HBM (BENCHMARKS.md, engine run 58): QKV 15.6 ->
# 9.3, o_proj 14.1 -> 8.0, router 10.4 -> 7.6. This runner against one jit for all buckets (run 59, H100, ms per
# forward): LLaDA2 batch 8 12.71-12.76 -> 12.52-12.60, SDAR-8B batch 8 9.21-9.26 -> 9.08-9.11, LLaDA2 batch 32
# level (there XLA picks cuBLAS itself). At batch 1's 32 rows the Triton GEMMs are the faster ones (SDAR-8B 4.93
# against 5.07 ms, run 32).
CUBLAS_GEMM_MIN_ROWS = 256


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about the jitted steps (part of their compile key)."""

    decoding: DecodingConfig
    block_size: int
    mask_token_id: int
    vocab_size: int  # the LM head's width (rows of a padded vocabulary included)
    num_real_tokens: int  # ids at or beyond this (padded vocab rows) are never proposed
    min_logit_rows: int  # EngineConfig.min_logit_rows
    attention_impl: str = "auto"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundInputs:
    window: WindowState
    context_lens: jax.Array  # i32[B]
    page_table: jax.Array  # i32[B, W]
    max_blocks: jax.Array  # i32[B]
    seeds: jax.Array  # u32[B]
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    max_steps: jax.Array  # i32[] step cap of this round: a runtime value, so changing it compiles nothing


def prefill(graphdef, params, kv: KVCache, tokens, context_lens, chunk_lens, page_table, *, spec: StepSpec):
    """Write the KV of prompt chunks tokens i32[B, C] at positions context_len + i, i < chunk_len."""
    md = AttentionMetadata(page_table, context_lens, chunk_lens, spec.block_size, spec.attention_impl)
    _, kv = nnx.merge(graphdef, params)(tokens, kv, md)
    return kv


class ReadRowInputs(NamedTuple):
    """What the sampler reads besides the logits, one row per window position [B * Q], fixed for a round.

    Made once before the round's loop (`read_row_inputs`). Built inside it, XLA left each of them in the loop body (the
    per-row repeats, and the mask, its int8 copy and the greedy test inside the LM head's lax.switch branches): nine
    small kernels in every forward, ~10 us of SDAR-8B batch 1's device time on the H200 (BENCHMARKS.md, run 32)."""

    seeds: jax.Array  # u32[R]
    positions: jax.Array  # i32[R] absolute positions
    temperature: jax.Array  # f32[R]
    top_k: jax.Array  # i32[R]
    top_p: jax.Array  # f32[R]
    allowed: jax.Array  # int8[V] 1 where a step may propose the id: not the mask token, not padded vocab rows
    plain_greedy: jax.Array  # bool[] every request greedy, no filter (`sampling.propose`'s one-pass branch)


def read_row_inputs(inputs: RoundInputs, positions, *, spec: StepSpec) -> ReadRowInputs:
    window = positions.shape[1]

    def per_row(x):  # [B] -> [B * Q]
        return jnp.repeat(x, window)

    vocab_ids = jnp.arange(spec.vocab_size)
    allowed = (vocab_ids < spec.num_real_tokens) & (vocab_ids != spec.mask_token_id)
    return ReadRowInputs(per_row(inputs.seeds), positions.reshape(-1), per_row(inputs.temperature),
                         per_row(inputs.top_k), per_row(inputs.top_p), allowed.astype(jnp.int8),
                         is_plain_greedy(inputs.temperature, inputs.top_k, inputs.top_p))


def logit_row_buckets(num_rows: int, min_rows: int) -> list[int]:
    """Row counts the LM head and sampler may run on in a step over num_rows window positions: 0 (no request reads a
    proposal, as in a verifying forward without editing), the quarters of num_rows raised to at least min_rows, and
    num_rows."""
    quarters = {max(min_rows, -(-num_rows * k // 4)) for k in (1, 2, 3)}
    return [0, *sorted(rows for rows in quarters if rows < num_rows), num_rows]


def proposals_at_read_positions(model, hidden, read, state: WindowState, rows: ReadRowInputs, *, spec: StepSpec):
    """Candidates i32[B, Q] and confidences f32[B, Q] at the positions `read` bool[B, Q]; elsewhere anything
    (`decoding.update` never reads it: the window's token and -inf, or a proposal of a padding row).

    The LM head and the sampler run on the read rows only, gathered to the front and padded to the smallest of
    `logit_row_buckets` that holds them, one lax.switch branch per bucket. At batch 32 the LM head is a
    compute-bound GEMM (1024 x 2048 x 157k for LLaDA2: ~0.84 ms per forward on the H200) while a block's masks fall
    from 32 to 0 over its steps; below ~200 rows its weight read bounds it and fewer rows save nothing, hence
    min_logit_rows. Each row is sampled as a request of one position (its own seed, position and step), so the
    sampler gives a row the same token in any bucket; its logits are the same bits only where the LM head's GEMM
    gives a row the same bits at every row count (cuBLAS picks its kernel per count), as already across batch sizes.
    """
    batch, window = read.shape
    num_rows = batch * window
    read = read.reshape(num_rows)
    num_read = read.sum()
    # a permutation with the read rows first, in order (cumulative counts, no sort: a sort would split the loop
    # body's CUDA graph, as noted in tests/test_sampling.py)
    rank = jnp.where(read, jnp.cumsum(read) - 1, num_read + jnp.cumsum(~read) - 1)
    order = jnp.zeros(num_rows, jnp.int32).at[rank].set(jnp.arange(num_rows, dtype=jnp.int32))
    tokens = state.tokens.reshape(num_rows)
    unread = jnp.full(num_rows, -jnp.inf, jnp.float32)
    steps = jnp.repeat(state.block_steps, spec.block_size, axis=1).reshape(num_rows)
    row_inputs = (hidden.reshape(num_rows, -1), rows.seeds, rows.positions, steps, rows.temperature, rows.top_k,
                  rows.top_p)

    def rows_of(num):
        if num == 0:
            return lambda: (tokens, unread)

        def propose_rows():
            taken = row_inputs if num == num_rows else [x[order[:num]] for x in row_inputs]
            row_hidden, seeds, row_positions, row_steps, temperature, top_k, top_p = taken
            with jax.named_scope("lm_head"):  # scopes name the parts in device profiles (tools/device_profile.py)
                logits = model.head(row_hidden)[:, None]  # the model's dtype: the sampler reads them as float32
            with jax.named_scope("sampler"):
                candidates, confidence = propose(logits, seeds, row_positions[:, None], row_steps[:, None],
                                                 temperature, top_k, top_p, rows.allowed,
                                                 plain_greedy=rows.plain_greedy,
                                                 unscaled_confidence=spec.decoding.strategy == "fixed_steps")
            if num == num_rows:
                return candidates[:, 0], confidence[:, 0]
            return tokens.at[order[:num]].set(candidates[:, 0]), unread.at[order[:num]].set(confidence[:, 0])
        return propose_rows

    buckets = logit_row_buckets(num_rows, spec.min_logit_rows)
    bucket = jnp.sum(num_read > jnp.asarray(buckets))  # the smallest bucket holding every read row
    candidates, confidence = jax.lax.switch(bucket, [rows_of(num) for num in buckets])
    return candidates.reshape(batch, window), confidence.reshape(batch, window)


def denoise_round(graphdef, params, kv: KVCache, inputs: RoundInputs, *, spec: StepSpec):
    """Denoising steps until a front block completes (or inputs.max_steps). Returns (kv, window, complete, forwards)."""
    batch, window_size = inputs.window.tokens.shape
    positions = inputs.context_lens[:, None] + jnp.arange(window_size, dtype=jnp.int32)[None, :]
    live = inputs.window.num_active_blocks > 0
    rows = read_row_inputs(inputs, positions, spec=spec)

    def step(carry):
        forwards, state, kv, _ = carry
        model = nnx.merge(graphdef, params)  # merged inside the loop body: modules may record (sow) at its trace level
        md = AttentionMetadata(inputs.page_table, inputs.context_lens, state.num_active_blocks * spec.block_size,
                               spec.block_size, spec.attention_impl)
        hidden, kv = model(state.tokens, kv, md)
        read = decoding.read_positions(state, spec.decoding, block_size=spec.block_size,
                                       mask_token_id=spec.mask_token_id)
        candidates, confidence = proposals_at_read_positions(model, hidden, read, state, rows, spec=spec)
        with jax.named_scope("sampler"):
            state, complete = decoding.update(state, candidates, confidence, inputs.max_blocks, spec.decoding,
                                              block_size=spec.block_size, mask_token_id=spec.mask_token_id)
        return forwards + 1, state, kv, complete

    def keep_going(carry):
        forwards, _, _, complete = carry
        return (forwards < inputs.max_steps) & jnp.any(live) & ~jnp.any(complete[:, 0] & live)

    num_blocks = inputs.window.block_steps.shape[1]
    init = (jnp.int32(0), inputs.window, kv, jnp.zeros((batch, num_blocks), bool))
    forwards, state, kv, complete = jax.lax.while_loop(keep_going, step, init)
    return kv, state, complete.sum(axis=1).astype(jnp.int32), forwards


def _on_flat_weights(step, graphdef, params_treedef, spec: StepSpec):
    """step(graphdef, params, kv, ...) as a function of (weights, kv, ...), weights being params' leaves in a list.

    Graph, tree structure and spec are bound once. As static arguments the graph would be hashed and compared on every
    call (~2 ms for a 36-layer model's GraphDef on the host), and jit flattens an nnx.State's Variable nodes in Python
    (~0.4 ms per call) where a list of arrays flattens in C++ (~0.08 ms).
    """
    def on_weights(weights, kv, *inputs):
        return step(graphdef, jax.tree.unflatten(params_treedef, weights), kv, *inputs, spec=spec)
    return on_weights


class ModelRunner:
    """Owns the weights and the KV pool; turns scheduler batches into jitted calls."""

    def __init__(self, model: nnx.Module, kv: KVCache, spec: StepSpec, *, batch_buckets: list[int],
                 width_buckets: list[int], chunk_buckets: list[int], max_num_batched_tokens: int,
                 max_steps_per_round: int):
        self.graphdef, params = nnx.split(model)
        self.weights, self.params_treedef = jax.tree.flatten(params)
        self.kv = kv
        self.spec = spec
        self.jit_prefill = jax.jit(_on_flat_weights(prefill, self.graphdef, self.params_treedef, spec),
                                   donate_argnums=1)  # the KV pool
        denoise = _on_flat_weights(denoise_round, self.graphdef, self.params_treedef, spec)
        self.jit_denoise_round = jax.jit(denoise, donate_argnums=1)
        cublas_gemms = {"xla_gpu_enable_triton_gemm": False} if jax.default_backend() == "gpu" else None
        self.jit_denoise_round_cublas = jax.jit(denoise, donate_argnums=1,  # see CUBLAS_GEMM_MIN_ROWS
                                                compiler_options=cublas_gemms)
        self.max_steps_per_round = max_steps_per_round  # may change between rounds
        self.page_size = kv.k_pages.shape[3]
        self.batch_buckets, self.width_buckets, self.chunk_buckets = batch_buckets, width_buckets, chunk_buckets
        self.max_num_batched_tokens = max_num_batched_tokens

    @property
    def params(self) -> nnx.State:
        """The weights as the model's state (for nnx.merge with self.graphdef): a read-only view, built per access;
        to change weights, replace self.weights."""
        return jax.tree.unflatten(self.params_treedef, self.weights)

    # shapes

    def decode_shapes(self) -> list[tuple[int, int]]:
        return [(b, w) for b in self.batch_buckets for w in self.width_buckets]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.batch_buckets for c in self.chunk_buckets if b * c <= self.max_num_batched_tokens]

    def denoise_step(self, batch_size: int):
        """The jitted denoise_round that a batch bucket compiles with (CUBLAS_GEMM_MIN_ROWS)."""
        rows = batch_size * self.spec.decoding.buffer_size * self.spec.block_size
        return self.jit_denoise_round_cublas if rows >= CUBLAS_GEMM_MIN_ROWS else self.jit_denoise_round

    def _width(self, num_tokens: int) -> int:
        return pad_to_bucket(-(-num_tokens // self.page_size), self.width_buckets, "max_model_len")

    # prefill

    def run_prefill(self, batch: PrefillBatch) -> None:
        size = pad_to_bucket(len(batch.requests), self.batch_buckets, "max_num_seqs")
        chunk = pad_to_bucket(max(batch.chunk_lens), self.chunk_buckets, "max_num_batched_tokens")
        tokens = np.zeros((size, chunk), np.int32)
        context_lens = np.zeros(size, np.int32)
        chunk_lens = np.zeros(size, np.int32)
        page_table = np.zeros((size, self.width_buckets[-1]), np.int32)
        for i, (request, length) in enumerate(zip(batch.requests, batch.chunk_lens)):
            start = request.context_len
            tokens[i, :length] = request.all_token_ids[start:start + length]
            context_lens[i], chunk_lens[i] = start, length
            page_table[i, :len(request.page_ids)] = request.page_ids
        self.kv = self.jit_prefill(self.weights, self.kv, tokens, context_lens, chunk_lens, page_table)

    # decode

    def run_decode(self, batch: DecodeBatch) -> list[DecodeResult]:
        inputs = self._round_inputs(batch)
        step = self.denoise_step(len(inputs.seeds))
        self.kv, state, num_complete, forwards = step(self.weights, self.kv, inputs)
        state, num_complete, forwards = jax.device_get((state, num_complete, forwards))
        return [DecodeResult(state.tokens[i], int(state.num_active_blocks[i]), state.block_steps[i],
                             state.block_masks[i], state.post_steps[i], int(num_complete[i]), int(forwards))
                for i in range(len(batch.requests))]

    def _round_inputs(self, batch: DecodeBatch) -> RoundInputs:
        requests = batch.requests
        size = pad_to_bucket(len(requests), self.batch_buckets, "max_num_seqs")
        window = len(requests[0].window.tokens)
        num_blocks = len(requests[0].window.block_steps)
        width = self._width(max(r.context_len + m * self.spec.block_size for r, m in zip(requests, batch.max_blocks)))
        arrays = dict(
            tokens=np.full((size, window), self.spec.mask_token_id, np.int32), fixed=np.zeros((size, window), bool),
            num_active_blocks=np.zeros(size, np.int32), block_steps=np.zeros((size, num_blocks), np.int32),
            block_masks=np.zeros((size, num_blocks), np.int32), post_steps=np.zeros((size, num_blocks), np.int32),
            context_lens=np.zeros(size, np.int32), page_table=np.zeros((size, width), np.int32),
            max_blocks=np.zeros(size, np.int32), seeds=np.zeros(size, np.uint32),
            temperature=np.zeros(size, np.float32), top_k=np.full(size, -1, np.int32),
            top_p=np.ones(size, np.float32))
        for i, (request, max_blocks) in enumerate(zip(requests, batch.max_blocks)):
            w = request.window
            for name in ("tokens", "fixed", "num_active_blocks", "block_steps", "block_masks", "post_steps"):
                arrays[name][i] = getattr(w, name)
            arrays["context_lens"][i] = request.context_len
            arrays["page_table"][i, :len(request.page_ids)] = request.page_ids
            arrays["max_blocks"][i] = max_blocks
            arrays["seeds"][i] = request.seed
            arrays["temperature"][i] = request.params.temperature
            arrays["top_k"][i] = min(request.params.top_k, np.iinfo(np.int32).max)  # beyond the vocabulary: off
            arrays["top_p"][i] = request.params.top_p
        state = WindowState(*(arrays.pop(name) for name in (
            "tokens", "fixed", "num_active_blocks", "block_steps", "block_masks", "post_steps")))
        return RoundInputs(window=state, max_steps=np.int32(self.max_steps_per_round), **arrays)

    # warm-up

    def warmup(self, progress=None) -> dict[str, float]:
        """Compile every (step x bucket) with placeholder inputs that write nothing; returns seconds per bucket."""
        timings = {}
        shapes = [("prefill", s) for s in self.prefill_shapes()] + [("decode", s) for s in self.decode_shapes()]
        for kind, shape in (progress(shapes) if progress else shapes):
            start = time.perf_counter()
            if kind == "prefill":
                batch, chunk = shape
                zeros = np.zeros(batch, np.int32)
                self.kv = self.jit_prefill(self.weights, self.kv, np.zeros((batch, chunk), np.int32), zeros, zeros,
                                           np.zeros((batch, self.width_buckets[-1]), np.int32))
            else:
                self._warm_decode(*shape)
            jax.block_until_ready(self.kv)
            timings[f"{kind} {shape}"] = time.perf_counter() - start
        return timings

    def _warm_decode(self, batch: int, width: int) -> None:
        window = self.spec.decoding.buffer_size * self.spec.block_size
        num_blocks = self.spec.decoding.buffer_size
        zeros_b, zeros_bn = np.zeros(batch, np.int32), np.zeros((batch, num_blocks), np.int32)
        state = WindowState(np.full((batch, window), self.spec.mask_token_id, np.int32),
                            np.zeros((batch, window), bool), zeros_b, zeros_bn, zeros_bn, zeros_bn)
        inputs = RoundInputs(state, zeros_b, np.zeros((batch, width), np.int32), zeros_b,
                             np.zeros(batch, np.uint32), np.zeros(batch, np.float32), np.full(batch, -1, np.int32),
                             np.ones(batch, np.float32), np.int32(self.max_steps_per_round))
        self.kv, *_ = self.denoise_step(batch)(self.weights, self.kv, inputs)
