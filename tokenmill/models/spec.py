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
    rope: Rope | None  # rotary families
    eos_token_ids: list[int]
    bos_token_id: int | None
    hf_config: Any
    # Per layer: the sliding window (attend to the last N positions) or None for full attention.
    layer_windows: tuple[int | None, ...] = ()
    local_rope: Rope | None = None  # RoPE of the sliding-window layers, when it differs (Gemma 3)
    attn_scale: float | None = None  # attention logit scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits -> softcap * tanh(logits / softcap) (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    # The context length served (the engine's max_model_len); None: max_position. RoPE tables cover
    # it, and it picks LongRoPE's factor set.
    context_len: int | None = None

    def window(self, layer_idx: int) -> int | None:
        return self.layer_windows[layer_idx] if self.layer_windows else None


def as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding frequencies, exactly as transformers computes them.

    LongRoPE (Phi-3 "longrope"/"su") has two sets: short factors for sequences up to
    `original_max_position_embeddings`, long ones beyond. HF generate uses the short set until a
    sequence outgrows that length and then recomputes its whole cache with the long set. Rotating
    cached K/V again is not something a paged cache can do, so tokenmill picks one set for the
    served context length (`--max-model-len`): long when it exceeds the original length, short
    otherwise. Tokens are then identical to HF for every request whose prompt already exceeds the
    original length (long context) or, with `--max-model-len` at most the original length, for
    every request (short context); they differ only while a request that started short has not yet
    outgrown it, where HF still uses the short factors.
    """

    inv_freq: torch.Tensor  # [rotary_dim // 2] fp32; rotary_dim < head_dim rotates a prefix only
    scaling: float = 1.0  # multiplier on cos/sin ("attention factor" of YaRN, LongRoPE)
    long_inv_freq: torch.Tensor | None = None  # LongRoPE: used when the context exceeds long_from
    long_from: int | None = None

    def table(self, num_positions: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [num_positions, rotary_dim] for a context of `num_positions`."""
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None:
            assert self.long_from is not None  # (LongRoPE's two sets come with the length between them)
            if num_positions > self.long_from:
                inv_freq = self.long_inv_freq
        positions = torch.arange(num_positions, dtype=torch.float, device=device)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


def rope_from_config(config: Any, head_dim: int, layer_type: str | None = None) -> Rope:
    """The RoPE of `config` (of one layer type's entry for per-type parameters, Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        dim = int(head_dim * partial)
        return Rope(1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling is not supported (its frequencies change with length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE scaling type {rope_type!r}")
    init = ROPE_INIT_FUNCTIONS[rope_type]
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = init(config, torch.device("cpu"), **kwargs)
    if rope_type != "longrope":
        return Rope(inv_freq.float(), float(scaling))
    original = int(params["original_max_position_embeddings"])
    long_inv_freq, _ = init(config, torch.device("cpu"), seq_len=original + 1, **kwargs)
    return Rope(inv_freq.float(), float(scaling), long_inv_freq.float(), original)


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
