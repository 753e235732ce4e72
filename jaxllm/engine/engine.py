"""LLMEngine: requests in, committed blocks out. step() = schedule -> run on the device -> postprocess.

One thread owns the device and calls step(); add_request and abort_request may come from any thread and take
effect at the next step boundary.
"""

import collections
import contextlib
import dataclasses
import itertools
import json
import logging
import operator
import pathlib
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import transformers
from tqdm import tqdm
from transformers import AutoTokenizer

from jaxllm.config import DTYPES, ConfigError, DecodingConfig, EngineConfig
from jaxllm.decoding import max_steps_per_block
from jaxllm.engine.page_manager import PageManager
from jaxllm.engine.request import Request, RequestOutput
from jaxllm.engine.runner import ModelRunner, StepSpec, powers_of_two
from jaxllm.engine.scheduler import DecodeBatch, PrefillBatch, Scheduler, SchedulerConfig
from jaxllm.models import load_model, model_config
from jaxllm.models.layers import KVCache
from jaxllm.sampling import SamplingParams

logger = logging.getLogger("jaxllm")

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _load_tokenizer(model_dir: pathlib.Path):
    """AutoTokenizer, without the warnings transformers prints about config.json fields it does not know. The
    released checkpoints name remote model code in config.json (`auto_map`); the tokenizer needs none, and
    trust_remote_code=None would ask on a terminal whether to run it (twice, ~15 s) before loading the same files."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    finally:
        transformers.logging.set_verbosity(verbosity)


class CompilationAfterWarmup(RuntimeError):
    """A jitted step compiled after warm-up: some shape escaped the buckets."""


class QueueFull(RuntimeError):
    """More requests are waiting than max_waiting_requests."""


class _CompileGuard:
    """Counts the XLA compilations a warmed-up engine's steps make; raises on one when strict (tests), logs it
    otherwise.

    Compilation events are process-wide, so a compilation is charged to the engine whose step runs in the compiling
    thread, and only once that engine has warmed up: another engine in the process (built before or after, warmed
    up or not) compiles its own shapes without being blamed for them or blaming this one.
    """

    def __init__(self):
        self._stepping = threading.local()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    @contextlib.contextmanager
    def watching(self, engine: "LLMEngine"):
        self._stepping.engine = engine
        try:
            yield
        finally:
            self._stepping.engine = None

    def _on_event(self, event: str, duration: float, **_) -> None:
        engine = getattr(self._stepping, "engine", None)
        if event != _COMPILE_EVENT or engine is None or engine.compile_after_warmup is None:
            return
        engine.compilations_after_warmup += 1
        logger.warning("compiled after warm-up (%.2fs): a shape escaped the buckets", duration)
        if engine.compile_after_warmup == "raise":
            raise CompilationAfterWarmup(f"an XLA compilation ({duration:.2f}s) happened after warm-up")


_compile_guard = _CompileGuard()


class LLMEngine:
    def __init__(self, model_dir: str | pathlib.Path, engine_config: EngineConfig | None = None,
                 decoding_config: DecodingConfig | None = None, *, random_weights: bool = False):
        engine_config, decoding_config = engine_config or EngineConfig(), decoding_config or DecodingConfig()
        self.config, self.decoding = engine_config, decoding_config
        if engine_config.compilation_cache_dir:
            jax.config.update("jax_compilation_cache_dir", engine_config.compilation_cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        model_dir = pathlib.Path(model_dir)
        # after warm-up a compilation in a step is logged ("log") or raises ("raise"); None: not warmed up yet
        self.compile_after_warmup: str | None = None
        self.compilations_after_warmup = 0
        self.model_config = model_config(model_dir)  # first: a wrong path is "no config.json", not a Hub error
        self.tokenizer = _load_tokenizer(model_dir)
        self._tokenizer_lock = threading.Lock()  # fast tokenizers raise "Already borrowed" when shared by threads
        # outputs are decoded by a copy of their own, used only by the thread that steps the engine (so unlocked):
        # behind the lock of the request side, every stream stalled while a server thread tokenized a long prompt
        self._detokenizer = _load_tokenizer(model_dir)
        self.mask_token_id = self._resolve_mask_id()
        self.eos_token_ids = self._resolve_eos_ids(model_dir)
        self.block_size = engine_config.block_size or self.model_config.default_block_size
        if self.decoding.strategy == "fixed_steps" and self.decoding.denoising_steps is None:
            self.decoding = dataclasses.replace(self.decoding, denoising_steps=self.block_size)
        self.page_size = engine_config.page_size or self.block_size
        if self.page_size % self.block_size:
            raise ConfigError(f"page_size ({self.page_size}) must be a multiple of block_size ({self.block_size})")
        self.max_model_len = self._resolve_max_model_len()
        model = load_model(model_dir, self.model_config, engine_config.dtype, random_init=random_weights,
                           quantization=engine_config.quantization)
        if engine_config.batch_invariant:
            model.set_attributes(batch_invariant=True)
        kv = self._allocate_pool(engine_config.num_pages or self._pages_that_fit(),
                                 sized_from_memory=engine_config.num_pages is None)
        num_pages = kv.k_pages.shape[2]
        self.runner = self._make_runner(model, kv)
        self.scheduler = Scheduler(self._scheduler_config(), PageManager(num_pages, self.page_size))
        if engine_config.batch_invariant and engine_config.enable_prefix_caching:
            logger.info("batch_invariant: a prompt takes cached pages up to a multiple of %d tokens or its last whole "
                        "block", self.scheduler.cfg.max_chunk(1))
        self._inbox: collections.deque = collections.deque()  # ("add", request) / ("abort", id), any thread
        self._wakeup = threading.Event()
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(engine_config.seed)
        self.num_steps = 0
        self.num_forwards = 0  # denoising forwards (each runs the whole decode batch)
        self.num_decode_rounds = 0  # device calls of the denoising loop
        self.decode_time = 0.0  # seconds spent in decode rounds
        self.last_forward_time = 0.0
        self.last_step_tokens = 0  # what the last step did: prompt tokens prefilled, or output tokens committed

    # set-up

    def _resolve_mask_id(self) -> int:
        mask = self.config.mask_token_id
        for candidate in (self.model_config.mask_token_id, self.tokenizer.mask_token_id):
            mask = candidate if mask is None else mask
        if mask is None:
            raise ConfigError("no mask token id: config.json has no mask_token_id and the tokenizer no mask_token; "
                              "pass mask_token_id")
        if not 0 <= mask < self.model_config.vocab_size:
            raise ConfigError(f"mask_token_id {mask} lies outside the vocabulary ({self.model_config.vocab_size})")
        return int(mask)

    def _resolve_eos_ids(self, model_dir: pathlib.Path) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        generation_config = model_dir / "generation_config.json"
        if generation_config.exists():
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
            ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _resolve_max_model_len(self) -> int:
        limit = self.config.max_model_len or min(self.model_config.max_position_embeddings, 4096)
        if limit > self.model_config.max_position_embeddings:
            raise ConfigError(f"max_model_len {limit} exceeds the model's max_position_embeddings "
                              f"{self.model_config.max_position_embeddings}")
        if limit < self.block_size:
            raise ConfigError(f"max_model_len {limit} is shorter than one block ({self.block_size} tokens)")
        if limit % self.block_size:  # a request's context grows by whole blocks
            logger.warning("max_model_len %d rounded down to %d, a multiple of the block size %d", limit,
                           limit // self.block_size * self.block_size, self.block_size)
        return limit // self.block_size * self.block_size

    def _page_bytes(self) -> int:
        cfg = self.model_config
        itemsize = jnp.dtype(DTYPES[self.config.dtype]).itemsize
        return 2 * cfg.num_layers * cfg.num_kv_heads * self.page_size * cfg.head_dim * itemsize

    def _pages_that_fit(self) -> int:
        """Pages for the memory fraction left after the weights (GPU); enough for every sequence elsewhere."""
        full_load = self.config.max_num_seqs * -(-self.max_model_len // self.page_size)
        stats = jax.devices()[0].memory_stats()
        if not stats or "bytes_limit" not in stats:
            return full_load
        budget = stats["bytes_limit"] * self.config.gpu_memory_utilization - stats["bytes_in_use"]
        return max(int(budget * 0.9) // self._page_bytes(), 1)  # 10% left for activations

    def _allocate_pool(self, num_pages: int, *, sized_from_memory: bool) -> KVCache:
        """The KV pool, allocated now. Sized from memory, a refused allocation shrinks it by a tenth until one is
        granted: an allocator that grows on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false) rounds each array's region up
        to a power of two, so two arrays inside the budget may not fit the device together (on an H200, two 42.5 GiB
        arrays under a 104.9 GiB limit: BENCHMARKS.md, run 25)."""
        cfg = self.model_config
        while True:
            shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, self.page_size, cfg.head_dim)
            try:
                return KVCache.zeros(shape, jnp.dtype(DTYPES[self.config.dtype]))
            except jax.errors.JaxRuntimeError as error:
                if "RESOURCE_EXHAUSTED" not in str(error):
                    raise
                needed = f"{num_pages} KV pages ({num_pages * self._page_bytes() / 2**30:.2f} GiB)"
                if not sized_from_memory or num_pages == 1:
                    raise ConfigError(f"the device cannot hold {needed}: lower num_pages or "
                                      f"gpu_memory_utilization") from error
                num_pages = max(num_pages * 9 // 10, 1)  # the refused arrays are freed as this block ends
                # each refusal waits ~10 s per array in XLA's allocator for memory to be freed: a pool sized for a
                # device that another process shares takes minutes to shrink (BENCHMARKS.md, run 50)
                logger.warning("the device refused %s; trying %d pages (another process on the device? "
                               "--num-pages or a lower --gpu-memory-utilization asks for less at once)",
                               needed, num_pages)

    def _make_runner(self, model, kv: KVCache) -> ModelRunner:
        cfg = self.model_config
        spec = StepSpec(
            decoding=self.decoding, block_size=self.block_size, mask_token_id=self.mask_token_id,
            vocab_size=cfg.vocab_size, num_real_tokens=min(len(self.tokenizer), cfg.vocab_size),
            min_logit_rows=self.config.min_logit_rows)
        max_pages = -(-self.max_model_len // self.page_size)
        token_budget = self.config.max_num_batched_tokens
        if token_budget < self.block_size:  # prefill goes by whole blocks
            raise ConfigError(f"max_num_batched_tokens {token_budget} is less than one block ({self.block_size} "
                              f"tokens)")
        # chunks of whole blocks up to the budget (or the context), the largest the budget itself so that a step
        # can use all of it; chunks below 16 tokens would only add compilations
        chunk_limit = min(token_budget, self.max_model_len) // self.block_size * self.block_size
        smallest_chunk = self.block_size * max(1, 16 // self.block_size)
        chunk_buckets = [c for c in powers_of_two(smallest_chunk, chunk_limit) if c < chunk_limit] + [chunk_limit]
        return ModelRunner(
            model, kv, spec, batch_buckets=powers_of_two(1, self.config.max_num_seqs),
            width_buckets=powers_of_two(min(8, max_pages), max_pages),
            chunk_buckets=chunk_buckets, max_num_batched_tokens=token_budget,
            max_steps_per_round=self.config.max_steps_per_round or max_steps_per_block(self.decoding, self.block_size))

    def _scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=self.block_size, page_size=self.page_size, buffer_size=self.decoding.buffer_size,
            max_num_seqs=self.config.max_num_seqs, max_model_len=self.max_model_len,
            max_num_batched_tokens=self.runner.max_num_batched_tokens, mask_token_id=self.mask_token_id,
            eos_token_ids=self.eos_token_ids, prefill_shapes=tuple(self.runner.prefill_shapes()),
            enable_prefix_caching=self.config.enable_prefix_caching, fixed_prefill_chunks=self.config.batch_invariant)

    def warmup(self, *, strict: bool = False) -> dict[str, float]:
        """Compile every bucket now (progress bar, seconds per bucket); later compilations log, or raise if strict."""
        timings = self.runner.warmup(lambda shapes: tqdm(shapes, desc="compiling buckets", unit="bucket"))
        for name, seconds in timings.items():
            logger.info("compiled %s in %.2fs", name, seconds)
        self.compile_after_warmup, self.compilations_after_warmup = ("raise" if strict else "log"), 0
        return timings

    # requests

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return [operator.index(t) for t in prompt]  # numpy integers too; a float or a string id is a TypeError
        with self._tokenizer_lock:
            return self.tokenizer.encode(prompt, add_special_tokens=False)

    def _text_of(self, token_ids: list[int]) -> str:
        return self._detokenizer.decode(token_ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        with self._tokenizer_lock:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise ValueError when prompt plus max_tokens cannot fit the context or the KV pool."""
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len >= self.max_model_len and params.max_tokens:  # the server's default max_tokens is 1 here
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
                f"{prompt_len} input tokens, which leave no room for output. Please reduce the length of the input "
                f"prompt.")
        if prompt_len + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{params.max_tokens} output tokens and your prompt contains at least {prompt_len} input tokens, "
                f"for a total of at least {prompt_len + params.max_tokens} tokens. Please reduce the length of the "
                f"input prompt or the number of requested output tokens.")
        # the window never opens past the last output token's block, so this is all a request alone ever holds
        last_block_end = -(-(prompt_len + params.max_tokens) // self.block_size) * self.block_size
        if -(-last_block_end // self.page_size) > self.scheduler.pages.num_pages:
            raise ValueError(f"the request needs more KV pages than the pool holds ({self.scheduler.pages.num_pages})")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        token_ids = self.tokenize(prompt)
        vocab_size = self.model_config.vocab_size
        if any(not 0 <= t < vocab_size for t in token_ids):
            # an id past the embedding reads garbage (a review's CPU run: NaN confidences, a window never completing)
            raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {vocab_size})")
        self.check_fits(len(token_ids), params)
        if self.num_waiting >= self.config.max_waiting_requests:
            raise QueueFull(f"{self.config.max_waiting_requests} requests are already waiting")
        in_use = set(self._requests) | set(self._pending_adds())
        if request_id is not None and request_id in in_use:
            raise ValueError(f"request id {request_id!r} is already in use")  # an abort must reach one request
        while request_id is None or request_id in in_use:  # an automatic id skips the ones callers chose
            request_id = f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**32))
        self._inbox.append(("add", Request(request_id, token_ids, params, seed)))
        self._wakeup.set()
        return request_id

    def abort_request(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wakeup.set()

    def has_unfinished_requests(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def wait_for_work(self, timeout: float) -> None:
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "add":
                self._requests[item.request_id] = item
                if item.params.max_tokens == 0:  # nothing to generate: done before it takes a page
                    self.scheduler.finish(item, "length")
                    outputs.append(self._output(item, [], ""))
                else:
                    self.scheduler.add(item)
            elif item in self._requests and not self._requests[item].is_finished:
                request = self._requests.pop(item)
                self.scheduler.finish(request, "abort")
                outputs.append(self._output(request, [], ""))
        return outputs

    def _expire_queued(self) -> list[RequestOutput]:
        if self.config.max_queue_time is None:
            return []
        expired = self.scheduler.expire_waiting(time.perf_counter() - self.config.max_queue_time)
        return [self._output(request, [], "") for request in expired]

    # the step

    def step(self) -> list[RequestOutput]:
        with _compile_guard.watching(self):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs = self._drain_inbox()
        batch = self.scheduler.schedule()
        outputs += self._expire_queued()  # after admission: a request admitted now has not waited too long
        if batch is None:
            return outputs
        self.num_steps += 1
        if isinstance(batch, PrefillBatch):
            self.runner.run_prefill(batch)
            self._stamp_prefills_written(self.scheduler.postprocess_prefill(batch))
            self.last_step_tokens = sum(batch.chunk_lens)
            return outputs
        decoded = self._decode(batch)
        self.last_step_tokens = sum(len(output.new_token_ids) for output in decoded)
        return outputs + decoded

    def _stamp_prefills_written(self, ended: list[Request]) -> None:
        """The scheduler marks a prompt's prefill done as its last chunk is dispatched, while the device still runs it.
        Requests whose prefill ended in this step are stamped when their KV is written instead (their first denoising
        round would wait for it anyway), so prefill_time_ms counts the prefill's device time."""
        if ended:
            jax.block_until_ready(self.runner.kv)
            written = time.perf_counter()
            for request in ended:
                request.stats.prefill_done_time = written

    def _decode(self, batch: DecodeBatch) -> list[RequestOutput]:
        jax.block_until_ready(self.runner.kv)  # a prefill still running is not decode time
        start = time.perf_counter()
        results = self.runner.run_decode(batch)
        elapsed = time.perf_counter() - start
        self.last_forward_time = elapsed / max(results[0].num_forwards, 1)
        self.decode_time += elapsed
        self.num_forwards += results[0].num_forwards
        self.num_decode_rounds += 1
        committed = self.scheduler.postprocess_decode(batch, results)
        outputs = []
        for request in batch.requests:
            if request.request_id not in committed and not request.is_finished:
                continue
            request.stats.first_block_time = request.stats.first_block_time or time.perf_counter()
            new_token_ids = committed.get(request.request_id, [])
            num_token_ids = len(request.output_token_ids)
            new_text = self._detokenize(request)  # a stop string drops the ids after it
            new_token_ids = new_token_ids[:max(0, len(new_token_ids) - (num_token_ids - len(request.output_token_ids)))]
            outputs.append(self._output(request, new_token_ids, new_text))
        return outputs

    def _detokenize(self, request: Request) -> str:
        """Newly committed text, trimmed at a stop string. While the request runs, an incomplete UTF-8 character
        and the last len(longest stop) - 1 characters are held back: a stop string may still complete there.

        A block commits many tokens at once: at a stop string the ids after the one that completes it are dropped
        too, so token_ids and usage count what the text shows (the stop string's own tokens included). A stop token
        (EOS or stop_token_ids) stays in token_ids, its text is not output (vLLM's default)."""
        stops = request.params.stop
        text = self._text_of(request.output_token_ids[:-1] if request.stopped_by_token else request.output_token_ids)
        cuts = {stop: text.find(stop) for stop in stops if stop in text}
        if cuts:
            first = min(cuts, key=cuts.get)  # the stop string that starts first cuts the text
            text = text[:cuts[first]]
            # the shortest prefix of the ids whose text holds it: bisect (containment grows with length)
            shortest, longest = 1, len(request.output_token_ids)
            while shortest < longest:
                middle = (shortest + longest) // 2
                if first in self._text_of(request.output_token_ids[:middle]):
                    longest = middle
                else:
                    shortest = middle + 1
            del request.output_token_ids[longest:]
            request.stopped_by_token = False
            if not request.is_finished:
                self.scheduler.finish(request, "stop")
            request.finish_reason = "stop"
        if not request.is_finished:
            text = text.rstrip("\ufffd")
            text = text[:max(0, len(text) - (max(map(len, stops), default=1) - 1))]
        new_text = text[len(request.text):]
        request.text = text if len(text) > len(request.text) else request.text
        return new_text

    def _output(self, request: Request, new_token_ids: list[int], new_text: str) -> RequestOutput:
        if request.is_finished:
            request.stats.finished_time = request.stats.finished_time or time.perf_counter()
            self._requests.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id, new_token_ids=new_token_ids, new_text=new_text,
            finished=request.is_finished, finish_reason=request.finish_reason,
            prompt_token_ids=request.prompt_token_ids, token_ids=list(request.output_token_ids), text=request.text,
            stats=request.stats.as_dict(len(request.output_token_ids)))

    # gauges for metrics

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._pending_adds())

    def _pending_adds(self) -> list[str]:
        """Ids of the requests added but not yet taken in by a step (the inbox also holds aborts). list() copies
        the deque in one call, so other threads' appends cannot interleave."""
        return [item.request_id for kind, item in list(self._inbox) if kind == "add"]

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def kv_cache_usage(self) -> float:
        pages = self.scheduler.pages
        return pages.num_used_pages / pages.num_pages

