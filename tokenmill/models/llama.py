"""Llama-family decoder (Llama, Qwen2, Mistral): RMSNorm, RoPE, GQA, SwiGLU, paged attention."""

from __future__ import annotations

import torch
from torch import nn

from transformers.activations import ACT2FN

from tokenmill.models.attention import AttentionMetadata, paged_attention
from tokenmill.models.lm_head import project_to_vocab
from tokenmill.models.parallel import NO_TP, TPInfo, all_reduce
from tokenmill.models.registry import Architecture, register
from tokenmill.models.spec import ModelSpec, layer_windows, rope_parameters

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

    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.window = spec.window(layer_idx)
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        # q, k and v fused into one GEMM.
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window)
        return all_reduce(self.o_proj(out), self.tp)


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.act = ACT2FN[spec.activation]  # transformers' own activation, so outputs match exactly
        self.intermediate = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return all_reduce(self.down_proj(self.act(gate) * up), self.tp)


class LlamaLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.self_attn = LlamaAttention(spec, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = LlamaMLP(spec, tp)

    def forward(self, x, cos, sin, kv, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    supports_tensor_parallel = True
    ignored_checkpoint_tensors = ("rotary_emb.inv_freq",)  # old checkpoints saved the RoPE buffer
    tied_weights = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, spec: ModelSpec, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(spec, i, tp) for i in range(spec.num_layers))
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


LLAMA_REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "vocab_size", "rms_norm_eps", "max_position_embeddings")


def llama_spec(config, *, qkv_bias: bool, o_bias: bool, uniform_window: bool = False) -> ModelSpec:
    """The spec of a Llama-shaped decoder (RMSNorm, RoPE, GQA, gated MLP)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inv_freq, scaling = rope_parameters(config, head_dim)
    return ModelSpec(
        model_type=config.model_type,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings,
        norm_eps=config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        activation=getattr(config, "hidden_act", "silu"),
        rope_inv_freq=inv_freq,
        rope_scaling=scaling,
        eos_token_ids=[],
        bos_token_id=getattr(config, "bos_token_id", None),
        hf_config=config,
        layer_windows=layer_windows(config, config.num_hidden_layers, uniform=uniform_window),
    )


def _llama(config) -> ModelSpec:
    # HF LlamaAttention: `attention_bias` puts a bias on all four projections, o_proj included.
    bias = bool(getattr(config, "attention_bias", False))
    return llama_spec(config, qkv_bias=bias, o_bias=bias)


register(Architecture("llama", ("LlamaForCausalLM",), LlamaForCausalLM, _llama, LLAMA_REQUIRED_KEYS,
                      features="RoPE (+ scaling), GQA, optional attention/MLP biases"))
register(Architecture("mistral", ("MistralForCausalLM",), LlamaForCausalLM,
                      lambda c: llama_spec(c, qkv_bias=False, o_bias=False, uniform_window=True),
                      LLAMA_REQUIRED_KEYS, features="Llama + sliding-window attention on every layer"))
register(Architecture("qwen2", ("Qwen2ForCausalLM",), LlamaForCausalLM,
                      lambda c: llama_spec(c, qkv_bias=True, o_bias=False), LLAMA_REQUIRED_KEYS,
                      features="Llama + q/k/v biases, sliding window on layers >= max_window_layers"))
