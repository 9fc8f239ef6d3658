"""Qwen3: the Llama decoder with an RMSNorm over each head's queries and keys before RoPE."""

from __future__ import annotations

from tokenmill.models.families.llama import (
    LLAMA_REQUIRED_KEYS,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaLayer,
    RMSNorm,
    llama_spec,
)
from tokenmill.models.model_loader.registry import Architecture, register
from tokenmill.models.spec import ModelSpec


class Qwen3Attention(LlamaAttention):
    qk_norm_class = RMSNorm


class Qwen3Layer(LlamaLayer):
    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    supports_tensor_parallel = False  # (not tested with q/k norms yet)
    layer_class = Qwen3Layer


def qwen3_spec(config) -> ModelSpec:
    # HF Qwen3Attention: `attention_bias` on all four projections; windows from layer_types.
    bias = bool(getattr(config, "attention_bias", False))
    return llama_spec(config, qkv_bias=bias, o_bias=bias)


register(
    Architecture(
        "qwen3",
        ("Qwen3ForCausalLM",),
        Qwen3ForCausalLM,
        qwen3_spec,
        LLAMA_REQUIRED_KEYS + ("head_dim",),
        features="Llama + q/k RMSNorm per head, sliding window on layers >= max_window_layers",
    )
)
