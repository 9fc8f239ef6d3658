"""Phi-3: the Llama decoder read from fused `qkv_proj` / `gate_up_proj` checkpoints, with partial
rotary dims and LongRoPE (see `spec.rope_from_config` for the short/long factor choice)."""

from __future__ import annotations

from tokenmill.models.families.llama import LLAMA_REQUIRED_KEYS, LlamaForCausalLM, llama_spec
from tokenmill.models.model_loader.registry import Architecture, register
from tokenmill.models.spec import ModelSpec


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's fused projections are the Llama classes' own layout: hf_to_local passes them
    # through. (gate first in gate_up_proj, as HF's chunk(2) reads it.)
    supports_tensor_parallel = False  # (not tested for Phi-3 yet)


def phi3_spec(config) -> ModelSpec:
    # HF Phi3Attention passes config.sliding_window to every layer.
    return llama_spec(config, qkv_bias=False, o_bias=False, uniform_window=True)


register(
    Architecture(
        "phi3",
        ("Phi3ForCausalLM",),
        Phi3ForCausalLM,
        phi3_spec,
        LLAMA_REQUIRED_KEYS,
        features="fused qkv/gate_up checkpoints, partial rotary, LongRoPE (per-position short/long)",
    )
)
