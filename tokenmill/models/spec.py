"""Architecture facts read from a HF `config.json`, normalised across model families."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# HF `model_type` -> tokenmill model family.
LLAMA_FAMILY = {"llama", "qwen2", "mistral"}
GPT2_FAMILY = {"gpt2"}
SUPPORTED = sorted(LLAMA_FAMILY | GPT2_FAMILY)


@dataclass
class ModelSpec:
    family: str  # "llama" | "gpt2"
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
    attention_bias: bool  # bias on q/k/v (Qwen2, GPT-2)
    mlp_bias: bool
    activation: str
    rope_inv_freq: torch.Tensor | None  # [head_dim // 2] fp32 (Llama family)
    rope_scaling: float  # multiplier on cos/sin ("attention factor" of YaRN etc.)
    eos_token_ids: list[int]
    bos_token_id: int | None
    hf_config: Any

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def spec_from_hf_config(config: Any, generation_eos: list[int] | None = None) -> ModelSpec:
    model_type = getattr(config, "model_type", None)
    if model_type in LLAMA_FAMILY:
        spec = _llama_spec(config)
    elif model_type in GPT2_FAMILY:
        spec = _gpt2_spec(config)
    else:
        raise ValueError(
            f"unsupported architecture {model_type!r} ({getattr(config, 'architectures', None)}); "
            f"tokenmill supports: {', '.join(SUPPORTED)}"
        )
    eos = generation_eos if generation_eos else _as_list(getattr(config, "eos_token_id", None))
    spec.eos_token_ids = [int(e) for e in eos]
    return spec


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _llama_spec(config: Any) -> ModelSpec:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inv_freq, scaling = _rope_parameters(config, head_dim)
    max_position = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        # We attend over the full context, which equals sliding-window attention only within the window.
        max_position = min(max_position, int(window))
    return ModelSpec(
        family="llama",
        model_type=config.model_type,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position=max_position,
        norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2",
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        activation=getattr(config, "hidden_act", "silu"),
        rope_inv_freq=inv_freq,
        rope_scaling=scaling,
        eos_token_ids=[],
        bos_token_id=getattr(config, "bos_token_id", None),
        hf_config=config,
    )


def _rope_parameters(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
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


def _gpt2_spec(config: Any) -> ModelSpec:
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
        raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx/reorder_and_upcast_attn are not supported")
    return ModelSpec(
        family="gpt2",
        model_type=config.model_type,
        hidden_size=config.n_embd,
        num_layers=config.n_layer,
        num_heads=config.n_head,
        num_kv_heads=config.n_head,
        head_dim=config.n_embd // config.n_head,
        intermediate_size=config.n_inner or 4 * config.n_embd,
        vocab_size=config.vocab_size,
        max_position=config.n_positions,
        norm_eps=config.layer_norm_epsilon,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        activation=config.activation_function,
        rope_inv_freq=None,
        rope_scaling=1.0,
        eos_token_ids=[],
        bos_token_id=getattr(config, "bos_token_id", None),
        hf_config=config,
    )
