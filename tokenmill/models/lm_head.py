"""The vocabulary projection of the sampled rows, the largest GEMM of a small model's step."""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.models.onednn import PackedLinear

# TOKENMILL_LM_HEAD=vocab-major (no streaming kernel) or =linear (plain nn.Linear): for A/B measurements.
_MODE = os.environ.get("TOKENMILL_LM_HEAD", "auto")

# Rows up to which tokenmill's streaming kernel reads the fp32 weight faster than the alternative
# (`tokenmill bench kernels`: SmolLM2's 49k x 576 head, AMD Zen3, 2 threads): MKL's GEMV / vocab-major
# GEMM 2x slower at one row, within +-12% at 2-4 rows, 1.5-1.9x slower at 8-32 rows, even or ahead at
# 64 (so the cut is 32); oneDNN's packed weight (--onednn-linear) 1.1-1.3x slower at one row, even
# or ahead from 2 rows on.
_SKINNY_ROWS_VS_BLAS = 32
_SKINNY_ROWS_VS_PACKED = 1


def project_to_vocab(head: nn.Module, hidden: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits [rows, vocab] of hidden [rows, dim]. `tied_weight`: the embedding matrix when the
    head shares it (then a row-major copy of the head's weight exists even if the head is packed)."""
    plain_cpu = hidden.device.type == "cpu" and type(head) is nn.Linear and head.bias is None
    packed_tied = type(head) is PackedLinear and head.bias is None and tied_weight is not None
    weight = head.weight if plain_cpu else tied_weight if packed_tied else None
    limit = _SKINNY_ROWS_VS_BLAS if plain_cpu else _SKINNY_ROWS_VS_PACKED
    if (_MODE == "auto" and weight is not None and hidden.dim() == 2 and hidden.shape[0] <= limit
            and weight.dtype == torch.float32 and weight.is_contiguous() and ops.fused_elementwise(hidden)):
        return ops.skinny_linear(hidden, weight)
    if plain_cpu and _MODE != "linear":
        # A skinny [rows, dim] x [dim, vocab] product runs 1.2-2x faster on CPU BLAS as the
        # vocab-major [vocab, dim] x [dim, rows] (measured: fp32, 49k vocab, 8-128 rows), and the
        # transposed result is a free view. The weight is read in place: no copy of it is kept.
        return torch.mm(head.weight, hidden.t()).t().float()
    return head(hidden).float()
