"""The vocabulary projection of the sampled rows, the largest GEMM of a small model's step."""

from __future__ import annotations

import os

import torch
from torch import nn

# TOKENMILL_LM_HEAD=linear: a plain CPU head through nn.Linear instead of the vocab-major product
# (for A/B measurements).
_MODE = os.environ.get("TOKENMILL_LM_HEAD", "auto")


def project_to_vocab(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, vocab] of hidden [rows, dim]. A packed head (--packed-linear, the CPU
    default) runs as packed; this only picks the product's orientation for a plain CPU head."""
    if hidden.device.type == "cpu" and type(head) is nn.Linear and head.bias is None and _MODE != "linear":
        # A skinny [rows, dim] x [dim, vocab] product runs 1.2-2x faster on CPU BLAS as the
        # vocab-major [vocab, dim] x [dim, rows] (measured: fp32, 49k vocab, 8-128 rows), and the
        # transposed result is a free view. The weight is read in place: no copy of it is kept.
        return torch.mm(head.weight, hidden.t()).t().float()
    return head(hidden).float()
