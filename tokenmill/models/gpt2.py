"""GPT-2 decoder: learned positions, LayerNorm, fused QKV with bias, GELU MLP, paged attention."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from tokenmill.models.attention import AttentionMetadata, paged_attention
from tokenmill.models.lm_head import project_to_vocab
from tokenmill.models.spec import ModelSpec

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class GPT2Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.head_dim = spec.head_dim
        self.c_attn = nn.Linear(spec.hidden_size, 3 * spec.hidden_size)
        self.c_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, kv, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        return self.c_proj(paged_attention(q, k, v, kv[0], kv[1], meta, self.scale))


class GPT2MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.c_fc = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.c_proj = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = ACT2FN[spec.activation]  # transformers' own activation, so outputs match exactly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.attn = GPT2Attention(spec)
        self.ln_2 = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mlp = GPT2MLP(spec)

    def forward(self, x, kv, meta):
        x = x + self.attn(self.ln_1(x), kv, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2ForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.wpe = nn.Embedding(spec.max_position, spec.hidden_size)
        self.h = nn.ModuleList(GPT2Block(spec) for _ in range(spec.num_layers))
        self.ln_f = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache, meta: AttentionMetadata):
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv in zip(self.h, kv_caches):
            x = block(x, kv, meta)
        return self.ln_f(x)

    def rebuild_buffers(self, device: torch.device | str | None = None) -> None:
        """GPT-2 has no computed buffers."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project_to_vocab(self.lm_head, hidden)

    @staticmethod
    def hf_to_local(name: str) -> tuple[str, int | None, str | None]:
        return name.removeprefix("transformer."), None, None

    # HF GPT-2 stores these as Conv1D ([in, out]); nn.Linear wants [out, in].
    transposed_weights = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
