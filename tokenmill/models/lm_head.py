"""The vocabulary projection of the sampled rows, the largest GEMM of a small model's step."""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.kernels import ops

# TOKENMILL_LM_HEAD=vocab-major (no streaming kernel) or =linear (plain nn.Linear): for A/B measurements.
_MODE = os.environ.get("TOKENMILL_LM_HEAD", "auto")

# Up to this many rows (a step's sampled rows), tokenmill's streaming kernel reads the fp32 weight
# at memory speed: 1.6-1.9x MKL at one row, 1.2-1.3x the vocab-major GEMM at 48-64 rows, never
# slower in between (SmolLM2's 49k x 576 head, AMD Zen3, 2 threads); above, the GEMM.
_SKINNY_ROWS = 64


def project_to_vocab(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, vocab] of hidden [rows, dim]."""
    plain_cpu = hidden.device.type == "cpu" and type(head) is nn.Linear and head.bias is None
    if (plain_cpu and _MODE == "auto" and hidden.dim() == 2 and hidden.shape[0] <= _SKINNY_ROWS
            and head.weight.dtype == torch.float32 and head.weight.is_contiguous() and ops.fused_elementwise(hidden)):
        return ops.skinny_linear(hidden, head.weight)
    if plain_cpu and _MODE != "linear":
        # A skinny [rows, dim] x [dim, vocab] product runs 1.2-2x faster on CPU BLAS as the
        # vocab-major [vocab, dim] x [dim, rows] (measured: fp32, 49k vocab, 8-128 rows), and the
        # transposed result is a free view. The weight is read in place: no copy of it is kept.
        return torch.mm(head.weight, hidden.t()).t().float()
    return head(hidden).float()
