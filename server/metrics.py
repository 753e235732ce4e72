"""Prometheus metrics (vLLM's names under a `jaxllm:` prefix) in a registry of the server's own.

Per-request counters and histograms are fed by the engine thread from each step's outputs; engine gauges (running,
waiting, KV usage, prefix cache) are read from the engine when /metrics is scraped, so they are never stale.
The forward-pass counter sums each finished request's denoising forwards (its NFE):
generation_tokens_total / request_forward_passes_total is the mean tokens per forward. num_requests_total counts
every finished request, as TokenSpeed's num_requests does (vLLM has none); request_success_total splits the same
count by finish reason (abort included).
"""

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxllm.engine.request import RequestOutput

PREFIX = "jaxllm:"
FINISH_REASONS = ("stop", "length", "abort", "queue_timeout")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0, 640.0, 2560.0)
PER_TOKEN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0)
FORWARD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                   1.0)
ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineGauges:
    """A collector that reads the engine's gauges at scrape time; nothing before the engine exists."""

    def __init__(self, get_engine):
        self._get_engine = get_engine

    def collect(self):
        engine = self._get_engine()
        if engine is None:
            return
        pages = engine.scheduler.pages
        # len() of the scheduler's queues is atomic under the GIL; the engine thread may be mid-step
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests in the running batch.",
                                value=engine.num_running)
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests queued for admission (those added during "
                                "the running step included).", value=engine.num_waiting)
        yield GaugeMetricFamily(f"{PREFIX}kv_cache_usage_perc", "Fraction (0-1) of KV pages in use.",
                                value=engine.kv_cache_usage)
        # tokens, as vLLM counts them: the cache holds whole pages, so a prompt's tail past its last one is not asked
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_queries", "Prompt tokens (in whole pages) looked up in the "
                                  "prefix cache.", value=pages.prefix_queries * pages.page_size)
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=pages.prefix_hits * pages.page_size)


class ServerMetrics:
    def __init__(self, get_engine):
        disable_created_metrics()  # process-wide (the server owns its process): no *_created sample per series
        self.registry = CollectorRegistry()
        self.registry.register(_EngineGauges(get_engine))
        self.num_requests = Counter(f"{PREFIX}num_requests", "Finished requests, whatever the finish reason.",
                                    registry=self.registry)
        self.requests = Counter(f"{PREFIX}request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Committed output tokens.",
                                         registry=self.registry)
        self.forward_passes = Counter(f"{PREFIX}request_forward_passes",
                                      "Denoising forwards summed over finished requests.", registry=self.registry)
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to the first committed block.",
                                    LATENCY_BUCKETS)
        self.tpot = self._histogram("request_time_per_output_token_seconds",
                                    "(e2e - ttft) / (output tokens - 1) per finished request.", PER_TOKEN_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                          LATENCY_BUCKETS)
        self.forward_time = self._histogram("forward_time_seconds", "Seconds per forward of each decode round.",
                                            FORWARD_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Time between a request's commits over the tokens "
                                   "the later one committed, one sample per token.", PER_TOKEN_BUCKETS)
        self.iteration_tokens = self._histogram("iteration_tokens_total", "Tokens per engine step: prompt tokens "
                                                "prefilled, or output tokens committed.", ITERATION_TOKEN_BUCKETS)
        self._last_commit: dict[str, float] = {}  # request id -> when its last tokens were committed

    def _histogram(self, name: str, documentation: str, buckets) -> Histogram:
        return Histogram(f"{PREFIX}{name}", documentation, buckets=buckets, registry=self.registry)

    def observe_output(self, output: RequestOutput) -> None:
        """The engine thread calls this for each output of a step, as it arrives."""
        self.generation_tokens.inc(len(output.new_token_ids))
        self._observe_inter_token_latency(output, time.monotonic())
        first_block = output.new_token_ids and len(output.new_token_ids) == len(output.token_ids)
        if first_block and output.stats.get("time_to_first_block_ms") is not None:  # as it happens, aborts too
            self.ttft.observe(output.stats["time_to_first_block_ms"] / 1e3)
        if output.finished:
            self._observe_finished(output)

    def _observe_inter_token_latency(self, output: RequestOutput, now: float) -> None:
        """A block commits several tokens at once: n samples of interval / n (the first commit is TTFT's)."""
        num_new = len(output.new_token_ids)
        last = self._last_commit.pop(output.request_id, None)
        if num_new and last is not None:
            for _ in range(num_new):
                self.itl.observe((now - last) / num_new)
        last = now if num_new else last
        if last is not None and not output.finished:
            self._last_commit[output.request_id] = last

    def _observe_finished(self, output: RequestOutput) -> None:
        stats = output.stats
        forward_passes = stats["forward_passes"]  # read before anything counts: a request counts whole or not at all
        self.num_requests.inc()
        self.requests.labels(output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.forward_passes.inc(forward_passes)
        if output.finish_reason == "queue_timeout" and stats.get("total_time_ms") is not None:
            self.queue_time.observe(stats["total_time_ms"] / 1e3)  # it waited all its life: the worst waits count
        if output.finish_reason in ("abort", "queue_timeout"):  # no generation to time
            return
        seconds = {k: stats[k] / 1e3 for k in ("queue_time_ms", "time_to_first_block_ms", "total_time_ms")
                   if stats.get(k) is not None}
        if "queue_time_ms" in seconds:
            self.queue_time.observe(seconds["queue_time_ms"])
        if "total_time_ms" in seconds:
            self.e2e.observe(seconds["total_time_ms"])
        if "time_to_first_block_ms" in seconds:
            if len(output.token_ids) > 1 and "total_time_ms" in seconds:
                decode = seconds["total_time_ms"] - seconds["time_to_first_block_ms"]
                self.tpot.observe(decode / (len(output.token_ids) - 1))

    def observe_forward_time(self, seconds: float) -> None:
        self.forward_time.observe(seconds)

    def observe_step_tokens(self, num_tokens: int) -> None:
        self.iteration_tokens.observe(num_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
