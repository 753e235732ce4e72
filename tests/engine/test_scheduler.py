"""The scheduler on the host alone: admission, prefill chunks, windows, commits, stops, preemption."""

import numpy as np
import pytest

from jaxllm.engine.page_manager import PageManager
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import DecodeBatch, DecodeResult, PrefillBatch, Scheduler, SchedulerConfig
from jaxllm.sampling import SamplingParams

MASK, EOS = 1, 0


def make_scheduler(num_pages=32, block_size=4, page_size=4, buffer_size=1, max_num_seqs=4, max_tokens_per_step=8,
                   caching=True, fixed_prefill_chunks=False):
    cfg = SchedulerConfig(block_size=block_size, page_size=page_size, buffer_size=buffer_size,
                          max_num_seqs=max_num_seqs, max_model_len=64, max_num_batched_tokens=max_tokens_per_step,
                          mask_token_id=MASK, eos_token_ids=(EOS,), enable_prefix_caching=caching,
                          prefill_shapes=((1, max_tokens_per_step), (2, max_tokens_per_step // 2),
                                          (4, max_tokens_per_step // 4)),
                          fixed_prefill_chunks=fixed_prefill_chunks)
    return Scheduler(cfg, PageManager(num_pages, page_size))


def request(name, prompt, max_tokens=8, **params):
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens, **params), seed=0)


def finish_prefill(scheduler):
    while True:
        batch = scheduler.schedule()
        if not isinstance(batch, PrefillBatch):
            return batch
        scheduler.postprocess_prefill(batch)


def complete_front_block(scheduler, batch, tokens_by_request, num_blocks=1):
    """Pretend the device filled each request's front num_blocks blocks of 4 with the given tokens."""
    results = []
    for r in batch.requests:
        tokens = r.window.tokens.copy()
        free = np.flatnonzero(~r.window.fixed[:4 * num_blocks])
        tokens[free] = tokens_by_request[r.request_id][:len(free)]
        n = len(r.window.block_steps)
        results.append(DecodeResult(tokens, num_blocks, np.ones(n, np.int32), np.zeros(n, np.int32),
                                    np.zeros(n, np.int32), num_complete_blocks=num_blocks, num_forwards=3))
    return scheduler.postprocess_decode(batch, results)


def test_prompt_prefills_in_chunks_then_decodes_with_the_tail_fixed():
    scheduler = make_scheduler()
    r = request("a", list(range(10, 21)))  # 11 tokens: two full blocks and a tail of 3
    scheduler.add(r)
    batch = scheduler.schedule()
    assert isinstance(batch, PrefillBatch) and batch.chunk_lens == [8]
    scheduler.postprocess_prefill(batch)
    assert r.status is RequestStatus.DECODING and r.context_len == 8
    assert r.window.tokens.tolist() == [18, 19, 20, MASK]
    assert r.window.fixed.tolist() == [True, True, True, False]


def test_committing_a_block_appends_only_generated_tokens_and_slides_the_window():
    scheduler = make_scheduler()
    r = request("a", [10, 11, 12, 13, 14, 15])
    scheduler.add(r)
    batch = finish_prefill(scheduler)
    assert isinstance(batch, DecodeBatch)
    committed = complete_front_block(scheduler, batch, {"a": [50, 51]})
    assert committed == {"a": [50, 51]}
    assert r.output_token_ids == [50, 51] and r.context_len == 8
    assert r.window.tokens.tolist() == [MASK] * 4 and not r.window.fixed.any()


def test_eos_finishes_and_frees_pages():
    scheduler = make_scheduler()
    r = request("a", [10, 11, 12, 13])
    scheduler.add(r)
    batch = finish_prefill(scheduler)
    complete_front_block(scheduler, batch, {"a": [5, EOS, 7, 8]})
    assert r.finish_reason == "stop" and r.output_token_ids == [5, EOS]
    assert scheduler.pages.num_used_pages == 0
    assert not scheduler.running


def test_a_stop_token_past_max_tokens_is_not_output():
    """The last block decodes beyond max_tokens; an EOS or stop token there ends nothing: the output stops at the
    limit, with "length"."""
    scheduler = make_scheduler()
    eos = request("eos", [10, 11, 12, 13], max_tokens=2)
    stop = request("stop", [20, 21], max_tokens=5, stop_token_ids=[9])
    scheduler.add(eos)
    scheduler.add(stop)
    batch = finish_prefill(scheduler)
    complete_front_block(scheduler, batch, {"eos": [5, 6, EOS, 8], "stop": [1, 2]})
    batch = finish_prefill(scheduler)
    complete_front_block(scheduler, batch, {"stop": [3, 4, 5, 9]})
    assert (eos.finish_reason, eos.output_token_ids) == ("length", [5, 6])
    assert (stop.finish_reason, stop.output_token_ids) == ("length", [1, 2, 3, 4, 5])


def test_ignore_eos_runs_to_max_tokens():
    scheduler = make_scheduler()
    r = request("a", [10, 11, 12, 13], max_tokens=6, ignore_eos=True)
    scheduler.add(r)
    for tokens in ([EOS, EOS, 3, 4], [5, 6, 7, 8]):
        batch = finish_prefill(scheduler)
        complete_front_block(scheduler, batch, {"a": tokens})
    assert r.finish_reason == "length" and r.output_token_ids == [EOS, EOS, 3, 4, 5, 6]


def test_window_never_opens_past_max_tokens():
    scheduler = make_scheduler(buffer_size=3)
    r = request("a", [10, 11, 12, 13], max_tokens=5)
    scheduler.add(r)
    batch = finish_prefill(scheduler)
    assert batch.max_blocks == [2]  # 5 tokens need two blocks, not three


def test_prefix_cache_skips_the_shared_prompt_pages():
    scheduler = make_scheduler()
    prompt = list(range(10, 23))  # 13 tokens: 3 full pages
    first = request("a", prompt)
    scheduler.add(first)
    finish_prefill(scheduler)
    second = request("b", prompt[:12] + [99])
    scheduler.add(second)
    scheduler.schedule()
    assert second.stats.num_cached_tokens == 12
    assert second.page_ids[:3] == first.page_ids[:3]


def test_cached_tokens_count_once_and_a_full_hit_reports_no_negative_prefill_time():
    scheduler = make_scheduler()
    prompt = list(range(10, 23))  # 13 tokens: the prefill target is 12, three full pages
    scheduler.add(request("a", prompt))
    finish_prefill(scheduler)
    second = request("b", prompt)
    scheduler.add(second)
    scheduler.schedule()
    assert second.status is RequestStatus.DECODING and second.stats.num_cached_tokens == 12  # all from the cache
    assert second.stats.as_dict(0)["prefill_time_ms"] >= 0
    hits, queries = scheduler.pages.prefix_hits, scheduler.pages.prefix_queries
    assert (hits, queries) == (3, 6)
    scheduler.preempt(second)
    scheduler.schedule()  # recomputed: re-matches the same pages, which the hit rate does not count again
    assert second.stats.num_preemptions == 1 and second.stats.num_cached_tokens == 12
    assert (scheduler.pages.prefix_hits, scheduler.pages.prefix_queries) == (hits, queries)


def prefill_all(scheduler, requests):
    """Step (without decoding) until every request decodes; the (request, tokens) of each prefill chunk run."""
    chunks = []
    for _ in range(100):
        if all(r.status is RequestStatus.DECODING for r in requests):
            return chunks
        batch = scheduler.schedule()
        if isinstance(batch, PrefillBatch):
            chunks += [(r.request_id, n) for r, n in zip(batch.requests, batch.chunk_lens)]
            scheduler.postprocess_prefill(batch)
    raise AssertionError(f"still prefilling after 100 steps: {chunks}")


@pytest.mark.parametrize("fixed", [False, True])
def test_identical_prompts_admitted_together_prefill_once(fixed):
    scheduler = make_scheduler(fixed_prefill_chunks=fixed)  # fixed: b's runs end at 8 (a chunk) and 12 (the prompt)
    prompt = list(range(10, 23))  # 13 tokens: the prefill target is 12, three full pages
    a, b = request("a", prompt), request("b", prompt)
    scheduler.add(a)
    scheduler.add(b)
    assert prefill_all(scheduler, [a, b]) == [("a", 8), ("a", 4)]  # b waits for the pages a writes, then takes them
    assert b.page_ids[:3] == a.page_ids[:3] and b.stats.num_cached_tokens == 12
    assert (scheduler.pages.prefix_hits, scheduler.pages.prefix_queries) == (3, 6)
    for r in (a, b):
        scheduler.finish(r, "abort")
    assert scheduler.pages.num_free_pages == scheduler.pages.num_pages


def test_a_prompt_sharing_a_prefill_in_flight_computes_only_what_differs():
    scheduler = make_scheduler()
    a, b = request("a", list(range(10, 23))), request("b", list(range(10, 18)) + [90, 91, 92, 93, 94])
    scheduler.add(a)
    scheduler.add(b)
    # b takes a's first two pages once written, then prefills its own third beside a's
    assert prefill_all(scheduler, [a, b]) == [("a", 8), ("a", 4), ("b", 4)]
    assert b.page_ids[:2] == a.page_ids[:2] and b.page_ids[2] != a.page_ids[2]
    assert b.stats.num_cached_tokens == 8


@pytest.mark.parametrize("fixed", [False, True])
def test_fixed_prefill_chunks_split_a_prompt_as_alone_in_any_batch(fixed):
    """Alone, a 16-token prefill goes 8 + 8 (the longest chunk). Beside a short prompt a step gives each request 4
    tokens: by default the long one takes them (4 + 8 + 4); with fixed chunks it waits for a step with room for 8."""
    scheduler = make_scheduler(caching=False, fixed_prefill_chunks=fixed)
    short, long = request("short", [10, 11, 12, 13, 14]), request("long", list(range(20, 37)))
    scheduler.add(short)
    scheduler.add(long)
    chunks_of_long = [n for name, n in prefill_all(scheduler, [short, long]) if name == "long"]
    assert chunks_of_long == ([8, 8] if fixed else [4, 8, 4])


@pytest.mark.parametrize("fixed", [False, True])
def test_fixed_prefill_chunks_take_cached_pages_only_up_to_a_chunk_boundary(fixed):
    """Three cached pages (12 tokens) of a prompt: by default all are taken; with fixed 8-token chunks the first two,
    and the prompt prefills from 8 as it would alone."""
    scheduler = make_scheduler(fixed_prefill_chunks=fixed)
    prompt = list(range(10, 27))  # 17 tokens: the prefill target is 16
    scheduler.add(request("a", prompt[:13]))
    finish_prefill(scheduler)
    b = request("b", prompt)
    scheduler.add(b)
    assert prefill_all(scheduler, [b]) == ([("b", 8)] if fixed else [("b", 4)])
    assert b.stats.num_cached_tokens == (8 if fixed else 12)


def test_prefix_cache_off_shares_nothing():
    scheduler = make_scheduler(caching=False)
    prompt = list(range(10, 23))
    for name in "ab":
        scheduler.add(request(name, prompt))
    finish_prefill(scheduler)
    a, b = scheduler.running
    assert not set(a.page_ids) & set(b.page_ids)


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    scheduler = make_scheduler(num_pages=4, max_tokens_per_step=16)
    old, new = request("old", [10, 11, 12, 13]), request("new", [20, 21, 22, 23])
    scheduler.add(old)
    scheduler.add(new)
    batch = finish_prefill(scheduler)  # each holds 2 pages: prompt block + window block
    complete_front_block(scheduler, batch, {"old": [1, 2, 3, 4], "new": [5, 6, 7, 8]})
    batch = scheduler.schedule()  # both need a third page; only room for one after preempting
    assert [r.request_id for r in batch.requests] == ["old"]
    assert new.status is RequestStatus.WAITING and scheduler.waiting[0] is new
    assert new.page_ids == [] and new.output_token_ids == [5, 6, 7, 8]
    assert new.prefill_target(4) == 8  # recomputed from prompt + committed output, block-aligned


@pytest.mark.parametrize("fixed", [False, True])
def test_fixed_prefill_chunks_recompute_a_preempted_output_in_its_commits(fixed):
    """A request (two blocks in flight) commits one block, then two at once, and is preempted. It finds its 8-token
    prompt's pages cached and recomputes its output: with fixed chunks in its commits, 4 + 8, as its decode wrote
    them (by default in one piece of 12); only the prompt's pages go into the prefix cache."""
    scheduler = make_scheduler(buffer_size=2, max_tokens_per_step=16, fixed_prefill_chunks=fixed)
    r = request("r", list(range(10, 19)), max_tokens=16)  # 9 tokens: the prompt's blocks end at 8
    scheduler.add(r)
    batch = finish_prefill(scheduler)
    complete_front_block(scheduler, batch, {"r": [1, 2, 3]})
    complete_front_block(scheduler, scheduler.schedule(), {"r": list(range(4, 12))}, num_blocks=2)
    assert r.context_len == 20
    scheduler.preempt(r)
    assert prefill_all(scheduler, [r]) == ([("r", 4), ("r", 8)] if fixed else [("r", 12)])
    # its first 16 tokens: a chunk; cached output pages would complete the run, the prompt's 2 pages alone do not
    later = request("later", r.all_token_ids[:16] + [99])
    scheduler.add(later)
    scheduler.schedule()
    assert later.stats.num_cached_tokens == (0 if fixed else 16)


def test_a_request_waits_for_the_pages_an_earlier_admission_still_takes():
    """Free pages are promised once: with "fresh" admitted and prefilling (11 of the 16 pages to come), "hit" (12,
    ten of them cached when it arrives) waits instead of both prefilling into a pool too small for the two (which
    ended in a preemption and a recompute); both finish, hit without a preemption, and every page comes back."""
    scheduler = make_scheduler(num_pages=16, max_tokens_per_step=16)
    shared = list(range(100, 140))  # ten full pages, cached by the first request
    first = request("first", shared, max_tokens=4)
    scheduler.add(first)
    complete_front_block(scheduler, finish_prefill(scheduler), {"first": [5, 6, 7, 8]})
    assert first.finish_reason == "length"
    fresh, hit = request("fresh", list(range(200, 240)), max_tokens=8), request("hit", shared + [7, 8, 9, 10],
                                                                                  max_tokens=4)
    scheduler.add(fresh)
    scheduler.add(hit)
    for _ in range(20):
        batch = scheduler.schedule()
        assert batch is not None, [(r.request_id, r.status, r.context_len) for r in scheduler.running]
        if isinstance(batch, PrefillBatch):
            scheduler.postprocess_prefill(batch)
        else:
            complete_front_block(scheduler, batch, {r.request_id: [5, 6, 7, 8] for r in batch.requests})
        if not scheduler.has_unfinished():
            break
    assert fresh.finish_reason == hit.finish_reason == "length" and hit.stats.num_preemptions == 0
    assert fresh.output_token_ids == [5, 6, 7, 8] * 2 and hit.output_token_ids == [5, 6, 7, 8]
    assert scheduler.pages.num_used_pages == 0


def test_admission_reserves_only_the_window_blocks_max_tokens_can_open():
    """With buffer_size 3, a 4-token answer opens one block: two such requests fit a 4-page pool together (prompt page
    + one window page each) and are admitted at once rather than one waiting for three blocks it never opens."""
    scheduler = make_scheduler(num_pages=4, buffer_size=3)
    a, b = request("a", [10, 11, 12, 13], max_tokens=4), request("b", [20, 21, 22, 23], max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    batch = finish_prefill(scheduler)
    assert [r.request_id for r in batch.requests] == ["a", "b"] and batch.max_blocks == [1, 1]
    complete_front_block(scheduler, batch, {"a": [5, 6, 7, 8], "b": [6, 7, 8, 9]})
    assert a.output_token_ids == [5, 6, 7, 8] and b.output_token_ids == [6, 7, 8, 9]
    assert a.stats.num_preemptions == b.stats.num_preemptions == 0 and scheduler.pages.num_used_pages == 0


def test_max_num_seqs_bounds_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add(request(name, [10, 11, 12, 13]))
    scheduler.schedule()
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1


def test_requests_never_scheduled_expire_after_the_queue_time_and_started_ones_wait_on():
    scheduler = make_scheduler(num_pages=4, max_num_seqs=1, max_tokens_per_step=16)
    running, queued, late = request("running", [10, 11, 12, 13]), request("queued", [20, 21]), request("late", [30])
    for r in (running, queued, late):
        scheduler.add(r)
    complete_front_block(scheduler, finish_prefill(scheduler), {"running": [5, 6, 7, 8]})
    scheduler.preempt(running)  # started, then sent back to the queue: it waits on
    running.stats.arrival_time = queued.stats.arrival_time = late.stats.arrival_time - 10.0
    assert scheduler.expire_waiting(arrived_before=late.stats.arrival_time) == [queued]
    assert queued.finish_reason == "queue_timeout" and queued not in scheduler.waiting
    assert list(scheduler.waiting) == [running, late] and scheduler.pages.num_used_pages == 0
    batch = finish_prefill(scheduler)  # the preempted request resumes where it stopped
    assert batch.requests == [running] and running.output_token_ids == [5, 6, 7, 8]


def test_a_prefill_step_always_fits_a_compiled_shape():
    scheduler = make_scheduler(max_tokens_per_step=16)
    for name, start, length in zip("abc", (10, 40, 70), (9, 9, 30)):
        scheduler.add(request(name, list(range(start, start + length))))
    batch = scheduler.schedule()
    padded_chunk = max(batch.chunk_lens)
    assert any(b >= len(batch.requests) and c >= padded_chunk for b, c in scheduler.cfg.prefill_shapes)
    assert batch.chunk_lens == [8, 8]  # two requests can only pad to 8 tokens each


@pytest.mark.parametrize("page_size", [4, 8])
def test_pages_cover_the_window(page_size):
    scheduler = make_scheduler(page_size=page_size, buffer_size=2)
    r = request("a", list(range(10, 19)))
    scheduler.add(r)
    batch = finish_prefill(scheduler)
    needed = -(-(r.context_len + batch.max_blocks[0] * 4) // page_size)
    assert len(r.page_ids) == needed
