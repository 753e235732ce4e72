"""The server end to end: a real `python -m jaxllm.server serve` process on a tiny checkpoint, started once for the
module and driven through the official openai client and raw httpx: OpenAI shapes, SSE invariants, errors, auth,
disconnects, load, /metrics, and tools/bench_serving.py against it. Failures no real engine produces on demand run
on servers with a stand-in engine (fake_engine_server.py)."""

import asyncio
import dataclasses
import json
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from jaxllm.config import split_options
from jaxllm.server import cli
from jaxllm.server.app import create_app
from jaxllm.server.protocol import SamplingDefaults, parse_chat_request, parse_completion_request
from tests.server import fake_engine_server

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tiny-sdar"
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 4
# small shapes so warm-up compiles four buckets: batch 1, 2, 4 decode at one page-table width, one prefill chunk
# and 32 pages, every sequence at full length: sized from a GPU's memory, each of the test's servers would claim
# the card, and the next one started waits minutes for the allocator to refuse it (BENCHMARKS.md, run 50)
SERVER_FLAGS = ["--served-model-name", MODEL, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len",
                str(MAX_MODEL_LEN), "--block-size", "4", "--page-size", "8", "--max-num-batched-tokens", "16",
                "--dtype", "float32", "--max-waiting-requests", "256", "--sse-keepalive-interval", "0.02",
                "--num-pages", "32", "--api-key", API_KEY, "--log-level", "warning"]
SMALL_POOL_PAGES = 4  # 32 tokens of KV pool at page size 8, fewer than MAX_MODEL_LEN
STARTUP_TIMEOUT_S = 300
REPO = pathlib.Path(__file__).resolve().parents[2]
FAKE_SERVER = [sys.executable, fake_engine_server.__file__]
FAKE_MODEL = fake_engine_server.MODEL
ABORTED = 'jaxllm:request_success_total{finished_reason="abort"}'
LENGTH = 'jaxllm:request_success_total{finished_reason="length"}'
KV_USAGE = "jaxllm:kv_cache_usage_perc"


@dataclasses.dataclass
class Server:
    url: str
    checkpoint: pathlib.Path
    first_statuses: tuple[int, int]  # (/health, /v1/models) at the first answer, while the engine was loading


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_ready(url: str, process: subprocess.Popen, log_path: pathlib.Path) -> tuple[int, int]:
    first = None
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            health = httpx.get(f"{url}/health", timeout=5).status_code
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        first = first or (health, httpx.get(f"{url}/v1/models", headers=AUTH, timeout=5).status_code)
        if health == 200:
            return first
        time.sleep(0.1)
    raise TimeoutError(f"the server was not ready after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _spawn(command: list[str], tmp_path_factory) -> tuple[subprocess.Popen, str, pathlib.Path]:
    """`command --port P` for a free port P: (process, url, log path)."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    return process, f"http://127.0.0.1:{port}", log_path


def _launch(checkpoint: pathlib.Path, tmp_path_factory, *flags: str) -> tuple[subprocess.Popen, str, pathlib.Path]:
    """A server process on a free port, with SERVER_FLAGS and then flags: (process, url, log path)."""
    # shared by every server a test session starts, so only the first one compiles
    cache = tmp_path_factory.getbasetemp() / "jax_compilation_cache"
    return _spawn([sys.executable, "-m", "jaxllm.server", "serve", "--model", str(checkpoint), "--host", "127.0.0.1",
                   "--compilation-cache-dir", str(cache), *SERVER_FLAGS, *flags], tmp_path_factory)


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    checkpoint = checkpoints("sdar")
    process, url, log_path = _launch(checkpoint, tmp_path_factory)
    try:
        yield Server(url, checkpoint, _wait_until_ready(url, process, log_path))
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def small_server(server, tmp_path_factory):
    """The url of a server on a copy of the checkpoint whose tokenizer has no chat template, with a KV pool of
    SMALL_POOL_PAGES pages: 32 tokens, fewer than its context."""
    checkpoint = tmp_path_factory.mktemp("no_chat_template")
    shutil.copytree(server.checkpoint, checkpoint, dirs_exist_ok=True)
    tokenizer_config = checkpoint / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({k: v for k, v in json.loads(tokenizer_config.read_text()).items()
                                            if k != "chat_template"}))
    process, url, log_path = _launch(checkpoint, tmp_path_factory, "--num-pages", str(SMALL_POOL_PAGES))
    try:
        _wait_until_ready(url, process, log_path)
        yield url
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    """The url of a server on the stand-in engine, for the tests that leave it running."""
    process, url, log_path = _spawn(FAKE_SERVER, tmp_path_factory)
    try:
        _wait_until_ready(url, process, log_path)
        yield url
    finally:
        _stop(process)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as session:
        yield session


@pytest.fixture(scope="module")
def tokenizer(server):
    return Tokenizer.from_file(str(server.checkpoint / "tokenizer.json"))


def scrape(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_for_idle_pool(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Scrape until nothing runs or waits and no KV page is in use; fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        idle = (samples["jaxllm:num_requests_running"], samples["jaxllm:num_requests_waiting"], samples[KV_USAGE])
        if idle == (0, 0, 0) or time.monotonic() > deadline:
            assert idle == (0, 0, 0), f"running, waiting, KV usage stayed at {idle}"
            return samples
        time.sleep(0.05)


async def first_data_line(lines) -> str | None:
    """Read an SSE stream's lines up to its first event, which is returned; the rest stay unread."""
    async for line in lines:
        if line.startswith("data: "):
            return line
    return None


def sse_events(lines) -> tuple[list, int]:
    """(data events, JSON-decoded except the final "[DONE]"; number of `: ping` comments)."""
    events, pings = [], 0
    for line in lines:
        if line.startswith(":"):
            pings += 1
        elif line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events, pings


# readiness, models, auth


def test_health_is_503_while_the_engine_loads_and_200_once_warm(server):
    assert server.first_statuses == (503, 503)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("endpoint, field", [("completions", "max_tokens"), ("chat", "max_completion_tokens")])
def test_zero_max_tokens_answers_with_no_output(http, endpoint, field):
    """max_tokens >= 0 (serving.md 2): 0 is an empty completion that ends by length, its prompt counted."""
    body = ({"prompt": "Hello there"} if endpoint == "completions" else
            {"messages": [{"role": "user", "content": "Hello there"}]})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    response = http.post(path, json={"model": MODEL, **body, field: 0})
    assert response.status_code == 200, response.text
    choice, usage = response.json()["choices"][0], response.json()["usage"]
    assert (choice["text"] if endpoint == "completions" else choice["message"]["content"]) == ""
    assert choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] > 0


def test_v1_needs_the_api_key_but_health_and_metrics_do_not(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    missing = httpx.post(f"{server.url}/v1/completions", json=body)
    wrong = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"})
    assert missing.status_code == wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.options(f"{server.url}/v1/completions").status_code != 401  # a CORS preflight carries no key (vLLM)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()


# OpenAI shapes through the official client


def test_a_completion_has_the_openai_shape_usage_and_dllm_metrics(client, tokenizer):
    completion = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0.8,
                                           seed=1, extra_body={"ignore_eos": True})
    assert completion.object == "text_completion" and completion.model == MODEL
    [choice] = completion.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    prompt_tokens = len(tokenizer.encode("Hello there", add_special_tokens=False).ids)
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 8)
    assert completion.usage.total_tokens == prompt_tokens + 8
    metrics = completion.model_extra["metrics"]
    assert metrics["forward_passes"] >= 1
    assert metrics["tokens_per_forward"] == round(8 / metrics["forward_passes"], 4)
    assert 0 <= metrics["time_to_first_token_ms"] <= metrics["e2e_latency_ms"]
    # vLLM's per-request fields: decode time after the first token, its mean gap, tokens over the time since scheduling
    assert metrics["generation_time_ms"] == pytest.approx(metrics["e2e_latency_ms"] - metrics["time_to_first_token_ms"],
                                                          abs=2e-3)
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / 7, abs=2e-3)
    inference_ms = metrics["e2e_latency_ms"] - metrics["queue_time_ms"]
    assert metrics["tokens_per_second"] == pytest.approx(8e3 / inference_ms, rel=1e-3)


def test_a_chat_completion_answers_as_the_assistant(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                          max_completion_tokens=6, seed=2, extra_body={"ignore_eos": True})
    assert chat.object == "chat.completion"
    [choice] = chat.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert chat.usage.completion_tokens == 6
    assert chat.usage.prompt_tokens > 3  # the chat template wraps the message in role markers


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_text_equals_the_non_streamed_text_for_the_same_seed(client, endpoint):
    chat = endpoint == "chat"
    create = client.chat.completions.create if chat else client.completions.create
    prompt = {"messages": [{"role": "user", "content": "Tell a story"}]} if chat else {"prompt": "Once upon a time"}
    request = dict(model=MODEL, max_tokens=14, temperature=1.0, seed=7, extra_body={"ignore_eos": True}, **prompt)
    full = create(**request)
    chunks = list(create(**request, stream=True, stream_options={"include_usage": True}))
    deltas = [(c.choices[0].delta.content or "") if chat else c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == (full.choices[0].message.content if chat else full.choices[0].text)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, 14)
    if chat:
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_text_before_it_streamed_or_not(http, stream):
    body = {"model": MODEL, "prompt": "Stop here", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    free_text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = free_text[len(free_text) // 2:][:3]
    expected = free_text[:free_text.index(stop)]
    request = {**body, "stop": [stop], "stream": stream}
    if stream:
        with http.stream("POST", "/v1/completions", json=request) as response:
            events, _ = sse_events(response.iter_lines())
        text = "".join(e["choices"][0]["text"] for e in events[:-1])
        finish_reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    else:
        choice = http.post("/v1/completions", json=request).json()["choices"][0]
        text, finish_reasons = choice["text"], [choice["finish_reason"]]
    assert (text, finish_reasons) == (expected, ["stop"])


def test_a_raw_stream_keeps_the_sse_contract_for_every_choice(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], "max_tokens": 10, "n": 3, "seed": 4,
            "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events, _ = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    usage_chunks = [c for c in chunks if "usage" in c]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1]["choices"] == []
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum(choice["finish_reason"] is not None for choice in mine) == 1
        assert mine[-1]["finish_reason"] is not None
    assert usage_chunks[0]["usage"]["completion_tokens"] <= 30


def test_n_choices_sample_with_seed_plus_their_index(http):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    together = http.post("/v1/completions", json={**body, "seed": 11, "n": 3}).json()
    alone = [http.post("/v1/completions", json={**body, "seed": 11 + i}).json() for i in range(3)]
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    texts = [c["text"] for c in together["choices"]]
    assert texts == [a["choices"][0]["text"] for a in alone]
    assert len(set(texts)) > 1
    assert together["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]  # a prompt counts once
    assert together["usage"]["completion_tokens"] == 24


def test_a_prompt_may_be_text_token_ids_or_a_batch_of_either(http, tokenizer):
    texts = ["The sky is", "A cat"]
    ids = [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0.0}

    def answers(prompt, n=1):
        response = http.post("/v1/completions", json={**body, "prompt": prompt, "n": n}).json()
        return [c["text"] for c in response["choices"]], response["usage"]["prompt_tokens"]

    single = [answers(t)[0][0] for t in texts]
    assert answers(ids[0]) == ([single[0]], len(ids[0]))
    assert answers(texts, n=2) == ([single[0], single[0], single[1], single[1]], len(ids[0]) + len(ids[1]))
    assert answers(ids) == (single, len(ids[0]) + len(ids[1]))


# errors

BAD_REQUESTS = [
    ("completions", {"prompt": ""}, 400, "invalid_value"),
    ("completions", {"prompt": []}, 400, "invalid_value"),
    ("completions", {}, 400, "invalid_value"),
    ("completions", {"prompt": [1, 10**9]}, 400, "invalid_value"),
    ("completions", {"prompt": [1, "a"]}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "max_tokens": -1}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "max_tokens": "5"}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "temperature": 2.5}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "temperature": True}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "top_k": 0}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "seed": 1.5}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "n": 0}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "n": 129}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "stop_token_ids": 5}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "logprobs": 1}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "min_tokens": 3}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "invalid_value"),
    ("completions", {"prompt": "x", "rid": ""}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "rid": 7}, 400, "invalid_value"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model_not_found"),
    ("completions", {"prompt": "x", "max_tokens": 100}, 400, "context_length_exceeded"),
    ("completions", {"prompt": list(range(10, 80))}, 400, "context_length_exceeded"),
    ("completions", b"{not json", 400, "json_parse_error"),
    ("completions", b"[1, 2]", 400, "json_parse_error"),
    ("completions", b"\xff\xfe", 400, "json_parse_error"),
    ("chat/completions", {"messages": []}, 400, "invalid_value"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400,
     "invalid_value"),
]


@pytest.mark.parametrize(("route", "body", "status", "code"), BAD_REQUESTS)
def test_a_bad_request_gets_an_openai_error_with_the_right_status(http, route, body, status, code):
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL, **body})
    response = http.post(f"/v1/{route}", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and error["message"]
    if code == "context_length_exceeded":
        assert error["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")
        assert ("you requested" in error["message"]) == ("max_tokens" in body)  # no made-up output length


def _chat_or_completion(route: str) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat") else {"prompt": "hi"}


UNSUPPORTED_FIELDS = [  # vLLM / OpenAI fields that change the output, which jaxllm does not implement
    ("chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("chat/completions", "function_call", {"name": "f"}),
    ("chat/completions", "tool_choice", "required"),
    ("chat/completions", "tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("completions", "guided_json", {"type": "object"}),
    ("completions", "guided_regex", "a+"),
    ("chat/completions", "guided_choice", ["yes", "no"]),
    ("completions", "guided_grammar", "root ::= \"a\""),
    ("chat/completions", "structured_outputs", {"choice": ["yes", "no"]}),
    ("completions", "bad_words", ["self"]),
    ("completions", "allowed_token_ids", [5]),
    ("completions", "include_stop_str_in_output", True),
    ("completions", "skip_special_tokens", False),
    ("completions", "prompt_logprobs", 1),
    ("completions", "prompt_logprobs", 0),
]


@pytest.mark.parametrize(("route", "field", "value"), UNSUPPORTED_FIELDS)
def test_a_field_that_would_change_the_output_is_refused_by_name(http, route, field, value):
    """Accepted and ignored, it would answer something other than what was asked for."""
    body = {"model": MODEL, "max_tokens": 2, **_chat_or_completion(route), field: value}
    response = http.post(f"/v1/{route}", json=body)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (field, "invalid_value")


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_those_fields_at_their_defaults_are_accepted(http, route):
    """Clients that send every field send these."""
    defaults = {"functions": [], "function_call": "none", "tool_choice": "auto", "guided_json": None,
                "guided_choice": None, "structured_outputs": None, "bad_words": [], "allowed_token_ids": None,
                "include_stop_str_in_output": False, "skip_special_tokens": True, "prompt_logprobs": None}
    for tool_choice in ("auto", "none"):
        body = {"model": MODEL, "max_tokens": 2, **_chat_or_completion(route), **defaults, "tool_choice": tool_choice}
        response = http.post(f"/v1/{route}", json=body)
        assert response.status_code == 200, response.text


LONE_SURROGATES = [  # JSON can escape half a UTF-16 pair, which is no Unicode text
    ("completions", {"prompt": "hi \ud800 there"}, "prompt"),
    ("completions", {"prompt": ["fine", "\udfff"], "stream": True}, "prompt"),
    ("completions", {"prompt": "hi", "stop": ["\n", "\ud800"]}, "stop"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages[1].content"),
    ("chat/completions", {"messages": [{"role": "user\ud800", "content": "hi"}]}, "messages[0].role"),
]


@pytest.mark.parametrize(("route", "body", "param"), LONE_SURROGATES)
def test_a_lone_surrogate_in_text_is_refused_by_name(http, route, body, param):
    content = json.dumps({"model": MODEL, "max_tokens": 2, **body})  # ASCII: the surrogate travels as \ud800
    response = http.post(f"/v1/{route}", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, "invalid_value")


def test_a_rid_becomes_the_response_id(http):
    body = {"model": MODEL, "max_tokens": 4, "rid": "job-42"}
    completion = http.post("/v1/completions", json={**body, "prompt": "abc", "n": 2}).json()
    chat = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert completion["id"] == chat["id"] == "job-42" and len(completion["choices"]) == 2
    with http.stream("POST", "/v1/completions", json={**body, "prompt": "abc", "stream": True}) as response:
        events, _ = sse_events(response.iter_lines())
    assert {event["id"] for event in events[:-1]} == {"job-42"}


def test_an_empty_stop_token_ids_list_is_accepted(http):
    """Some clients send every field with its empty default."""
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stop_token_ids": []})
    assert response.status_code == 200, response.text


def test_unknown_routes_and_methods_get_json_errors(http):
    assert http.get("/v1/nothing-here").status_code == 404
    wrong_method = http.get("/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_more_choices_than_the_server_queues_are_refused_upfront(http):
    """The waiting queue (256) could never take this request whole: a 429 would be answered for ever."""
    body = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 128, "max_tokens": 4}  # 384 choices
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == ("n", "invalid_value")


def test_a_full_waiting_queue_answers_429_and_leaves_no_pages_behind(server, http):
    filling = {"model": MODEL, "prompt": ["a", "b"], "n": 128, "max_tokens": 4, "stream": True}  # 256: the whole queue

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as session:
            # its first bytes come once its choices are queued; leaving the block aborts them
            async with session.stream("POST", "/v1/completions", json=filling):
                return await session.post("/v1/completions", json={**filling, "prompt": "a", "stream": False})

    response = asyncio.run(scenario())
    assert response.status_code == 429 and response.json()["error"]["code"] == "scheduler_queue_full"
    wait_for_idle_pool(server.url)
    assert http.post("/v1/completions", json={**filling, "prompt": "a", "n": 1, "stream": False}).status_code == 200


# disconnects and load


def test_a_disconnected_stream_is_aborted_and_its_pages_freed(server):
    aborted = scrape(server.url)[ABORTED]
    long_request = {"model": MODEL, "prompt": "x", "max_tokens": 56, "ignore_eos": True}

    async def scenario() -> float:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as session:
            blockers = [asyncio.create_task(session.post("/v1/completions", json=long_request)) for _ in range(4)]
            # one scrape for both: on a GPU the blockers may be gone by the next
            while (sample := scrape(server.url))["jaxllm:num_requests_running"] < MAX_NUM_SEQS:
                await asyncio.sleep(0.002)
            usage_of_the_blockers = sample[KV_USAGE]
            # every slot is taken: this stream waits in the queue, then runs (holding pages of its own); leave at its
            # first block, at once: the 13 blocks it has left must not finish before the server sees it gone (with a
            # metrics scrape here the abort went uncounted once on a loaded machine, most likely so)
            # its keep-alive pings while it waits go uncounted: on a GPU the blockers may end within one interval (the
            # fake engine's tests count them)
            async with session.stream("POST", "/v1/completions", json={**long_request, "stream": True}) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        break
            assert all(r.status_code == 200 for r in await asyncio.gather(*blockers))
            return usage_of_the_blockers

    usage_of_the_blockers = asyncio.run(scenario())
    assert usage_of_the_blockers > 0  # so the idle pool below is pages returned, not pages never taken
    samples = wait_for_idle_pool(server.url)
    assert samples[ABORTED] == aborted + 1


def test_200_concurrent_requests_are_all_answered_and_the_pool_returns_to_baseline(server):
    completion = {"model": MODEL, "prompt": "Count:", "max_tokens": 6, "ignore_eos": True, "temperature": 1.0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "ignore_eos": True}

    async def one(session: httpx.AsyncClient, i: int) -> int:
        route, body = ("/v1/completions", completion) if i % 2 else ("/v1/chat/completions", chat)
        if i % 4 < 2:
            return (await session.post(route, json={**body, "seed": i})).json()["usage"]["completion_tokens"]
        async with session.stream("POST", route, json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as stream:
            events, _ = sse_events([line async for line in stream.aiter_lines()])
        assert events[-1] == "[DONE]"
        return events[-2]["usage"]["completion_tokens"]

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120, limits=limits) as session:
            return await asyncio.gather(*(one(session, i) for i in range(200)))

    assert asyncio.run(burst()) == [6] * 200
    wait_for_idle_pool(server.url)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_long_prompt_is_tokenized_off_the_event_loop(server, route):
    """Templating and tokenizing a prompt of 700 kB takes about half a second; /health keeps answering meanwhile (the
    prompt is then refused: it is longer than the context). Done on the event loop, the work would hold every
    /health sent meanwhile until it ends: a few answers in all (3, with `_prepare` moved onto the loop). Counted by
    answers and their median, as one answer can still wait ~0.5 s when the other test worker keeps both CPU cores
    busy."""
    text = "def f(x):\n    return x + 1\n" * 25_000
    prompt = {"prompt": text} if route == "completions" else {"messages": [{"role": "user", "content": text}]}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as session:
            start = time.monotonic()
            long_request = asyncio.create_task(session.post(f"/v1/{route}", json={"model": MODEL, **prompt}))
            health_latencies = []
            while not long_request.done():
                sent = time.monotonic()
                assert (await session.get("/health")).status_code == 200
                health_latencies.append(time.monotonic() - sent)
            return await long_request, sorted(health_latencies), time.monotonic() - start

    refused, health_latencies, elapsed = asyncio.run(scenario())
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    median = health_latencies[len(health_latencies) // 2]
    assert len(health_latencies) >= 5 and median < elapsed / 4, (
        f"{len(health_latencies)} /health answers in the request's {elapsed:.3f}s, median {median:.3f}s")


# metrics


def test_metrics_count_requests_tokens_forwards_and_latencies(server, http):
    before = scrape(server.url)
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Measure me", "max_tokens": 8,
                                                  "ignore_eos": True}).json()
    after = scrape(server.url)

    def change(name: str) -> float:
        return after[name] - before[name]

    assert change(LENGTH) == 1 and change(ABORTED) == 0 and change("jaxllm:num_requests_total") == 1
    assert change("jaxllm:prompt_tokens_total") == response["usage"]["prompt_tokens"]
    assert change("jaxllm:generation_tokens_total") == 8
    assert change("jaxllm:request_forward_passes_total") == response["metrics"]["forward_passes"]
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_time_per_output_token_seconds"):
        assert change(f"jaxllm:{histogram}_count") == 1
    assert change("jaxllm:forward_time_seconds_count") >= 1
    # every step: the prompt tokens it prefilled (the cached ones are not), or the output tokens it committed
    cached = response["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert change("jaxllm:iteration_tokens_total_sum") == response["usage"]["prompt_tokens"] - cached + 8
    assert change("jaxllm:iteration_tokens_total_count") >= 2
    # a sample per token after the first commit (its blocks commit the 8 tokens in 2-3 steps)
    assert 1 <= change("jaxllm:inter_token_latency_seconds_count") <= 7
    assert after["jaxllm:prefix_cache_queries_total"] >= after["jaxllm:prefix_cache_hits_total"] >= 0


def test_a_top_k_beyond_int32_is_served_and_the_engine_stays_up(http):
    """A top_k past the vocabulary keeps every token; it once overflowed an int32 in the engine thread, which
    failed the engine for every later request."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 1.0, "top_k": 2**31, "seed": 5}
    huge = http.post("/v1/completions", json=body)
    assert huge.status_code == 200, huge.text
    assert http.get("/health").status_code == 200
    off = http.post("/v1/completions", json=body | {"top_k": -1}).json()
    assert huge.json()["choices"][0]["text"] == off["choices"][0]["text"]


def test_cached_tokens_count_each_prompt_once_with_several_choices(client):
    """usage counts a prompt once however many choices sample it; its cached tokens are part of it."""
    messages = [{"role": "user", "content": "Tell me about the tiny model that serves these tests, twice over."}]
    for _ in range(2):  # the second request finds the prompt's pages cached
        usage = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=4, temperature=1.0,
                                               seed=2).usage
    assert 0 < usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_the_metrics_count_cached_tokens_as_usage_does(http):
    body = {"model": MODEL, "n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 2,
            "messages": [{"role": "user", "content": "Count the cached tokens of this prompt once, not thrice."}]}
    for _ in range(2):
        response = http.post("/v1/chat/completions", json=body).json()
    assert response["metrics"]["cached_tokens"] == response["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_the_prefix_cache_counters_count_tokens_as_usage_does(server, http):
    body = {"model": MODEL, "max_tokens": 4, "prompt": "A prompt long enough to fill a few pages of the KV cache, sent "
            "twice so that the second request finds them cached."}
    http.post("/v1/completions", json=body)
    before = scrape(server.url)
    cached = http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = scrape(server.url)
    hits = after["jaxllm:prefix_cache_hits_total"] - before["jaxllm:prefix_cache_hits_total"]
    assert hits == cached > 0
    assert after["jaxllm:prefix_cache_queries_total"] - before["jaxllm:prefix_cache_queries_total"] == cached


def test_a_generation_config_top_k_of_0_means_no_filter(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0, "temperature": 0.6}))
    defaults = SamplingDefaults.from_model_dir(tmp_path)
    assert (defaults.top_k, defaults.temperature) == (-1, 0.6)
    request = parse_completion_request({"model": MODEL, "prompt": "hi"}, MODEL, defaults, 100)
    assert request.sampling_params(0, 4).top_k == -1  # a request leaving top_k out is served, unfiltered


def test_chat_text_parts_reach_the_template_as_one_string():
    """Templates that test `message.content is string` dropped a list of parts, and ones that add it to a string
    failed. The parts go on lines of their own, as vLLM joins them: "Hello" and "World" are not "HelloWorld"."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                      {"type": "text", "text": "World"}]}]}
    request = parse_chat_request(body, MODEL, SamplingDefaults(), 100)
    assert request.messages == [{"role": "user", "content": "Hello\nWorld"}]


# a model without a chat template, and a KV pool smaller than the context


def test_chat_with_a_model_without_a_chat_template_is_a_400(small_server):
    chat = httpx.post(f"{small_server}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "invalid_value" and "no chat template" in chat.json()["error"]["message"]
    completion = httpx.post(f"{small_server}/v1/completions", headers=AUTH, timeout=60,
                            json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert completion.status_code == 200, completion.text


def test_leaving_max_tokens_out_generates_what_the_kv_pool_holds(small_server):
    """The default max_tokens is what is left of the context, or of a pool that holds less; asked for explicitly,
    more than the pool holds is still refused."""
    body = {"model": MODEL, "prompt": "hi", "ignore_eos": True}
    response = httpx.post(f"{small_server}/v1/completions", headers=AUTH, timeout=60, json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["total_tokens"] == SMALL_POOL_PAGES * 8 < MAX_MODEL_LEN  # SERVER_FLAGS: page size 8
    assert response.json()["choices"][0]["finish_reason"] == "length"
    too_many = httpx.post(f"{small_server}/v1/completions", headers=AUTH, timeout=60,
                          json={**body, "max_tokens": usage["completion_tokens"] + 1})
    assert too_many.status_code == 400, too_many.text


# failures, on the stand-in engine


def test_a_chat_stream_writes_only_pings_until_its_first_token_comes_with_the_role(fake_server):
    """Clients (vLLM's bench) time the first token from the first chunk with choices, so the role chunk must not go
    out while the request waits: it goes out with the first content, after keep-alive pings."""
    body = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": fake_engine_server.SLOW}], "max_tokens": 2,
            "stream": True}
    sent = time.monotonic()
    with httpx.stream("POST", f"{fake_server}/v1/chat/completions", json=body, timeout=30) as stream:
        lines = [(time.monotonic() - sent, line) for line in stream.iter_lines() if line]
    first_event = next(i for i, (_, line) in enumerate(lines) if line.startswith("data: "))
    assert first_event > 0 and all(line == ": ping" for _, line in lines[:first_event])
    assert lines[first_event][0] >= fake_engine_server.SLOW_START_S
    events, _ = sse_events(line for _, line in lines)
    assert [event["choices"][0]["delta"] for event in events[:2]] == [{"role": "assistant", "content": ""},
                                                                     {"content": "a"}]


def test_a_request_whose_output_the_server_cannot_handle_fails_alone(fake_server):
    """A request whose output the server cannot turn into a response (its stats lack what the metrics need) fails
    alone, streamed or not, with internal_error; the engine thread logs the metrics error and goes on, and a stream
    running meanwhile and later requests are served."""
    running = {"model": FAKE_MODEL, "prompt": "fine", "max_tokens": 200, "stream": True}
    poisoned = {"model": FAKE_MODEL, "prompt": fake_engine_server.POISON, "max_tokens": 3}

    async def scenario():
        async with httpx.AsyncClient(base_url=fake_server, timeout=30) as session:
            async with session.stream("POST", "/v1/completions", json=running) as stream:
                lines = stream.aiter_lines()
                first = await first_data_line(lines)
                failed = await session.post("/v1/completions", json=poisoned)
                async with session.stream("POST", "/v1/completions", json={**poisoned, "stream": True}) as failing:
                    failed_stream = [line async for line in failing.aiter_lines()]
                running_stream = [first] + [line async for line in lines]
            later = await session.post("/v1/completions", json={**poisoned, "prompt": "fine"})
        return failed, failed_stream, running_stream, later

    failed, failed_stream, running_stream, later = asyncio.run(scenario())
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "internal_error"
    events, _ = sse_events(failed_stream)
    assert events[-2]["error"]["code"] == "internal_error" and events[-1] == "[DONE]"
    assert all(event["choices"][0]["finish_reason"] is None for event in events[:-2])
    events, _ = sse_events(running_stream)
    assert "".join(event["choices"][0]["text"] for event in events[:-1]) == "a" * 200
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    assert later.status_code == 200 and later.json()["choices"][0]["text"] == "aaa"


def test_requests_sharing_a_rid_are_served_apart(fake_server):
    """Clients reuse rids: a second request under a running one's rid must not take over its engine request."""
    running = {"model": FAKE_MODEL, "prompt": "fine", "max_tokens": 400, "stream": True, "rid": "job-42"}

    async def scenario():
        async with httpx.AsyncClient(base_url=fake_server, timeout=30) as session:
            async with session.stream("POST", "/v1/completions", json=running) as stream:
                lines = stream.aiter_lines()
                first = await first_data_line(lines)
                other = await session.post("/v1/completions", json={**running, "stream": False, "max_tokens": 3})
                return other, [first] + [line async for line in lines]

    # bounded: a stream whose engine request was taken over gets only keep-alive pings, for ever
    other, running_stream = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert other.json()["id"] == "job-42" and other.json()["choices"][0]["text"] == "aaa"
    events, _ = sse_events(running_stream)
    assert {event["id"] for event in events[:-1]} == {"job-42"}
    assert "".join(event["choices"][0]["text"] for event in events[:-1]) == "a" * 400


@pytest.mark.parametrize("failing, status, code", [(fake_engine_server.REFUSE, 500, "internal_error"),
                                                    (fake_engine_server.EXPIRE, 408, "scheduler_queue_timeout")])
def test_a_request_whose_prompt_fails_leaves_none_of_its_prompts_running(fake_server, failing, status, code):
    """A prompt the engine refuses unexpectedly (prompts are added all or none), or one that waits past the queue
    time: the error comes back and the request's other prompt is aborted."""
    aborted = scrape(fake_server)[ABORTED]
    body = {"model": FAKE_MODEL, "prompt": ["fine", failing], "max_tokens": 10**6}
    response = httpx.post(f"{fake_server}/v1/completions", json=body, timeout=30)
    assert response.status_code == status and response.json()["error"]["code"] == code
    assert wait_for_idle_pool(fake_server)[ABORTED] == aborted + 1


def test_a_stream_that_fails_before_its_first_event_answers_with_the_status(fake_server):
    """Nothing was sent when the request expired in the queue, so the status is the error's (408), as without
    stream; an error after the stream has started is an event (the engine-failure test below)."""
    body = {"model": FAKE_MODEL, "prompt": fake_engine_server.EXPIRE, "max_tokens": 10, "stream": True}
    response = httpx.post(f"{fake_server}/v1/completions", json=body, timeout=30)
    assert response.status_code == 408 and response.json()["error"]["code"] == "scheduler_queue_timeout"


def test_an_engine_failure_fails_the_requests_in_flight_and_stops_the_server(tmp_path_factory):
    """When the engine's step raises, every request in flight gets engine_failed (a stream as an error event before
    [DONE]) and the server exits with status 1 for a supervisor to restart it, instead of answering 503 for ever."""
    process, url, log_path = _spawn(FAKE_SERVER, tmp_path_factory)
    endless = {"model": FAKE_MODEL, "prompt": "fine", "max_tokens": 10**6}

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=30) as session:
            non_streamed = asyncio.create_task(session.post("/v1/completions", json=endless))
            async with session.stream("POST", "/v1/completions", json={**endless, "stream": True}) as stream:
                lines = stream.aiter_lines()
                first = await first_data_line(lines)
                while scrape(url)["jaxllm:num_requests_running"] < 2:
                    await asyncio.sleep(0.01)
                crashing = await session.post("/v1/completions", json={**endless, "prompt": fake_engine_server.CRASH})
                streamed = [first] + [line async for line in lines]
            return await non_streamed, crashing, streamed

    try:
        _wait_until_ready(url, process, log_path)
        non_streamed, crashing, streamed = asyncio.run(scenario())
        exit_status = process.wait(timeout=30)
    finally:
        _stop(process)
    for response in (non_streamed, crashing):
        assert response.status_code == 500 and response.json()["error"]["code"] == "engine_failed"
    events, _ = sse_events(streamed)
    assert events[-2]["error"]["code"] == "engine_failed" and events[-1] == "[DONE]"
    assert exit_status == 1 and "the engine failed" in log_path.read_text()


# the benchmark client


@pytest.mark.parametrize("load", [["--request-rate", "40"], ["--endpoint", "chat", "--max-concurrency", "3"]])
def test_bench_serving_reports_latencies_and_throughput(server, tmp_path, load):
    out = tmp_path / "summary.json"
    command = [sys.executable, str(REPO / "tools" / "bench_serving.py"), "--base-url", server.url, "--api-key",
               API_KEY, "--num-prompts", "12", "--random-input-len", "8", "--random-output-len", "8", "--ignore-eos",
               "--json-out", str(out), *load]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    summary = json.loads(out.read_text())
    assert (summary["completed"], summary["failed"], summary["total_output_tokens"]) == (12, 0, 96)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < summary[f"mean_{metric}_ms"] <= summary[f"p99_{metric}_ms"] * 1.0001
    assert summary["mean_ttft_ms"] < summary["mean_e2el_ms"]
    assert summary["tokens_per_forward"] > 0 and summary["output_throughput_tok_per_s"] > 0
    if "--max-concurrency" in load:
        assert summary["peak_concurrent_requests"] <= 3


# the command line


def test_serve_rejects_bad_flags_before_loading_anything(server, capsys):
    for argv in (["serve", "--model", str(server.checkpoint), "--decoding-strategy", "nope"],
                 ["serve", "--model", str(server.checkpoint), "--block-size", "0"],
                 ["serve", "--model", str(server.checkpoint / "missing")]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
    assert "decoding_strategy" in capsys.readouterr().err


def test_boolean_engine_flags_reach_the_engine_options_only_when_given():
    def options(*flags):
        return cli.engine_options(cli.build_parser().parse_args(["serve", *flags]))

    assert options() == {}
    assert options("--batch-invariant", "--no-enable-prefix-caching") == dict(batch_invariant=True,
                                                                               enable_prefix_caching=False)
    assert split_options(options("--batch-invariant"))[0].batch_invariant


def test_serve_checks_its_flags_before_importing_jax_or_the_server():
    """A mistyped flag is answered at once: before the checks pass, nothing heavy (JAX, transformers, torch, Sanic:
    ~8 s together) is imported."""
    probe = ("import sys\nfrom jaxllm.server import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as exit:\n"
             "    heavy = [m for m in ('jax', 'transformers', 'torch', 'sanic') if m in sys.modules]\n"
             "    print('exit', exit.code, 'imported', heavy)\n")
    for flags, code, message in ((["--max-num-seqs", "x"], 2, "invalid int value"),
                                 (["--decoding-strategy", "nope"], 2, "decoding_strategy must be one of"),
                                 (["--dtype", "float16"], 2, "dtype must be one of"),
                                 (["--sse-keepalive-interval", "0"], 2, "keep-alive interval must be > 0 seconds"),
                                 (["--help"], 0, "--max-num-seqs")):
        finished = subprocess.run([sys.executable, "-c", probe, "serve", *flags], capture_output=True, text=True,
                                  timeout=60, cwd=REPO, check=False)
        assert finished.stdout.splitlines()[-1] == f"exit {code} imported []", finished.stdout + finished.stderr
        assert message in finished.stdout + finished.stderr


@pytest.mark.parametrize("keepalive_s", [0, -1.0])
def test_an_app_refuses_a_keepalive_interval_that_is_not_positive(keepalive_s):
    """A 0 s keep-alive floods a stream with pings and never delivers its output."""
    with pytest.raises(ValueError, match="keep-alive interval must be > 0"):
        create_app(fake_engine_server.FakeEngine, model_name=FAKE_MODEL, sse_keepalive_s=keepalive_s)


def test_serve_exits_with_an_error_when_the_model_cannot_load(server, tmp_path):
    for tokenizer_file in server.checkpoint.glob("tokenizer*.json"):
        shutil.copy(tokenizer_file, tmp_path)  # a tokenizer but no config.json or weights
    command = [sys.executable, "-m", "jaxllm.server", "serve", "--model", str(tmp_path), "--host", "127.0.0.1",
               "--port", str(_free_port())]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert finished.returncode == 1
    assert "the engine failed to start" in finished.stderr


def test_sigterm_lets_running_streams_finish(checkpoints, tmp_path_factory):
    """A rolling restart: the server stops taking connections but its engine runs until the open streams end."""
    process, url, log_path = _launch(checkpoints("sdar"), tmp_path_factory)
    try:
        _wait_until_ready(url, process, log_path)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 48, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 2:  # the role chunk and the first block are out
                        process.terminate()
        assert events[-1] == "[DONE]", log_path.read_text()[-2000:]
        finish_reasons = [choice["finish_reason"] for event in events[:-1] for choice in json.loads(event)["choices"]]
        assert finish_reasons[-1] == "length"
        assert process.wait(timeout=30) == 0
    finally:
        _stop(process)
