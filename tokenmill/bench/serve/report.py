"""`bench serve`'s report: throughput and TTFT/TPOT/ITL/e2e statistics of a run, as a table, JSON
and plots."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.report import LatencyStats, format_grid, json_safe
from tokenmill.bench.serve.client import RequestResult


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


# (label, value getter, format) rows of the printed table; compare reuses them.
MetricRow = tuple[str, Callable[[BenchReport], float | str], str]
METRIC_ROWS: list[MetricRow] = [
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


def _latency_rows() -> list[MetricRow]:
    rows: list[MetricRow] = []
    for name, attr in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E latency", "e2e")):
        for stat in ("mean", "p50", "p90", "p99"):
            label = f"{'Mean' if stat == 'mean' else stat.upper()} {name} (ms)"
            rows.append((label, operator.attrgetter(f"{attr}.{stat}_ms"), "{:.2f}"))
    return rows


METRIC_ROWS += _latency_rows()


def format_table(columns: Mapping[str, BenchReport], extra_rows: Sequence[tuple[str, Sequence[str]]] = ()) -> str:
    """One row per metric, one column per report."""
    rows = [[label, *(fmt.format(get(rep)) for rep in columns.values())] for label, get, fmt in METRIC_ROWS]
    rows += [[label, *values] for label, values in extra_rows]
    return format_grid([["Metric", *columns.keys()], *rows])


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
