"""Prometheus metrics of the server (text format at GET /metrics).

Two sources:
- request-level series observed by the handlers (outcomes, TTFT / TPOT / end-to-end histograms), and
- engine gauges and counters read at scrape time from the engine thread's latest ``EngineStats`` snapshot
  (running / waiting sequences, KV-cache blocks and usage, prefix-cache hit rate, prompt / generation tokens) and,
  when the engine measures it, the live roofline: the fraction of their best possible time that steps ran at, overall
  and as a histogram of per-step fractions (``rooflm.roofline.live``).

Each app owns its own ``CollectorRegistry``, so several servers in one process (tests) never collide.
"""
from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from rooflm.engine.async_engine import AsyncLLMEngine
from rooflm.engine.stats import EngineStats
from rooflm.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Outcomes of a generation request (label "outcome" of rooflm_requests_total).
SUCCESS, ABORTED, INVALID, UNAUTHORIZED, NOT_FOUND, REJECTED, ERROR = (
    "success", "aborted", "invalid", "unauthorized", "not_found", "rejected", "error")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)


def outcome_for_status(status: int) -> str:
    if status == 401:
        return UNAUTHORIZED
    if status == 404:
        return NOT_FOUND
    if status == 503:
        return REJECTED
    if 400 <= status < 500:
        return INVALID
    return ERROR


class _EngineCollector(Collector):
    """Reads the engine's stats snapshot at scrape time (never the engine itself)."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("rooflm_num_requests_running", "Sequences running (holding KV blocks).", s.num_running)
        yield gauge("rooflm_num_requests_waiting", "Sequences waiting for admission (incl. preempted).", s.num_waiting)
        yield gauge("rooflm_num_requests_unfinished", "Requests added to the engine and not finished yet.",
                    self.engine.num_unfinished_requests)
        yield gauge("rooflm_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0..1).", s.kv_usage)
        yield gauge("rooflm_kv_cache_free_blocks", "Free KV-cache blocks (cached-but-unreferenced count as free).",
                    s.num_free_blocks)
        yield gauge("rooflm_kv_cache_total_blocks", "KV-cache blocks in the pool.", s.num_total_blocks)
        yield gauge("rooflm_kv_cache_peak_blocks_used", "Most KV-cache blocks in use at once.", s.peak_blocks_used)
        yield gauge("rooflm_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up (0..1).",
                    s.prefix_cache_hit_rate)
        yield counter("rooflm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries)
        yield counter("rooflm_prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits)
        yield counter("rooflm_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded).",
                      s.prompt_tokens_total)
        yield counter("rooflm_generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield counter("rooflm_num_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions)
        yield counter("rooflm_engine_steps", "Engine steps run.", s.num_steps)
        yield gauge("rooflm_engine_alive", "1 while the engine loop runs, 0 once it stopped.",
                    1.0 if self.engine.is_running else 0.0)
        if s.host_cache_enabled:  # kv_offload_gb > 0
            yield counter("rooflm_host_cache_hits", "Prompt tokens restored from the prefix cache's host tier.",
                          s.host_cache_hits)
            yield counter("rooflm_host_cache_misses", "Full-block prompt tokens found neither on the device nor on "
                          "the host.", s.host_cache_misses)
            yield gauge("rooflm_host_cache_blocks", "KV blocks held in the host tier.", s.host_cache_blocks)
            yield counter("rooflm_host_cache_offloaded_bytes", "Bytes copied from the device to the host tier.",
                          s.host_cache_bytes_offloaded)
            yield counter("rooflm_host_cache_restored_bytes", "Bytes copied from the host tier back to the device.",
                          s.host_cache_bytes_restored)
        if s.spec_verifications:
            yield counter("rooflm_spec_decode_draft_tokens", "Speculative draft tokens verified.", s.spec_draft_tokens)
            yield counter("rooflm_spec_decode_accepted_tokens", "Speculative draft tokens accepted.",
                          s.spec_accepted_tokens)
            yield counter("rooflm_spec_decode_verifications", "Verifications (one per request and step with drafts).",
                          s.spec_verifications)
            yield gauge("rooflm_spec_decode_acceptance_rate", "Accepted / verified draft tokens (0..1).",
                        s.spec_acceptance_rate)
            yield gauge("rooflm_spec_decode_mean_accepted_length", "Tokens per verification: accepted drafts + 1.",
                        s.spec_mean_accepted_length)
        if s.roofline_fraction is not None:
            yield gauge("rooflm_roofline_fraction", "Best possible time of the engine steps run / their measured "
                        "time (1 = at the roofline).", s.roofline_fraction)
            yield roofline_histogram(s)


def roofline_histogram(s: EngineStats) -> HistogramMetricFamily:
    """The per-step fraction histogram from a stats snapshot: its per-bucket counts summed into Prometheus'
    cumulative ``le`` buckets (the last one +Inf, equal to the number of steps)."""
    buckets, running = [], 0
    for bound, count in zip(s.roofline_bucket_bounds, s.roofline_bucket_counts):
        running += count
        buckets.append((floatToGoString(bound), running))
    if not buckets or buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", running))
    return HistogramMetricFamily("rooflm_step_roofline_fraction", "Per engine step: best possible time / measured "
                                 "time.", buckets=buckets, sum_value=s.roofline_fraction_sum)


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("rooflm_requests", "Generation requests answered, by endpoint and outcome.",
                                ["endpoint", "outcome"], registry=self.registry)
        self.finished = Counter("rooflm_request_finish", "Finished sequences, by finish reason.",
                                ["finish_reason"], registry=self.registry)
        self.ttft = Histogram("rooflm_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("rooflm_time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first).",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("rooflm_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint=endpoint, outcome=outcome).inc()

    def tracker(self, endpoint: str) -> "RequestTracker":
        return RequestTracker(self, endpoint)


class RequestTracker:
    """Latency bookkeeping of one HTTP generation request (all its prompts and samples)."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.max_tokens_seen = 0  # longest sample so far: TPOT is per sequence
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        n = max((len(o.token_ids) for o in out.outputs), default=0)
        if n > self.max_tokens_seen:
            now = time.monotonic()
            if self.first_token is None:
                self.first_token = now
                self.metrics.ttft.observe(now - self.arrival)
            self.last_token = now
            self.max_tokens_seen = n
        if out.finished:
            for o in out.outputs:
                self.metrics.finished.labels(finish_reason=o.finish_reason or "unknown").inc()

    def finish(self, outcome: str) -> None:
        """Record the outcome once; latencies only for successful requests."""
        if self.done:
            return
        self.done = True
        self.metrics.count(self.endpoint, outcome)
        if outcome != SUCCESS:
            return
        end = self.last_token or time.monotonic()
        self.metrics.e2e.observe(end - self.arrival)
        if self.first_token is not None and self.max_tokens_seen > 1:
            self.metrics.tpot.observe((end - self.first_token) / (self.max_tokens_seen - 1))
