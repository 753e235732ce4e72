"""OpenAI response bodies and SSE chunks for completions and chat, with usage and the dLLM `metrics` object.

`metrics` (not an OpenAI field) carries what a block-diffusion request cost: forward_passes (denoising forwards, NFE),
tokens_per_forward (completion tokens / forward passes), and queue / time-to-first-token / decode / end-to-end times
in milliseconds, measured by the engine from the moment the request was added. Over several choices, forward passes
and token counts add up, the first token is the earliest one and the end is the latest one.
"""

import dataclasses
import json
import time
import uuid

from jaxllm.engine.request import RequestOutput


@dataclasses.dataclass(frozen=True)
class ResponseHeader:
    """Fields every body and chunk of one response repeats."""

    id: str
    object: str
    created: int
    model: str

    @classmethod
    def new(cls, chat: bool, stream: bool, model: str, rid: str | None = None) -> "ResponseHeader":
        """rid: the client's id for the request; None: a fresh one."""
        prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        kind += ".chunk" if chat and stream else ""
        return cls(rid or f"{prefix}-{uuid.uuid4().hex}", kind, int(time.time()), model)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def usage(prompt_lens: list[int], finals: list[RequestOutput]) -> dict:
    """OpenAI usage; each prompt counts once however many choices it has."""
    completion_tokens = sum(len(o.token_ids) for o in finals)
    body = {"prompt_tokens": sum(prompt_lens), "completion_tokens": completion_tokens,
            "total_tokens": sum(prompt_lens) + completion_tokens}
    cached_tokens = _cached_tokens(finals, len(prompt_lens))
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def _cached_tokens(finals: list[RequestOutput], num_prompts: int) -> int:
    """Prompt tokens read from the prefix cache, each prompt counted once: choice i samples prompt i // n, and a
    prompt's cached tokens are those every one of its choices found cached."""
    n = len(finals) // num_prompts
    return sum(min(o.stats.get("cached_tokens") or 0 for o in finals[p * n:(p + 1) * n]) for p in range(num_prompts))


def _present(values):
    return [v for v in values if v is not None]


def request_metrics(finals: list[RequestOutput], num_prompts: int = 1) -> dict:
    """The response's `metrics` object: vLLM's per-request fields (time_to_first_token_ms, generation_time_ms,
    queue_time_ms, mean_itl_ms, tokens_per_second; the first token is the first committed block's, and its time counts
    from arrival) and the dLLM's counts. Over several choices: the first token and queue time of the earliest, the end
    of the last, inter-token gaps and throughput over all their tokens."""
    stats = [o.stats for o in finals]
    forward_passes = sum(s["forward_passes"] for s in stats)
    completion_tokens = sum(len(o.token_ids) for o in finals)
    queue = _present(s["queue_time_ms"] for s in stats)
    first = _present(s["time_to_first_block_ms"] for s in stats)
    end = _present(s["total_time_ms"] for s in stats)
    ttft, e2e = (min(first) if first else None), (max(end) if end else None)
    timed = [(s["total_time_ms"] - s["time_to_first_block_ms"], len(o.token_ids) - 1) for o, s in zip(finals, stats)
             if s["time_to_first_block_ms"] is not None and s["total_time_ms"] is not None and len(o.token_ids) > 1]
    gaps = sum(gap for _, gap in timed)
    inference_ms = e2e - min(queue) if e2e is not None and queue else None  # scheduled to the last token
    return {
        "forward_passes": forward_passes,
        "tokens_per_forward": round(completion_tokens / forward_passes, 4) if forward_passes else None,
        "queue_time_ms": min(queue) if queue else None,
        "time_to_first_token_ms": ttft,
        "generation_time_ms": round(e2e - ttft, 3) if ttft is not None and e2e is not None else None,
        "mean_itl_ms": round(sum(ms for ms, _ in timed) / gaps, 3) if gaps else None,
        "tokens_per_second": round(1e3 * completion_tokens / inference_ms, 2) if inference_ms else None,
        "e2e_latency_ms": e2e,
        "cached_tokens": _cached_tokens(finals, num_prompts),  # as usage counts them
        "preemptions": sum(s["preemptions"] for s in stats),
    }


def _choice(chat: bool, index: int, text: str, finish_reason: str | None) -> dict:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def full_response(header: ResponseHeader, prompt_lens: list[int], finals: list[RequestOutput]) -> dict:
    """The non-streamed body; finals are the finished outputs in choice order."""
    chat = header.object == "chat.completion"
    choices = [_choice(chat, i, o.text, o.finish_reason) for i, o in enumerate(finals)]
    return {**header.as_dict(), "choices": choices, "usage": usage(prompt_lens, finals),
            "metrics": request_metrics(finals, len(prompt_lens))}


def chunk(header: ResponseHeader, index: int, text: str | None, finish_reason: str | None = None,
          role: str | None = None) -> dict:
    """One choice's streamed update; a chat delta omits absent fields."""
    if header.object == "chat.completion.chunk":
        delta = {k: v for k, v in (("role", role), ("content", text)) if v is not None}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {**header.as_dict(), "choices": [choice]}


def usage_chunk(header: ResponseHeader, prompt_lens: list[int], finals: list[RequestOutput]) -> dict:
    return {**header.as_dict(), "choices": [], "usage": usage(prompt_lens, finals),
            "metrics": request_metrics(finals, len(prompt_lens))}


def sse_event(body: dict | str) -> str:
    payload = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"
