"""Open-loop load generator for OpenAI-compatible servers (`tokenmill bench serve`).

Requests go to `POST /v1/completions` with `stream: true`; each request's start, first content chunk,
later content chunks and end are timed to give TTFT, ITL, TPOT and end-to-end latency. Arrivals
follow a seeded Poisson process, so two servers driven with the same seed see the same trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np

from tokenmill.bench.sampling import GREEDY, Sampling, sampling_from_args

PERCENTILES: tuple[int, ...] = (50, 90, 99)
# ShareGPT entries shorter than this (in tokens) are dropped: tiny turns measure overhead, not decoding.
MIN_SHAREGPT_TOKENS = 4
# Synthetic output length when --output-len is not given (with --dataset it means "from the data").
SYNTHETIC_OUTPUT_LEN = 128
_HUMAN_ROLES = {"human", "user"}
_GPT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing"}


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the datasets need (tests pass a tiny stand-in)."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


# --------------------------------------------------------------------------------------------------
# Data model


@dataclass(frozen=True)
class BenchRequest:
    """One request of the trace. `prompt_len` is the tokenizer's count; a server's usage wins."""

    prompt: str
    output_len: int
    prompt_len: int | None = None


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


@dataclass(frozen=True)
class LatencyStats:
    """Mean and percentiles in milliseconds (NaN when there were no samples)."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def from_seconds(cls, values: Sequence[float]) -> LatencyStats:
        if len(values) == 0:
            return cls(math.nan, math.nan, math.nan, math.nan)
        ms = np.asarray(values, dtype=float) * 1000.0
        p = percentiles(ms, PERCENTILES)
        return cls(float(ms.mean()), p[50], p[90], p[99])


@dataclass
class BenchReport:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    total_input_tokens: int
    total_output_tokens: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    request_rate: float
    max_concurrency: int | None
    model: str | None
    # Prompt tokens the server answered from its prefix cache (usage.prompt_tokens_details), summed
    # over the requests that reported it; None when none did.
    cached_input_tokens: int | None = None
    errors: list[str] = field(default_factory=list)  # a few distinct messages, for diagnosis
    results: list[RequestResult] = field(default_factory=list, repr=False)

    def to_dict(self, per_request: bool = True) -> dict[str, Any]:
        """JSON-safe dict: inf becomes "inf" and NaN becomes None (strict JSON has neither)."""
        data = asdict(self)
        data.pop("results")
        if per_request:
            data["per_request"] = {
                "start_time_s": [r.start_time for r in self.results],
                "success": [r.success for r in self.results],
                "ttft_ms": [r.ttft * 1000 for r in self.results],
                "e2e_ms": [r.latency * 1000 for r in self.results],
                "output_tokens": [r.output_tokens for r in self.results],
                "prompt_tokens": [r.prompt_tokens for r in self.results],
                "cached_prompt_tokens": [r.cached_prompt_tokens for r in self.results],
            }
        return json_safe(data)


def json_safe(value: Any) -> Any:
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# --------------------------------------------------------------------------------------------------
# Math


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[float] = PERCENTILES) -> dict[Any, float]:
    """Linear-interpolated percentiles (numpy's default, as vLLM reports them)."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return dict.fromkeys(qs, math.nan)
    return {q: float(np.percentile(arr, q)) for q in qs}


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (s from start) of a Poisson process: exponential gaps with mean 1/rate.

    The first request goes at 0; rate inf sends everything at once.
    """
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 or inf, got {request_rate}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# --------------------------------------------------------------------------------------------------
# Datasets


def _sample_lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> list[int]:
    """Uniform integers in [mean*(1-r), mean*(1+r)], at least 1; exactly `mean` when r == 0."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def _fit_prompt(tokenizer: Tokenizer, rng: np.random.Generator, vocab: np.ndarray, length: int) -> tuple[str, int]:
    """Random-token text that re-encodes to about `length` tokens.

    Decoding then encoding merges or splits tokens, so the length drifts; truncate or top up a few
    times until it re-encodes to the target (or give up and report the real count).
    """
    ids: list[int] = rng.choice(vocab, size=length).tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for _ in range(4):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids = ids + rng.choice(vocab, size=length - len(ids)).tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def synthetic_requests(
    tokenizer: Tokenizer,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts of random vocabulary tokens (no special tokens), deterministic for a seed."""
    rng = np.random.default_rng(seed)
    in_lens = _sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _sample_lengths(rng, output_len, range_ratio, num_prompts)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
    requests = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        prompt, real_len = _fit_prompt(tokenizer, rng, vocab, n_in)
        requests.append(BenchRequest(prompt=prompt, output_len=n_out, prompt_len=real_len))
    return requests


def _first_exchange(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first human turn and the gpt turn answering it, or None if the entry has no such pair."""
    turns = entry.get("conversations") or entry.get("conversation") or []
    for i, turn in enumerate(turns):
        if str(turn.get("from", "")).lower() in _HUMAN_ROLES:
            for reply in turns[i + 1 :]:
                if str(reply.get("from", "")).lower() in _GPT_ROLES:
                    return str(turn.get("value", "")), str(reply.get("value", ""))
            return None
    return None


def load_sharegpt(
    path: str | Path,
    tokenizer: Tokenizer,
    num_prompts: int | None,
    seed: int = 0,
    output_len: int | None = None,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """Requests from a ShareGPT-style JSON list, shuffled with `seed`.

    The output length is the gpt turn's token count unless `output_len` fixes it; pairs shorter than
    MIN_SHAREGPT_TOKENS, or longer than `max_model_len` in total, are skipped.
    """
    entries = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of {{'conversations': [...]}} entries")
    pairs = [p for p in (_first_exchange(e) for e in entries if isinstance(e, dict)) if p is not None]
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, completion in pairs:
        if num_prompts is not None and len(requests) >= num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out_len = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
        if prompt_len < MIN_SHAREGPT_TOKENS or out_len < MIN_SHAREGPT_TOKENS:
            continue
        if max_model_len is not None and prompt_len + out_len > max_model_len:
            continue
        requests.append(BenchRequest(prompt=prompt, output_len=out_len, prompt_len=prompt_len))
    if not requests:
        raise ValueError(f"{path}: no usable human/gpt conversation pairs")
    return requests


def load_tokenizer(path: str | Path | None) -> Any:
    """A Hugging Face tokenizer from a model directory; None means the bundled default model."""
    from transformers import AutoTokenizer

    from tokenmill.models.model_loader.hub import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(path))


# --------------------------------------------------------------------------------------------------
# Client


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


def build_report(
    results: Sequence[RequestResult],
    duration: float,
    request_rate: float,
    max_concurrency: int | None,
    model: str | None,
) -> BenchReport:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else math.nan
    errors = list(dict.fromkeys(r.error for r in results if not r.success))[:5]
    cached = [r.cached_prompt_tokens for r in ok if r.cached_prompt_tokens is not None]
    return BenchReport(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) * per_s,
        output_throughput=out_tokens * per_s,
        total_token_throughput=(in_tokens + out_tokens) * per_s,
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        ttft=LatencyStats.from_seconds([r.ttft for r in ok]),
        tpot=LatencyStats.from_seconds([t for r in ok if (t := r.tpot) is not None]),
        itl=LatencyStats.from_seconds([x for r in ok for x in r.itl]),
        e2e=LatencyStats.from_seconds([r.latency for r in ok]),
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        model=model,
        cached_input_tokens=sum(cached) if cached else None,
        errors=errors,
        results=list(results),
    )


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


# --------------------------------------------------------------------------------------------------
# Output: table, JSON, plot

# (label, value getter, format) rows of the printed table; compare reuses them.
METRIC_ROWS: list[tuple[str, Callable[[BenchReport], float], str]] = [
    ("Successful requests", lambda r: r.completed, "{:.0f}"),
    ("Failed requests", lambda r: r.failed, "{:.0f}"),
    ("Benchmark duration (s)", lambda r: r.duration_s, "{:.2f}"),
    ("Total input tokens", lambda r: r.total_input_tokens, "{:.0f}"),
    (
        "Input tokens from the server's cache",
        lambda r: "-" if r.cached_input_tokens is None else r.cached_input_tokens,
        "{}",
    ),
    ("Total output tokens", lambda r: r.total_output_tokens, "{:.0f}"),
    ("Request throughput (req/s)", lambda r: r.request_throughput, "{:.2f}"),
    ("Output token throughput (tok/s)", lambda r: r.output_throughput, "{:.2f}"),
    ("Total token throughput (tok/s)", lambda r: r.total_token_throughput, "{:.2f}"),
]


def _latency_rows() -> list[tuple[str, Callable[[BenchReport], float], str]]:
    rows = []
    for name, attr in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2e")):
        for stat in ("mean", "p50", "p90", "p99"):
            label = f"{'Mean' if stat == 'mean' else stat.upper()} {name} (ms)"
            rows.append((label, lambda r, a=attr, s=stat: getattr(getattr(r, a), f"{s}_ms"), "{:.2f}"))
    return rows


METRIC_ROWS += _latency_rows()


def format_grid(table: Sequence[Sequence[str]], title: str | None = None) -> str:
    """A plain-text table of a header row and rows of cells: the first column left-aligned, the
    others right-aligned, between rules (every benchmark prints its results this way)."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]

    def line(cells: Sequence[str]) -> str:
        padded = (c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded)

    rule = "-" * len(line(table[0]))
    head = [rule, title, rule] if title else [rule]
    return "\n".join([*head, line(table[0]), rule, *(line(r) for r in table[1:]), rule])


def format_table(columns: Mapping[str, BenchReport], extra_rows: Sequence[tuple[str, Sequence[str]]] = ()) -> str:
    """One row per metric, one column per report."""
    rows = [[label, *(fmt.format(get(rep)) for rep in columns.values())] for label, get, fmt in METRIC_ROWS]
    rows += [[label, *values] for label, values in extra_rows]
    return format_grid([["Metric", *columns.keys()], *rows])


def write_json(path: str | Path, data: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


def plot_reports(reports: Mapping[str, BenchReport], path: str | Path, title: str = "tokenmill bench serve") -> None:
    """Histograms and CDFs of TTFT and e2e latency, plus throughput bars, one colour per report."""
    # The object API with an explicit Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3)
    for col, (attr, label) in enumerate((("ttft", "TTFT"), ("latency", "E2E latency"))):
        samples = {
            name: np.array([getattr(r, attr) * 1000 for r in rep.results if r.success]) for name, rep in reports.items()
        }
        pooled = np.concatenate(list(samples.values()) + [np.zeros(0)])
        # Shared bin edges so the reports' histograms are directly comparable.
        bins = np.histogram_bin_edges(pooled, bins=min(30, max(5, pooled.size // 4))) if pooled.size else 10
        for name, ms in samples.items():
            if ms.size == 0:
                continue
            axes[0, col].hist(ms, bins=bins, alpha=0.55, label=name)
            axes[1, col].step(np.sort(ms), np.arange(1, ms.size + 1) / ms.size, where="post", label=name)
        axes[0, col].set(title=f"{label} histogram", xlabel="ms", ylabel="requests")
        axes[1, col].set(title=f"{label} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
            ax.legend()
    names = list(reports)
    throughputs = (("output_throughput", "Output tokens/s"), ("request_throughput", "Requests/s"))
    for row, (attr, label) in enumerate(throughputs):
        ax = axes[row, 2]
        values = [getattr(reports[n], attr) for n in names]
        bars = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
        ax.bar_label(bars, fmt="%.2f")
        ax.set(title=label, ylabel=label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------------
# CLI glue (flags are defined in tokenmill.cli.bench)


def requests_from_args(args: argparse.Namespace, tokenizer: Tokenizer) -> list[BenchRequest]:
    """The request trace the workload flags describe: a ShareGPT file if --dataset, else synthetic."""
    if args.dataset:
        return load_sharegpt(args.dataset, tokenizer, args.num_prompts, seed=args.seed, output_len=args.output_len)
    return synthetic_requests(
        tokenizer,
        args.num_prompts,
        args.input_len,
        args.output_len or getattr(args, "synthetic_output_len", SYNTHETIC_OUTPUT_LEN),
        range_ratio=args.range_ratio,
        seed=args.seed,
    )


def warmup_requests(requests: Sequence[BenchRequest], count: int) -> list[BenchRequest]:
    """Untimed requests shaped like the trace's first `count`, with their prompts reversed: sending
    the trace's own prompts first would let a server's prefix cache answer them in the timed run."""
    return [BenchRequest(prompt=r.prompt[::-1], output_len=r.output_len) for r in requests[:count]]


def tokenizer_dir_from_args(args: argparse.Namespace) -> str | None:
    """--tokenizer, else --model when it is a local directory, else None (the bundled default)."""
    if args.tokenizer:
        return args.tokenizer
    model = getattr(args, "model", None)
    if model and Path(model).expanduser().is_dir():
        return model
    return None


def describe_trace(requests: Sequence[BenchRequest], request_rate: float, max_concurrency: int | None) -> str:
    in_lens = [r.prompt_len or 0 for r in requests]
    out_lens = [r.output_len for r in requests]
    return (
        f"{len(requests)} requests, prompt tokens {min(in_lens)}-{max(in_lens)}, "
        f"output tokens {min(out_lens)}-{max(out_lens)}, rate {request_rate} req/s, "
        f"max concurrency {max_concurrency or 'unbounded'}"
    )


def main(args: argparse.Namespace) -> int:
    """`tokenmill bench serve`: benchmark the server at --url and print/write the report."""
    tokenizer = load_tokenizer(tokenizer_dir_from_args(args))
    requests = requests_from_args(args, tokenizer)
    print(
        f"{describe_trace(requests, args.request_rate, args.max_concurrency)}; {sampling_from_args(args).describe()}",
        file=sys.stderr,
    )
    report = asyncio.run(
        run_benchmark(
            args.url,
            requests,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            model_name=args.model if args.model and not Path(args.model).expanduser().is_dir() else None,
            sampling=sampling_from_args(args),
        )
    )
    print(format_table({report.model or "server": report}))
    if report.cached_input_tokens:
        share = report.cached_input_tokens / max(report.total_input_tokens, 1)
        print(
            f"note: the server answered {report.cached_input_tokens} of the {report.total_input_tokens} prompt tokens "
            f"({share:.1%}) from its prefix cache: it had seen these prompts, or their beginnings, before this run "
            "(a server that served the same trace earlier skips their prefill)",
            file=sys.stderr,
        )
    for err in report.errors:
        print(f"error: {err}", file=sys.stderr)
    if args.json:
        write_json(args.json, report.to_dict())
    if args.plot:
        plot_reports({report.model or "server": report}, args.plot, title=f"tokenmill bench serve: {args.url}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if report.completed > 0 else 1
