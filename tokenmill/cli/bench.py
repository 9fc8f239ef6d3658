"""`tokenmill bench ...` command line: `serve` (load-test a running server) and `compare`
(tokenmill vs the naive Hugging Face baseline), and the engine benchmarks `offline`, `features`,
`moe-dispatch`, `profile`, `agreement` and `kernels`, whose modules add their own flags.

Heavy imports (transformers, matplotlib, httpx) happen inside the command functions, so building
the `tokenmill` parser stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any

from tokenmill.bench.arg_types import positive_int, range_ratio, request_rate
from tokenmill.bench.sampling import add_sampling_args

BENCH_EXTRA_HINT = "the benchmarks need the bench extra: pip install 'tokenmill[bench]'"
# Engine benchmarks: command -> one-line summary. The module tokenmill.bench.<command, "-" as "_">
# has `add_args(parser)` and `main(args)`, its docstring is the command's description, and it
# imports the bench extra's packages (numpy, httpx, matplotlib).
ENGINE_BENCHMARKS = {
    "offline": "benchmark the engine in-process (offline LLM.generate), optionally vs HF",
    "features": "each speed feature off vs on, one flag at a time",
    "moe-dispatch": "time the ways of running one MoE layer's experts",
    "profile": "share of a step in attention, GEMMs, elementwise ops, sampler and host Python",
    "agreement": "teacher-forced top-1 agreement of a dtype/quantization with fp32 (or bf16) on real text",
    "kernels": "tokenmill's C++ CPU kernels on the model's shapes vs the read bandwidth and library paths",
}


def add_workload_args(
    parser: argparse.ArgumentParser,
    num_prompts: int = 100,
    input_len: int = 256,
    output_len: int = 128,
    sweep: bool = False,
) -> None:
    """Flags describing the request trace and how it is offered; shared by `serve` and `compare`.
    `sweep`: --request-rate and --max-concurrency take several values (one run per combination)."""
    several = "; several values sweep them, one run per combination" if sweep else ""
    group = parser.add_argument_group("workload")
    group.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="Hugging Face tokenizer directory used to build prompts and count prompt tokens "
        "(default: the model directory, else the bundled SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--num-prompts",
        type=positive_int,
        metavar="N",
        default=num_prompts,
        help=f"number of requests in the trace (default: {num_prompts})",
    )
    group.add_argument(
        "--request-rate",
        type=request_rate,
        metavar="RATE",
        default=math.inf,
        nargs="+" if sweep else None,
        help="mean arrival rate in requests/s of the Poisson (open-loop) arrival process; "
        f"'inf' sends every request at once (default: inf){several}",
    )
    group.add_argument(
        "--max-concurrency",
        type=positive_int,
        metavar="N",
        default=None,
        nargs="+" if sweep else None,
        help=f"most requests in flight at once; later arrivals wait for a slot (default: unbounded){several}",
    )
    group.add_argument(
        "--input-len",
        type=positive_int,
        metavar="TOKENS",
        default=input_len,
        help=f"synthetic dataset: prompt length in tokens (default: {input_len})",
    )
    group.add_argument(
        "--output-len",
        type=positive_int,
        metavar="TOKENS",
        default=None,
        help=f"output length in tokens, sent as max_tokens with ignore_eos (default: {output_len} "
        "for the synthetic dataset; with --dataset, each reply's real length)",
    )
    group.add_argument(
        "--range-ratio",
        type=range_ratio,
        metavar="R",
        default=0.0,
        help="synthetic dataset: draw lengths uniformly from [len*(1-r), len*(1+r)] for "
        "mixed lengths; 0 makes every request the same size (default: 0)",
    )
    group.add_argument(
        "--dataset",
        metavar="PATH",
        default=None,
        help='ShareGPT-style JSON file ([{"conversations": [{"from": "human", ...}, '
        '{"from": "gpt", ...}]}]); the first human turn is the prompt and the gpt '
        "reply's token count the output length (default: synthetic random-token prompts)",
    )
    group.add_argument(
        "--seed",
        type=int,
        metavar="N",
        default=0,
        help="seed for prompts, dataset sampling and arrival times; the same seed gives the same trace (default: 0)",
    )
    add_sampling_args(group)
    parser.set_defaults(synthetic_output_len=output_len)


def _bench_module(name: str) -> Any:
    """tokenmill.bench.<name>, imported when its command runs (it needs the bench extra)."""
    try:
        return importlib.import_module(f"tokenmill.bench.{name}")
    except ImportError as exc:
        raise ValueError(f"{BENCH_EXTRA_HINT} ({exc})") from None


def _cmd_serve(args: argparse.Namespace) -> int:
    return _bench_module("serve").main(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    return _bench_module("compare").main(args)


def add_bench_command(
    bench_subparsers: Any, name: str, summary: str, description: str | None, func: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """Add `tokenmill bench NAME`, run by `func`; `description` keeps its own line breaks."""
    parser = bench_subparsers.add_parser(
        name, help=summary, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.set_defaults(func=func)
    return parser


def _register_serve(bench_subparsers: Any) -> None:
    parser = add_bench_command(
        bench_subparsers,
        "serve",
        "load-test a running OpenAI-compatible server",
        "Send a seeded trace of streaming /v1/completions requests to a running OpenAI-compatible server\n"
        "at Poisson arrival times and report throughput and TTFT/TPOT/ITL/e2e latency.",
        _cmd_serve,
    )
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="server base URL, or its /v1/completions endpoint (default: http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model name sent in each request (default: the first id from GET /v1/models); "
        "a local directory is also used as the tokenizer",
    )
    add_workload_args(parser, sweep=True)
    parser.add_argument("--json", metavar="PATH", default=None, help="write the report as JSON to PATH")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="write a PNG with TTFT/e2e histograms and CDFs and throughput bars to PATH",
    )


def _register_compare(bench_subparsers: Any) -> None:
    parser = add_bench_command(
        bench_subparsers,
        "compare",
        "tokenmill vs a naive Hugging Face server on the same trace",
        "Start `tokenmill serve` and the naive one-request-at-a-time Hugging Face baseline on 127.0.0.1,\n"
        "drive both with the identical request trace, print one table with both and their ratios, write\n"
        "it as JSON and plot both side by side; both servers are always stopped.",
        _cmd_compare,
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="Hugging Face model directory both servers load (default: the bundled SmolLM2-135M-Instruct)",
    )
    add_workload_args(parser, num_prompts=32, input_len=128, output_len=64)
    parser.add_argument("--port", type=int, default=0, help="port for tokenmill serve (default: a free port)")
    parser.add_argument("--naive-port", type=int, default=0, help="port for the naive server (default: a free port)")
    parser.add_argument(
        "--serve-args", default="", help="extra flags for `tokenmill serve`, as one shell-quoted string (default: none)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for both servers to become ready (default: 600)",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed requests sent to each server before measuring (default: 1)"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        default="bench/results/compare.json",
        help="write both reports and the ratios as JSON to PATH; '' to skip (default: bench/results/compare.json)",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        default="bench/results/compare.png",
        help="write the side-by-side PNG to PATH; '' to skip (default: bench/results/compare.png)",
    )


def _register_engine_benchmarks(bench_subparsers: Any) -> None:
    for name, summary in ENGINE_BENCHMARKS.items():
        try:  # imported here, not at the top: without the bench extra the rest of the CLI still works
            module = importlib.import_module(f"tokenmill.bench.{name.replace('-', '_')}")
        except ImportError as exc:
            add_bench_command(bench_subparsers, name, f"{summary} (needs the bench extra)", None, _missing_extra(exc))
            continue
        description = inspect.cleandoc(module.__doc__) if module.__doc__ else None
        parser = add_bench_command(bench_subparsers, name, summary, description, module.main)
        module.add_args(parser)
        parser.add_argument(
            "--json",
            metavar="PATH",
            default=None,  # (read by tokenmill.bench.report.print_report)
            help="write the results, the command line, date, torch version and threads as JSON to PATH",
        )


def _missing_extra(exc: ImportError) -> Callable[[argparse.Namespace], int]:
    def fail(args: argparse.Namespace) -> int:
        raise ValueError(f"{BENCH_EXTRA_HINT} ({exc})")

    return fail


def register(subparsers: Any) -> None:
    """Add `bench` and its sub-subcommands to the `tokenmill` parser."""
    bench = subparsers.add_parser(
        "bench",
        help="benchmark servers and the engine",
        description="Benchmarks: `serve` load-tests a running server, `compare` runs tokenmill against a naive "
        "Hugging Face baseline.",
    )
    # The one place the bench sub-subparsers are created; the engine benchmarks register into it.
    bench_subparsers = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    _register_serve(bench_subparsers)
    _register_compare(bench_subparsers)
    _register_engine_benchmarks(bench_subparsers)
