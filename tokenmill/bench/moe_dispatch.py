"""`tokenmill bench moe-dispatch`: the ways tokenmill can run one MoE layer's experts, timed on the
same routed tokens (batch-1 and batch-64 decode, a 512-token prefill by default).

Each way is the product code of tokenmill.models.layers.moe: the stacked weights through `grouped_mm`
(fp32 default), a loop over the experts that received tokens on plain (MKL) linears, the same loop
on packed linears (`--packed-linear`: tokenmill's fp32 panel GEMM, or oneDNN) and on torch.ao int8
linears (`--quantization int8`).
Every way is checked against the first before it is timed (fp32: within 1e-4; int8: reported).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.report import format_grid, print_report

if TYPE_CHECKING:  # (imported where used: the CLI registers this module's flags without loading torch)
    import torch


@dataclass
class DispatchRow:
    tokens: int
    method: str
    best_ms: float
    max_abs_diff: float  # against the first method, on the same tokens


def _layer(hidden: int, intermediate: int, experts: int, top_k: int, seed: int):
    import torch

    from tokenmill.models.layers.moe import MoEConfig, SparseMoE

    torch.manual_seed(seed)
    config = MoEConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=intermediate,
        normalize_top_k=True,
        weights_in_model_dtype=False,
    )
    layer = SparseMoE(hidden, config).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * hidden**-0.5)
    return layer


def _variants(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(name, layer) for each way, all with the same weights."""
    import torch

    from tokenmill.kernels.ops import cpu_kernels_available
    from tokenmill.models.layers.linear import UNQUANTIZED, LinearMethod
    from tokenmill.models.layers.packed_linear import packed_method_for
    from tokenmill.models.layers.quantization.int8 import Int8LinearMethod
    from tokenmill.models.model_loader.linear_setup import process_weights_after_loading

    def make(method: LinearMethod | None = None):
        layer = _layer(args.hidden_size, args.intermediate_size, args.num_experts, args.top_k, args.seed)
        layer.experts.linear_method = method  # (experts of a method: split into linear layers of it)
        process_weights_after_loading(layer)
        return layer

    variants = [("grouped_mm", make()), ("loop, MKL linears", make(UNQUANTIZED))]
    packed = packed_method_for(torch.float32)  # (--packed-linear itself leaves experts on grouped_mm: see moe.py)
    if packed is not None:
        variants.append(("loop, packed linears", make(packed)))
    variants.append(("loop, int8", make(Int8LinearMethod(kernels=cpu_kernels_available(torch.device("cpu"))))))
    return variants


def _best_ms(layer, x: torch.Tensor, reps: int) -> float:
    layer(x)  # warm-up: oneDNN builds its primitive for the shape
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def run(args: argparse.Namespace) -> list[DispatchRow]:
    import torch

    rows = []
    variants = _variants(args)
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden_size, generator=torch.Generator().manual_seed(tokens))
            reference = variants[0][1](x)
            for name, layer in variants:
                diff = (layer(x) - reference).abs().max().item()
                if "int8" not in name and diff > 1e-4:
                    raise RuntimeError(f"{name} disagrees with {variants[0][0]} by {diff:.2e}")
                rows.append(DispatchRow(tokens, name, _best_ms(layer, x, args.reps), diff))
    return rows


def main(args: argparse.Namespace) -> int:
    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    print(
        f"MoE layer: hidden {args.hidden_size}, expert intermediate {args.intermediate_size}, "
        f"{args.num_experts} experts, top-{args.top_k}, fp32, {torch.get_num_threads()} threads; "
        f"best of {args.reps}"
    )
    rows = run(args)
    base = {r.tokens: r.best_ms for r in rows if r.method == "grouped_mm"}
    table = [
        ["tokens", "method", "ms", "vs grouped_mm", "max |diff|"],
        *(
            [str(r.tokens), r.method, f"{r.best_ms:.2f}", f"{base[r.tokens] / r.best_ms:.2f}x", f"{r.max_abs_diff:.1e}"]
            for r in rows
        ),
    ]
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    return print_report(args, format_grid(table), {"args": settings, "rows": [asdict(r) for r in rows]})


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=positive_int, default=1024, help="model width (default: 1024)")
    parser.add_argument(
        "--intermediate-size", type=positive_int, default=3584, help="each expert's intermediate size (default: 3584)"
    )
    parser.add_argument("--num-experts", type=positive_int, default=8, help="experts in the layer (default: 8)")
    parser.add_argument("--top-k", type=positive_int, default=2, help="experts per token (default: 2)")
    parser.add_argument(
        "--tokens",
        type=positive_int,
        nargs="+",
        default=[1, 64, 512],
        metavar="N",
        help="token counts to time: decode batch sizes or a prefill length (default: 1 64 512)",
    )
    parser.add_argument(
        "--reps", type=positive_int, default=10, help="timed repetitions; the best counts (default: 10)"
    )
    parser.add_argument(
        "--num-threads", type=positive_int, default=None, help="torch threads (default: torch's default, one per core)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
