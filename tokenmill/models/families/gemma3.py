"""Gemma 3 (text, `Gemma3ForCausalLM`): Gemma 2 with a (1 + w) RMSNorm over each head's queries and
keys, and a RoPE of its own (`rope_local_base_freq`) on the sliding-window layers."""

from __future__ import annotations

from tokenmill.models.families.gemma import GemmaRMSNorm
from tokenmill.models.families.gemma2 import GEMMA2_REQUIRED_KEYS, Gemma2ForCausalLM, Gemma2Layer, gemma2_spec
from tokenmill.models.families.llama import LlamaAttention
from tokenmill.models.model_loader.registry import Architecture, register
from tokenmill.models.spec import ModelSpec, rope_from_config


class Gemma3Attention(LlamaAttention):
    qk_norm_class = GemmaRMSNorm


class Gemma3Layer(Gemma2Layer):
    attention_class = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3Layer


def gemma3_spec(config) -> ModelSpec:
    spec = gemma2_spec(config)
    # transformers 5 keeps one RoPE parameter set per layer type.
    spec.rope = rope_from_config(config, spec.head_dim, "full_attention")
    if "sliding_attention" in config.layer_types:
        spec.local_rope = rope_from_config(config, spec.head_dim, "sliding_attention")
    return spec


register(
    Architecture(
        "gemma3_text",
        ("Gemma3ForCausalLM",),
        Gemma3ForCausalLM,
        gemma3_spec,
        GEMMA2_REQUIRED_KEYS,
        features="Gemma 2 + q/k norm, local RoPE base on sliding layers, layer_types pattern",
    )
)
