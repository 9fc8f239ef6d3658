"""`tokenmill bench kernels`: tokenmill's C++ CPU kernels on the model's shapes, against the
machine's streaming read bandwidth and the library paths they replace.

- paged attention (`tokenmill::paged_attention`): a batch of decodes over contexts of 16-512
  tokens with the K/V caches of several layers (so they come from DRAM, as in a model step), the
  same with one small cache (L2/L3-resident: the kernel's compute rate), over bf16 and int8 caches
  (`--kv-cache-dtype`), and chunks of 64 prefill queries over their context; K/V read rate against
  `x.sum()` over a 1 GiB tensor (the streaming read rate here);
- the panel GEMM of `--packed-linear` (`tokenmill::packed_linear`) on the vocabulary projection at
  1-64 rows, with 4 copies of the weight in turn so that none is served from the last-level cache,
  and on one decoder layer's GEMMs at 1-256 rows (a decode batch is its row count; weights in
  cache: the compute rate, in GFLOP/s), against oneDNN's packed weights (what bf16 layers, and
  fp32 ones without tokenmill's kernels, run on) and MKL (a plain nn.Linear; vocab-major for the
  head, the orientation a plain head uses);
- the same GEMMs of every decoder layer in turn, each layer its own weights (from DRAM, as in a
  model step), on fp32, bf16 and int8 (`--quantization int8`) panels at 1-64 rows: ms per pass and
  the weights' read rate.

Each figure is the best of 7 timed repeats (a noisy VM slows repeats, it never speeds them up).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.engine_args import resolve_bench_model
from tokenmill.bench.report import format_grid, print_report

if TYPE_CHECKING:  # (imported where used: the CLI registers this module's flags without loading torch)
    import torch

BLOCK_SIZE = 16
PROJECTION_ROWS = (1, 2, 4, 8, 16, 32, 64)
LAYER_GEMM_ROWS = (1, 16, 64, 128, 256)
MODEL_GEMM_ROWS = (1, 8, 16, 64)
MODEL_GEMM_PANELS = ("fp32", "bf16", "int8")
GEMM_PATHS = ("panel kernel", "panel int8", "oneDNN packed", "MKL")


def best_seconds(fn: Callable[[], Any], calls: int, repeats: int = 7) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def read_bandwidth() -> float:
    """Bytes/s of `x.sum()` over a 1 GiB fp32 tensor: the streaming read rate of this machine."""
    import torch

    x = torch.ones(2**28)
    return x.numel() * 4 / best_seconds(lambda: x.sum(), calls=3)


def attention_case(
    name: str,
    heads: int,
    kv_heads: int,
    dim: int,
    contexts: np.ndarray,
    queries: int,
    layers: int,
    cache_dtype: torch.dtype,
    calls: int,
) -> dict[str, Any]:
    """ms per kernel call and the K/V bytes read per second, over `layers` caches in turn."""
    import torch

    from tokenmill.kernels import ops
    from tokenmill.models.layers.kv_quant import to_cache

    gen = torch.Generator().manual_seed(0)
    blocks = [-(-int(c) // BLOCK_SIZE) for c in contexts]
    num_blocks = sum(blocks) + 1
    order = torch.randperm(num_blocks, generator=gen).int()  # tables jump around the cache
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = order[used : used + n]
        used += n
    caches = [
        (
            to_cache(torch.randn(num_blocks * BLOCK_SIZE, kv_heads, dim, generator=gen), cache_dtype),
            to_cache(torch.randn(num_blocks * BLOCK_SIZE, kv_heads, dim, generator=gen), cache_dtype),
        )
        for _ in range(layers)
    ]
    q = torch.randn(len(contexts) * queries, heads, dim, generator=gen)
    out = torch.empty_like(q)
    starts = torch.arange(len(contexts), dtype=torch.int32) * queries
    lens = torch.full((len(contexts),), queries, dtype=torch.int32)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    turn = [0]

    def call() -> None:
        k, v = caches[turn[0] % layers]
        turn[0] += 1
        ops.paged_attention(q, k, v, out, starts, lens, tables, ctx, BLOCK_SIZE, dim**-0.5, 0, 0.0)

    seconds = best_seconds(call, calls)
    kv_bytes = int(ctx.sum()) * kv_heads * caches[0][0].shape[-1] * caches[0][0].element_size() * 2
    return {
        "case": name,
        "ms": seconds * 1e3,
        "kv_gb_per_s": kv_bytes / seconds / 1e9,
        "kv_mb": kv_bytes / 1e6,
        "sequences": len(contexts),
        "queries_per_sequence": queries,
    }


def gemm_paths(
    weights: list[torch.Tensor], vocab_major: bool = False, int8: bool = False
) -> dict[str, Callable[[torch.Tensor, int], Any]]:
    """(x, index) -> x @ weights[index]^T by each path, weights packed once up front; `int8`: also
    the weights as `--quantization int8` holds them (int8 panels and scales) on the panel GEMM."""
    import torch

    from tokenmill.kernels import ops
    from tokenmill.models.layers.linear import linear_with
    from tokenmill.models.layers.quantization.int8 import Int8LinearMethod

    panels = [ops.pack_linear_weight(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    mkl = (
        (lambda x, i: torch.mm(weights[i], x.t()))
        if vocab_major
        else (lambda x, i: torch.nn.functional.linear(x, weights[i]))
    )
    paths = {"panel kernel": lambda x, i: ops.packed_linear(x, panels[i], None, weights[i].shape[0])}
    if int8:
        layers = [linear_with(_linear_of(w), Int8LinearMethod(kernels=True)) for w in weights]
        paths["panel int8"] = lambda x, i: layers[i](x)
    paths["oneDNN packed"] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], "")
    paths["MKL"] = mkl
    return paths


def _in_turn(gemm: Callable[[torch.Tensor, int], Any], x: torch.Tensor, turn: Iterator[int]) -> Any:
    return gemm(x, next(turn) % 4)


def _linear_of(weight: torch.Tensor) -> torch.nn.Linear:
    import torch

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    return linear


def projection_cases(vocab: int, hidden: int) -> list[dict[str, Any]]:
    """ms per vocabulary projection of 1-64 rows by each path, 4 weights in turn (from DRAM)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    paths = gemm_paths([torch.randn(vocab, hidden, generator=gen) for _ in range(4)], vocab_major=True)
    weight_bytes = vocab * hidden * 4
    results = []
    for rows in PROJECTION_ROWS:
        x = torch.randn(rows, hidden, generator=gen)
        turn = itertools.count(1)  # which of the 4 weights the next call reads, across paths
        row: dict[str, Any] = {"rows": rows}
        for path, gemm in paths.items():
            row[path] = best_seconds(functools.partial(_in_turn, gemm, x, turn), calls=8) * 1e3
        row["weight_gb_per_s_kernel"] = weight_bytes / row["panel kernel"] / 1e6
        results.append(row)
    return results


def layer_gemm_shapes(hidden: int, intermediate: int, qkv_out: int, attn_out: int) -> list[tuple[int, int]]:
    """(in, out) of a decoder layer's four GEMMs: fused qkv, o, fused gate/up, down."""
    return [(hidden, qkv_out), (attn_out, hidden), (hidden, 2 * intermediate), (intermediate, hidden)]


def layer_gemm_cases(shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """ms and GFLOP/s of one decoder layer's four GEMMs (`shapes`, see layer_gemm_shapes) at
    LAYER_GEMM_ROWS rows by each path. One layer's weights stay in the last-level cache: the
    compute rate, not DRAM's."""
    import torch

    gen = torch.Generator().manual_seed(3)
    paths = gemm_paths([torch.randn(out, inp, generator=gen) for inp, out in shapes], int8=True)
    results = []
    for rows in LAYER_GEMM_ROWS:
        xs = [torch.randn(rows, inp, generator=gen) for inp, _ in shapes]
        flops = sum(2 * rows * inp * out for inp, out in shapes)
        row: dict[str, Any] = {"rows": rows}
        for path, gemm in paths.items():
            seconds = best_seconds(lambda: [gemm(x, i) for i, x in enumerate(xs)], calls=max(4, 256 // rows))
            row[path] = {"ms": seconds * 1e3, "gflop_per_s": flops / seconds / 1e9}
        results.append(row)
    return results


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """A tensor a linear method set on its layer (mypy sees nn.Module's attributes as Tensor | Module)."""
    tensor: torch.Tensor = getattr(module, name)
    return tensor


def model_gemm_cases(shapes: list[tuple[int, int]], layers: int) -> list[dict[str, Any]]:
    """ms per pass over `layers` decoder layers' GEMMs (`shapes`: (in, out) each), every layer its
    own weights, and GB/s of the weights read, on fp32, bf16 and int8 panels at MODEL_GEMM_ROWS rows."""
    import torch

    from tokenmill.kernels import ops
    from tokenmill.models.layers.linear import linear_with
    from tokenmill.models.layers.quantization.int8 import Int8LinearMethod

    gen = torch.Generator().manual_seed(4)
    weights = [[torch.randn(out, inp, generator=gen) for inp, out in shapes] for _ in range(layers)]

    def panel_path(dtype: torch.dtype) -> tuple[Callable[[torch.Tensor, int, int], Any], int]:
        packed = [[ops.pack_linear_weight(w.to(dtype)) for w in layer] for layer in weights]
        nbytes = sum(t.numel() * t.element_size() for layer in packed for t in layer)
        return (lambda x, i, j: ops.packed_linear(x, packed[i][j], None, shapes[j][1])), nbytes

    int8 = [[linear_with(_linear_of(w), Int8LinearMethod(kernels=True)) for w in layer] for layer in weights]
    int8_tensors = [[(_tensor(m, "qweight"), _tensor(m, "scales")) for m in layer] for layer in int8]
    int8_bytes = sum(t.numel() * t.element_size() for layer in int8_tensors for pair in layer for t in pair)

    def int8_gemm(x: torch.Tensor, i: int, j: int) -> torch.Tensor:  # (the op itself, as the fp32 path calls it)
        qweight, scales = int8_tensors[i][j]
        return ops.packed_int8_linear(x, qweight, scales, None, int8[i][j].out_features)

    paths = {"fp32": panel_path(torch.float32), "bf16": panel_path(torch.bfloat16), "int8": (int8_gemm, int8_bytes)}
    results = []
    for rows in MODEL_GEMM_ROWS:
        xs = [torch.randn(rows, inp, generator=gen) for inp, _ in shapes]
        row: dict[str, Any] = {"rows": rows, "layers": layers}
        for name, (gemm, nbytes) in paths.items():

            def one_pass() -> None:
                for i in range(layers):
                    for j, x in enumerate(xs):
                        gemm(x, i, j)

            with torch.inference_mode():
                seconds = best_seconds(one_pass, calls=1, repeats=5)
            row[name] = {"ms": seconds * 1e3, "weight_gb_per_s": nbytes / seconds / 1e9}
        results.append(row)
    return results


def main(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig

    from tokenmill.kernels.build import load

    if not load():
        print("tokenmill's CPU kernels are not available here (TOKENMILL_CPU_KERNELS=0 or no compiler)")
        return 1
    config = AutoConfig.from_pretrained(resolve_bench_model(args.model))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    bandwidth = read_bandwidth()
    contexts = np.random.default_rng(2).integers(16, 513, size=args.batch)
    attention = [
        attention_case(
            "decode, fp32 caches of 8 layers (DRAM)", heads, kv_heads, dim, contexts, 1, 8, torch.float32, 20
        ),
        attention_case(
            "decode, one fp32 cache of 1/8 the contexts (cached)",
            heads,
            kv_heads,
            dim,
            contexts // 8 + 1,
            1,
            1,
            torch.float32,
            100,
        ),
        attention_case(
            "decode, bf16 caches of 8 layers (DRAM)", heads, kv_heads, dim, contexts, 1, 8, torch.bfloat16, 20
        ),
        attention_case("decode, int8 caches of 8 layers (DRAM)", heads, kv_heads, dim, contexts, 1, 8, torch.int8, 20),
        attention_case(
            "prefill chunks of 64 queries, 8 sequences",
            heads,
            kv_heads,
            dim,
            contexts[:8] + 64,
            64,
            1,
            torch.float32,
            5,
        ),
    ]
    projection = projection_cases(config.vocab_size, config.hidden_size)
    shapes = layer_gemm_shapes(config.hidden_size, config.intermediate_size, (heads + 2 * kv_heads) * dim, heads * dim)
    gemms = layer_gemm_cases(shapes)
    model_gemms = model_gemm_cases(shapes, config.num_hidden_layers)
    rows = [
        [
            a["case"],
            f"{a['ms']:.3f}",
            f"{a['kv_mb']:.1f}",
            f"{a['kv_gb_per_s']:.1f}",
            f"{a['kv_gb_per_s'] / (bandwidth / 1e9):.0%}",
        ]
        for a in attention
    ]
    tables = [
        f"streaming read (x.sum over 1 GiB): {bandwidth / 1e9:.1f} GB/s; {torch.get_num_threads()} threads",
        format_grid(
            [["paged attention", "ms/call", "K/V MB", "K/V GB/s", "of read rate"], *rows],
            f"paged attention, {args.batch} sequences, heads {heads}/{kv_heads}, head_dim {dim}",
        ),
        format_grid(
            [
                ["rows", "panel kernel ms", "oneDNN packed ms", "MKL vocab-major ms", "kernel GB/s"],
                *[
                    [
                        str(p["rows"]),
                        f"{p['panel kernel']:.2f}",
                        f"{p['oneDNN packed']:.2f}",
                        f"{p['MKL']:.2f}",
                        f"{p['weight_gb_per_s_kernel']:.1f}",
                    ]
                    for p in projection
                ],
            ],
            f"vocabulary projection, {config.vocab_size} x {config.hidden_size} fp32",
        ),
        format_grid(
            [
                ["rows", *[f"{path} {unit}" for path in GEMM_PATHS for unit in ("ms", "GFLOP/s")]],
                *[
                    [
                        str(g["rows"]),
                        *[
                            f"{g[path][key]:{fmt}}"
                            for path in GEMM_PATHS
                            for key, fmt in (("ms", ".3f"), ("gflop_per_s", ".0f"))
                        ],
                    ]
                    for g in gemms
                ],
            ],
            "one decoder layer's GEMMs (qkv, o, gate/up, down), fp32 weights (panel int8: "
            "--quantization int8's), weights in cache",
        ),
        format_grid(
            [
                ["rows", *[f"{panels} {unit}" for panels in MODEL_GEMM_PANELS for unit in ("ms", "GB/s")]],
                *[
                    [
                        str(g["rows"]),
                        *[
                            f"{g[panels][key]:{fmt}}"
                            for panels in MODEL_GEMM_PANELS
                            for key, fmt in (("ms", ".2f"), ("weight_gb_per_s", ".1f"))
                        ],
                    ]
                    for g in model_gemms
                ],
            ],
            f"the {config.num_hidden_layers} decoder layers' GEMMs in turn, each layer its own "
            "weights (from DRAM), on fp32, bf16 and int8 panels",
        ),
    ]
    return print_report(
        args,
        "\n\n".join(tables),
        {
            "read_bandwidth_gb_per_s": bandwidth / 1e9,
            "attention": attention,
            "vocab_projection": projection,
            "layer_gemms": gemms,
            "model_gemms": model_gemms,
        },
    )


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="model whose shapes to use: directory or hub name (default: the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--batch", type=positive_int, default=64, metavar="N", help="decode sequences per attention call (default: 64)"
    )
