"""`bench serve`'s open-loop driver: requests sent at their arrival times whatever the server's pace,
at most `max_concurrency` in flight."""

from __future__ import annotations

import asyncio
import math
import time

import httpx

from tokenmill.bench.sampling import GREEDY, Sampling
from tokenmill.bench.serve.client import RequestResult, completions_url, discover_model, send_request
from tokenmill.bench.serve.report import BenchReport, build_report
from tokenmill.bench.serve.workload import BenchRequest, arrival_offsets


async def run_benchmark(
    url: str,
    requests: list[BenchRequest],
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    model_name: str | None = None,
    progress: bool = True,
    sampling: Sampling = GREEDY,
) -> BenchReport:
    """Drive `url` with `requests` at Poisson arrivals (open loop), at most `max_concurrency` in flight.

    Arrival times are fixed up front, so a slow server does not slow the offered load; requests that
    arrive while `max_concurrency` are in flight wait for a slot (that wait is not part of TTFT).
    """
    from tqdm.auto import tqdm

    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max concurrency must be >= 1, got {max_concurrency}")
    endpoint = completions_url(url)
    offsets = arrival_offsets(len(requests), request_rate, seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # No read timeout: a queued request may legitimately wait minutes for its first byte.
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = model_name or await discover_model(client, url)
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
        t0 = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            if slots is None:
                result = await send_request(client, endpoint, request, model, t0, sampling)
            else:
                async with slots:
                    result = await send_request(client, endpoint, request, model, t0, sampling)
            bar.update()
            return result

        try:
            results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        finally:
            bar.close()
        duration = time.perf_counter() - t0
    return build_report(results, duration, request_rate, max_concurrency, model)
