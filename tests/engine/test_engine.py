"""The engine end to end on a tiny confident checkpoint: batching, determinism, preemption, prefix cache, aborts,
compile-free serving after warm-up, stops and strategies."""

import dataclasses
import threading
import time

import jax
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError
from jaxllm.engine import runner
from jaxllm.engine.engine import CompilationAfterWarmup
from jaxllm.engine.request import RequestStatus
from jaxllm.models.layers import KVCache

# 16 pages of 4 tokens: one request at a time always fits, four long ones at once do not (preemption)
OPTIONS = dict(dtype="float32", block_size=4, max_num_seqs=4, max_model_len=64, num_pages=16)
PROMPTS = [[5, 6, 7], list(range(100, 111)), [42] * 6, list(range(300, 317))]


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints("sdar", lm_head_scale=60)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, decoding_strategy="threshold", threshold=0.6, **OPTIONS)


def token_ids(outputs):
    return [o.token_ids for o in outputs]


def test_seeded_sampling_is_the_same_alone_or_in_any_batch(checkpoints):
    # the plain random model, not the confident one: there sampling at temperature 0.9 is all but greedy, and a
    # seed could change nothing
    llm = LLM(checkpoints("sdar"), decoding_strategy="threshold", threshold=0.6, **OPTIONS)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    batched = llm.generate(PROMPTS, params)
    assert batched[1].token_ids == alone
    assert batched[0].token_ids != alone  # the other prompts are not copies of it
    other_seed = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.9, seed=8))[0].token_ids
    assert other_seed != alone


def test_greedy_output_does_not_depend_on_batch_or_page_size(checkpoint, llm):
    params = SamplingParams(max_tokens=10)
    reference = [llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert token_ids(llm.generate(PROMPTS, params)) == reference
    big_pages = LLM(checkpoint, decoding_strategy="threshold", threshold=0.6, page_size=8, **OPTIONS)
    assert token_ids(big_pages.generate(PROMPTS, params)) == reference


def test_batch_invariant_mode_gives_a_prompt_the_same_tokens_in_bf16_alone_or_in_a_batch(checkpoints):
    """bf16 and the plain random model, whose near-ties flip on a last bit. Without the mode this very case differs
    from the first token on this CPU: alone, a request's 32 rows take the row-scale norm and XLA's 32-row bf16
    products, which round otherwise than beside others. 32 prompts (1024 rows a step; before the q/k norms, RoPE,
    routing and attention ran in fixed chunks in the mode, a token's bits changed at 1024 rows) are prefilled in one
    step, uncached."""
    llm = LLM(checkpoints("llada2", dtype="bf16"), dtype="bfloat16", decoding_strategy="fixed_steps", block_size=32,
              max_num_seqs=32, max_model_len=128, num_pages=200, enable_prefix_caching=False, batch_invariant=True)
    vocab = len(llm.engine.tokenizer)
    prompts = [np.random.default_rng(index).integers(4, vocab, 64).tolist() for index in range(32)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    alone = llm.generate([prompts[0]], params)[0].token_ids
    batched = llm.generate(prompts, params)
    assert batched[0].token_ids == alone
    assert batched[1].token_ids != alone


@pytest.fixture
def interpreted_attention(monkeypatch):
    """The attention kernel in interpret mode, as it runs on the GPU: XLA's reference attention on this CPU gives a
    chunk's rows the same bits wherever a prefill splits, the kernel does not."""
    import jaxllm.models.layers as layers
    attention = layers.paged_attention_from_qkv
    monkeypatch.setattr(layers, "paged_attention_from_qkv",
                        lambda *args, **kwargs: attention(*args, **{**kwargs, "impl": "pallas", "interpret": True}))


def invariant_bf16_llm(checkpoints) -> LLM:
    """The mode on the bf16 LLaDA2, 16-token blocks and pages, 64-token prefill chunks."""
    return LLM(checkpoints("llada2", dtype="bf16"), dtype="bfloat16", decoding_strategy="fixed_steps", block_size=16,
               page_size=16, max_num_seqs=4, max_model_len=256, num_pages=64, max_num_batched_tokens=64,
               batch_invariant=True)


def kv_of(engine, request, num_tokens: int) -> list[np.ndarray]:
    """The K and V of a request's first num_tokens (whole pages) in the engine's pool."""
    pages = np.array(request.page_ids[:num_tokens // engine.page_size])
    return [np.asarray(pool[:, :, pages]) for pool in (engine.runner.kv.k_pages, engine.runner.kv.v_pages)]


@pytest.mark.parametrize("second_tail, hits, compared", [(32, 4, 112), (8, 5, 80)])
def test_batch_invariant_mode_gives_a_prompt_the_same_kv_bits_after_a_prefix_cache_hit(checkpoints,
                                                                                       interpreted_attention,
                                                                                       second_tail, hits, compared):
    """A first prompt of 112 tokens prefills 64 + 48 and caches 7 pages of 16; a second shares its first 80.
    - With 32 more tokens (112) the second prefills 64 + 48 alone. Taking all 5 shared pages and prefilling from 80,
      its K/V at positions 80-111 differed from alone (750 of 10752 K elements); the mode takes 4 and prefills from
      64, as alone.
    - With 8 more (88: its last whole block ends at 80) it takes all 5 and prefills nothing. Pages 64-79 come from
      the first prompt's piece 64-111, where alone its piece 64-79 writes them: a cached page's bits must depend on
      where its piece starts only, not where it ends (keys past a query's block add nothing)."""
    rng = np.random.default_rng(0)
    shared = rng.integers(4, 200, 80).tolist()
    first, second = shared + rng.integers(4, 200, 32).tolist(), shared + rng.integers(4, 200, second_tail).tolist()

    def prompt_kv(prompts):
        """The K and V pages of the last prompt once it decodes (each prompt run to its first block first)."""
        engine = invariant_bf16_llm(checkpoints).engine
        for prompt in prompts:
            request_id = engine.add_request(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
            while not any(r.request_id == request_id and r.status is RequestStatus.DECODING
                          for r in engine.scheduler.running):
                engine.step()
        request = next(r for r in engine.scheduler.running if r.request_id == request_id)
        assert engine.scheduler.pages.prefix_hits == (hits if len(prompts) > 1 else 0)
        return kv_of(engine, request, compared)

    for alone, after_hit in zip(prompt_kv([second]), prompt_kv([first, second])):
        np.testing.assert_array_equal(after_hit, alone)


@pytest.mark.parametrize("preempt_after", [16, 32])
def test_batch_invariant_mode_gives_a_preempted_request_the_kv_and_tokens_it_has_alone(checkpoints,
                                                                                       interpreted_attention,
                                                                                       preempt_after):
    """Preempted once it has committed preempt_after tokens, a request recomputes its committed output in its
    commits (a block each here), as its decode wrote them: at 96 tokens of context its K/V are those it has when
    never preempted, and so are its tokens. (Recomputed in pieces of up to 64 tokens, its K differed in 954 and 1242
    of 9216 elements; on another random model its tokens did from token 32 and from token 26.)"""
    prompt = np.random.default_rng(1).integers(4, 200, 40).tolist()

    def run(preempt):
        engine = invariant_bf16_llm(checkpoints).engine
        request_id = engine.add_request(prompt, SamplingParams(max_tokens=64, ignore_eos=True))
        engine.step()  # admitted
        request = next(r for r in engine.scheduler.running if r.request_id == request_id)
        kv = None
        while engine.has_unfinished_requests():
            engine.step()
            if preempt and request.stats.num_preemptions == 0 and len(request.output_token_ids) >= preempt_after:
                engine.scheduler.preempt(request)
            if kv is None and request.status is RequestStatus.DECODING and request.context_len == 96:
                kv = kv_of(engine, request, 96)
        assert request.stats.num_preemptions == preempt
        return kv, request.output_token_ids

    (alone_kv, alone_tokens), (kv, tokens) = run(preempt=0), run(preempt=1)
    for alone_pool, pool in zip(alone_kv, kv):
        np.testing.assert_array_equal(pool, alone_pool)
    assert tokens == alone_tokens


@pytest.mark.parametrize("blocks_in_flight", [1, 3])
def test_preempted_requests_give_the_same_output(checkpoints, blocks_in_flight):
    """Seeded sampling on the plain random model (the confident one is all but greedy): preempted mid-window, a
    request resumes its blocks in flight, later blocks' partial tokens and step counters included."""
    llm = LLM(checkpoints("sdar"), decoding_strategy="threshold", threshold=0.6, buffer_size=blocks_in_flight,
              add_block_threshold=0.2 if blocks_in_flight > 1 else None, **OPTIONS)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=11)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    assert not any(o.stats["preemptions"] for o in alone)
    together = llm.generate(PROMPTS, params)
    assert sum(o.stats["preemptions"] for o in together) > 0
    assert token_ids(together) == token_ids(alone)
    assert llm.engine.kv_cache_usage == 0.0


def test_a_repeated_prompt_reuses_cached_pages_and_gives_the_same_output(llm):
    prompt = list(range(500, 521))
    first = llm.generate([prompt], SamplingParams(max_tokens=8))[0]
    second = llm.generate([prompt], SamplingParams(max_tokens=8))[0]
    assert second.stats["cached_tokens"] == 20  # five full pages of the 21-token prompt
    assert second.token_ids == first.token_ids
    assert llm.engine.scheduler.pages.prefix_hit_rate > 0


def test_copies_of_a_prompt_in_one_batch_prefill_it_once(llm):
    prompt = list(range(600, 621))
    outputs = llm.generate([prompt] * 3, SamplingParams(max_tokens=8))
    assert [o.stats["cached_tokens"] for o in outputs] == [0, 20, 20]  # five full pages of the 21-token prompt
    assert token_ids(outputs[1:]) == [outputs[0].token_ids] * 2


def test_abort_finishes_the_request_and_frees_its_pages(llm):
    engine = llm.engine
    request_id = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv_cache_usage > 0
    engine.abort_request(request_id)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [(request_id, "abort")]
    assert engine.kv_cache_usage == 0.0 and not engine.has_unfinished_requests()


def test_a_request_not_scheduled_within_max_queue_time_finishes_with_queue_timeout(llm, monkeypatch):
    """Expiry comes after admission: a request that waited long but fits now runs; one still queued expires."""
    engine = llm.engine
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, max_queue_time=60.0))
    monkeypatch.setattr(engine.scheduler, "cfg", dataclasses.replace(engine.scheduler.cfg, max_num_seqs=1))

    def arrived_long_ago(request_id):  # as if it had waited behind others for two minutes
        queued = [item for kind, item in engine._inbox if kind == "add"] + list(engine.scheduler.waiting)
        next(r for r in queued if r.request_id == request_id).stats.arrival_time -= 120.0

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = engine.add_request(PROMPTS[0], params)
    arrived_long_ago(first)
    assert not [o for o in engine.step() if o.finished]  # admitted in this step: it runs
    second = engine.add_request(PROMPTS[1], params)
    engine.step()  # waits behind the first (one sequence at a time)
    arrived_long_ago(second)
    finished = {o.request_id: o for o in engine.step() if o.finished}
    assert (finished[second].finish_reason, finished[second].token_ids) == ("queue_timeout", [])
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert finished[first].finish_reason == "length" and len(finished[first].token_ids) == 8
    assert engine.kv_cache_usage == 0.0


def test_offline_generation_refuses_a_queue_time_limit(checkpoint):
    """LLM.generate queues all its prompts at once: a queue time limit would end some with no output."""
    with pytest.raises(ConfigError, match="max_queue_time"):
        LLM(checkpoint, max_queue_time=1.0, **OPTIONS)


def test_a_request_joins_a_running_batch_at_the_next_step(llm):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    solo = [llm.generate([p], params)[0].token_ids for p in PROMPTS[:2]]
    engine = llm.engine
    first = engine.add_request(PROMPTS[0], params)
    engine.step()
    engine.step()  # first is decoding now
    second = engine.add_request(PROMPTS[1], params)
    finished, second_started_while_first_ran = {}, False
    while len(finished) < 2:
        for output in engine.step():
            if output.request_id == second and first not in finished:
                second_started_while_first_ran = True
            if output.finished:
                finished[output.request_id] = output.token_ids
    assert second_started_while_first_ran
    assert [finished[first], finished[second]] == solo


def test_nothing_compiles_after_warmup_and_an_unbucketed_shape_fails_loudly(checkpoint, monkeypatch):
    # batch 2's 8 rows compile with cuBLAS GEMMs, batch 1's 4 without: warm-up compiles each bucket as its steps run
    monkeypatch.setattr(runner, "CUBLAS_GEMM_MIN_ROWS", 8)
    earlier = LLM(checkpoint, decoding_strategy="threshold", threshold=0.6, **OPTIONS)  # never warmed up
    llm = LLM(checkpoint, decoding_strategy="threshold", threshold=0.6, dtype="float32", block_size=4,
              max_num_seqs=2, max_model_len=32)
    timings = llm.engine.warmup(strict=True)
    assert len(timings) == len(llm.engine.runner.prefill_shapes()) + len(llm.engine.runner.decode_shapes())
    rng = np.random.default_rng(0)
    for batch in (1, 2, 3):
        prompts = [rng.integers(10, 8000, int(n)).tolist() for n in rng.integers(1, 20, batch)]
        llm.generate(prompts, SamplingParams(max_tokens=int(rng.integers(1, 12))))
    assert llm.engine.compilations_after_warmup == 0
    llm.engine.runner.batch_buckets = [3]  # a bucket warm-up never compiled
    with pytest.raises(CompilationAfterWarmup):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    # another engine in the process compiles its own shapes: not an error, and not this engine's count
    count = llm.engine.compilations_after_warmup
    assert earlier.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].finish_reason
    assert llm.engine.compilations_after_warmup == count and earlier.engine.compilations_after_warmup == 0


def test_the_step_cap_splits_rounds_without_changing_tokens_or_compiling(llm):
    engine, params = llm.engine, SamplingParams(max_tokens=12, ignore_eos=True)
    default_cap = engine.runner.max_steps_per_round

    def generate_with_cap(cap):  # (tokens, decode rounds, forwards)
        engine.runner.max_steps_per_round = cap
        rounds, forwards = engine.num_decode_rounds, engine.num_forwards
        tokens = llm.generate([PROMPTS[1]], params)[0].token_ids
        return tokens, engine.num_decode_rounds - rounds, engine.num_forwards - forwards

    try:
        tokens, rounds, forwards = generate_with_cap(default_cap)
        compiled = engine.runner.jit_denoise_round._cache_size()
        capped_tokens, capped_rounds, capped_forwards = generate_with_cap(1)
    finally:
        engine.runner.max_steps_per_round = default_cap
    assert capped_tokens == tokens
    assert capped_rounds == capped_forwards == forwards  # one forward per round, the same forwards in all
    assert rounds < capped_rounds
    assert engine.runner.jit_denoise_round._cache_size() == compiled  # the cap is a runtime value: nothing recompiled


def test_stop_string_trims_the_text(llm):
    full = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), full.text
    stopped = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index(stop)]
    # the ids end with the token that completes the stop string, not with the rest of its block
    text_of = llm.engine._text_of
    assert stop in text_of(stopped.token_ids) and stop not in text_of(stopped.token_ids[:-1])
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) < 16


def test_the_stop_string_that_starts_first_cuts_both_text_and_ids(llm):
    """Two stop strings completed by one commit: the one that starts first (but is completed by a later token
    than the other) cuts the text, and the ids end with the token that completes that same one."""
    prompt, block = PROMPTS[2], OPTIONS["block_size"]
    full = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    text, text_of = full.text, llm.engine._text_of

    def tokens_to_complete(stop):
        return next(n for n in range(1, len(full.token_ids) + 1) if stop in text_of(full.token_ids[:n]))

    def commit(num_tokens):  # the first block holds the prompt's tail
        return (num_tokens + len(prompt) % block - 1) // block

    pairs = [(text[i:i + length], text[i + 1:i + 3]) for length in (6, 8, 10) for i in range(len(text) - length)]
    first, inner = next((first, inner) for first, inner in pairs if text.find(first) < text.find(inner)
                        and inner.strip() and tokens_to_complete(inner) < tokens_to_complete(first)
                        and commit(tokens_to_complete(inner)) == commit(tokens_to_complete(first)))
    stopped = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, stop=[inner, first]))[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[:text.find(first)]
    assert stopped.token_ids == full.token_ids[:tokens_to_complete(first)]


def test_text_that_may_begin_a_stop_string_is_held_back(llm):
    """A stop string longer than the first block's text, completed by the second block: nothing of it streams."""
    first_block = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=4, ignore_eos=True))[0].text
    full = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=16, ignore_eos=True))[0].text
    stop = full[:len(first_block) + 2]
    assert full.startswith(first_block) and len(stop) == len(first_block) + 2
    engine = llm.engine
    request_id = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))
    streamed, final = "", None
    while final is None:
        for output in engine.step():
            if output.request_id == request_id:
                streamed += output.new_text
                final = output if output.finished else None
    assert final.finish_reason == "stop" and final.text == streamed == ""


def test_a_stop_token_ends_the_output_after_it_and_its_text_is_not_output(llm):
    """The stop token is the last id, but its text is not in the output (as vLLM without include_stop_str_in_output)."""
    full = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    stopped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[full[5]]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full[:full.index(full[5]) + 1]
    text_of = lambda ids: llm.engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert text_of(stopped.token_ids) != text_of(stopped.token_ids[:-1])  # the stop token has text of its own
    assert stopped.text == text_of(stopped.token_ids[:-1])


def test_zero_max_tokens_ends_at_once_with_length_and_holds_no_pages(llm):
    output = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=0))[0]
    assert output.finish_reason == "length" and output.token_ids == [] and output.text == ""
    assert output.stats["forward_passes"] == 0 and llm.engine.kv_cache_usage == 0.0


def test_max_tokens_ends_with_length(llm):
    output = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 7
    assert output.stats["forward_passes"] > 0 and output.stats["tokens_per_forward"] > 0


def test_a_request_filling_the_whole_pool_runs(llm):
    """8 prompt + 56 output tokens fill the 16 pages of 4 exactly: accepted and run to the end, pages returned."""
    out = llm.generate([[5] * 8], SamplingParams(max_tokens=56, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 56
    assert llm.engine.kv_cache_usage == 0.0


def test_a_pool_the_device_refuses_shrinks_when_sized_from_memory_and_fails_clearly_when_given(
        checkpoint, llm, monkeypatch, caplog):
    """A device that holds at most 40 pages (as an H200 refuses the second of two pool arrays when its allocator
    grows on demand): the pool sized from memory (64 pages here, every sequence at full length) shrinks a tenth at a
    time to 40 and serves the same tokens; 50 pages asked for are a ConfigError naming them."""
    allocate = KVCache.zeros.__func__

    def device_of_40_pages(cls, shape, dtype):
        if shape[2] > 40:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return allocate(cls, shape, dtype)

    monkeypatch.setattr(KVCache, "zeros", classmethod(device_of_40_pages))
    sized_from_memory = {**OPTIONS, "num_pages": None}
    fitted = LLM(checkpoint, decoding_strategy="threshold", threshold=0.6, **sized_from_memory)
    assert fitted.engine.scheduler.pages.num_pages == 40  # 64 -> 57 -> 51 -> 45 -> 40
    assert "the device refused 45 KV pages" in caplog.text
    params = SamplingParams(max_tokens=10)
    assert token_ids(fitted.generate(PROMPTS[:1], params)) == token_ids(llm.generate(PROMPTS[:1], params))
    with pytest.raises(ConfigError, match="cannot hold 50 KV pages"):
        LLM(checkpoint, **{**OPTIONS, "num_pages": 50})


def test_a_prompt_over_the_context_is_rejected_with_the_openai_message(llm):
    with pytest.raises(ValueError, match="This model's maximum context length is 64 tokens"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=8))


def test_a_refused_prompt_leaves_none_of_its_call_behind(llm):
    """generate() adds its prompts one by one: when a later one is refused, the earlier ones are aborted, and the
    next call returns its own outputs only."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([PROMPTS[0], [5] * 60], params)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_cache_usage == 0.0
    outputs = llm.generate([PROMPTS[1]], params)
    assert [len(o.token_ids) for o in outputs] == [6]
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(PROMPTS[:3], [params, params])


def test_a_request_id_in_use_is_refused_and_aborts_count_as_no_waiting_request(llm):
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True), request_id="mine")
    with pytest.raises(ValueError, match="'mine' is already in use"):
        engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8), request_id="mine")
    engine.step()
    engine.abort_request("mine")
    assert engine.num_waiting == 0  # the pending abort is no request waiting for admission
    assert [(o.request_id, o.finish_reason) for o in engine.step() if o.finished] == [("mine", "abort")]
    assert engine.kv_cache_usage == 0.0


def test_an_automatic_request_id_skips_one_a_caller_chose(llm):
    engine = llm.engine
    chosen = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True), request_id="req-0")
    automatic = [engine.add_request(PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(2)]
    assert chosen not in automatic and len(set(automatic)) == 2
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: len(o.token_ids) for o in engine.step() if o.finished}
    assert finished == {chosen: 8, automatic[0]: 8, automatic[1]: 8}


def test_token_ids_as_numpy_integers_or_a_tuple_are_one_prompt(llm):
    """np.int64 ids were taken for separate prompts and sent to the tokenizer as text."""
    params = SamplingParams(max_tokens=6)
    expected = llm.generate([PROMPTS[1]], params)[0].token_ids
    for prompt in (np.array(PROMPTS[1]), list(np.array(PROMPTS[1])), tuple(PROMPTS[1])):
        [output] = llm.generate(prompt, params)
        assert output.token_ids == expected and output.prompt_token_ids == PROMPTS[1]
    assert [o.token_ids for o in llm.generate([np.array(PROMPTS[1]), "x"], params)][0] == expected


def test_a_directory_without_config_json_is_named(tmp_path):
    """The tokenizer loaded first, and a wrong path read as a Hugging Face Hub repo id."""
    with pytest.raises(ConfigError, match="has no config.json"):
        LLM(tmp_path / "no_such_checkpoint")


def test_a_prompt_id_outside_the_vocabulary_is_refused(llm):
    vocab_size = llm.engine.model_config.vocab_size
    for bad in (vocab_size, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.engine.add_request([5, bad, 7], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert [len(o.token_ids) for o in llm.generate([[5, vocab_size - 1]], SamplingParams(max_tokens=4,
                                                                                         ignore_eos=True))] == [4]


def test_generate_takes_more_prompts_than_the_waiting_queue_holds(checkpoint):
    llm = LLM(checkpoint, **OPTIONS, max_waiting_requests=2)
    outputs = llm.generate(PROMPTS + PROMPTS[:2], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == PROMPTS + PROMPTS[:2]
    assert [len(o.token_ids) for o in outputs] == [5] * 6
    assert llm.engine.kv_cache_usage == 0.0


def test_greedy_decoding_ignores_top_k_and_top_p(checkpoint):
    """A greedy request's confidences are the plain softmax's whatever filter it names, so its threshold decisions
    and tokens are the unfiltered request's (renormalised over the kept tokens they rose)."""
    filtered_greedy = SamplingParams(top_k=3, top_p=0.5)
    assert (filtered_greedy.top_k, filtered_greedy.top_p) == (-1, 1.0)
    llm = LLM(checkpoint, **OPTIONS, decoding_strategy="threshold", threshold=0.9)
    plain, filtered = (llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, **extra))
                       for extra in ({}, dict(top_k=3, top_p=0.5)))
    assert [o.token_ids for o in filtered] == [o.token_ids for o in plain]
    assert [o.stats["forward_passes"] for o in filtered] == [o.stats["forward_passes"] for o in plain]


def test_a_context_shorter_than_a_block_is_a_config_error(checkpoint):
    with pytest.raises(ConfigError, match="max_model_len 3 is shorter than one block"):
        LLM(checkpoint, **{**OPTIONS, "max_model_len": 3})


def test_a_token_budget_below_one_block_is_a_config_error(checkpoint):
    with pytest.raises(ConfigError, match="max_num_batched_tokens 2 is less than one block"):
        LLM(checkpoint, **{**OPTIONS, "max_num_batched_tokens": 2})


def test_a_prefill_step_takes_the_whole_token_budget(checkpoint):
    """24 tokens per step (not a power of two): a 30-token prompt prefills 24, then the last whole block."""
    engine = LLM(checkpoint, **{**OPTIONS, "max_num_batched_tokens": 24}).engine
    engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.last_step_tokens == 24
    engine.step()
    assert engine.last_step_tokens == 4


@pytest.mark.parametrize("options", [
    dict(decoding_strategy="joint_threshold", threshold=0.5, editing_threshold=0.0, max_post_steps=4),
    dict(decoding_strategy="threshold", threshold=0.6, buffer_size=3, add_block_threshold=0.2,
         semi_complete_threshold=0.8),
    dict(decoding_strategy="fixed_steps", denoising_steps=2, buffer_size=2, add_block_threshold=0.5),
    dict(decoding_strategy="fixed_steps"),  # steps per block default to the block size
])
def test_every_strategy_generates_to_the_end(checkpoint, options):
    llm = LLM(checkpoint, **OPTIONS, **options)
    outputs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=14, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [14, 14, 14]
    assert all(1 not in o.token_ids for o in outputs)  # the mask id never leaks
    assert llm.engine.kv_cache_usage == 0.0


def test_the_lm_head_on_the_read_rows_only_gives_the_same_tokens(checkpoints):
    """min_logit_rows=1 runs the LM head and sampler on the rows a step reads (masks, and filled tokens while a block
    may edit), gathered into buckets of a quarter, a half, ... of the batch's rows (the default runs all rows or,
    when none is read, none): each row keeps its request's seed and settings, its position and step, and its
    proposal lands back where it belongs. Two requests in flight (buckets of 4, 8, 12 and 16 rows at batch 2) keep
    the compiles of every bucket's LM head and sampler to batches 1 and 2."""
    options = dict(decoding_strategy="joint_threshold", threshold=0.5, editing_threshold=0.0, max_post_steps=2,
                   buffer_size=2, add_block_threshold=0.5, **(OPTIONS | dict(max_model_len=32, max_num_seqs=2)))
    params = [SamplingParams(max_tokens=12, ignore_eos=True, **settings) for settings in (
        dict(temperature=1.0, seed=3), dict(), dict(temperature=1.0, top_k=20, seed=5),
        dict(temperature=0.8, top_p=0.9, seed=9))]
    every_row = LLM(checkpoints("sdar"), **options).generate(PROMPTS, params)
    read_rows = LLM(checkpoints("sdar"), min_logit_rows=1, **options)
    assert token_ids(read_rows.generate(PROMPTS, params)) == token_ids(every_row)
    assert read_rows.engine.kv_cache_usage == 0.0


def test_the_mask_id_comes_from_the_option_then_config_json_then_the_tokenizer(checkpoints):
    """Released SDAR configs name their mask token; LLaDA2's leave it to the tokenizer; an option overrides both."""
    assert LLM(checkpoints("sdar", mask_token_id=5)).engine.mask_token_id == 5
    assert LLM(checkpoints("sdar", mask_token_id=5), mask_token_id=7).engine.mask_token_id == 7
    assert LLM(checkpoints("llada2")).engine.mask_token_id == 1  # the project tokenizer's <|mask|>


def test_outputs_are_decoded_while_another_thread_tokenizes_a_prompt(llm):
    """The server tokenizes prompts in worker threads while the engine thread decodes outputs; sharing one tokenizer
    lock, every stream stalled behind a long prompt's tokenization."""
    finished = threading.Event()

    def generate():
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
        finished.set()

    with llm.engine._tokenizer_lock:  # held as by a thread tokenizing a long prompt
        threading.Thread(target=generate, daemon=True).start()
        assert finished.wait(timeout=60)


def test_prefill_time_counts_the_prefill_the_device_runs(checkpoint):
    """The step that dispatches a prompt's prefill returns before the device has run it; the request's prefill time
    must still count that work, not the dispatch alone."""
    llm = LLM(checkpoint, dtype="float32", block_size=4, max_num_seqs=1, max_model_len=1024, num_pages=300,
              max_num_batched_tokens=1024, enable_prefix_caching=False)
    llm.generate([list(range(10, 1010))], SamplingParams(max_tokens=4, ignore_eos=True))  # compiles the shapes
    engine = llm.engine
    request_id = engine.add_request(list(range(20, 1020)), SamplingParams(max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outputs = engine.step()  # the whole prompt in one chunk
    jax.block_until_ready(engine.runner.kv)
    prefill_ms = 1e3 * (time.perf_counter() - start)
    while not any(o.finished for o in outputs):
        outputs = engine.step()
    stats = next(o for o in outputs if o.request_id == request_id).stats
    assert stats["prefill_time_ms"] >= 0.5 * prefill_ms
