"""The engine thread: it builds and warms the LLMEngine, then steps it while there is work.

Only this thread calls engine.step(). Handlers on the event loop submit requests (engine.add_request is thread-safe)
and read their outputs, merged per choice as they arrive, from what this thread hands over with
loop.call_soon_threadsafe, so no handler ever polls. Closing a submission that has not finished aborts its engine
requests, which frees their pages at the next step. A request that waits longer than the engine's max_queue_time to
be scheduled fails with 408 `scheduler_queue_timeout` (an error event on a stream that has started).

Metrics are best-effort: an error while recording them is logged, and the outputs still reach their requests. An
engine that fails to start, or whose step raises, is broken: the handlers waiting on it get `engine_failed` and the
server stops, so that its exit status (1) tells a supervisor to restart it, as vLLM does, instead of answering 503
for ever.
"""

import asyncio
import logging
import threading
from collections.abc import Callable

from jaxllm.engine.engine import LLMEngine, QueueFull
from jaxllm.engine.request import RequestOutput
from jaxllm.sampling import SamplingParams
from jaxllm.server.metrics import ServerMetrics
from jaxllm.server.protocol import APIError

logger = logging.getLogger("jaxllm.server")

IDLE_WAIT_S = 0.5  # an idle engine thread wakes this often to notice a shutdown


class Submission:
    """One HTTP request's engine requests (one per choice), read as per-choice updates."""

    def __init__(self, request_ids: list[str]):
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._choice_of = {request_id: i for i, request_id in enumerate(request_ids)}
        self._pending: dict[int, RequestOutput] = {}  # each choice's outputs since the last read, merged
        self._error: APIError | None = None
        self._arrived = asyncio.Event()

    def put(self, output: RequestOutput | APIError) -> None:
        """Merge an output into its choice's pending update as it arrives (the event loop thread only): a reader
        stuck behind a slow client then holds one update per choice, not a backlog that grows with every step
        (serving.md: merge pending deltas per request instead of queueing)."""
        if isinstance(output, APIError):  # the engine failed
            self._error = output
        else:
            choice = self._choice_of[output.request_id]
            earlier = self._pending.get(choice)
            if earlier is not None:
                output.new_text = earlier.new_text + output.new_text
                output.new_token_ids = earlier.new_token_ids + output.new_token_ids
            self._pending[choice] = output
        self._arrived.set()

    async def next_updates(self, timeout: float | None = None) -> dict[int, RequestOutput]:
        """Wait for output and return everything pending, merged per choice; {} when timeout passes first."""
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout)
        except TimeoutError:
            return {}
        self._arrived.clear()
        if self._error is not None:
            raise self._error
        updates, self._pending = self._pending, {}
        for output in updates.values():
            if output.finish_reason == "queue_timeout":  # the whole request fails; closing it aborts its other choices
                raise queue_timeout_error()
            if output.finished:
                self.unfinished.discard(output.request_id)
        return updates


class EngineLoop:
    def __init__(self, build_engine: Callable[[], LLMEngine], metrics: ServerMetrics):
        self._build_engine = build_engine
        self._metrics = metrics
        self.engine: LLMEngine | None = None
        self.ready = False
        self.failure: BaseException | None = None
        self._routes: dict[str, Submission] = {}  # touched on the event loop thread only
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # the engine thread

    def start(self, loop: asyncio.AbstractEventLoop, on_failure: Callable[[], None]) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, args=(on_failure,), name="jaxllm-engine", daemon=True)
        self._thread.start()

    def _run(self, on_failure: Callable[[], None]) -> None:
        try:
            engine = self._build_engine()
            engine.warmup(strict=False)
        except Exception as error:
            logger.exception("the engine failed to start")
            self._fail(error, on_failure)
            return
        self.engine, self.ready = engine, True
        logger.info("engine ready: max_model_len %d, %d KV pages", engine.max_model_len,
                    engine.scheduler.pages.num_pages)
        try:
            self._serve(engine)
        except Exception as error:
            logger.exception("the engine failed")
            self._fail(error, on_failure)

    def _fail(self, error: Exception, on_failure: Callable[[], None]) -> None:
        """Fail the handlers waiting on the engine, then stop the server (call_soon_threadsafe keeps that order)."""
        self.ready, self.failure = False, error
        if not self._stopping.is_set():  # once stopped, the server may close the event loop
            self._loop.call_soon_threadsafe(self._fail_all, f"the engine failed: {error}")
            self._loop.call_soon_threadsafe(on_failure)

    def _serve(self, engine: LLMEngine) -> None:
        steps, forwards = engine.num_steps, engine.num_forwards
        while not self._stopping.is_set():
            if not engine.has_unfinished_requests():
                engine.wait_for_work(IDLE_WAIT_S)
                continue
            outputs = engine.step()  # an exception here is the engine's: _run stops the server
            if engine.num_steps != steps:  # this step ran a prefill or a decode round
                self._record(self._metrics.observe_step_tokens, engine.last_step_tokens)
            if engine.num_forwards != forwards:  # this step ran a decode round
                self._record(self._metrics.observe_forward_time, engine.last_forward_time)
            steps, forwards = engine.num_steps, engine.num_forwards
            for output in outputs:
                self._record(self._metrics.observe_output, output)
            if outputs and not self._stopping.is_set():  # once stopped, the server may close the event loop
                self._loop.call_soon_threadsafe(self._route, outputs)

    @staticmethod
    def _record(observe: Callable, value) -> None:
        """Metrics are best-effort: a bug in them must not cost requests their outputs, nor the engine its loop."""
        try:
            observe(value)
        except Exception:
            logger.exception("error while recording metrics (%s)", observe.__name__)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * IDLE_WAIT_S)

    # the event loop thread

    def _route(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            submission = self._routes.get(output.request_id)
            if submission is not None:
                submission.put(output)

    def _fail_all(self, message: str) -> None:
        for submission in set(self._routes.values()):  # an error each: a raised error collects its raiser's frames
            submission.put(APIError(500, message, type="server_error", code="engine_failed"))

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str]) -> Submission:
        """Add one engine request per (prompt, params, id); all or none are added. Raises APIError."""
        if not self.ready:
            raise not_ready_error(self.failure)
        submission = Submission(request_ids)
        try:
            for prompt, sampling, request_id in zip(prompts, params, request_ids):
                self._routes[request_id] = submission
                self._add_request(prompt, sampling, request_id)
        except BaseException:
            self.close(submission)  # all or none: abort the choices already added
            raise
        return submission

    def _add_request(self, prompt: list[int], params: SamplingParams, request_id: str) -> None:
        try:
            self.engine.add_request(prompt, params, request_id)
        except QueueFull as error:
            raise APIError(429, f"The request queue is full: {error}.", type="rate_limit_error",
                           code="scheduler_queue_full") from None
        except ValueError as error:
            message = str(error)
            code = "context_length_exceeded" if message.startswith("This model's maximum context length") else None
            raise APIError(400, message, param="prompt" if code else None, code=code) from None

    def close(self, submission: Submission) -> None:
        """Forget the submission; abort what it added that has not finished (a no-op for ids never added)."""
        for request_id in submission.request_ids:
            if self._routes.pop(request_id, None) is not None and request_id in submission.unfinished:
                self.engine.abort_request(request_id)


def queue_timeout_error() -> APIError:
    return APIError(408, "The request waited longer than the server's --max-queue-time to be scheduled; the server "
                         "is overloaded, retry later.", type="timeout_error", code="scheduler_queue_timeout")


def not_ready_error(failure: BaseException | None) -> APIError:
    if failure is not None:
        return APIError(503, f"the engine is not running: {failure}", type="service_unavailable",
                        code="engine_failed")
    return APIError(503, "the model is still loading and compiling; retry when GET /health returns 200",
                    type="service_unavailable", code="not_ready")
