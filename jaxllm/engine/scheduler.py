"""The scheduler decides what the next device step does; it is plain host Python (no JAX) and owns the pages.

Each step is either a prefill step (prompt chunks of several requests) or a decode round (every decoding request's
window). Prefill goes first, but never twice in a row while requests are decoding. When pages run out, the most
recently admitted request is preempted: its pages are freed and it is recomputed later from its prompt and committed
output, with the same block alignment, so its output does not change.
"""

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jaxllm.engine.page_manager import PageManager, page_hashes
from jaxllm.engine.request import Request, RequestStatus, Window


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    page_size: int
    buffer_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int  # prompt tokens per prefill step
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    prefill_shapes: tuple[tuple[int, int], ...]  # compiled (batch, chunk) shapes a prefill step must fit
    enable_prefix_caching: bool = True
    # batch_invariant: a request's context is prefilled in the pieces it would have alone, each whole in one step
    # (where a prefill splits changes the attention's arithmetic): the prompt's blocks at multiples of the longest
    # chunk (max_chunk(1)), a preempted request's committed output in its commits, as its decode wrote them; only
    # prompt pages are cached, and a run of them is taken up to such a multiple or the prompt's last block
    fixed_prefill_chunks: bool = False

    def max_chunk(self, num_requests: int) -> int:
        """The longest chunk a prefill step of num_requests can pad to (0: none fits)."""
        return max((chunk for batch, chunk in self.prefill_shapes if batch >= num_requests), default=0)


@dataclasses.dataclass
class PrefillBatch:
    requests: list[Request]
    chunk_lens: list[int]  # prompt tokens each request prefills, starting at its context_len


@dataclasses.dataclass
class DecodeBatch:
    requests: list[Request]
    max_blocks: list[int]  # window blocks each request may have in flight this round


@dataclasses.dataclass
class DecodeResult:
    """Per request, what a decode round returned (numpy, from the device)."""

    tokens: np.ndarray  # i32[Q]
    num_active_blocks: int
    block_steps: np.ndarray  # i32[N]
    block_masks: np.ndarray  # i32[N]
    post_steps: np.ndarray  # i32[N]
    num_complete_blocks: int
    num_forwards: int


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pages: PageManager):
        self.cfg = cfg
        self.pages = pages
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order
        self._last_step_was_prefill = False

    # admission and planning

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> PrefillBatch | DecodeBatch | None:
        self._admit()
        prefilling = [r for r in self.running if r.status is RequestStatus.PREFILLING]
        decoding = [r for r in self.running if r.status is RequestStatus.DECODING]
        if prefilling and not (decoding and self._last_step_was_prefill):
            batch = self._schedule_prefill(prefilling)
            if batch.requests:
                self._last_step_was_prefill = True
                return batch
        self._last_step_was_prefill = False
        decoding = [r for r in self.running if r.status is RequestStatus.DECODING]  # a cache hit may have joined
        if decoding:
            batch = self._schedule_decode(decoding)
            if batch.requests:
                return batch
        return None

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cfg.page_size)

    def _pages_to_decode(self, request: Request) -> int:
        """Pages a request holds once prefilled, with its first window's blocks."""
        target = request.prefill_target(self.cfg.block_size)
        return self._pages_for(target + self._window_blocks(request, target) * self.cfg.block_size)

    def _admit(self) -> None:
        # the free pages the prefilling requests will still take are theirs: each is promised once
        owed = sum(max(0, self._pages_to_decode(r) - len(r.page_ids)) for r in self.running
                   if r.status is RequestStatus.PREFILLING)
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            request = self.waiting[0]
            target = request.prefill_target(self.cfg.block_size)
            needed = self._pages_to_decode(request)
            if needed > self.pages.num_free_pages - owed and self.running:
                return  # wait for pages rather than thrash
            self.waiting.popleft()
            if self.cfg.enable_prefix_caching:
                # with fixed chunks, a recompute's output pages are not what a prompt's pieces would write
                hashed = min(target, self._prompt_blocks_end(request)) if self.cfg.fixed_prefill_chunks else target
                request.page_hashes = page_hashes(request.all_token_ids, self.cfg.page_size,
                                                  hashed // self.cfg.page_size)
                request.page_ids = self.pages.match_prefix(request.page_hashes,
                                                           count=request.stats.first_scheduled_time is None,
                                                           usable_run=self._usable_cached_run(request, 0))
            request.context_len = len(request.page_ids) * self.cfg.page_size
            if request.stats.first_scheduled_time is None:  # a recompute after preemption re-matches its own pages
                request.stats.first_scheduled_time = time.perf_counter()
                request.stats.num_cached_tokens = request.context_len
            request.status = RequestStatus.PREFILLING
            self.running.append(request)
            self._finish_prefill_if_done(request)
            if request.status is RequestStatus.PREFILLING:
                owed += max(0, needed - len(request.page_ids))

    def _schedule_prefill(self, requests: list[Request]) -> PrefillBatch:
        batch = PrefillBatch([], [])
        budget = self.cfg.max_num_batched_tokens
        being_written: set[bytes] = set()  # hashes of the prompt pages this batch fills
        for request in requests:
            if request.status is not RequestStatus.PREFILLING:
                continue  # preempted below while making room for an earlier request
            if self.cfg.enable_prefix_caching and self._holds_only_written_pages(request):
                # a request prefilling the same prefix beside this one (n > 1, a popular system prompt) registered
                # pages since this one was admitted, or writes them in this batch: take them, or wait a step for them
                self._match_more_cached_pages(request)
                if request.status is not RequestStatus.PREFILLING:
                    continue
                next_page = request.context_len // self.cfg.page_size
                if set(request.page_hashes[next_page:next_page + 1]) & being_written:
                    continue
            longest = self.cfg.max_chunk(len(batch.requests) + 1)
            if max(batch.chunk_lens, default=0) > longest:
                break
            remaining = request.prefill_target(self.cfg.block_size) - request.context_len
            chunk = min(remaining, budget, longest) // self.cfg.block_size * self.cfg.block_size
            if self.cfg.fixed_prefill_chunks:
                piece = self._fixed_piece(request)
                if chunk < piece:
                    continue  # its next piece does not fit this step whole
                chunk = piece
            if chunk == 0:
                break
            while not self._ensure_pages(request, request.context_len + chunk):
                # Pages come back when this batch runs or a decoding request finishes. If neither can happen (every
                # running request prefilling), they would wait on each other forever. Admission promises each free
                # page once, so no test reaches this; it stays so that a miscount costs a recompute, not a hang.
                decoding = any(r.status is RequestStatus.DECODING for r in self.running)
                if batch.requests or decoding or self.running[-1] is request:
                    return batch
                self.preempt(self.running[-1])
            batch.requests.append(request)
            batch.chunk_lens.append(chunk)
            budget -= chunk
            if self.cfg.enable_prefix_caching:
                full_pages = (request.context_len + chunk) // self.cfg.page_size
                being_written.update(request.page_hashes[request.context_len // self.cfg.page_size:full_pages])
        return batch

    def _prompt_blocks_end(self, request: Request) -> int:
        return len(request.prompt_token_ids) // self.cfg.block_size * self.cfg.block_size

    def _fixed_piece(self, request: Request) -> int:
        """The next piece of a request's prefill with fixed_prefill_chunks."""
        prompt_end = self._prompt_blocks_end(request)
        if request.context_len < prompt_end:
            return min(self.cfg.max_chunk(1), prompt_end - request.context_len)
        commit_end = prompt_end
        for size in request.commit_sizes:
            commit_end += size
            if request.context_len < commit_end:
                # the rest of the commit; one wider than any chunk (a window wider than the budget) goes in parts
                return min(commit_end - request.context_len, self.cfg.max_chunk(1))
        raise AssertionError(f"{request.request_id}: context {request.context_len} past its committed output")

    def _usable_cached_run(self, request: Request, first_page: int) -> Callable[[int], int] | None:
        """With fixed_prefill_chunks, how much of a run of cached pages from first_page to take: up to the last page
        that ends at a multiple of the longest chunk or at the prompt's last block, where its next piece starts as it
        would alone."""
        if not self.cfg.fixed_prefill_chunks:
            return None
        prompt_end, unit = self._prompt_blocks_end(request), self.cfg.max_chunk(1)

        def usable(length: int) -> int:
            for taken in range(length, 0, -1):
                end = (first_page + taken) * self.cfg.page_size
                if end % unit == 0 or end == prompt_end:
                    return taken
            return 0

        return usable

    def _holds_only_written_pages(self, request: Request) -> bool:
        """Its context ends at a page boundary and it holds no page past it: cached pages can extend it."""
        return (request.context_len % self.cfg.page_size == 0
                and len(request.page_ids) == request.context_len // self.cfg.page_size)

    def _match_more_cached_pages(self, request: Request) -> None:
        """Take the cached pages that continue the request's context; decoding starts if they complete its prefill."""
        num_pages = request.context_len // self.cfg.page_size
        first_time = request.stats.num_preemptions == 0
        pages = self.pages.match_prefix(request.page_hashes[num_pages:], count=first_time, new_query=False,
                                        usable_run=self._usable_cached_run(request, num_pages))
        if not pages:
            return
        request.page_ids.extend(pages)
        request.context_len += len(pages) * self.cfg.page_size
        if first_time:
            request.stats.num_cached_tokens += len(pages) * self.cfg.page_size
        self._finish_prefill_if_done(request)

    def _window_blocks(self, request: Request, context_len: int) -> int:
        """Blocks a window after context_len tokens may open: buffer_size, fewer where max_tokens ends sooner."""
        end = min(len(request.prompt_token_ids) + request.params.max_tokens, self.cfg.max_model_len)
        return max(1, min(self.cfg.buffer_size, -(-(end - context_len) // self.cfg.block_size)))

    def _schedule_decode(self, requests: list[Request]) -> DecodeBatch:
        batch = DecodeBatch([], [])
        for request in requests:
            if request.status is not RequestStatus.DECODING:
                continue  # preempted below while making room for an earlier request
            max_blocks = self._window_blocks(request, request.context_len)
            while not self._ensure_pages(request, request.context_len + max_blocks * self.cfg.block_size):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.max_blocks.append(max_blocks)
        return batch

    def _ensure_pages(self, request: Request, num_tokens: int) -> bool:
        missing = self._pages_for(num_tokens) - len(request.page_ids)
        if missing <= 0:
            return True
        pages = self.pages.allocate(missing)
        if pages is None:
            return False
        request.page_ids.extend(pages)
        return True

    # results

    def postprocess_prefill(self, batch: PrefillBatch) -> list[Request]:
        """Account for a dispatched prefill batch; returns the requests whose first prefill it ends."""
        ended = []
        for request, chunk in zip(batch.requests, batch.chunk_lens):
            request.context_len += chunk
            self._register_prompt_pages(request)
            if self._finish_prefill_if_done(request):
                ended.append(request)
        return ended

    def _register_prompt_pages(self, request: Request) -> None:
        if not self.cfg.enable_prefix_caching:
            return
        num_full = request.context_len // self.cfg.page_size
        for page, page_hash in zip(request.page_ids[:num_full], request.page_hashes[:num_full]):
            self.pages.register(page, page_hash)

    def _finish_prefill_if_done(self, request: Request) -> bool:
        """Move a fully prefilled request to decoding; True where this ends its first prefill (not a recompute)."""
        target = request.prefill_target(self.cfg.block_size)
        if request.context_len < target:
            return False
        if request.window is None:  # a preempted request resumes its blocks in flight as they were
            tail = request.all_token_ids[target:]  # the prompt tail shares the first block, fixed
            request.window = Window.start(tail, self.cfg.buffer_size, self.cfg.block_size, self.cfg.mask_token_id)
        request.status = RequestStatus.DECODING
        if request.stats.prefill_done_time is not None:
            return False
        request.stats.prefill_done_time = time.perf_counter()  # the engine restamps a dispatched prefill when written
        return True

    def postprocess_decode(self, batch: DecodeBatch, results: list[DecodeResult]) -> dict[str, list[int]]:
        """Commit finished blocks; returns the new output tokens of each request that committed any."""
        committed = {}
        for request, result in zip(batch.requests, results):
            request.stats.num_forwards += result.num_forwards
            window = request.window
            window.tokens, window.num_active_blocks = result.tokens, result.num_active_blocks
            window.block_steps, window.block_masks, window.post_steps = (
                result.block_steps, result.block_masks, result.post_steps)
            if result.num_complete_blocks:
                committed[request.request_id] = self._commit(request, result.num_complete_blocks)
        return committed

    def _commit(self, request: Request, num_blocks: int) -> list[int]:
        size = num_blocks * self.cfg.block_size
        window = request.window
        new_tokens = window.tokens[:size][~window.fixed[:size]].tolist()
        new_tokens, reason = self._apply_token_stops(request, new_tokens)
        request.output_token_ids.extend(new_tokens)
        request.stopped_by_token = reason == "stop"
        if reason:
            self.finish(request, reason)
        else:
            request.context_len += size
            request.commit_sizes.append(size)
            window.shift(num_blocks, self.cfg.block_size, self.cfg.mask_token_id)
        return new_tokens

    def _apply_token_stops(self, request: Request, new_tokens: list[int]) -> tuple[list[int], str | None]:
        params = request.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.cfg.eos_token_ids))
        room = min(params.max_tokens, self.cfg.max_model_len - len(request.prompt_token_ids))
        room -= len(request.output_token_ids)
        # the last block decodes past the limit: a stop token beyond it is never output
        for i, token in enumerate(new_tokens[:room]):
            if token in stop_ids:
                return new_tokens[: i + 1], "stop"
        if len(new_tokens) >= room:
            return new_tokens[:room], "length"
        return new_tokens, None

    # leaving

    def finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.pages.free(request.page_ids)
        request.page_ids = []
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def expire_waiting(self, arrived_before: float) -> list[Request]:
        """Finish ("queue_timeout") the waiting requests never scheduled that arrived before this perf_counter time;
        a preempted request has started and waits on."""
        expired = [request for request in self.waiting
                   if request.stats.first_scheduled_time is None and request.stats.arrival_time < arrived_before]
        for request in expired:
            self.finish(request, "queue_timeout")
        return expired

    def preempt(self, request: Request) -> None:
        """Free the request's pages and requeue it first. Its window stays: after recomputing the committed KV
        (prefill up to the same context) it resumes mid-block, so its output is the one it would have had."""
        self.pages.free(request.page_ids)
        request.page_ids, request.context_len = [], 0
        request.status = RequestStatus.WAITING
        request.stats.num_preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)
