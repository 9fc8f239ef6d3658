"""`tokenmill bench features`: each speed feature off vs on, one flag at a time, in one command.

Every row is one engine, in a fresh process, built with the default settings except for that one
flag, running a workload the feature is for (a shared system prompt for prefix caching, repeated
requests for the result cache, the mixed workload of `bench offline` for the rest). Reported:
useful output tok/s, TTFT, the model's weight bytes and greedy agreement of "on" with "off".
Server features (request tracing) run a `tokenmill serve` instead, streamed requests over HTTP
(`served_features`); `--only` lists every feature.
Speculative decoding runs chat requests one at a time (batch size 1; `speculative`): code
rewrites, whose answers repeat the prompt, and free text, and reports the drafts' acceptance rate.
Multi-LoRA: the mixed workload spread evenly over 4 random adapters (ranks 8 and 16, every
projection) served from one engine, against the base model alone on the same workload.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.engine_args import add_bench_engine_args, engine_kwargs, resolve_bench_model
from tokenmill.bench.lora_adapters import write_random_adapter
from tokenmill.bench.offline.report import greedy_agreement
from tokenmill.bench.offline.runners import in_fresh_process, tokenmill_run
from tokenmill.bench.offline.workload import MIN_PROMPT_TOKEN_ID, OfflineRequest, make_workload
from tokenmill.bench.report import format_cell, format_grid, print_report
from tokenmill.bench.serve.workload import load_tokenizer, synthetic_requests
from tokenmill.bench.served_features import COLLECTOR_STUB, served_run
from tokenmill.bench.speculative import BS1_WORKLOADS, bs1_run, bs1_workloads


@dataclass
class FeatureRow:
    feature: str
    setting: str
    workload: str
    output_tok_s: float
    mean_ttft_s: float
    p50_latency_s: float
    weight_mib: float
    greedy_agreement_with_off: float | None = None  # exact-match fraction of requests
    spec_acceptance_rate: float | None = None  # speculative decoding: accepted / proposed draft tokens
    spec_mean_accepted_length: float | None = None  # tokens per verification step


@dataclass(frozen=True)
class Feature:
    name: str
    off: dict[str, Any]
    on: dict[str, Any]
    workload: str  # "mixed" | "shared-prefix" | "repeat" | "serve" | one of BS1_WORKLOADS
    gpu_only: bool = False  # skipped (and said so) where no CUDA device is available
    # off/on are `tokenmill serve` settings, measured through a real server ("serve" workload).
    server: bool = False
    # "on" serves LoRA adapters of these ranks (random, every projection), the requests spread
    # evenly over them; "off" is the base model alone on the same workload.
    lora_ranks: tuple[int, ...] = ()


FEATURES = [
    Feature("packed linear (--packed-linear)", {"packed_linear": False}, {"packed_linear": True}, "mixed"),
    Feature(
        "prefix caching (--enable-prefix-caching)",
        {"enable_prefix_caching": False},
        {"enable_prefix_caching": True},
        "shared-prefix",
    ),
    Feature("result cache (--result-cache-size 256)", {"result_cache_size": 0}, {"result_cache_size": 256}, "repeat"),
    Feature("int8 weights (--quantization int8)", {"quantization": None}, {"quantization": "int8"}, "mixed"),
    Feature("bf16 (--dtype bfloat16)", {"dtype": "float32"}, {"dtype": "bfloat16"}, "mixed"),
    Feature(
        "bf16 KV cache (--kv-cache-dtype bfloat16)",
        {"dtype": "float32"},
        {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
        "mixed",
    ),
    Feature("torch.compile (--compile)", {"compile": False}, {"compile": True}, "mixed"),
    Feature(
        "overlap scheduling (--overlap-scheduling)",
        {"overlap_scheduling": False},
        {"overlap_scheduling": True},
        "mixed",
    ),
    Feature("CUDA graphs (--cuda-graphs)", {"cuda_graphs": False}, {"cuda_graphs": True}, "mixed", gpu_only=True),
    Feature(
        "request tracing (--otlp-traces-endpoint)", {}, {"otlp_traces_endpoint": COLLECTOR_STUB}, "serve", server=True
    ),
    *(
        Feature(
            "ngram speculation (--speculative-method ngram)",
            {"speculative_method": None},
            {"speculative_method": "ngram"},
            workload,
        )
        for workload in BS1_WORKLOADS
    ),
    Feature(
        "multi-LoRA (4 adapters, ranks 8/16, --max-loras 4)",
        {},
        {"enable_lora": True, "max_loras": 4, "max_lora_rank": 16},
        "mixed",
        lora_ranks=(8, 16, 8, 16),
    ),
]


def shared_prefix_workload(
    num_prompts: int, prefix_len: int, suffix_len: int, output_len: int, vocab_size: int, seed: int
) -> list[OfflineRequest]:
    """One system prompt of `prefix_len` tokens shared by every request, then its own suffix."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(MIN_PROMPT_TOKEN_ID, vocab_size, size=prefix_len).tolist()
    return [
        OfflineRequest(prefix + rng.integers(MIN_PROMPT_TOKEN_ID, vocab_size, size=suffix_len).tolist(), output_len)
        for _ in range(num_prompts)
    ]


def measure(
    args: argparse.Namespace,
    features: Sequence[Feature],
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> list[FeatureRow]:
    from tokenmill.models.model_loader.loader import load_spec

    model_dir = resolve_bench_model(args.model)  # resolved here: the runs' fresh processes get a path
    vocab = load_spec(model_dir).vocab_size
    workloads = {
        "mixed": make_workload(args.num_prompts, 4, 200, 16, args.max_output, vocab, args.seed),
        "shared-prefix": shared_prefix_workload(args.num_prompts, 200, 16, 16, vocab, args.seed),
        "repeat": make_workload(args.num_prompts, 4, 200, 16, args.max_output, vocab, args.seed + 1),
    }
    if any(f.workload in BS1_WORKLOADS for f in features):
        workloads.update(bs1_workloads(load_tokenizer(model_dir), args.bs1_prompts, args.max_output))
    warm = make_workload(2, 4, 64, 8, 8, vocab, args.seed + 99)
    rows: list[FeatureRow] = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-lora-") as adapter_dir:
        for feature in features:
            if feature.server:
                rows += _served_rows(args, model_dir, feature, log)
            elif feature.workload in BS1_WORKLOADS:
                rows += _bs1_rows(args, model_dir, feature, workloads[feature.workload], log)
            else:
                rows += _engine_rows(
                    args, model_dir, feature, workloads[feature.workload], warm, Path(adapter_dir), log
                )
    return rows


def _engine_rows(
    args: argparse.Namespace,
    model_dir: Path,
    feature: Feature,
    workload: list[OfflineRequest],
    warm: list[OfflineRequest],
    adapter_dir: Path,
    log: Callable[[str], None],
) -> list[FeatureRow]:
    """One engine per setting, each in a fresh process, on the feature's workload."""
    lora_paths = None
    if feature.lora_ranks:  # requests spread evenly over the adapters
        adapters = [
            str(write_random_adapter(model_dir, adapter_dir / f"rank{rank}-{i}", rank, seed=i))
            for i, rank in enumerate(feature.lora_ranks)
        ]
        lora_paths = [adapters[i % len(adapters)] for i in range(len(workload))]
    rows = []
    tokens: dict[str, list[list[int]]] = {}
    for setting, overrides in (("off", feature.off), ("on", feature.on)):
        result = in_fresh_process(
            tokenmill_run,
            engine_kwargs(args, model_dir, **overrides),
            workload,
            f"{feature.name} {setting}",
            False,
            warm,
            feature.workload == "repeat",
            None,
            lora_paths if setting == "on" else None,
        )
        weights, tokens[setting] = result.weight_bytes or 0, result.token_ids
        agreement = None
        if setting == "on" and not feature.lora_ranks:  # (adapters change the output by design)
            agreement = greedy_agreement(tokens["on"], tokens["off"])["exact_match_fraction"]
        rows.append(
            FeatureRow(
                feature.name,
                setting,
                feature.workload,
                result.output_throughput,
                result.ttft.mean_ms / 1e3,
                result.latency.p50_ms / 1e3,
                weights / 2**20,
                agreement,
            )
        )
        log(
            f"  {feature.name} {setting}: {result.output_throughput:.1f} tok/s, "
            f"mean TTFT {result.ttft.mean_ms / 1e3:.3f} s, weights {weights / 2**20:.1f} MiB"
        )
    return rows


def _served_rows(
    args: argparse.Namespace, model_dir: Any, feature: Feature, log: Callable[[str], None]
) -> list[FeatureRow]:
    """A server feature: streamed requests (prompts ~100 tokens, outputs up to --max-output) off vs on."""
    requests = synthetic_requests(load_tokenizer(model_dir), args.num_prompts, 100, args.max_output, 0.5, args.seed)
    rows = []
    for setting, settings in (("off", feature.off), ("on", feature.on)):
        report, spans = served_run(args, model_dir, settings, requests, f"{feature.name} {setting}")
        if COLLECTOR_STUB in settings.values() and spans == 0:
            raise RuntimeError(f"{feature.name} {setting}: the collector stub received no span")
        rows.append(
            FeatureRow(
                feature.name,
                setting,
                feature.workload,
                report.output_throughput,
                report.ttft.mean_ms / 1000,
                report.e2e.p50_ms / 1000,
                math.nan,
            )
        )
        log(
            f"  {feature.name} {setting}: {report.output_throughput:.1f} tok/s, mean TTFT "
            f"{report.ttft.mean_ms / 1000:.3f} s, {report.failed} failed, {spans} spans exported"
        )
    return rows


def _bs1_rows(
    args: argparse.Namespace,
    model_dir: Any,
    feature: Feature,
    workload: list[OfflineRequest],
    log: Callable[[str], None],
) -> list[FeatureRow]:
    """Requests one at a time, off vs on (speculative decoding)."""
    rows, tokens = [], {}
    for setting, overrides in (("off", feature.off), ("on", feature.on)):
        result = in_fresh_process(
            bs1_run, engine_kwargs(args, model_dir, **overrides), workload, f"{feature.name} {setting}", False
        )
        run, tokens[setting] = result.run, result.run.token_ids
        agreement = greedy_agreement(tokens["on"], tokens["off"])["exact_match_fraction"] if setting == "on" else None
        rows.append(
            FeatureRow(
                feature.name,
                setting,
                feature.workload,
                run.output_throughput,
                run.ttft.mean_ms / 1e3,
                run.latency.p50_ms / 1e3,
                (run.weight_bytes or 0) / 2**20,
                agreement,
                result.acceptance_rate,
                result.mean_accepted_length,
            )
        )
        accepted = (
            ""
            if result.acceptance_rate is None
            else (
                f", {result.acceptance_rate:.0%} of drafts accepted, {result.mean_accepted_length:.2f} tokens per step"
            )
        )
        log(
            f"  {feature.name} {setting} ({feature.workload}): {run.output_throughput:.1f} tok/s, "
            f"p50 latency {run.latency.p50_ms / 1e3:.2f} s{accepted}"
        )
    return rows


def format_rows(rows: Sequence[FeatureRow]) -> str:
    table = [
        [
            "feature",
            "setting",
            "workload",
            "output tok/s",
            "speed-up",
            "mean TTFT (s)",
            "p50 latency (s)",
            "weights (MiB)",
            "greedy = off",
            "drafts accepted",
        ]
    ]
    off: dict[str, FeatureRow] = {}
    for r in rows:
        if r.setting == "off":
            off[r.feature + r.workload] = r
        base = off.get(r.feature + r.workload)
        speedup = r.output_tok_s / base.output_tok_s if base and r.setting == "on" else None
        table.append(
            [
                r.feature,
                r.setting,
                r.workload,
                format_cell(r.output_tok_s, ".1f"),
                format_cell(speedup, ".2f") + ("x" if speedup else ""),
                format_cell(r.mean_ttft_s, ".3f"),
                format_cell(r.p50_latency_s, ".2f"),
                format_cell(r.weight_mib, ".1f"),
                format_cell(None if r.greedy_agreement_with_off is None else r.greedy_agreement_with_off * 100, ".0f")
                + ("%" if r.greedy_agreement_with_off is not None else ""),
                "-"
                if r.spec_acceptance_rate is None
                else f"{r.spec_acceptance_rate:.0%} ({r.spec_mean_accepted_length:.2f}/step)",
            ]
        )
    return format_grid(table, title="Speed features, each off vs on (one flag changed per pair)")


def main(args: argparse.Namespace) -> int:
    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    chosen = [f for f in FEATURES if not args.only or any(key in f.name for key in args.only)]
    if not chosen:
        raise ValueError(f"--only {args.only} matches none of: {', '.join(f.name for f in FEATURES)}")
    if not torch.cuda.is_available():
        for feature in [f for f in chosen if f.gpu_only]:
            print(f"skipping {feature.name}: no CUDA device", file=sys.stderr)
            chosen.remove(feature)
    start = time.perf_counter()
    rows = measure(args, chosen)
    print(f"({time.perf_counter() - start:.0f} s in all)", file=sys.stderr)
    return print_report(args, format_rows(rows), {"rows": [asdict(r) for r in rows]})


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-prompts", type=positive_int, default=32, metavar="N", help="requests per run (default: 32)"
    )
    parser.add_argument(
        "--max-output",
        type=positive_int,
        default=64,
        metavar="TOKENS",
        help="longest output of the mixed workload (default: 64)",
    )
    parser.add_argument(
        "--bs1-prompts",
        type=positive_int,
        default=4,
        metavar="N",
        help="requests of each batch-size-1 workload (speculation), run one at a time (default: 4)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="WORD",
        default=None,
        help="run only the features whose name contains one of these words (e.g. int8 compile); the "
        f"features: {'; '.join(f.name for f in FEATURES)}",
    )
    add_bench_engine_args(parser)
