"""Prometheus metrics for the server, named after vLLM's with a `slipstream:` prefix.

Two sources feed one per-app CollectorRegistry (never the global one, so several apps can
live in one process):

- engine state (running/waiting, KV cache usage, prefix cache, preemptions, speculative
  decoding's drafts and accepted tokens) is read from
  engine.stats() at scrape time by a custom collector;
- request metrics (token counters, finished requests by reason, latency histograms) are
  recorded from every RequestOutput as the engine produces it (`record`, called on the
  engine thread; prometheus_client is thread-safe).

This module only observes: it must never change what the engine does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from slipstream.outputs import RequestOutput

PREFIX = "slipstream:"
LABELS = ["model_name"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0)
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Speculative verification steps (one per sequence that verified drafts)",
    "spec_decode_num_draft_tokens": "Draft tokens verified",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted",
}
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class _Progress:
    num_tokens: int = 0
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, engine_stats))

        def counter(name, doc, labels=()):
            return Counter(PREFIX + name, doc, [*LABELS, *labels], registry=self.registry)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry).labels(model_name)

        self.model_name = model_name
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Generation tokens produced").labels(model_name)
        self.request_success = counter("request_success", "Finished requests, by finish reason", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token (from arrival)", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two steps that produced tokens",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Time from arrival to first scheduling",
                                    REQUEST_BUCKETS)
        self._progress: dict[str, _Progress] = {}  # engine thread only

    def record(self, out: RequestOutput) -> None:
        """Account for one (cumulative) output; call it for every output, aborted ones included."""
        progress = self._progress.setdefault(out.request_id, _Progress())
        num_tokens = sum(len(o.token_ids) for o in out.outputs)
        m = out.metrics
        if num_tokens > progress.num_tokens:
            if progress.num_tokens == 0:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                self.ttft.observe(m.ttft)
            elif m.last_token_time is not None and progress.last_token_time is not None:
                self.itl.observe(m.last_token_time - progress.last_token_time)
            self.generation_tokens.inc(num_tokens - progress.num_tokens)
            progress.num_tokens, progress.last_token_time = num_tokens, m.last_token_time
        if out.finished:
            del self._progress[out.request_id]
            reason = out.outputs[0].finish_reason or "abort"
            self.request_success.labels(self.model_name, reason).inc()
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)
            if m.queue_time is not None:
                self.queue_time.observe(m.queue_time)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Engine state at scrape time, from engine.stats()."""

    def __init__(self, model_name: str, engine_stats: Callable[[], dict]):
        self.model_name = model_name
        self.engine_stats = engine_stats

    def collect(self):
        s = self.engine_stats()
        yield self._metric(GaugeMetricFamily, "num_requests_running",
                           "Sequences in the running batch (a request with n > 1 has n)", s["num_running"])
        yield self._metric(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting to be scheduled",
                           s["num_waiting"])
        yield self._metric(GaugeMetricFamily, "kv_cache_usage_perc",
                           "Fraction of KV cache blocks in use (0..1; cached free blocks count as free)",
                           s["kv_cache_usage"])
        yield self._metric(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                           s["prefix_cache_queries"])
        yield self._metric(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens served by the prefix cache",
                           s["prefix_cache_hits"])
        yield self._metric(CounterMetricFamily, "num_preemptions", "Preemptions (sequences sent back to the queue)",
                           s["num_preemptions"])
        for name, doc in SPEC_DECODE_COUNTERS.items():
            if name in s:  # only an engine that speculates has them
                yield self._metric(CounterMetricFamily, name, doc, s[name])

    def _metric(self, family, name: str, doc: str, value: float):
        metric = family(PREFIX + name, doc, labels=LABELS)
        metric.add_metric([self.model_name], value)
        return metric
