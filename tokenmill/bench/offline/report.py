"""`bench offline`'s output: the runs side by side, the concurrency sweep as a table and a plot, and
the greedy agreement of two runs' tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.offline.runners import RunResult
from tokenmill.bench.report import format_cell, format_grid


def greedy_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, float]:
    """Per request, compare the first min(len) tokens: the fraction of requests that match exactly,
    and the mean fraction of tokens before the first difference."""
    exact, prefix = 0, []
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        same = next((k for k in range(n) if x[k] != y[k]), n)
        exact += same == n
        prefix.append(same / n if n else 1.0)
    count = len(prefix)
    return {
        "requests": count,
        "exact_match_fraction": exact / count if count else math.nan,
        "mean_matching_prefix_fraction": float(np.mean(prefix)) if count else math.nan,
    }


def format_runs(runs: Sequence[RunResult]) -> str:
    rows: list[tuple[str, str, Any]] = [
        ("Requests", "d", lambda r: r.num_requests),
        ("Prompt tokens", "d", lambda r: r.prompt_tokens),
        ("Prompt tokens from the prefix cache", "d", lambda r: r.cached_prompt_tokens),
        ("Useful output tokens", "d", lambda r: r.output_tokens),
        (
            "Generated tokens (incl. padding)",
            "d",
            lambda r: r.generated_tokens if r.generated_tokens is not None else r.output_tokens,
        ),
        ("Padding waste (%)", ".1f", lambda r: None if r.padding_waste is None else r.padding_waste * 100),
        ("Total time (s)", ".2f", lambda r: r.duration_s),
        ("Useful output tok/s", ".1f", lambda r: r.output_throughput),
        ("Requests/s", ".3f", lambda r: r.request_throughput),
        ("Mean latency (s)", ".2f", lambda r: r.latency.mean_ms / 1e3),
        ("P50 latency (s)", ".2f", lambda r: r.latency.p50_ms / 1e3),
        ("P99 latency (s)", ".2f", lambda r: r.latency.p99_ms / 1e3),
        ("Mean TTFT (s)", ".3f", lambda r: r.ttft.mean_ms / 1e3),
        ("P50 TTFT (s)", ".3f", lambda r: r.ttft.p50_ms / 1e3),
        ("P99 TTFT (s)", ".3f", lambda r: r.ttft.p99_ms / 1e3),
    ]
    table = [["Metric", *(r.name for r in runs)]]
    table += [[label, *(format_cell(get(r), spec) for r in runs)] for label, spec, get in rows]
    return format_grid(table)


def format_sweep(runs: Sequence[RunResult]) -> str:
    table = [["concurrency", "mean latency (s)", "p99 latency (s)", "mean TTFT (s)", "p99 TTFT (s)", "output tok/s"]]
    for r in runs:
        table.append(
            [
                str(r.max_num_seqs),
                format_cell(r.latency.mean_ms / 1e3, ".2f"),
                format_cell(r.latency.p99_ms / 1e3, ".2f"),
                format_cell(r.ttft.mean_ms / 1e3, ".3f"),
                format_cell(r.ttft.p99_ms / 1e3, ".3f"),
                format_cell(r.output_throughput, ".1f"),
            ]
        )
    return format_grid(table, title="Concurrency sweep (max_num_seqs)")


def plot_sweep(runs: Sequence[RunResult], path: str | Path, title: str = "tokenmill bench offline --sweep") -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    conc = [r.max_num_seqs for r in runs]
    fig = Figure(figsize=(11, 4.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax_tp, ax_lat = fig.subplots(1, 2)
    ax_tp.plot(conc, [r.output_throughput for r in runs], "o-")
    ax_tp.set(title="Output tokens/s vs concurrency", xlabel="max_num_seqs", ylabel="output tok/s", xscale="log")
    ax_lat.plot(conc, [r.latency.mean_ms / 1e3 for r in runs], "o-", label="mean latency")
    ax_lat.plot(conc, [r.latency.p99_ms / 1e3 for r in runs], "s--", label="p99 latency")
    ax_lat.plot(conc, [r.ttft.mean_ms / 1e3 for r in runs], "^:", label="mean TTFT")
    ax_lat.set(title="Latency vs concurrency", xlabel="max_num_seqs", ylabel="seconds", xscale="log")
    ax_lat.legend()
    for ax in (ax_tp, ax_lat):
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
