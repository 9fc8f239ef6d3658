"""`tokenmill export`: a native model as an ONNX or TorchScript decoder step, optionally checked."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tokenmill.export.layout import FILES, FORMATS

DTYPES = ("float32", "float16")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a model to ONNX or TorchScript (one decoder step with explicit past K/V)",
        description="Write a native Llama-family model (llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, "
        "phi3) as one decoder step: input_ids, attention_mask, position_ids and "
        "past_key_values.{i}.key/value in, logits and present.{i}.key/value out (the Optimum / "
        "onnxruntime-genai layout), batch and sequence axes dynamic. OUT gets the graph, the "
        "tokenizer and config files and tokenmill_export.json (the I/O layout). What it does not "
        "carry: the paged KV cache, continuous batching and tokenmill's sampler.",
    )
    parser.add_argument("out", metavar="OUT", help="output directory")
    parser.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="onnx (torch.onnx dynamo exporter; run with onnxruntime) or torchscript (torch.jit.trace; "
        "run with torch.jit.load / libtorch)",
    )
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: the bundled model)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="weights and K/V dtype (float16 is for GPUs: --device cuda; logits are fp32 either way)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to trace (and check)")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="N",
        help="longest context the export serves (its RoPE table; default: the model's maximum)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="then run the export (onnxruntime / torch.jit.load) against tokenmill's engine on a few "
        "prompts: greedy tokens and log-probabilities of 32 steps, alone and as a padded batch",
    )
    parser.add_argument("--check-only", action="store_true", help="check an existing export in OUT, do not export")
    parser.add_argument("--prompt", action="append", default=None, help="a prompt for --check (repeatable)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt in --check (default: 32)")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.engine.setup import resolve_device
    from tokenmill.models.model_loader.hub import resolve_model

    model_dir = resolve_model(args.model)
    device = resolve_device(args.device)
    out = Path(args.out)
    if not args.check_only:
        if args.format == "onnx":
            _require("onnx", "onnxscript")
        from tokenmill.export.decoder import load_exportable
        from tokenmill.export.formats import export

        start = time.perf_counter()
        print(f"exporting {model_dir} to {out / FILES[args.format]} ({args.dtype}, {device})", file=sys.stderr)
        decoder = load_exportable(model_dir, getattr(torch, args.dtype), device, args.max_model_len)
        path = export(decoder, args.format, out, getattr(torch, args.dtype), device, model_dir)
        print(
            f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
    if not (args.check or args.check_only):
        return 0
    if args.format == "onnx":
        _require("onnxruntime")
    from tokenmill.export.check import check_export

    report = check_export(out, model_dir, device, args.prompt, args.new_tokens)
    print(report.table())
    return 0 if report.passed else 1


def _require(*modules: str) -> None:
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} not installed: pip install 'tokenmill[export]'")
