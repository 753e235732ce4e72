"""POST /v1/completions and /v1/chat/completions: validate, tokenize, submit, then answer in full or as SSE.

A stream sends one chunk per choice per committed block (merged when the reader falls behind), exactly one chunk
per choice with a finish_reason (it also carries that choice's `metrics`), then the usage chunk when asked, then
`data: [DONE]`. While nothing is committed (queued, prefilling) it sends `: ping` comments, so Sanic's
RESPONSE_TIMEOUT, which counts from the last write, never cuts it. Its first write starts the response, and a chat
stream's role chunks go out with its first content, so a client's time to first chunk is the first token's. An error
after submission is sent as an error event, and `data: [DONE]` still ends the stream. Whatever ends the handler (a
finish, a client disconnect that cancels it, an error), `finally` closes the submission, which aborts unfinished
engine requests.
"""

import asyncio
import dataclasses
import logging
import uuid

import jinja2
from sanic import Request, response

from jaxllm.engine.engine import LLMEngine
from jaxllm.engine.request import RequestOutput
from jaxllm.server import DEFAULT_SSE_KEEPALIVE_S
from jaxllm.server.engine_loop import EngineLoop, Submission
from jaxllm.server.protocol import (
    APIError,
    GenerationRequest,
    SamplingDefaults,
    internal_error,
    invalid,
    parse_chat_request,
    parse_completion_request,
    parse_json,
)
from jaxllm.server.responses import ResponseHeader, chunk, full_response, request_metrics, sse_event, usage_chunk

logger = logging.getLogger("jaxllm.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclasses.dataclass(frozen=True)
class ServingState:
    """What the handlers need from the app: app.ctx.serving."""

    engine_loop: EngineLoop
    model_name: str
    sampling_defaults: SamplingDefaults
    sse_keepalive_s: float = DEFAULT_SSE_KEEPALIVE_S  # silence after which a stream gets a `: ping` comment


@dataclasses.dataclass
class Job:
    """A validated request, tokenized: choice i samples prompt i // n with seed + i % n."""

    header: ResponseHeader
    request: GenerationRequest
    prompt_ids: list[list[int]]

    @property
    def num_choices(self) -> int:
        return len(self.prompt_ids) * self.request.n

    @property
    def prompt_lens(self) -> list[int]:
        return [len(ids) for ids in self.prompt_ids]


def _tokenize(engine: LLMEngine, request: GenerationRequest) -> list[list[int]]:
    if request.messages is None:
        return [engine.tokenize(prompt) for prompt in request.prompts]
    try:
        return [engine.apply_chat_template(request.messages)]
    except jinja2.TemplateError as error:
        raise invalid("messages", f"the chat template rejected the messages: {error}") from None
    except ValueError as error:  # transformers': the tokenizer has no chat template
        message = f"this model has no chat template, so it serves /v1/completions only ({error})"
        raise invalid("messages", message) from None


def _prepare(state: ServingState, raw_body: bytes, chat: bool) -> Job:
    engine = state.engine_loop.engine
    parse = parse_chat_request if chat else parse_completion_request
    request = parse(parse_json(raw_body), state.model_name, state.sampling_defaults, engine.model_config.vocab_size)
    return Job(ResponseHeader.new(chat, request.stream, state.model_name, request.rid), request,
               _tokenize(engine, request))


def _default_max_tokens(engine: LLMEngine, prompt_len: int) -> int:
    """What is left of the context, or of the KV pool where that holds less: the engine refuses a request alone
    that cannot fit either. Once nothing is left, 1 makes the engine's own error name the limit."""
    pool_tokens = engine.scheduler.pages.num_pages * engine.page_size
    return max(min(engine.max_model_len, pool_tokens) - prompt_len, 1)


def _submit(engine_loop: EngineLoop, job: Job) -> Submission:
    engine, n, prompts, params = engine_loop.engine, job.request.n, [], []
    max_waiting = engine.config.max_waiting_requests
    if job.num_choices > max_waiting:  # the engine's queue could never take them all: a 429 would repeat for ever
        raise invalid("n", f"the request asks for {job.num_choices} choices ({len(job.prompt_ids)} prompts x n={n}), "
                           f"more than the server queues at once ({max_waiting}, --max-waiting-requests)")
    for ids in job.prompt_ids:
        max_tokens = job.request.max_tokens
        max_tokens = _default_max_tokens(engine, len(ids)) if max_tokens is None else max_tokens
        for sample in range(n):
            prompts.append(ids)
            params.append(_sampling_params(job.request, sample, max_tokens))
    # the response id names the engine requests in logs; a random part keeps them unique when clients reuse a rid
    engine_id = f"{job.header.id}-{uuid.uuid4().hex[:12]}"
    request_ids = [f"{engine_id}-{i}" for i in range(job.num_choices)]
    return engine_loop.submit(prompts, params, request_ids)


def _sampling_params(request: GenerationRequest, sample: int, max_tokens: int):
    try:
        return request.sampling_params(sample, max_tokens)
    except ValueError as error:
        raise APIError(400, str(error), code="invalid_value") from None


async def handle_generation(request: Request, chat: bool):
    state: ServingState = request.app.ctx.serving
    # off the event loop: parsing, templating and tokenizing a long prompt there would hold up every open stream
    job = await asyncio.to_thread(_prepare, state, request.body, chat)
    submission = _submit(state.engine_loop, job)
    try:
        if job.request.stream:
            await _stream(request, job, submission, state.sse_keepalive_s)
            return None
        finals = await _collect(submission, job.num_choices)
        return response.json(full_response(job.header, job.prompt_lens, finals))
    finally:
        state.engine_loop.close(submission)


async def _collect(submission: Submission, num_choices: int) -> list[RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    while submission.unfinished:
        for index, output in (await submission.next_updates()).items():
            if output.finished:
                finals[index] = output
    return [finals[i] for i in range(num_choices)]


class _EventStream:
    """The SSE response, started at its first write: clients time the first token from the first chunk (vLLM's
    bench does), so nothing goes out before the engine commits something or a keep-alive is due."""

    def __init__(self, request: Request, first_events: str):
        self._request, self._response = request, None
        self._first_events = first_events  # sent with the first event, in the same write

    async def _write(self, text: str) -> None:
        if self._response is None:
            self._response = await self._request.respond(content_type="text/event-stream; charset=utf-8",
                                                         headers=SSE_HEADERS)
        await self._response.send(text)

    @property
    def started(self) -> bool:
        return self._response is not None

    async def ping(self) -> None:
        await self._write(": ping\n\n")

    async def send(self, body: dict | str) -> None:
        text, self._first_events = self._first_events + sse_event(body), ""
        await self._write(text)


async def _stream(request: Request, job: Job, submission: Submission, keepalive_s: float) -> None:
    chat = job.header.object == "chat.completion.chunk"
    roles = [chunk(job.header, index, "", role="assistant") for index in range(job.num_choices)] if chat else []
    stream = _EventStream(request, "".join(map(sse_event, roles)))
    finals: dict[int, RequestOutput] = {}
    try:
        while submission.unfinished:
            updates = await submission.next_updates(keepalive_s)
            if not updates:
                await stream.ping()
            for index, output in sorted(updates.items()):
                if output.finished:
                    finals[index] = output
                if output.new_text or output.finished:
                    await stream.send(_update_chunk(job.header, index, output, chat))
        if job.request.include_usage:
            ordered = [finals[i] for i in range(job.num_choices)]
            await stream.send(usage_chunk(job.header, job.prompt_lens, ordered))
    except APIError as error:  # the request or the engine failed
        if not stream.started:  # nothing sent yet: the status can still say so, as for a request without stream
            raise
        await stream.send(error.body())
    except Exception as error:
        if not stream.started:
            raise
        logger.exception("error while streaming %s (engine requests %s)", job.header.id, submission.request_ids)
        await stream.send(internal_error(error).body())
    await stream.send("[DONE]")


def _update_chunk(header: ResponseHeader, index: int, output: RequestOutput, chat: bool) -> dict:
    text = output.new_text or (None if chat else "")
    body = chunk(header, index, text, output.finish_reason if output.finished else None)
    if output.finished:
        body["metrics"] = request_metrics([output])
    return body
