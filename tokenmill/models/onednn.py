"""Linear layers on oneDNN with pre-packed weights, for CPU inference (`--onednn-linear`).

PyTorch runs a CPU `nn.Linear` through MKL's sgemm, which on this project's AMD CPUs takes a slow
code path: fp32 GEMMs of a decode batch ran at ~155 GFLOP/s. oneDNN with the weight reordered once
into its blocked layout ran the same shapes at ~400 GFLOP/s (2.5x), and the lm_head 3x faster
(microbenchmarks of the model's GEMM shapes; the end-to-end effect is in bench/README.md). The math stays fp32 (or
bf16 for bf16 weights): only the blocking and accumulation order differ, like any other BLAS.
MoE expert weights are not nn.Linear modules and stay stacked on `grouped_mm` (faster than packed
per-expert linears for most expert shapes, see moe.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# The reorder takes a typical row count; 64 (a decode batch) was as fast as a matching hint for
# 8 to 1024 rows, while a hint of 1 halved the speed of batches.
_BATCH_HINT = 64


def padded_rows(rows: int) -> int:
    """Row counts rounded up to a few buckets. oneDNN builds (JIT-compiles) a primitive for every
    new input shape; a step's token count takes hundreds of values, and building a primitive per
    step per layer type cost more than the padding does (<= 1/8 extra rows at worst)."""
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 32 if rows <= 256 else 128
    return -(-rows // step) * step


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """y = x W^T + b with W held as an opaque oneDNN tensor (not a Parameter: inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:  # e.g. [1, T, in] from HF modules (the generic path): rows are rows
            return self.forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _packable_dtypes() -> tuple[torch.dtype, ...]:
    # oneDNN's bf16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on AVX2-only CPUs it raises.
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def pack_linears(model: nn.Module) -> int:
    """Replace every plain nn.Linear of a CPU fp32/bf16 model by a PackedLinear (bf16 only where the
    CPU supports oneDNN bf16; others keep the default GEMMs); returns how many."""
    dtypes = _packable_dtypes()
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype in dtypes:
                setattr(module, name, PackedLinear(child))
                count += 1
    logger.info("oneDNN: %d linear layers packed", count)
    return count
