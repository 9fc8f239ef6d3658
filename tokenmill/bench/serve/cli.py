"""`tokenmill bench serve`: the command (its flags are defined in tokenmill.cli.bench)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tokenmill.bench.report import write_json
from tokenmill.bench.sampling import sampling_from_args
from tokenmill.bench.serve.report import BenchReport, format_table, plot_reports
from tokenmill.bench.serve.runner import run_benchmark
from tokenmill.bench.serve.workload import describe_trace, load_tokenizer, requests_from_args


def tokenizer_dir_from_args(args: argparse.Namespace) -> str | None:
    """--tokenizer, else --model when it is a local directory, else None (the bundled default)."""
    if args.tokenizer:
        return args.tokenizer
    model = getattr(args, "model", None)
    if model and Path(model).expanduser().is_dir():
        return model
    return None


def sweep_points(args: argparse.Namespace) -> list[tuple[float, int | None]]:
    """(request rate, max concurrency) of each run: every combination of the values given."""
    rates = args.request_rate if isinstance(args.request_rate, list) else [args.request_rate]
    limits = args.max_concurrency if isinstance(args.max_concurrency, list) else [args.max_concurrency]
    return [(rate, limit) for limit in limits for rate in rates]


def point_label(rate: float, limit: int | None, points: list[tuple[float, int | None]]) -> str:
    """A sweep point's column name: what varies in the sweep."""
    parts = []
    if len({p[1] for p in points}) > 1 or len(points) == 1:
        parts.append(f"c={limit or 'inf'}")
    if len({p[0] for p in points}) > 1:
        parts.append(f"rate={rate:g}")
    return " ".join(parts)


def main(args: argparse.Namespace) -> int:
    """`tokenmill bench serve`: benchmark the server at --url, once or at each sweep point, and
    print/write the report."""
    tokenizer = load_tokenizer(tokenizer_dir_from_args(args))
    requests = requests_from_args(args, tokenizer)
    sampling = sampling_from_args(args)
    points = sweep_points(args)
    reports: dict[str, BenchReport] = {}
    for rate, limit in points:
        print(f"{describe_trace(requests, rate, limit)}; {sampling.describe()}", file=sys.stderr)
        report = asyncio.run(
            run_benchmark(
                args.url,
                requests,
                request_rate=rate,
                max_concurrency=limit,
                seed=args.seed,
                model_name=args.model if args.model and not Path(args.model).expanduser().is_dir() else None,
                sampling=sampling,
            )
        )
        reports[report.model or "server" if len(points) == 1 else point_label(rate, limit, points)] = report
        _warn(report)
    print(format_table(reports))
    if args.json:
        if len(points) == 1:
            write_json(args.json, next(iter(reports.values())).to_dict())
        else:
            write_json(
                args.json,
                {
                    "points": [
                        {"request_rate": rate, "max_concurrency": limit, "report": rep.to_dict(per_request=False)}
                        for (rate, limit), rep in zip(points, reports.values())
                    ]
                },
            )
    if args.plot:
        plot_reports(reports, args.plot, title=f"tokenmill bench serve: {args.url}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0 if all(rep.completed > 0 for rep in reports.values()) else 1


def _warn(report: BenchReport) -> None:
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
