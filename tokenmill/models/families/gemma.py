"""Gemma (1): the Llama decoder with (1 + w) RMSNorms computed in fp32, embeddings scaled by
sqrt(hidden_size), a GELU-tanh gated MLP and tied embeddings."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.models.families.llama import (
    LLAMA_REQUIRED_KEYS,
    LlamaForCausalLM,
    LlamaLayer,
    RMSNorm,
    llama_spec,
    rms_normalize,
)
from tokenmill.models.model_loader.registry import Architecture, register
from tokenmill.models.spec import ModelSpec

GEMMA_REQUIRED_KEYS = LLAMA_REQUIRED_KEYS + ("head_dim",)


class GemmaRMSNorm(RMSNorm):
    """HF's GemmaRMSNorm: weights stored as offsets from 1; normalised and scaled in fp32, then cast."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


class GemmaLayer(LlamaLayer):
    norm_class = GemmaRMSNorm


class GemmaForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = False  # (not tested for the Gemma family yet)
    layer_class = GemmaLayer
    norm_class = GemmaRMSNorm


def check_causal(config) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True (an embedding model) is not a causal LM")


def gemma_spec(config, activation: str | None = None) -> ModelSpec:
    """The Gemma spec every Gemma generation starts from (HF: attention_bias on all four projections)."""
    check_causal(config)
    bias = bool(getattr(config, "attention_bias", False))
    spec = llama_spec(config, qkv_bias=bias, o_bias=bias, activation=activation)
    spec.embed_scale = config.hidden_size**0.5
    return spec


register(
    Architecture(
        "gemma",
        ("GemmaForCausalLM",),
        GemmaForCausalLM,
        gemma_spec,
        GEMMA_REQUIRED_KEYS,
        features="(1 + w) RMSNorm, sqrt(hidden) embedding scale, GELU-tanh MLP",
    )
)
