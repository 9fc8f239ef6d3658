"""Llama-shaped decoders: RMSNorm, RoPE, GQA paged attention, gated MLP.

Llama, Mistral and Qwen2 are served by these classes as they are; Qwen3, Gemma 1/2/3 and Phi-3
subclass them (class attributes choose the norm, the q/k norm and the layer; spec fields carry
the rest: windows, softcaps, attention and embedding scales, per-layer RoPE).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.activations import ACT2FN

from tokenmill.kernels import ops
from tokenmill.kernels.ops import fused_elementwise
from tokenmill.models.layers.attention import AttentionMetadata, paged_attention
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.parallel import NO_TP, TPInfo, all_reduce
from tokenmill.models.model_loader.registry import Architecture, register
from tokenmill.models.spec import ModelSpec, layer_windows, rope_from_config

if TYPE_CHECKING:
    from tokenmill.models.layers.fused_layer import FusedLayer, FusedStack

KVCache = list[tuple[torch.Tensor, torch.Tensor]]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x divided by its root mean square over the last dim, computed (and returned) in fp32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and fused_elementwise(x):
            return ops.rms_norm(x, self.weight, self.eps)
        # Same op order as transformers' LlamaRMSNorm: normalise in fp32, then scale in the input dtype.
        return self.weight * rms_normalize(x, self.eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, 1, rotary_dim]; a partial rotary_dim (Phi-3's
    partial_rotary_factor) rotates the leading dims and passes the rest through."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


class LlamaAttention(nn.Module):
    """`spec` holds this rank's shapes: with tensor parallelism, its share of the heads."""

    qk_norm_class: type[nn.Module] | None = None  # RMSNorm over each head's q and k (Qwen3, Gemma 3)

    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.window = spec.window(layer_idx)
        self.softcap = spec.attn_softcap
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        # q, k and v fused into one GEMM.
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        # The layers LoRA adapters may target, by the output sizes of their fused parts (tokenmill.lora).
        self.lora_parts = {"qkv_proj": (self.q_size, self.kv_size, self.kv_size), "o_proj": (spec.hidden_size,)}
        self.scale = spec.attn_scale if spec.attn_scale is not None else self.head_dim**-0.5
        if self.qk_norm_class is not None:
            self.q_norm = self.qk_norm_class(spec.head_dim, spec.norm_eps)
            self.k_norm = self.qk_norm_class(spec.head_dim, spec.norm_eps)

    def forward(self, x, cos, sin, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        q, k, v = self.project_qkv(x, cos, sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.window, self.softcap)
        return all_reduce(self.o_proj(out), self.tp)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, heads, dim] and k, v [T, kv_heads, dim] of tokens x [T, hidden], rotated (q, k)."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm_class is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if fused_elementwise(q):  # in place: q and k are fresh (views of this step's projection)
            ops.rope_(q, k, cos.view(cos.shape[0], -1), sin.view(sin.shape[0], -1))
            return q, k, v
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.tp = tp
        self.act = ACT2FN[spec.activation]  # transformers' own activation, so outputs match exactly
        self.silu = spec.activation == "silu"  # (SiLU(gate) * up has a fused CPU kernel)
        self.intermediate = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.lora_parts = {"gate_up_proj": (spec.intermediate_size,) * 2, "down_proj": (spec.hidden_size,)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu and gate_up.dim() == 2 and fused_elementwise(gate_up):
            return all_reduce(self.down_proj(ops.silu_mul(gate_up)), self.tp)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return all_reduce(self.down_proj(self.act(gate) * up), self.tp)


class LlamaLayer(nn.Module):
    norm_class: type[nn.Module] = RMSNorm
    attention_class: type[nn.Module] = LlamaAttention
    mlp_class: type[nn.Module] = LlamaMLP

    def __init__(self, spec: ModelSpec, layer_idx: int, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.input_layernorm = self.norm_class(spec.hidden_size, spec.norm_eps)
        self.self_attn = self.attention_class(spec, layer_idx, tp)
        self.post_attention_layernorm = self.norm_class(spec.hidden_size, spec.norm_eps)
        self.mlp = self.mlp_class(spec, tp)
        # The layer as one C++ call (tokenmill.models.layers.fused_layer), where it applies.
        self.fused: FusedLayer | None = None

    def forward(self, x, cos, sin, kv, meta):
        if self.fused is not None and self.fused.applies(meta):
            return self.fused(x, cos, sin, kv, meta)
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    supports_tensor_parallel = True
    ignored_checkpoint_tensors = ("rotary_emb.inv_freq",)  # old checkpoints saved the RoPE buffer
    tied_weights = {"lm_head.weight": "embed_tokens.weight"}
    layer_class: type[nn.Module] = LlamaLayer
    norm_class: type[nn.Module] = RMSNorm
    # cos/sin tables (rebuild_buffers); _1: of the local RoPE, where the spec has one
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_cos_1: torch.Tensor
    rope_sin_1: torch.Tensor

    def __init__(self, spec: ModelSpec, tp: TPInfo = NO_TP) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(spec, i, tp) for i in range(spec.num_layers))
        self.norm = self.norm_class(spec.hidden_size, spec.norm_eps)
        # Every layer fused (tokenmill.models.layers.fused_layer.FusedStack), where it applies.
        self.fused_stack: FusedStack | None = None
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Which RoPE table each layer reads: 1 = the local one of sliding layers (Gemma 3).
        self.layer_rope = [
            int(spec.local_rope is not None and spec.window(i) is not None) for i in range(spec.num_layers)
        ]
        self.rebuild_buffers()

    def rebuild_buffers(self, device: torch.device | str | None = None) -> None:
        """cos/sin tables for every position, computed like transformers' rotary embeddings."""
        device = device or "cpu"  # explicit: construction may run under a meta-device context
        assert self.spec.rope is not None, "Llama-shaped decoders are rotary"
        ropes = [self.spec.rope] + ([self.spec.local_rope] if self.spec.local_rope is not None else [])
        for i, rope in enumerate(ropes):
            cos, sin = rope.table(self.spec.context_len or self.spec.max_position, device)
            suffix = f"_{i}" if i else ""
            self.register_buffer("rope_cos" + suffix, cos, persistent=False)
            self.register_buffer("rope_sin" + suffix, sin, persistent=False)

    def _rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [T, 1, rotary_dim] of each RoPE table, broadcast over heads."""
        tables = [(self.rope_cos, self.rope_sin)]
        if self.spec.local_rope is not None:
            tables.append((self.rope_cos_1, self.rope_sin_1))
        return [(cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)) for cos, sin in tables]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache, meta: AttentionMetadata):
        """input_ids/positions: [T]. Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.spec.embed_scale is not None:
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)  # HF rounds the scale to the dtype first
        if self.fused_stack is not None and self.fused_stack.applies(meta):
            return self.fused_stack(x, positions, (self.rope_cos, self.rope_sin), kv_caches, meta)
        rope = self._rope_at(positions, x.dtype)
        for layer, kv, table in zip(self.layers, kv_caches, self.layer_rope):
            x = layer(x, *rope[table], kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        if self.spec.final_softcap is not None:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits

    @staticmethod
    def hf_to_local(name: str) -> tuple[str, int | None, str | None]:
        """Map a HF weight name to (local name, shard index, fused group) for loading. Checkpoints
        that already fuse them (Phi-3's qkv_proj / gate_up_proj) pass through unchanged."""
        name = name.removeprefix("model.")
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            if f"self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), i, "qkv"
        for i, proj in enumerate(("gate_proj", "up_proj")):
            if f"mlp.{proj}." in name:
                return name.replace(proj, "gate_up_proj"), i, "gate_up"
        return name, None, None


LLAMA_REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
)


def llama_spec(
    config, *, qkv_bias: bool, o_bias: bool, uniform_window: bool = False, activation: str | None = None
) -> ModelSpec:
    """The spec of a Llama-shaped decoder (RMSNorm, RoPE, GQA, gated MLP); families change fields
    of it (dataclasses.replace) for what they add."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    activation = activation or getattr(config, "hidden_act", "silu")
    if not isinstance(activation, str) or activation not in ACT2FN:
        raise ValueError(f"unsupported activation {activation!r}")
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
        activation=activation,
        rope=rope_from_config(config, head_dim),
        eos_token_ids=[],
        bos_token_id=getattr(config, "bos_token_id", None),
        hf_config=config,
        layer_windows=layer_windows(config, config.num_hidden_layers, uniform=uniform_window),
    )


def _llama(config) -> ModelSpec:
    # HF LlamaAttention: `attention_bias` puts a bias on all four projections, o_proj included.
    bias = bool(getattr(config, "attention_bias", False))
    return llama_spec(config, qkv_bias=bias, o_bias=bias)


register(
    Architecture(
        "llama",
        ("LlamaForCausalLM",),
        LlamaForCausalLM,
        _llama,
        LLAMA_REQUIRED_KEYS,
        features="RoPE (+ linear/YaRN/Llama-3/LongRoPE scaling), GQA, optional attention/MLP biases",
    )
)
register(
    Architecture(
        "mistral",
        ("MistralForCausalLM",),
        LlamaForCausalLM,
        lambda c: llama_spec(c, qkv_bias=False, o_bias=False, uniform_window=True),
        LLAMA_REQUIRED_KEYS,
        features="Llama + sliding-window attention on every layer",
    )
)
register(
    Architecture(
        "qwen2",
        ("Qwen2ForCausalLM",),
        LlamaForCausalLM,
        lambda c: llama_spec(c, qkv_bias=True, o_bias=False),
        LLAMA_REQUIRED_KEYS,
        features="Llama + q/k/v biases, sliding window on layers >= max_window_layers",
    )
)
