"""`tokenmill bench ...` command line: `serve` (load-test a running server) and `compare`
(tokenmill vs the naive Hugging Face baseline); `offline` joins them when tokenmill.bench.offline
exists and exposes `register_offline(bench_subparsers)`.

Heavy imports (transformers, matplotlib, httpx) happen inside the command functions, so building
the `tokenmill` parser stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
from typing import Any

# Sub-subcommands that live in optional modules: (module, registration function).
OPTIONAL_BENCH_COMMANDS = [
    ("tokenmill.bench.offline", "register_offline"),
    ("tokenmill.bench.features", "register_features"),
    ("tokenmill.bench.moe_dispatch", "register_moe_dispatch"),
    ("tokenmill.bench.profile", "register_profile"),
    ("tokenmill.bench.agreement", "register_agreement"),
]


def request_rate(value: str) -> float:
    """argparse type for --request-rate: a positive number of requests/s, or 'inf'."""
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'inf', got {value!r}") from None
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or 'inf'), got {value!r}")
    return rate


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return number


def range_ratio(value: str) -> float:
    ratio = float(value)
    if not 0.0 <= ratio < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value!r}")
    return ratio


def add_workload_args(
    parser: argparse.ArgumentParser, num_prompts: int = 100, input_len: int = 256, output_len: int = 128
) -> None:
    """Flags describing the request trace and how it is offered; shared by `serve` and `compare`."""
    group = parser.add_argument_group("workload")
    group.add_argument("--tokenizer", metavar="DIR", default=None,
                       help="Hugging Face tokenizer directory used to build prompts and count prompt tokens "
                            "(default: the model directory, else the bundled SmolLM2-135M-Instruct)")
    group.add_argument("--num-prompts", type=positive_int, metavar="N", default=num_prompts,
                       help=f"number of requests in the trace (default: {num_prompts})")
    group.add_argument("--request-rate", type=request_rate, metavar="RATE", default=math.inf,
                       help="mean arrival rate in requests/s of the Poisson (open-loop) arrival process; "
                            "'inf' sends every request at once (default: inf)")
    group.add_argument("--max-concurrency", type=positive_int, metavar="N", default=None,
                       help="most requests in flight at once; later arrivals wait for a slot "
                            "(default: unbounded)")
    group.add_argument("--input-len", type=positive_int, metavar="TOKENS", default=input_len,
                       help=f"synthetic dataset: prompt length in tokens (default: {input_len})")
    group.add_argument("--output-len", type=positive_int, metavar="TOKENS", default=None,
                       help=f"output length in tokens, sent as max_tokens with ignore_eos (default: {output_len} "
                            "for the synthetic dataset; with --dataset, each reply's real length)")
    group.add_argument("--range-ratio", type=range_ratio, metavar="R", default=0.0,
                       help="synthetic dataset: draw lengths uniformly from [len*(1-r), len*(1+r)] for "
                            "mixed lengths; 0 makes every request the same size (default: 0)")
    group.add_argument("--dataset", metavar="PATH", default=None,
                       help="ShareGPT-style JSON file ([{\"conversations\": [{\"from\": \"human\", ...}, "
                            "{\"from\": \"gpt\", ...}]}]); the first human turn is the prompt and the gpt "
                            "reply's token count the output length (default: synthetic random-token prompts)")
    group.add_argument("--seed", type=int, metavar="N", default=0,
                       help="seed for prompts, dataset sampling and arrival times; the same seed gives the "
                            "same trace (default: 0)")
    parser.set_defaults(synthetic_output_len=output_len)


def _cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.bench import serve

    return serve.main(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    from tokenmill.bench import compare

    return compare.main(args)


def _register_serve(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "serve", help="load-test a running OpenAI-compatible server",
        description="Send a seeded trace of streaming /v1/completions requests to a running OpenAI-compatible "
                    "server at Poisson arrival times and report throughput and TTFT/TPOT/ITL/e2e latency.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="server base URL, or its /v1/completions endpoint (default: http://127.0.0.1:8000)")
    parser.add_argument("--model", default=None,
                        help="model name sent in each request (default: the first id from GET /v1/models); "
                             "a local directory is also used as the tokenizer")
    add_workload_args(parser)
    parser.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON to PATH")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="write a PNG with TTFT/e2e histograms and CDFs and throughput bars to PATH")
    parser.set_defaults(func=_cmd_serve)


def _register_compare(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "compare", help="tokenmill vs a naive Hugging Face server on the same trace",
        description="Start `tokenmill serve` and the naive one-request-at-a-time Hugging Face baseline on "
                    "127.0.0.1, drive both with the identical request trace, print one table with both and "
                    "their ratios, write it as JSON and plot both side by side; both servers are always stopped.",
    )
    parser.add_argument("--model", metavar="DIR", default=None,
                        help="Hugging Face model directory both servers load (default: the bundled "
                             "SmolLM2-135M-Instruct)")
    add_workload_args(parser, num_prompts=32, input_len=128, output_len=64)
    parser.add_argument("--port", type=int, default=0, help="port for tokenmill serve (default: a free port)")
    parser.add_argument("--naive-port", type=int, default=0, help="port for the naive server (default: a free port)")
    parser.add_argument("--serve-args", default="",
                        help="extra flags for `tokenmill serve`, as one shell-quoted string (default: none)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds to wait for both servers to become ready (default: 600)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed requests sent to each server before measuring (default: 1)")
    parser.add_argument("--json", metavar="PATH", default="bench/compare.json",
                        help="write both reports and the ratios as JSON to PATH; '' to skip "
                             "(default: bench/compare.json)")
    parser.add_argument("--plot", metavar="PATH", default="bench/compare.png",
                        help="write the side-by-side PNG to PATH; '' to skip (default: bench/compare.png)")
    parser.set_defaults(func=_cmd_compare)


def _register_optional(bench_subparsers: Any) -> None:
    for module_name, function_name in OPTIONAL_BENCH_COMMANDS:
        if importlib.util.find_spec(module_name) is not None:
            getattr(importlib.import_module(module_name), function_name)(bench_subparsers)


def register(subparsers: Any) -> None:
    """Add `bench` and its sub-subcommands to the `tokenmill` parser."""
    bench = subparsers.add_parser(
        "bench", help="benchmark servers and the engine",
        description="Benchmarks: `serve` load-tests a running server, `compare` runs tokenmill against a naive "
                    "Hugging Face baseline.",
    )
    # The one place the bench sub-subparsers are created; optional modules register into it.
    bench_subparsers = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    _register_serve(bench_subparsers)
    _register_compare(bench_subparsers)
    _register_optional(bench_subparsers)
