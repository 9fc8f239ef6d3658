"""GPT-2 decoder: learned positions, LayerNorm, fused QKV with bias, GELU MLP, paged attention."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from tokenmill.models.layers.attention import AttentionMetadata, paged_attention
from tokenmill.models.layers.linear import Linear
from tokenmill.models.model_loader.registry import Architecture, register
from tokenmill.models.spec import ModelSpec

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class GPT2Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.head_dim = spec.head_dim
        self.c_attn = Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.c_proj = Linear(spec.hidden_size, spec.hidden_size, bias=True)
        self.scale = attention_scale(spec.hf_config, self.head_dim, layer_idx)

    def forward(self, x: torch.Tensor, kv, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        return self.c_proj(paged_attention(q, k, v, kv[0], kv[1], meta, self.scale))


class GPT2MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.c_fc = Linear(spec.hidden_size, spec.intermediate_size, bias=True)
        self.c_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=True)
        self.act = ACT2FN[spec.activation]  # transformers' own activation, so outputs match exactly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.attn = GPT2Attention(spec, layer_idx)
        self.ln_2 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mlp = GPT2MLP(spec)

    def forward(self, x, kv, meta):
        x = x + self.attn(self.ln_1(x), kv, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2ForCausalLM(nn.Module):
    supports_tensor_parallel = False
    # Causal-mask buffers that old GPT-2 checkpoints saved next to the weights.
    ignored_checkpoint_tensors = (".attn.bias", ".attn.masked_bias")
    tied_weights = {"lm_head.weight": "wte.weight"}

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.wpe = nn.Embedding(spec.max_position, spec.hidden_size)
        self.h = nn.ModuleList(GPT2Block(spec, i) for i in range(spec.num_layers))
        self.ln_f = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache, meta: AttentionMetadata):
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv in zip(self.h, kv_caches):
            x = block(x, kv, meta)
        return self.ln_f(x)

    def rebuild_buffers(self, device: torch.device | str | None = None) -> None:
        """GPT-2 has no computed buffers."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    @staticmethod
    def hf_to_local(name: str) -> tuple[str, int | None, str | None]:
        return name.removeprefix("transformer."), None, None

    # HF GPT-2 stores these as Conv1D ([in, out]); Linear wants [out, in].
    transposed_weights = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def attention_scale(config, head_dim: int, layer_idx: int) -> float:
    """HF GPT2Attention's scaling: 1/sqrt(d) unless scale_attn_weights=False, and optionally
    divided by the layer number (scale_attn_by_inverse_layer_idx)."""
    scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(layer_idx + 1)
    return scale


def gpt2_spec(config) -> ModelSpec:
    # (reorder_and_upcast_attn only upcasts attention to fp32 in half precision: same maths.)
    return ModelSpec(
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
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        activation=config.activation_function,
        rope=None,
        eos_token_ids=[],
        bos_token_id=getattr(config, "bos_token_id", None),
        hf_config=config,
    )


register(
    Architecture(
        "gpt2",
        ("GPT2LMHeadModel",),
        GPT2ForCausalLM,
        gpt2_spec,
        ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions", "layer_norm_epsilon"),
        features="learned positions, LayerNorm, GELU MLP, Conv1D checkpoints",
    )
)
