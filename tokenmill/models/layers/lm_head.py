"""The vocabulary projection of the sampled rows, the largest GEMM of a small model's step."""

from __future__ import annotations

import os

import torch
from torch import nn

# TOKENMILL_LM_HEAD=linear: a plain CPU head through nn.Linear instead of the vocab-major product
# (for A/B measurements).
_MODE = os.environ.get("TOKENMILL_LM_HEAD", "auto")


def project_to_vocab(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, vocab] of hidden [rows, dim]. A packed or int8 head (tokenmill's CPU
    kernels) returns its fp32 sums unrounded: bf16 logits (8 significant bits: steps of 1/16 at
    |logit| 16-32) tie and swap near-equal tokens, the largest part of a bf16 model's disagreement with
    fp32 (SmolLM2, teacher-forced top-1: 97.2% with bf16 logits, 98.4% with fp32 ones, bench/README.md).
    This also picks the product's orientation for a plain CPU head."""
    logits = getattr(head, "logits", None)
    if logits is not None and hidden.device.type == "cpu":
        return logits(hidden)
    if hidden.device.type == "cpu" and type(head) is nn.Linear and head.bias is None and _MODE != "linear":
        # A skinny [rows, dim] x [dim, vocab] product runs 1.2-2x faster on CPU BLAS as the
        # vocab-major [vocab, dim] x [dim, rows] (measured: fp32, 49k vocab, 8-128 rows), and the
        # transposed result is a free view. The weight is read in place: no copy of it is kept.
        return torch.mm(head.weight, hidden.t()).t().float()
    return head(hidden).float()
