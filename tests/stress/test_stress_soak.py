"""Soak: steady load at 70% of measured capacity (long: 10 minutes, short: 30 s).

Its own server, whose queue (`--max-queue 512`) is deep enough that a passing dip in the machine's
speed turns into queueing, not 429s: the overload test is where refusals are checked. Required:

* no errors at all (every request a whole stream);
* no memory growth trend (RSS sampled every 10 s, least-squares slope after warm-up);
* no slowdown of the server itself: its CPU time per completed request in the last third of the
  run within 25% of the first third's (CPU time, unlike latency, does not grow when the VM's
  hypervisor steals cycles);
* stable latency: p99 of the last third of the requests within max(2x, +1 s) of the first
  third's, judged only when the machine's CPU steal stayed level (within 5 points) between those
  thirds. On a shared VM steal can rise 30% for minutes, and a 70%-loaded queue then grows no
  matter what the server does; the steal figures are reported either way.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.stress.stress_lib import (
    MAX_NUM_SEQS,
    counts,
    measure_capacity,
    open_loop,
    p99,
    record,
    rss_mb,
    slope_per_min,
    wait_quiescent,
)
from tests.utils.server import ServerProcess

SAMPLE_EVERY_S = 10.0
SOAK_QUEUE = 512


@pytest.fixture(scope="module")
def soak_server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tiny_model_dir, server_log_dir, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", str(SOAK_QUEUE)
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def machine_cpu_times() -> tuple[float, float]:
    """(steal, total) CPU seconds of the whole machine since boot (/proc/stat via psutil)."""
    t = psutil.cpu_times()
    return getattr(t, "steal", 0.0), sum(t)


def steal_fraction(a: tuple[float, float], b: tuple[float, float]) -> float:
    return (b[0] - a[0]) / max(b[1] - a[1], 1e-9)


@pytest.mark.slow
def test_soak_at_70_percent_capacity(soak_server: ServerProcess, long_mode: bool) -> None:
    duration = 600.0 if long_mode else 30.0
    url = soak_server.base_url
    server = psutil.Process(soak_server.proc.pid)
    capacity = asyncio.run(measure_capacity(url, concurrency=MAX_NUM_SEQS, duration_s=15 if long_mode else 6))
    # The short CI run offers 50%: its 6 s capacity probe is noisy on 2 shared cores. Long mode is
    # the real 70% soak.
    rate = (0.7 if long_mode else 0.5) * capacity
    # (seconds since start, server RSS MB, server CPU seconds, machine (steal, total) CPU seconds)
    samples: list[tuple[float, float, float, tuple[float, float]]] = []

    def sample(start: float) -> None:
        cpu = server.cpu_times()
        samples.append((time.monotonic() - start, rss_mb(server.pid), cpu.user + cpu.system, machine_cpu_times()))

    async def run() -> list:
        start = time.monotonic()

        async def sampler() -> None:
            for _ in range(int(duration / SAMPLE_EVERY_S) + 2):  # bounded
                sample(start)
                await asyncio.sleep(SAMPLE_EVERY_S)

        task = asyncio.ensure_future(sampler())
        try:
            return await open_loop(url, int(rate * duration), rate, offset=200_000, max_duration_s=duration + 5)
        finally:
            sample(start)
            task.cancel()

    results = asyncio.run(asyncio.wait_for(run(), duration + 300))
    asyncio.run(wait_quiescent(url))
    outcomes = [o for _, o in results]
    c = counts(outcomes)
    results.sort(key=lambda r: r[0])
    third = max(1, len(results) // 3)
    first = p99([o.latency_s for _, o in results[:third]])
    last = p99([o.latency_s for _, o in results[-third:]])

    # Per-third machine steal and server CPU per request, from the samples nearest the thirds' edges.
    def at(t: float):
        return min(samples, key=lambda s: abs(s[0] - t))

    edges = [at(0.0), at(duration / 3), at(2 * duration / 3), at(duration)]
    per_third = max(1.0, rate * duration / 3)
    steal = [steal_fraction(edges[i][3], edges[i + 1][3]) for i in range(3)]
    cpu_per_request = [(edges[i + 1][2] - edges[i][2]) / per_third for i in range(3)]
    warm = [(s[0], s[1]) for s in samples if s[0] >= 60.0] if long_mode else [(s[0], s[1]) for s in samples]
    slope = slope_per_min(warm)
    steady = steal[2] - steal[0] <= 0.05
    record(
        "soak",
        duration_s=duration,
        offered_rps=round(rate, 2),
        requests=len(outcomes),
        ok=c.get("ok", 0),
        errors=len(outcomes) - c.get("ok", 0),
        p99_first_third_s=round(first, 3),
        p99_last_third_s=round(last, 3),
        cpu_steal_by_third=[round(s, 3) for s in steal],
        server_cpu_s_per_request_by_third=[round(x, 4) for x in cpu_per_request],
        latency_judged=steady,
        rss_first_mb=round(samples[0][1], 1),
        rss_last_mb=round(samples[-1][1], 1),
        rss_slope_mb_per_min=round(slope, 2),
        rss_samples=len(samples),
    )
    bad = [o for o in outcomes if o.kind != "ok"]
    assert not bad, [(o.kind, o.status, o.detail) for o in bad[:5]]
    if long_mode:  # 30 s is too short for a trend or per-third CPU figures; only bound the growth
        assert slope < 5.0, f"RSS grows {slope:.2f} MB/min after warm-up: {samples}"
        assert cpu_per_request[2] <= 1.25 * cpu_per_request[0], cpu_per_request
    else:
        assert samples[-1][1] - samples[0][1] < 100, samples
    if steady:
        assert last <= max(2.0 * first, first + 1.0), (first, last, steal)
    else:
        warnings.warn(
            f"soak latency not judged: CPU steal rose from {steal[0]:.0%} to {steal[2]:.0%} "
            f"(p99 {first:.2f} s -> {last:.2f} s)",
            stacklevel=1,
        )
