"""Soak: steady load at 70% of measured capacity (long: 10 minutes, short: 30 s).

No errors at all, no memory growth trend (RSS sampled every 10 s, least-squares slope), and p99
latency of the last third of the run no worse than the first third's (within noise).
"""

from __future__ import annotations

import asyncio
import time

from server_fixtures import ServerProcess
from stress_lib import (
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

SAMPLE_EVERY_S = 10.0


def test_soak_at_70_percent_capacity(stress_server: ServerProcess, long_mode: bool) -> None:
    duration = 600.0 if long_mode else 30.0
    url = stress_server.base_url
    pid = stress_server.proc.pid
    capacity = asyncio.run(measure_capacity(url, concurrency=MAX_NUM_SEQS, duration_s=15 if long_mode else 6))
    # The short CI run offers 50%: its 6 s capacity probe is noisy on 2 shared cores, and a transient
    # 429 there would be back-pressure working, not a soak failure. Long mode is the real 70% soak.
    rate = (0.7 if long_mode else 0.5) * capacity
    samples: list[tuple[float, float]] = []

    async def run() -> list:
        start = time.monotonic()

        async def sampler() -> None:
            for _ in range(int(duration / SAMPLE_EVERY_S) + 2):  # bounded
                samples.append((time.monotonic() - start, rss_mb(pid)))
                await asyncio.sleep(SAMPLE_EVERY_S)

        task = asyncio.ensure_future(sampler())
        try:
            return await open_loop(url, int(rate * duration), rate, offset=200_000, max_duration_s=duration + 5)
        finally:
            samples.append((time.monotonic() - start, rss_mb(pid)))
            task.cancel()

    results = asyncio.run(asyncio.wait_for(run(), duration + 300))
    asyncio.run(wait_quiescent(url))
    outcomes = [o for _, o in results]
    c = counts(outcomes)
    results.sort(key=lambda r: r[0])
    third = max(1, len(results) // 3)
    first = p99([o.latency_s for _, o in results[:third]])
    last = p99([o.latency_s for _, o in results[-third:]])
    warm = [s for s in samples if s[0] >= 60.0] if long_mode else samples
    slope = slope_per_min(warm)
    record("soak", duration_s=duration, offered_rps=round(rate, 2), requests=len(outcomes), ok=c.get("ok", 0),
           errors=len(outcomes) - c.get("ok", 0), p99_first_third_s=round(first, 3), p99_last_third_s=round(last, 3),
           rss_first_mb=round(samples[0][1], 1), rss_last_mb=round(samples[-1][1], 1),
           rss_slope_mb_per_min=round(slope, 2), rss_samples=len(samples))
    bad = [o for o in outcomes if o.kind != "ok"]
    assert not bad, [(o.kind, o.status, o.detail) for o in bad[:5]]
    assert last <= max(2.0 * first, first + 1.0), (first, last)
    if long_mode:
        assert slope < 5.0, f"RSS grows {slope:.2f} MB/min after warm-up: {samples}"
    else:  # 30 s is too short for a trend; only bound the growth
        assert samples[-1][1] - samples[0][1] < 100, samples
