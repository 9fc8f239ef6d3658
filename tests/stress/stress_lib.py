"""Shared pieces of the stress suite: load clients that check every stream, capacity, RSS, metrics.

Everything talks to 127.0.0.1 only, and every loop is bounded both in count and in time.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from tests.utils.server import parse_metrics

# Figures of the run, printed at the end of the session (and written to $TOKENMILL_STRESS_REPORT).
REPORT: dict[str, dict[str, Any]] = {}

MAX_NUM_SEQS = 8  # the stress server's batch (--max-num-seqs)
MAX_QUEUE = 16  # ... and how many more may wait (--max-queue)
MAX_TOKENS = 8  # every load request asks for exactly this many tokens (ignore_eos): counts are exact
REQUEST_TIMEOUT_S = 120.0


def record(section: str, **figures: Any) -> None:
    REPORT.setdefault(section, {}).update(figures)


# ---------------------------------------------------------------------------------------------- bodies


def completion_body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
        "logprobs": 0,
        "stream_options": {"include_usage": True},
    }


def chat_body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 0,
        "stream_options": {"include_usage": True},
    }


def load_request(i: int, max_tokens: int = MAX_TOKENS) -> tuple[str, dict[str, Any]]:
    """The i-th request of a load run: completions and chat alternate, prompts vary a little."""
    rng = random.Random(i)
    prompt = " ".join(
        rng.choice(["tell", "me", "about", "the", "river", "mill", "stone", "water", "grain"])
        for _ in range(rng.randint(3, 24))
    )
    if i % 2:
        return "/v1/chat/completions", chat_body(prompt, max_tokens)
    return "/v1/completions", completion_body(prompt, max_tokens)


# ---------------------------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    kind: str  # ok | refused (429) | draining (503) | unreachable (connection refused) | lost
    detail: str = ""
    status: int | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    started: bool = False  # the stream's first event arrived
    payloads: list[str] = field(default_factory=list)


def check_error_body(text: str, status: int) -> str | None:
    """None if `text` is the OpenAI error shape, else what is wrong with it."""
    try:
        body = json.loads(text)
    except ValueError:
        return f"{status}: body is not JSON: {text[:200]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(body) != {"error"}:
        return f"{status}: not an OpenAI error body: {text[:200]!r}"
    if not isinstance(err.get("message"), str) or not err["message"] or not isinstance(err.get("type"), str):
        return f"{status}: error without message/type: {text[:200]!r}"
    if "Traceback" in err["message"]:
        return f"{status}: traceback leaked: {text[:200]!r}"
    return None


def check_stream(path: str, payloads: list[str], max_tokens: int) -> str | None:
    """None if the SSE payloads are one whole stream, else the first problem found.

    Whole = ends with exactly one [DONE]; one id throughout; exactly one finish_reason, on the last
    choice chunk; token count (logprobs entries, one per token) == usage.completion_tokens == max_tokens;
    for completions the text offsets are contiguous, so a repeated or dropped chunk is caught.
    """
    if not payloads or payloads[-1] != "[DONE]":
        return f"stream cut short ({len(payloads)} events, last {payloads[-1][:80] if payloads else None!r})"
    if payloads.count("[DONE]") != 1:
        return "more than one [DONE]"
    try:
        chunks = [json.loads(p) for p in payloads[:-1]]
    except ValueError as exc:
        return f"undecodable event: {exc}"
    if any("error" in c for c in chunks):
        return f"in-band error: {next(c for c in chunks if 'error' in c)}"
    if len({c.get("id") for c in chunks}) != 1:
        return "chunks carry different ids"
    usage_chunks = [c for c in chunks if c.get("usage")]
    if len(usage_chunks) != 1 or chunks[-1] is not usage_chunks[0] or chunks[-1]["choices"]:
        return "usage must come once, in the last chunk, with no choices"
    choice_chunks = list(chunks[:-1])
    tokens = finishes = 0
    offset = 0
    chat = path.endswith("chat/completions")
    for n, c in enumerate(choice_chunks):
        if len(c["choices"]) != 1 or c["choices"][0]["index"] != 0:
            return f"chunk {n}: unexpected choices {c['choices']}"
        ch = c["choices"][0]
        if finishes:
            return f"chunk {n} after the finish_reason chunk"
        if ch.get("finish_reason") is not None:
            finishes += 1
            if ch["finish_reason"] != "length":
                return f"finish_reason {ch['finish_reason']!r} (ignore_eos + max_tokens must end on length)"
        lp = ch.get("logprobs")
        if chat:
            if n == 0:
                if ch["delta"].get("role") != "assistant":
                    return "chat stream does not open with the assistant role"
                continue
            tokens += len(lp["content"]) if lp else 0
        elif lp:
            for tok, off in zip(lp["tokens"], lp["text_offset"]):
                if off != offset:
                    return f"text offsets jump at token {tokens} ({off} != {offset}): duplicated or lost chunk"
                offset += len(tok)
                tokens += 1
    if finishes != 1:
        return f"{finishes} finish_reason chunks"
    usage = usage_chunks[0]["usage"]["completion_tokens"]
    if not tokens == usage == max_tokens:
        return f"token count {tokens}, usage.completion_tokens {usage}, max_tokens {max_tokens}"
    return None


async def stream_request(
    client: httpx.AsyncClient,
    base_url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
) -> Outcome:
    """One streaming request, classified; never raises (a hang past `timeout` is `lost`)."""
    start = time.monotonic()
    out = Outcome("lost")

    async def run() -> bool:  # True: got a stream to check
        async with client.stream("POST", base_url + path, json=body, headers=headers) as r:
            out.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                problem = check_error_body(text, r.status_code)
                if problem:
                    out.detail = problem
                elif r.status_code == 429:
                    out.kind = "refused"
                elif r.status_code == 503:
                    out.kind = "draining"
                else:
                    out.detail = f"HTTP {r.status_code}: {text[:200]}"
                return False
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    if not out.started:
                        out.started, out.ttft_s = True, time.monotonic() - start
                    out.payloads.append(line[6:])
                    if line == "data: [DONE]":
                        break
            return True

    try:
        if not await asyncio.wait_for(run(), timeout):
            return out
        problem = check_stream(path, out.payloads, body["max_tokens"])
        if problem:
            out.detail = problem
        else:
            out.kind = "ok"
    except httpx.ConnectError as exc:
        out.kind, out.detail = "unreachable", str(exc)
    except asyncio.TimeoutError:
        out.detail = f"timed out after {timeout}s"
    except httpx.HTTPError as exc:
        out.detail = f"{type(exc).__name__}: {exc}"
    finally:
        out.latency_s = time.monotonic() - start
    return out


def new_client(max_connections: int = 512, keepalive: bool = True) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64 if keepalive else 0)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0))


# ---------------------------------------------------------------------------------------------- load shapes


async def measure_capacity(base_url: str, concurrency: int, duration_s: float, max_requests: int = 400) -> float:
    """Completed requests per second of a closed loop (`concurrency` clients back to back)."""
    done: list[Outcome] = []
    counter = iter(range(max_requests))
    async with new_client() as client:
        deadline = time.monotonic() + duration_s
        start = time.monotonic()

        async def worker() -> None:
            for i in counter:
                if time.monotonic() > deadline:
                    return
                path, body = load_request(100_000 + i)
                done.append(await stream_request(client, base_url, path, body))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - start
    bad = [o for o in done if o.kind != "ok"]
    assert not bad, f"capacity probe failed: {bad[0].kind} {bad[0].detail}"
    return len(done) / elapsed


async def open_loop(
    base_url: str,
    count: int,
    rate: float,
    max_tokens: int = MAX_TOKENS,
    offset: int = 0,
    max_duration_s: float | None = None,
) -> list[tuple[float, Outcome]]:
    """Fire `count` requests at a fixed `rate` (req/s) regardless of responses; (send time, outcome) each."""
    results: list[tuple[float, Outcome]] = []
    async with new_client() as client:
        start = time.monotonic()
        tasks = []

        async def one(i: int) -> None:
            sent = time.monotonic() - start
            path, body = load_request(offset + i, max_tokens)
            results.append((sent, await stream_request(client, base_url, path, body)))

        for i in range(count):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if max_duration_s is not None and time.monotonic() - start > max_duration_s:
                break
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
    return results


# ---------------------------------------------------------------------------------------------- server facts


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


async def scrape(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    return parse_metrics((await client.get(base_url + "/metrics", timeout=10.0)).text)


def scrape_once(base_url: str) -> dict[str, float]:
    async def go() -> dict[str, float]:
        async with new_client() as client:
            return await scrape(client, base_url)

    return asyncio.run(go())


async def wait_quiescent(base_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks; fails with the last scrape."""
    async with new_client() as client:
        deadline = time.monotonic() + timeout_s
        m: dict[str, float] = {}
        while time.monotonic() < deadline:
            m = await scrape(client, base_url)
            if (
                m["tokenmill_kv_cache_usage_ratio"] == 0
                and m["tokenmill_num_requests_running"] == 0
                and m["tokenmill_num_requests_waiting"] == 0
            ):
                return m
            await asyncio.sleep(0.2)
    raise AssertionError(
        f"server did not return to idle within {timeout_s}s: "
        f"kv={m.get('tokenmill_kv_cache_usage_ratio')} running={m.get('tokenmill_num_requests_running')} "
        f"waiting={m.get('tokenmill_num_requests_waiting')}"
    )


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) samples, in MB per minute."""
    if len(samples) < 2:
        return 0.0
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    c: dict[str, int] = {}
    for o in outcomes:
        c[o.kind] = c.get(o.kind, 0) + 1
    return c
