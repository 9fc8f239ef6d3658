"""`bench serve`'s HTTP client: one streaming `POST /v1/completions` per request, its start, first
content chunk, later chunks and end timed."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.sampling import GREEDY, Sampling
from tokenmill.bench.serve.workload import BenchRequest


@dataclass
class RequestResult:
    """Timings of one request, in seconds; `start_time` is relative to the benchmark start."""

    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int | None = None  # from the server's prefix cache, as its usage says (None: not said)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; undefined for single-token outputs."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def completions_url(url: str) -> str:
    """Accept a server base URL, a .../v1 URL or the full completions endpoint."""
    url = url.rstrip("/")
    if url.endswith("/v1/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/completions"
    return url + "/v1/completions"


def _base_url(url: str) -> str:
    url = completions_url(url)
    return url[: -len("/v1/completions")]


def _sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for comments, blank lines and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


async def discover_model(client: httpx.AsyncClient, url: str) -> str | None:
    """The first model id from GET /v1/models, or None when the server does not list any."""
    try:
        resp = await client.get(_base_url(url) + "/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _payload(request: BenchRequest, model: str | None, sampling: Sampling = GREEDY) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        **sampling.request_fields(),
        "stream": True,
        "stream_options": {"include_usage": True},
        # Exact output lengths make runs comparable across servers and seeds.
        "ignore_eos": True,
    }
    if model:
        payload["model"] = model
    return payload


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    request: BenchRequest,
    model: str | None,
    t0: float,
    sampling: Sampling = GREEDY,
) -> RequestResult:
    """Stream one completion and time it; errors are recorded, never raised."""
    result = RequestResult(prompt_tokens=request.prompt_len or 0)
    start = time.perf_counter()
    result.start_time = start - t0
    try:
        await _stream_into(client, url, _payload(request, model, sampling), result, start)
    except Exception as exc:
        result.success = False
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The response's lines as an event stream ends them (LF or CR LF). Not httpx's aiter_lines: it
    also cuts at U+2028, U+0085 and the other breaks of str.splitlines, which JSON leaves raw inside
    strings (sampled text holds them: one of 128 sampled vLLM replies broke a run)."""
    pending = ""
    async for text in resp.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


async def _stream_into(
    client: httpx.AsyncClient, url: str, payload: dict[str, Any], result: RequestResult, start: float
) -> None:
    chunks = 0
    last = start
    usage_tokens: int | None = None
    done = False
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            result.error = f"HTTP {resp.status_code}: {body[:200]}"
            return
        async for line in _sse_lines(resp):
            data = _sse_data(line)
            if not data:
                continue
            if data == "[DONE]":
                done = True
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if chunk.get("error"):
                result.error = f"server error: {chunk['error']}"
                return
            usage = chunk.get("usage") or {}
            if usage.get("completion_tokens") is not None:
                usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                result.prompt_tokens = int(usage["prompt_tokens"])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                result.cached_prompt_tokens = int(cached)
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
    result.latency = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if not done:
        result.error = "stream ended before data: [DONE]"
    elif chunks == 0:
        result.error = "stream had no text chunks"  # TTFT would be undefined
    else:
        result.success = True
