"""int8 GEMMs on AMX tiles against the int8 panel GEMM they replace from 12-16 rows up (fp32 x: AMX-int8
tiles; bf16 x: the weights widened to bf16 on AMX-bf16 tiles, from 1,024 rows on oneDNN), and against
the bf16 GEMM (`onednn_linear`, oneDNN / AMX-bf16) a bf16 model runs: SmolLM2's 120 layer GEMMs, each
layer its own weights (from DRAM, as in a model step), ms a pass (best of 5) at 1-2,048 rows. The
panel GEMM's figures come from a second process with TOKENMILL_AMX_INT8=0 (the switch is read once
per process).

    python bench/amx_int8_vs_panels.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tokenmill.kernels import build

sys.path.insert(0, os.path.dirname(__file__))
from amx_linear_vs_onednn import LAYERS, SHAPES, best_pass, layer_weights

ROWS = (1, 2, 4, 8, 12, 16, 32, 64, 128, 256, 512, 1024, 2048)


def int8_layer_weights() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each layer's four weights as tokenmill's int8 layers pack them (groups of 32, bf16 scales)."""
    from tokenmill.models.layers.quantization.int8 import GROUP_SIZE, quantize_weight

    def packed(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, scales = quantize_weight(torch.randn(n, k) / k**0.5, GROUP_SIZE)
        return torch.ops.tokenmill.pack_int8_weight(q), torch.ops.tokenmill.pack_linear_weight(scales)

    return [[packed(n, k) for n, k in SHAPES] for _ in range(LAYERS)]


def gemm(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.ops.tokenmill.packed_int8_linear(x, w[0], w[1], None, w[1].shape[0] * w[1].shape[2])


def int8_passes(dtype: torch.dtype = torch.float32) -> dict[int, float]:
    """ms a pass of the int8 GEMMs with x in `dtype` (a fp32 or a bf16 model's activations)."""
    weights = int8_layer_weights()
    return {rows: best_pass(lambda x, w: gemm(x.to(dtype), w), weights, rows, repeats=5) for rows in ROWS}


def main() -> None:
    if not build.load():
        raise SystemExit("tokenmill's CPU kernels are not built here")
    torch.manual_seed(0)
    if "--int8-only" in sys.argv:
        print(json.dumps(int8_passes()))
        return
    amx = torch.ops.tokenmill.amx_int8_usable()
    panels = json.loads(
        subprocess.run(
            [sys.executable, __file__, "--int8-only"],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "TOKENMILL_AMX_INT8": "0"},
        ).stdout
    )
    tiles, bf16_tiles = int8_passes(), int8_passes(torch.bfloat16)
    bf16 = layer_weights()
    print(
        f"AMX-int8 tiles here: {amx}; int8 weights {sum(n * k for n, k in SHAPES) * LAYERS * 1.0625 / 1e6:.1f} MB "
        f"with scales, bf16 {sum(n * k for n, k in SHAPES) * LAYERS * 2 / 1e6:.1f} MB"
    )
    print("ms a pass; int8 x fp32: panels only (TOKENMILL_AMX_INT8=0) / as dispatched (AMX-int8 tiles from 16 rows);")
    print(
        "int8 x bf16 as dispatched (panels, bf16 tiles from 12 rows, oneDNN from 1,024); bf16 weights on onednn_linear"
    )
    print("rows  int8 fp32 panels  int8 fp32  int8 bf16  bf16 weights")
    for rows in ROWS:
        onednn = best_pass(lambda x, w: torch.ops.tokenmill.onednn_linear(x, w, None), bf16, rows, repeats=5)
        print(f"{rows:4d}  {panels[str(rows)]:16.2f}  {tiles[rows]:9.2f}  {bf16_tiles[rows]:9.2f}  {onednn:12.2f}")


if __name__ == "__main__":
    main()
