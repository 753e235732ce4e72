"""Serving benchmark: stream prompts to a running OpenAI-compatible server and report latency and throughput.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 16 \
        --random-input-len 64 --random-output-len 32 --ignore-eos [--max-concurrency 8] [--dataset-path sharegpt.json]

Load: Poisson arrivals at --request-rate (gamma with --burstiness; inf sends everything at once), optionally capped at
--max-concurrency requests in flight. Prompts: random token ids (lengths uniform in L*(1 -+ --random-range-ratio)),
or ShareGPT-style conversations from a local JSON file (turn 0 is the prompt, turn 1's length the output length).

Metrics (serving.md §9, vLLM's definitions), from streamed responses with usage:
- TTFT: send to the first chunk with content.
- ITL: the gap between successive content chunks, one sample per chunk. A dLLM server streams one chunk per committed
  block, so this is the inter-block latency, not a per-token one.
- TPOT: (E2EL - TTFT) / (output tokens - 1), output tokens from the usage chunk.
- E2EL: send to the last chunk.
- Throughput: requests/s, output tokens/s, total (prompt + output) tokens/s over the whole run; tokens per forward
  from the server's `metrics` (jaxllm only).
"""

import argparse
import asyncio
import dataclasses
import json
import os
import pathlib
import random
import statistics
import sys
import time

import httpx
import numpy as np
from tokenizers import Tokenizer

DEFAULT_TOKENIZER = pathlib.Path(__file__).resolve().parents[1] / "jaxllm" / "default_model"
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048


@dataclasses.dataclass
class Prompt:
    prompt: str | list[int]  # token ids go to /v1/completions as they are
    prompt_len: int
    output_len: int


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str = ""
    send_time: float = 0.0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    forward_passes: int = 0


# prompts


def _lengths(mean: int, ratio: float, count: int, rng: random.Random) -> list[int]:
    low, high = max(int(mean * (1 - ratio)), 1), max(int(mean * (1 + ratio)), 1)
    return [rng.randint(low, high) for _ in range(count)]


def random_prompts(tokenizer: Tokenizer, args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    special = set(tokenizer.get_added_tokens_decoder())
    candidates = [t for t in range(tokenizer.get_vocab_size()) if t not in special]
    inputs = _lengths(args.random_input_len, args.random_range_ratio, args.num_prompts, rng)
    outputs = _lengths(args.random_output_len, args.random_range_ratio, args.num_prompts, rng)
    prompts = []
    for input_len, output_len in zip(inputs, outputs):
        ids = rng.choices(candidates, k=input_len)
        prompts.append(Prompt(ids if args.endpoint == "completions" else tokenizer.decode(ids), input_len, output_len))
    return prompts


def sharegpt_prompts(tokenizer: Tokenizer, args: argparse.Namespace, rng: random.Random) -> list[Prompt]:
    conversations = [c["conversations"] for c in json.loads(pathlib.Path(args.dataset_path).read_text())
                     if len(c.get("conversations", [])) >= 2]
    rng.shuffle(conversations)
    prompts = []
    for turns in conversations:
        prompt, reference = turns[0]["value"], turns[1]["value"]
        prompt_len, output_len = len(tokenizer.encode(prompt).ids), len(tokenizer.encode(reference).ids)
        if args.sharegpt_output_len:
            output_len = args.sharegpt_output_len
        if (min(prompt_len, output_len) >= SHAREGPT_MIN_LEN and prompt_len <= SHAREGPT_MAX_PROMPT_LEN
                and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN):
            prompts.append(Prompt(prompt, prompt_len, output_len))
        if len(prompts) == args.num_prompts:
            break
    return prompts


# one request


def _payload(args: argparse.Namespace, model: str, prompt: Prompt) -> dict:
    body = {"model": model, "max_tokens": prompt.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt.prompt}]}
    return {**body, "prompt": prompt.prompt}


def _has_content(event: dict) -> bool:
    for choice in event.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def send_one(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int) -> RequestResult:
    result = RequestResult(prompt_len, send_time=time.perf_counter())
    last_chunk, saw_usage = None, False
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue  # blank separators, `: ping` keep-alives, the end marker
                now, event = time.perf_counter(), json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error chunk")
                    return result
                if _has_content(event):
                    if last_chunk is None:
                        result.ttft = now - result.send_time
                    else:
                        result.itl.append(now - last_chunk)
                    last_chunk = now
                if event.get("usage"):
                    saw_usage = True
                    result.prompt_len = event["usage"]["prompt_tokens"]  # exact, also for re-tokenized chat text
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.forward_passes = (event.get("metrics") or {}).get("forward_passes") or 0
                result.e2el = now - result.send_time
    except httpx.HTTPError as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.ok = saw_usage or last_chunk is not None
    result.error = "" if result.ok else "the stream ended without content or usage"
    if last_chunk is None:
        result.ttft = result.e2el  # nothing but usage came: the whole wait was the first response
    return result


# the run


def arrival_gaps(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Gaps between sends: gamma(burstiness, 1 / (rate * burstiness)); burstiness 1 is a Poisson process."""
    if rate == float("inf"):
        return [0.0] * count
    return list(rng.gamma(burstiness, 1.0 / (rate * burstiness), count))


async def run(args: argparse.Namespace, prompts: list[Prompt]) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=60.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        url = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
        limit = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def limited(prompt: Prompt) -> RequestResult:
            async with limit:
                return await send_one(client, url, _payload(args, model, prompt), prompt.prompt_len)

        tasks = []
        start = time.perf_counter()
        for prompt, gap in zip(prompts, arrival_gaps(len(prompts), args.request_rate, args.burstiness,
                                                     np.random.default_rng(args.seed))):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _distribution(name: str, seconds: list[float], percentiles: list[float]) -> dict:
    ms = [1e3 * s for s in seconds] or [float("nan")]
    row = {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
           f"std_{name}_ms": statistics.pstdev(ms)}
    return row | {f"p{p:g}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles}


def _peak_concurrency(done: list[RequestResult]) -> int:
    events = sorted([(r.send_time, 1) for r in done] + [(r.send_time + r.e2el, -1) for r in done])
    level = peak = 0
    for _, change in events:
        level += change
        peak = max(peak, level)
    return peak


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    forward_passes = sum(r.forward_passes for r in done)
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    summary = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput_per_s": len(done) / duration, "output_throughput_tok_per_s": output_tokens / duration,
        "total_throughput_tok_per_s": (input_tokens + output_tokens) / duration,
        "peak_concurrent_requests": _peak_concurrency(done),
        "tokens_per_forward": output_tokens / forward_passes if forward_passes else None,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, samples in (("ttft", [r.ttft for r in done]), ("tpot", tpots),
                          ("itl", [gap for r in done for gap in r.itl]), ("e2el", [r.e2el for r in done])):
        summary |= _distribution(name, samples, percentiles)
    return summary


def print_table(summary: dict) -> None:
    print("| metric | value |\n|---|---|")
    for key, value in summary.items():
        if key == "errors":
            continue
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"| {key} | {shown} |")
    print("itl: one sample per SSE chunk = per committed block (inter-block latency)")
    for error in summary["errors"]:
        print(f"error: {error}", file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--model", help="model id to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"))
    parser.add_argument("--tokenizer", type=pathlib.Path, default=DEFAULT_TOKENIZER,
                        help="directory holding tokenizer.json (prompt lengths, random token ids)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    parser.add_argument("--dataset-path", help="ShareGPT-style JSON; random token ids when left out")
    parser.add_argument("--sharegpt-output-len", type=int, help="override the reference output lengths")
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens")
    parser.add_argument("--percentiles", default="90,99", help="besides mean, median and std")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument("--json-out", type=pathlib.Path, help="also write the summary here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    rng = random.Random(args.seed)
    prompts = sharegpt_prompts(tokenizer, args, rng) if args.dataset_path else random_prompts(tokenizer, args, rng)
    results, duration = asyncio.run(run(args, prompts))
    summary = summarize(results, duration, [float(p) for p in args.percentiles.split(",")])
    print_table(summary)
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
