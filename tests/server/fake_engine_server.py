"""A server on a stand-in engine without a model: `python tests/server/fake_engine_server.py --port N`.

It starts in seconds and fails on demand, where a real engine has no known way to fail: a prompt that holds POISON
gets outputs whose stats the server cannot read (no forward_passes, which the metrics need once it finishes), one
that holds REFUSE is refused by add_request with an unexpected exception, one that holds CRASH makes the
engine's step raise, and one that holds EXPIRE finishes at its first step with "queue_timeout" and no token (as
LLMEngine's requests do when they wait past max_queue_time). One that holds SLOW commits nothing for SLOW_START_S (as
behind a long queue or prefill), then runs as any other request does: it commits one token, "a", per step until
max_tokens. Streams get a keep-alive ping after KEEPALIVE_S of silence.
"""

import argparse
import collections
import dataclasses
import logging
import sys
import threading
import time
import types

from jaxllm.engine.request import RequestOutput
from jaxllm.sampling import SamplingParams
from jaxllm.server import cli
from jaxllm.server.app import create_app

MODEL = "fake"
POISON, REFUSE, CRASH, EXPIRE, SLOW = "poison", "refuse", "crash", "expire", "slow"
STEP_S = 0.002  # a running request commits a token this often
SLOW_START_S = 0.3
KEEPALIVE_S = 0.05
TOKEN = ord("a")


@dataclasses.dataclass
class FakeRequest:
    prompt: str
    max_tokens: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)


class FakeEngine:
    """What the server uses of LLMEngine; a token is a byte of the prompt's UTF-8."""

    max_model_len = 1 << 20
    page_size = max_model_len  # one page (scheduler.pages.num_pages): the pool holds the context
    model_config = types.SimpleNamespace(vocab_size=256)
    config = types.SimpleNamespace(max_waiting_requests=1 << 20)
    num_steps = 0
    last_step_tokens = 0
    num_forwards = 0
    last_forward_time = 0.0
    kv_cache_usage = 0.0

    def __init__(self):
        self.scheduler = types.SimpleNamespace(pages=types.SimpleNamespace(num_pages=1, page_size=1, prefix_queries=0,
                                                                           prefix_hits=0))
        self._inbox = collections.deque()  # ("add", id, FakeRequest) or ("abort", id, None), from any thread
        self._running: dict[str, FakeRequest] = {}
        self._wakeup = threading.Event()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._inbox)

    def warmup(self, strict: bool) -> None:
        pass

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return list(prompt.encode()) if isinstance(prompt, str) else list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenize("".join(message["content"] for message in messages))

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str) -> None:
        text = bytes(prompt).decode(errors="replace")
        if REFUSE in text:
            raise RuntimeError("add_request broke")
        self._inbox.append(("add", request_id, FakeRequest(text, params.max_tokens)))
        self._wakeup.set()

    def abort_request(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id, None))
        self._wakeup.set()

    def has_unfinished_requests(self) -> bool:
        return bool(self._inbox or self._running)

    def wait_for_work(self, timeout: float) -> None:
        self._wakeup.wait(timeout)
        self._wakeup.clear()

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_S)
        outputs = []
        while self._inbox:
            kind, request_id, request = self._inbox.popleft()
            if kind == "add":
                self._running[request_id] = request
            elif request_id in self._running:
                outputs.append(self._output(request_id, self._running.pop(request_id), "abort"))
        for request_id, request in list(self._running.items()):
            if CRASH in request.prompt:
                raise RuntimeError("the device fell over")
            if EXPIRE in request.prompt:
                del self._running[request_id]
                outputs.append(self._output(request_id, request, "queue_timeout"))
                continue
            if SLOW in request.prompt and time.perf_counter() - request.arrival_time < SLOW_START_S:
                continue
            request.token_ids.append(TOKEN)
            finished = len(request.token_ids) == request.max_tokens
            if finished:
                del self._running[request_id]
            outputs.append(self._output(request_id, request, "length" if finished else None))
        return outputs

    def _output(self, request_id: str, request: FakeRequest, finish_reason: str | None) -> RequestOutput:
        new_token_ids = [] if finish_reason in ("abort", "queue_timeout") else [TOKEN]
        elapsed_ms = 1e3 * (time.perf_counter() - request.arrival_time)
        stats = {"queue_time_ms": 0.0, "time_to_first_block_ms": 0.0, "total_time_ms": elapsed_ms,
                 "forward_passes": len(request.token_ids), "cached_tokens": 0, "preemptions": 0}
        return RequestOutput(request_id, new_token_ids, bytes(new_token_ids).decode(), finish_reason is not None,
                             finish_reason, list(request.prompt.encode()), list(request.token_ids),
                             bytes(request.token_ids).decode(), {} if POISON in request.prompt else stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    port = parser.parse_args().port
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(cli.run(create_app(FakeEngine, model_name=MODEL, sse_keepalive_s=KEEPALIVE_S), "127.0.0.1", port))


if __name__ == "__main__":
    main()
