"""`tokenmill bench serve`: the command (its flags are defined in tokenmill.cli.bench)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tokenmill.bench.report import write_json
from tokenmill.bench.sampling import sampling_from_args
from tokenmill.bench.serve.report import format_table, plot_reports
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
