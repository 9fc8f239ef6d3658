"""`tokenmill bench offline`: the command (see the package docstring) and its flags."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.engine_args import add_bench_engine_args, engine_kwargs, make_llm, resolve_bench_model
from tokenmill.bench.offline.hf_baseline import hf_baseline_run
from tokenmill.bench.offline.report import format_runs, format_sweep, greedy_agreement, plot_sweep
from tokenmill.bench.offline.runners import RunResult, in_fresh_process, run_tokenmill, tokenmill_run, warmup
from tokenmill.bench.offline.workload import STRUCTURED_SCHEMA, OfflineRequest, describe_workload, make_workload
from tokenmill.bench.report import print_report
from tokenmill.bench.sampling import add_sampling_args, sampling_from_args


def compare_model_impls(
    args: argparse.Namespace, model_dir: Path, workload: Sequence[OfflineRequest], progress: bool
) -> dict[str, Any]:
    """The workload on the native path, then on the generic transformers path, each in a fresh
    process; prints both and returns them with the throughput ratio and greedy agreement."""
    runs = [
        in_fresh_process(
            tokenmill_run,
            engine_kwargs(args, model_dir, model_impl=impl),
            workload,
            f"tokenmill --model-impl {impl}",
            progress,
        )
        for impl in ("native", "transformers")
    ]
    native, generic = runs
    ratio = generic.output_throughput / native.output_throughput
    agreement = greedy_agreement(native.token_ids, generic.token_ids)
    print(format_runs(runs))
    print(f"generic (transformers) / native useful tok/s: {ratio:.2f}x")
    print(
        f"greedy agreement: {agreement['exact_match_fraction'] * 100:.1f}% of {agreement['requests']} requests "
        f"match exactly; mean matching prefix {agreement['mean_matching_prefix_fraction'] * 100:.1f}%"
    )
    return {
        "native": native.to_dict(),
        "transformers": generic.to_dict(),
        "throughput_ratio_transformers_over_native": ratio,
        "greedy_agreement": agreement,
    }


def compare_structured_output(
    args: argparse.Namespace, model_dir: Path, workload: Sequence[OfflineRequest], progress: bool
) -> dict[str, Any]:
    """The workload unconstrained, then with every request constrained to STRUCTURED_SCHEMA, each in
    a fresh process (same prompts, greedy, same token counts); prints both and the throughput ratio."""
    kwargs = engine_kwargs(args, model_dir)
    free = in_fresh_process(tokenmill_run, kwargs, workload, "unconstrained", progress)
    constrained = in_fresh_process(
        tokenmill_run, kwargs, workload, "json_schema", progress, None, False, {"json": STRUCTURED_SCHEMA}
    )
    ratio = constrained.output_throughput / free.output_throughput
    print(format_runs([free, constrained]))
    print(
        f"json_schema / unconstrained useful tok/s: {ratio:.3f}x ({(1 - ratio) * 100:+.1f}% slower); "
        f"schema compiled in {constrained.grammar_compile_s:.2f} s (once, before the timed run)"
    )
    if constrained.output_tokens != free.output_tokens:
        print(
            f"warning: the constrained run produced {constrained.output_tokens} tokens, the free run "
            f"{free.output_tokens}",
            file=sys.stderr,
        )
    return {
        "unconstrained": free.to_dict(),
        "json_schema": constrained.to_dict(),
        "schema": STRUCTURED_SCHEMA,
        "throughput_ratio_json_schema_over_unconstrained": ratio,
    }


def parse_values(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.engine.precision import resolve_dtype
    from tokenmill.engine.setup import resolve_device
    from tokenmill.models.model_loader.loader import load_spec

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    progress = not args.no_progress
    model_dir = resolve_bench_model(args.model)
    report: dict[str, Any] = {"model_dir": str(model_dir), "engine": engine_kwargs(args, model_dir)}
    print(f"model: {model_dir}", file=sys.stderr)
    device = resolve_device(args.device)
    workload = make_workload(
        args.num_prompts,
        args.min_input,
        args.max_input,
        args.min_output,
        args.max_output,
        load_spec(model_dir).vocab_size,
        args.seed,
    )
    report["workload"] = {
        "num_prompts": args.num_prompts,
        "min_input": args.min_input,
        "max_input": args.max_input,
        "min_output": args.min_output,
        "max_output": args.max_output,
        "seed": args.seed,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
        "requested_output_tokens": sum(r.output_len for r in workload),
    }
    sampling = sampling_from_args(args)
    report["workload"]["sampling"] = asdict(sampling)
    print(f"{describe_workload(workload)}; {sampling.describe()}", file=sys.stderr)

    # The engine of this process serves the main run, the roofline and the long outputs; sweep
    # points and the model-impl and structured-output comparisons build their own.
    main_here = not args.skip_main and args.compare not in ("model-impl", "structured-output")
    llm = make_llm(args, model_dir) if main_here or args.roofline or args.long_outputs or args.long_prompts else None
    runs: list[RunResult] = []
    if args.compare == "model-impl":
        report["model_impl"] = compare_model_impls(args, model_dir, workload, progress)
    if args.compare == "structured-output":
        report["structured_output"] = compare_structured_output(args, model_dir, workload, progress)
    if main_here:  # first, in this process: no other heavy run has gone before it
        warmup(llm, workload, sampling=sampling)
        main_run = run_tokenmill(llm, workload, use_tqdm=progress, sampling=sampling)
        runs.append(main_run)
        report["tokenmill"] = main_run.to_dict()
        if main_run.output_tokens != main_run.requested_tokens:
            print(
                f"warning: tokenmill produced {main_run.output_tokens} tokens, {main_run.requested_tokens} "
                "were requested",
                file=sys.stderr,
            )
    if args.compare == "hf":
        hf_run = in_fresh_process(
            hf_baseline_run,
            model_dir,
            workload,
            args.hf_batch_size,
            str(resolve_dtype(args.dtype, device, model_dir)).removeprefix("torch."),
            str(device),
            progress,
            sampling,
        )
        runs.append(hf_run)
        report["hf"] = hf_run.to_dict()
        if runs[0] is not hf_run:
            ratio = runs[0].output_throughput / hf_run.output_throughput
            agreement = greedy_agreement(runs[0].token_ids, hf_run.token_ids) if sampling.greedy else None
            report["comparison"] = {"throughput_ratio_tokenmill_over_hf": ratio, "greedy_agreement": agreement}

    if runs:
        print(format_runs(runs))
        if "comparison" in report:
            c = report["comparison"]
            a = c["greedy_agreement"]
            print(f"tokenmill / HF useful tok/s: {c['throughput_ratio_tokenmill_over_hf']:.2f}x")
            if a is not None:
                print(
                    f"greedy agreement vs HF (first min(len) tokens): {a['exact_match_fraction'] * 100:.1f}% of "
                    f"{a['requests']} requests match exactly; mean matching prefix "
                    f"{a['mean_matching_prefix_fraction'] * 100:.1f}% (left padding shifts HF numerics slightly)"
                )

    if args.sweep:
        sweep_workload = workload[: args.sweep_prompts] if args.sweep_prompts else workload
        print(f"sweep: {describe_workload(sweep_workload)}", file=sys.stderr)
        sweep_runs = []
        for value in args.sweep_values:
            run = in_fresh_process(
                functools.partial(tokenmill_run, sampling=sampling),
                engine_kwargs(args, model_dir, max_num_seqs=value),
                sweep_workload,
                f"concurrency {value}",
                progress,
            )
            run.max_num_seqs = value
            sweep_runs.append(run)
            print(
                f"  concurrency {value}: {run.output_throughput:.1f} tok/s, "
                f"mean latency {run.latency.mean_ms / 1e3:.2f} s",
                file=sys.stderr,
            )
        print(format_sweep(sweep_runs))
        report["sweep"] = [r.to_dict() for r in sweep_runs]
        if args.plot:
            plot_sweep(sweep_runs, args.plot, title=f"tokenmill bench offline --sweep ({model_dir.name})")
            print(f"wrote {args.plot}", file=sys.stderr)

    if args.long_outputs:
        from tokenmill.bench.long_outputs import format_long_outputs, run_long_outputs

        points = run_long_outputs(
            llm, args.long_outputs, args.long_streams, args.long_prompt_len, load_spec(model_dir).vocab_size, args.seed
        )
        print(format_long_outputs(points))
        report["long_outputs"] = [p.to_dict() for p in points]

    if args.long_prompts:
        from tokenmill.bench.long_prompts import format_long_prompts, run_long_prompts

        prompt_points = run_long_prompts(
            llm,
            args.long_prompts,
            args.long_prompt_streams,
            args.long_prompt_repeats,
            load_spec(model_dir).vocab_size,
            args.seed,
        )
        print(format_long_prompts(prompt_points))
        report["long_prompts"] = [p.to_dict() for p in prompt_points]

    if args.roofline:
        from tokenmill.bench.roofline import format_roofline, measure_roofline

        result = measure_roofline(llm, prompt_len=32, new_tokens=128, copy_bytes=args.roofline_copy_bytes)
        print(format_roofline(result))
        report["roofline"] = result.to_dict()

    return print_report(args, None, report)


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=positive_int, default=64, metavar="N", help="requests (default: 64)")
    group.add_argument(
        "--min-input", type=positive_int, default=4, metavar="TOKENS", help="shortest prompt (default: 4)"
    )
    group.add_argument(
        "--max-input", type=positive_int, default=200, metavar="TOKENS", help="longest prompt (default: 200)"
    )
    group.add_argument(
        "--min-output", type=positive_int, default=16, metavar="TOKENS", help="shortest output (default: 16)"
    )
    group.add_argument(
        "--max-output", type=positive_int, default=128, metavar="TOKENS", help="longest output (default: 128)"
    )
    add_sampling_args(
        group, note=", here and in the HF baseline (the --compare model-impl and structured-output runs stay greedy)"
    )
    bench = parser.add_argument_group("benchmark")
    bench.add_argument(
        "--compare",
        choices=["hf", "model-impl", "structured-output"],
        default=None,
        help="hf: also run Hugging Face generate in static left-padded batches on the same "
        "prompts; model-impl: run the workload with --model-impl native and with "
        "--model-impl transformers (the generic path), each in a fresh process, instead "
        "of the main run; structured-output: run the workload unconstrained and with "
        "every request constrained to a JSON schema (greedy, same token counts), each "
        "in a fresh process, instead of the main run",
    )
    bench.add_argument(
        "--hf-batch-size",
        type=positive_int,
        default=16,
        metavar="N",
        help="static batch size of the HF baseline (default: 16)",
    )
    bench.add_argument("--sweep", action="store_true", help="rerun the workload at each --sweep-values max_num_seqs")
    bench.add_argument(
        "--sweep-values",
        type=parse_values,
        default=[1, 4, 16, 64],
        metavar="LIST",
        help="comma-separated concurrency limits (default: 1,4,16,64)",
    )
    bench.add_argument(
        "--sweep-prompts",
        type=positive_int,
        default=None,
        metavar="N",
        help="use only the first N prompts in the sweep (default: all)",
    )
    bench.add_argument(
        "--plot", metavar="PATH", default=None, help="with --sweep: PNG of tok/s and latency vs concurrency"
    )
    bench.add_argument(
        "--roofline",
        action="store_true",
        help="measure copy bandwidth, weight bytes and batch-1 decode step vs its bandwidth bound",
    )
    bench.add_argument(
        "--roofline-copy-bytes",
        type=positive_int,
        default=1 << 30,
        metavar="BYTES",
        help="size of the fp32 tensor copied to measure bandwidth (default: 1 GiB)",
    )
    bench.add_argument(
        "--long-outputs",
        type=parse_values,
        default=None,
        metavar="LIST",
        help="also stream --long-streams requests of each of these output lengths (e.g. 256,1024,4096) "
        "with cumulative outputs (before) and delta outputs (after), reporting engine host time "
        "per output token",
    )
    bench.add_argument(
        "--long-streams",
        type=positive_int,
        default=8,
        metavar="N",
        help="concurrent streams of --long-outputs (default: 8)",
    )
    bench.add_argument(
        "--long-prompt-len",
        type=positive_int,
        default=32,
        metavar="TOKENS",
        help="prompt length of --long-outputs requests (default: 32)",
    )
    bench.add_argument(
        "--long-prompts",
        type=parse_values,
        default=None,
        metavar="LIST",
        help="also time the first token of prompts of each of these lengths (e.g. 2000,8000), one output token "
        "each, fresh random prompts every repeat (no prefix cache hits)",
    )
    bench.add_argument(
        "--long-prompt-streams",
        type=parse_values,
        default=[1],
        metavar="LIST",
        help="--long-prompts: how many such prompts are submitted at once, per point (default: 1)",
    )
    bench.add_argument(
        "--long-prompt-repeats",
        type=positive_int,
        default=3,
        metavar="N",
        help="--long-prompts: timed repeats of each point (default: 3)",
    )
    bench.add_argument(
        "--skip-main", action="store_true", help="skip the main tokenmill run (e.g. only --sweep or --roofline)"
    )
    add_bench_engine_args(parser)
