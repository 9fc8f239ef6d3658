"""Llama-family decoder (Llama, Qwen2, Mistral): RMSNorm, RoPE, GQA, SwiGLU, paged attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.attention import AttentionMetadata, paged_attention
from tokenmill.models.lm_head import project_to_vocab
from tokenmill.models.parallel import NO_TP, TPInfo, all_reduce
from tokenmill.models.spec import ModelSpec

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm: normalise in fp32, then scale in the input dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    """`spec` holds this rank's shapes: with tensor parallelism, its share of the heads."""

    def __init__(self, spec: ModelSpec, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        # q, k and v fused into one GEMM.
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)
        return all_reduce(self.o_proj(out), self.tp)


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        if spec.activation != "silu":
            raise ValueError(f"unsupported activation {spec.activation!r} for the Llama family")
        self.intermediate = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return all_reduce(self.down_proj(F.silu(gate) * up), self.tp)


class LlamaLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.self_attn = LlamaAttention(spec, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = LlamaMLP(spec, tp)

    def forward(self, x, cos, sin, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    supports_tensor_parallel = True

    def __init__(self, spec: ModelSpec, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(spec, tp) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rebuild_buffers()

    def rebuild_buffers(self, device: torch.device | str | None = None) -> None:
        """cos/sin table for every position, computed like transformers' LlamaRotaryEmbedding."""
        device = device or "cpu"  # explicit: construction may run under a meta-device context
        positions = torch.arange(self.spec.max_position, dtype=torch.float, device=device)
        freqs = positions[:, None] * self.spec.rope_inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos() * self.spec.rope_scaling, persistent=False)
        self.register_buffer("rope_sin", emb.sin() * self.spec.rope_scaling, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache, meta: AttentionMetadata):
        """input_ids/positions: [T]. Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # [T, 1, D], broadcast over heads
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project_to_vocab(self.lm_head, hidden)

    @staticmethod
    def hf_to_local(name: str) -> tuple[str, int | None, str | None]:
        """Map a HF weight name to (local name, shard index, fused group) for loading."""
        name = name.removeprefix("model.")
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            if f"self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), i, "qkv"
        for i, proj in enumerate(("gate_proj", "up_proj")):
            if f"mlp.{proj}." in name:
                return name.replace(proj, "gate_up_proj"), i, "gate_up"
        return name, None, None
