"""Prometheus metrics. Names are a contract with the deployment dashboards: do not rename."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# `status` of tokenmill_requests_total: ok; invalid (4xx for the request itself); unauthorized (401);
# rejected (429 queue full, 503 draining/engine down); aborted (client left); error (server failure).
REQUEST_STATUSES = ("ok", "invalid", "unauthorized", "rejected", "aborted", "error")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _StatsSource(Protocol):
    def stats(self) -> Any: ...


class SlidingWindowRate:
    """Events per second over the last `window_s` seconds (thread-safe; old events are dropped lazily)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, count: int, now: float | None = None) -> None:
        if count <= 0:
            return
        with self._lock:
            self._events.append((time.monotonic() if now is None else now, count))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            return sum(c for _, c in self._events) / self.window_s


class EngineStatsCollector(Collector):
    """Scrape-time gauges from one `engine.stats()` call (so they are mutually consistent)."""

    def __init__(self, engine: _StatsSource) -> None:
        self.engine = engine
        self._gpu = _GpuProbe()

    def collect(self) -> Iterable[Metric]:
        s = self.engine.stats()
        yield _gauge("tokenmill_num_requests_waiting", "Requests waiting to be scheduled by the engine.", s.num_waiting)
        yield _gauge("tokenmill_num_requests_running", "Requests in the engine's running batch.", s.num_running)
        yield _gauge("tokenmill_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).", s.kv_cache_usage)
        yield _gauge("tokenmill_prefix_cache_hit_rate", "Prefix cache hit rate (0..1).", s.prefix_cache_hit_rate)
        preemptions = CounterMetricFamily("tokenmill_num_preemptions", "Sequences preempted for lack of KV blocks.")
        preemptions.add_metric([], s.num_preemptions_total)
        yield preemptions
        for name, doc, value in (
            (
                "tokenmill_result_cache_hits",
                "Deterministic requests answered from the result cache.",
                s.result_cache_hits_total,
            ),
            (
                "tokenmill_result_cache_misses",
                "Deterministic requests not found in the result cache.",
                s.result_cache_misses_total,
            ),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
        yield _gauge("tokenmill_result_cache_entries", "Completions held by the result cache.", s.result_cache_entries)
        yield from _spec_decode_counters(s)
        yield from _lora_info(s)
        yield from self._gpu.collect()


class _GpuProbe:
    """GPU memory (torch) and utilisation (NVML, when nvidia-ml-py is importable); nothing without CUDA."""

    def __init__(self) -> None:
        self._torch: Any = None
        self._nvml: Any = None
        try:
            import torch

            if torch.cuda.is_available():
                self._torch = torch
        except ImportError:  # pragma: no cover - torch is a hard dependency
            return
        if self._torch is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception:  # optional: no NVML, no utilisation metric
                self._nvml = None

    def collect(self) -> Iterable[Metric]:
        if self._torch is None:
            return
        mem = GaugeMetricFamily(
            "tokenmill_gpu_memory_used_bytes", "GPU memory allocated by tokenmill (torch).", labels=["gpu"]
        )
        for i in range(self._torch.cuda.device_count()):
            mem.add_metric([str(i)], float(self._torch.cuda.memory_allocated(i)))
        yield mem
        if self._nvml is not None:
            util = GaugeMetricFamily("tokenmill_gpu_utilization_ratio", "GPU utilisation (0..1, NVML).", labels=["gpu"])
            try:
                for i in range(self._nvml.nvmlDeviceGetCount()):
                    handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
                    util.add_metric([str(i)], self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
            except Exception:  # a scrape must never fail because NVML hiccupped
                return
            yield util


def _spec_decode_counters(s: Any) -> Iterable[Metric]:
    """Speculative decoding (vLLM's names): acceptance rate = accepted / draft tokens, mean accepted
    length = 1 + accepted / drafts (zeros while speculation is off)."""
    for name, doc, value in (
        (
            "tokenmill_spec_decode_num_drafts",
            "Speculative verification steps (one per sequence and step).",
            s.spec_decode_num_drafts,
        ),
        ("tokenmill_spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_decode_num_draft_tokens),
        (
            "tokenmill_spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the model.",
            s.spec_decode_num_accepted_tokens,
        ),
    ):
        family = CounterMetricFamily(name, doc)
        family.add_metric([], value)
        yield family
    per_position = CounterMetricFamily(
        "tokenmill_spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0 = first).",
        labels=["position"],
    )
    for position, value in enumerate(s.spec_decode_accepted_per_position):
        per_position.add_metric([str(position)], value)
    yield per_position


def _lora_info(s: Any) -> Iterable[Metric]:
    """vLLM's `lora_requests_info`: the adapters of the running and the waiting requests (sorted,
    comma-separated) and the slots, as labels of one gauge whose value is the scrape time; only
    with LoRA on. Dashboards read which adapters are hot and which wait for a slot."""
    if not s.max_loras:
        return
    info = GaugeMetricFamily(
        "tokenmill_lora_requests_info",
        "Running/waiting LoRA adapters and the slots (--max-loras).",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    info.add_metric([",".join(s.lora_running), ",".join(s.lora_waiting), str(s.max_loras)], time.time())
    yield info


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


class ServerMetrics:
    """All server metrics in their own registry (importing tokenmill never touches the global one)."""

    def __init__(self, engine: _StatsSource, endpoints: Iterable[str] = (), rate_window_s: float = 10.0) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenmill_requests_total", "Finished requests by outcome.", ["status", "endpoint"], registry=r
        )
        for endpoint in endpoints:  # export zeros up front so rate() and dashboards see every series
            for status in REQUEST_STATUSES:
                self.requests.labels(status=status, endpoint=endpoint)
        self.ttft = Histogram(
            "tokenmill_time_to_first_token_seconds",
            "Arrival to first generated token.",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "tokenmill_time_per_output_token_seconds",
            "Decode time per generated token after the first.",
            registry=r,
            buckets=_TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "tokenmill_e2e_request_latency_seconds", "Arrival to last token.", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.queue = Histogram(
            "tokenmill_request_queue_time_seconds", "Arrival to first scheduled.", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.prompt_tokens = Counter("tokenmill_prompt_tokens_total", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("tokenmill_generation_tokens_total", "Tokens generated.", registry=r)
        self.batch_size = Histogram(
            "tokenmill_batch_size", "Sequences per engine step.", registry=r, buckets=_BATCH_BUCKETS
        )
        self.token_rate = SlidingWindowRate(rate_window_s)
        tps = Gauge(
            "tokenmill_generation_tokens_per_second",
            f"Generated tokens per second over the last {rate_window_s:g}s.",
            registry=r,
        )
        tps.set_function(self.token_rate.rate)
        r.register(EngineStatsCollector(engine))

    def on_step(self, step: Any) -> None:
        """Engine step listener: runs on the engine thread (prometheus_client metrics are thread-safe)."""
        if step.batch_size > 0:
            self.batch_size.observe(step.batch_size)

    def on_tokens(self, count: int) -> None:
        """Tokens streamed out just now; feeds the tokens/s window as they happen, not at request end."""
        self.token_rate.add(count)

    def on_request_done(self, endpoint: str, status: str) -> None:
        self.requests.labels(status=status, endpoint=endpoint).inc()

    def on_engine_request_done(
        self, metrics: Any, prompt_tokens: int, completion_tokens: int, longest_choice: int
    ) -> None:
        """Stage histograms and token counters for one engine request (one prompt of a batch)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if metrics is None:
            return
        end = metrics.finished_time or time.time()
        if metrics.queue_time is not None:
            self.queue.observe(max(0.0, metrics.queue_time))
        if metrics.ttft is not None:
            self.ttft.observe(max(0.0, metrics.ttft))
            if longest_choice > 1:
                self.tpot.observe(max(0.0, end - metrics.first_token_time) / (longest_choice - 1))
        if metrics.finished_time is not None:
            self.e2e.observe(max(0.0, end - metrics.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
