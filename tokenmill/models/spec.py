"""Architecture facts read from a HF `config.json`, normalised across model families.

Each family module builds its `ModelSpec` from the transformers config (see `registry`); the
engine reads only the shape fields (layers, KV heads, head size, vocabulary, context length, eos).
A family that needs more (MoE experts, ...) may subclass `ModelSpec` with extra fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ModelSpec:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int
    norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v (Qwen2, GPT-2, Llama with attention_bias)
    o_bias: bool  # bias on the attention output projection (Llama with attention_bias, GPT-2)
    mlp_bias: bool
    activation: str  # a transformers ACT2FN name
    rope_inv_freq: torch.Tensor | None  # [rotary_dim // 2] fp32 (rotary families)
    rope_scaling: float  # multiplier on cos/sin ("attention factor" of YaRN etc.)
    eos_token_ids: list[int]
    bos_token_id: int | None
    hf_config: Any
    # Per layer: the sliding window (attend to the last N positions) or None for full attention.
    layer_windows: tuple[int | None, ...] = ()

    def window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def rope_parameters(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq and cos/sin scale exactly as transformers computes them (so greedy output matches)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling is not supported (its frequencies change with length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE scaling type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def layer_windows(config: Any, num_layers: int, uniform: bool = False) -> tuple[int | None, ...]:
    """Sliding windows per layer as HF applies them: `sliding_window` on the layers that
    `layer_types` marks "sliding_attention" (Qwen2 derives these from use_sliding_window and
    max_window_layers, Gemma 2/3 alternate them), or on every layer when `uniform` (Mistral,
    whose modeling code ignores layer_types)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return ()
    if uniform:
        return (int(window),) * num_layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
