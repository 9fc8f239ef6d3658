"""Overload: fire at 4x the measured capacity at a server with --max-queue 16.

The server must stay up with bounded memory and answer every request either with a whole stream
or a clean 429; nothing may be lost (a 5xx, a hang, a cut or duplicated stream).
"""

from __future__ import annotations

import asyncio

from tests.stress.stress_lib import (
    MAX_NUM_SEQS,
    counts,
    measure_capacity,
    open_loop,
    record,
    rss_mb,
    scrape_once,
    wait_quiescent,
)
from tests.utils.server import ServerProcess

RSS_GROWTH_LIMIT_MB = 300


def test_overload_at_4x_capacity(stress_server: ServerProcess, long_mode: bool) -> None:
    n = 1000 if long_mode else 200
    url = stress_server.base_url
    pid = stress_server.proc.pid
    capacity = asyncio.run(measure_capacity(url, concurrency=MAX_NUM_SEQS, duration_s=15 if long_mode else 6))
    rss_before = rss_mb(pid)
    before = scrape_once(url)
    rate = 4 * capacity
    results = asyncio.run(open_loop(url, n, rate, offset=0))
    outcomes = [o for _, o in results]
    c = counts(outcomes)
    assert stress_server.proc.poll() is None, "server died under overload"
    after = asyncio.run(wait_quiescent(url))
    rss_after = rss_mb(pid)
    lost = [o for o in outcomes if o.kind not in ("ok", "refused")]
    record(
        "overload",
        requests_sent=len(outcomes),
        served=c.get("ok", 0),
        refused_429=c.get("refused", 0),
        lost=len(lost),
        capacity_rps=round(capacity, 2),
        offered_rps=round(rate, 2),
        rss_before_mb=round(rss_before, 1),
        rss_after_mb=round(rss_after, 1),
    )
    assert len(outcomes) == n
    assert not lost, f"{len(lost)} lost, e.g. {[(o.kind, o.status, o.detail) for o in lost[:5]]}"
    assert c.get("ok", 0) > 0 and c.get("refused", 0) > 0, c  # 4x capacity must hit the queue limit
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_MB, (rss_before, rss_after)

    # The server's own books agree with what the clients saw.
    def delta(endpoint: str, status: str) -> float:
        key = f'tokenmill_requests_total{{endpoint="{endpoint}",status="{status}"}}'
        return after[key] - before[key]

    for status, expected in (("ok", c.get("ok", 0)), ("rejected", c.get("refused", 0)), ("error", 0)):
        assert delta("/v1/completions", status) + delta("/v1/chat/completions", status) == expected, status
