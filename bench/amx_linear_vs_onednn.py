"""tokenmill's AMX tiles (`tokenmill::amx_linear`, decode-sized bf16 steps) against oneDNN's bf16 GEMM
on the same reordered weights: SmolLM2's 120 layer GEMMs, each layer its own weights (from DRAM, as in
a model step), ms a pass (best of 9) at 1-96 rows. `onednn_linear` takes the AMX path up to 64 rows
where the CPU has AMX; `mkldnn::_linear_pointwise` is oneDNN alone.

    python bench/amx_linear_vs_onednn.py
"""

from __future__ import annotations

import time

import torch

from tokenmill.kernels import build

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down of SmolLM2-135M
LAYERS = 30


def layer_weights() -> list[list[torch.Tensor]]:
    """Each layer's four bf16 weights, random, reordered by oneDNN as OneDnnLinearMethod reorders them."""
    return [
        [torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k) / k**0.5).bfloat16(), 64) for n, k in SHAPES]
        for _ in range(LAYERS)
    ]


def best_pass(gemm, weights: list[list[torch.Tensor]], rows: int, repeats: int = 9) -> float:
    """ms of the fastest of `repeats` passes of gemm(x, weight) over every layer's weights."""
    xs = {k: torch.randn(rows, k).bfloat16() for k in {k for _, k in SHAPES}}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in weights:
            for (_, k), w in zip(SHAPES, layer):
                gemm(xs[k], w)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    if not build.load():
        raise SystemExit("tokenmill's CPU kernels are not built here")
    torch.manual_seed(0)
    weights = layer_weights()
    amx = torch.ops.tokenmill.amx_linear_applies(torch.ones(1, 576, dtype=torch.bfloat16), weights[0][0])
    print(f"AMX path here: {amx}; weights {sum(n * k for n, k in SHAPES) * LAYERS * 2 / 1e6:.1f} MB")
    print("rows  tokenmill onednn_linear ms  oneDNN alone ms")
    for rows in (1, 8, 16, 32, 48, 64, 96):
        ours = best_pass(lambda x, w: torch.ops.tokenmill.onednn_linear(x, w, None), weights, rows)
        theirs = best_pass(lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), weights, rows)
        print(f"{rows:4d}  {ours:27.2f}  {theirs:15.2f}")


if __name__ == "__main__":
    main()
