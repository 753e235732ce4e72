"""OpenAI request validation: a JSON body in, a GenerationRequest out, or an APIError that names the bad field.

Honoured: model, prompt / messages, max_tokens (chat also max_completion_tokens), temperature, top_p, top_k, seed,
stop, stop_token_ids, ignore_eos, n, stream, stream_options.include_usage. Fields that would change the output in a
way jaxllm does not implement (logprobs, penalties, echo, best_of, tools, guided decoding, ...) are refused unless
neutral; any other unknown field is ignored, as vLLM does.
"""

import dataclasses
import json
import logging
import math
import pathlib

from jaxllm.sampling import SamplingParams

logger = logging.getLogger("jaxllm.server")

MAX_N = 128
MAX_STOP_STRINGS = 4
MAX_RID_LEN = 256  # an id, not a payload: it is echoed in every chunk and in the logs
SEED_MODULUS = 2**32  # SamplingParams seeds are u32; larger or negative client seeds wrap


class APIError(Exception):
    """An error the client caused (or must wait out), in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def internal_error(error: Exception) -> APIError:
    """An unexpected failure of the server's own while serving one request."""
    return APIError(500, f"internal server error: {type(error).__name__}: {error}", type="server_error",
                    code="internal_error")


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """Values for fields a request leaves out: the model's generation_config.json, else OpenAI's defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def from_model_dir(cls, model_dir: pathlib.Path) -> "SamplingDefaults":
        path = pathlib.Path(model_dir) / "generation_config.json"
        config = json.loads(path.read_text()) if path.exists() else {}
        known = {f.name: config[f.name] for f in dataclasses.fields(cls) if config.get(f.name) is not None}
        if known.get("top_k", -1) <= 0:  # Hugging Face's top_k 0 means no top-k filter: the API's -1
            known.pop("top_k", None)
        return cls(**known)


@dataclasses.dataclass
class GenerationRequest:
    prompts: list[str | list[int]] | None  # completions: one entry per prompt
    messages: list[dict] | None  # chat
    n: int
    max_tokens: int | None  # None: what is left of the context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    rid: str | None  # the client's id for the request (SGLang's extension): the response's id

    def sampling_params(self, choice: int, max_tokens: int) -> SamplingParams:
        """Parameters of the choice-th sample of a prompt: seed + choice when the request is seeded."""
        seed = None if self.seed is None else (self.seed + choice) % SEED_MODULUS
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=seed, stop=list(self.stop),
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)


# field readers: absent or null -> default; wrong type or range -> 400


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_int(body: dict, name: str, default, low: int | None = None, high: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(name, f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise invalid(name, f"{name} must be {bounds}, got {value}")
    return value


def _read_number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not (_is_int(value) or (isinstance(value, float) and math.isfinite(value))):
        raise invalid(name, f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        raise invalid(name, f"{name} must lie in {'(' if low_open else '['}{low}, {high}], got {value}")
    return float(value)


def _read_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be a boolean, got {value!r}")
    return value


def _read_top_k(body: dict, default: int) -> int:
    top_k = _read_int(body, "top_k", default)
    if top_k == 0 or top_k < -1:
        raise invalid("top_k", f"top_k must be -1 (off) or >= 1, got {top_k}")
    return top_k


def _check_encodable(text: str, param: str) -> str:
    """JSON may escape a lone surrogate ("\\ud800"), which no tokenizer (nor a UTF-8 response) can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(param, f"{param} holds a lone UTF-16 surrogate, which is not valid Unicode text") from None
    return text


def _read_stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise invalid("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    return [_check_encodable(s, "stop") for s in stop]


def _read_token_ids(value, name: str, vocab_size: int, *, may_be_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or not (value or may_be_empty) or not all(_is_int(t) for t in value):
        raise invalid(name, f"{name} must be a {'' if may_be_empty else 'non-empty '}list of token ids")
    if not all(0 <= t < vocab_size for t in value):
        raise invalid(name, f"{name} holds token ids outside the vocabulary [0, {vocab_size})")
    return value


def _read_stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage); stream_options is only valid on a streamed request."""
    stream = _read_bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", "stream_options must be an object")
    if options.get("continuous_usage_stats"):
        raise invalid("stream_options", "continuous_usage_stats is not supported by this server")
    return stream, _read_bool(options, "include_usage")


# fields whose neutral value is accepted and anything else refused, rather than silently ignored
_NEUTRAL = {
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None or v == "",
    "best_of": lambda v: v is None or v == 1,
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "repetition_penalty": lambda v: v is None or v == 1,
    "min_p": lambda v: v is None or v == 0,
    "logit_bias": lambda v: v is None or v == {},
    "top_logprobs": lambda v: v is None or v == 0,
    "tools": lambda v: v is None or v == [],
    "functions": lambda v: v is None or v == [],
    "tool_choice": lambda v: v in (None, "none", "auto"),  # "required" or a named tool: there are no tools to call
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "min_tokens": lambda v: v is None or v == 0,
    "structured_outputs": lambda v: v is None or v == {},
    "bad_words": lambda v: v is None or v == [],
    "allowed_token_ids": lambda v: v is None,
    "include_stop_str_in_output": lambda v: v is None or v is False,
    "skip_special_tokens": lambda v: v is None or v is True,
    "prompt_logprobs": lambda v: v is None,
}
_GUIDED_PREFIX = "guided_"  # vLLM's guided_json, guided_regex, guided_choice, guided_grammar, ...
_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                  "ignore_eos", "n", "stream", "stream_options", "user", "logprobs", "metadata", "rid",
                  *_NEUTRAL}


def _refuse_unsupported(body: dict, chat: bool) -> None:
    for name, is_neutral in _NEUTRAL.items():
        if not is_neutral(body.get(name)):
            raise invalid(name, f"{name}={body[name]!r} is not supported by this server")
    for name, value in body.items():
        if name.startswith(_GUIDED_PREFIX) and value is not None:
            raise invalid(name, f"{name} (guided decoding) is not supported by this server")
    logprobs = body.get("logprobs")
    if not (logprobs is None or (chat and logprobs is False)):
        raise invalid("logprobs", "logprobs are not supported by this server")


def _log_ignored(body: dict, known: set[str]) -> None:
    ignored = sorted(set(body) - known)
    if ignored:
        logger.info("fields were present in the request but ignored: %s", ignored)


def check_model(body: dict, served_model_name: str) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", f"model must be a string, got {model!r}")
    if model is not None and model != served_model_name:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def _read_common(body: dict, defaults: SamplingDefaults, vocab_size: int, max_tokens_field: str) -> dict:
    stream, include_usage = _read_stream(body)
    stop_token_ids = body.get("stop_token_ids")
    return {
        "n": _read_int(body, "n", 1, 1, MAX_N),
        "max_tokens": _read_int(body, max_tokens_field, None, 0),
        "temperature": _read_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        "top_p": _read_number(body, "top_p", defaults.top_p, 0.0, 1.0, low_open=True),
        "top_k": _read_top_k(body, defaults.top_k),
        "seed": _read_int(body, "seed", None),
        "stop": _read_stop(body),
        "stop_token_ids": [] if stop_token_ids is None else _read_token_ids(stop_token_ids, "stop_token_ids",
                                                                            vocab_size, may_be_empty=True),
        "ignore_eos": _read_bool(body, "ignore_eos"),
        "stream": stream,
        "include_usage": include_usage,
        "rid": _read_rid(body),
    }


def _read_rid(body: dict) -> str | None:
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, str) and rid and rid.isprintable() and len(rid) <= MAX_RID_LEN):
        raise invalid("rid", f"rid must be a non-empty printable string of at most {MAX_RID_LEN} characters")
    return rid


def _read_prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists: one entry per prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", "prompt must be a non-empty string, list of strings, list of token ids, or list of "
                                "token-id lists")
    for entry in prompt:
        if isinstance(entry, str):
            if not entry:
                raise invalid("prompt", "prompt must not be empty")
            _check_encodable(entry, "prompt")
        else:
            _read_token_ids(entry, "prompt", vocab_size)
    return prompt


def parse_completion_request(body: dict, served_model_name: str, defaults: SamplingDefaults,
                             vocab_size: int) -> GenerationRequest:
    check_model(body, served_model_name)
    _refuse_unsupported(body, chat=False)
    _log_ignored(body, _COMMON_FIELDS | {"prompt"})
    common = _read_common(body, defaults, vocab_size, "max_tokens")
    return GenerationRequest(prompts=_read_prompts(body, vocab_size), messages=None, **common)


def _read_message(message, index: int) -> dict:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise invalid(param, f"{param} must be an object with a string role")
    for key, value in message.items():  # role, name, ...: the chat template renders them all
        if isinstance(value, str):
            _check_encodable(value, f"{param}.{key}")
    content = message.get("content")

    def is_text_part(part) -> bool:
        return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)

    if content is None and message["role"] == "assistant":
        return {**message, "content": ""}
    if not (isinstance(content, str) or (isinstance(content, list) and all(map(is_text_part, content)))):
        raise invalid(f"{param}.content", f"{param}.content must be a string or a list of text parts")
    if isinstance(content, list):  # one string, as chat templates that test for a string content expect; parts on
        # lines of their own, as vLLM joins them
        text = _check_encodable("\n".join(part["text"] for part in content), f"{param}.content")
        return {**message, "content": text}
    return message


def parse_chat_request(body: dict, served_model_name: str, defaults: SamplingDefaults,
                       vocab_size: int) -> GenerationRequest:
    check_model(body, served_model_name)
    _refuse_unsupported(body, chat=True)
    _log_ignored(body, _COMMON_FIELDS | {"messages", "max_completion_tokens"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list")
    messages = [_read_message(m, i) for i, m in enumerate(messages)]
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    common = _read_common(body, defaults, vocab_size, field)
    return GenerationRequest(prompts=None, messages=messages, **common)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}", code="json_parse_error") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="json_parse_error")
    return body
