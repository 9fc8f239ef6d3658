"""The exportable decoder step: tokenmill's native Llama-family layers and weights, with attention
over explicit past K/V tensors instead of the paged cache.

One call runs `input_ids` [batch, seq] after `past_key_values.{i}.key/value` [batch, kv_heads,
past, head_dim] and returns `logits` [batch, seq, vocab] (fp32) and `present.{i}.key/value` [batch,
kv_heads, past + seq, head_dim]: the decoder-with-past layout Optimum and onnxruntime-genai use.
`attention_mask` [batch, past + seq] marks real tokens (1) and padding (0); `position_ids` [batch,
seq] are the tokens' positions (left-padded rows count from their first real token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch import nn

from tokenmill.models.families.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

# Input and output names (Optimum's / onnxruntime-genai's).
INPUTS = ("input_ids", "attention_mask", "position_ids")


def past_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]


@dataclass
class PastKV:
    """What every layer's attention needs in an exported step (it stands in for the paged
    AttentionMetadata): the step's shape, which keys each query may see, and the presents so far."""

    batch: int
    seq: int
    visible: torch.Tensor  # [batch, 1, seq, past + seq] bool, causal + padding (full attention)
    window_visible: dict[int, torch.Tensor] = field(default_factory=dict)  # the same per sliding window
    presents: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def build(cls, attention_mask: torch.Tensor, seq: int, windows: set[int]) -> PastKV:
        batch, total = attention_mask.shape
        past = total - seq
        key = torch.arange(total, device=attention_mask.device)[None, :]
        query = torch.arange(seq, device=attention_mask.device)[:, None] + past
        causal = key <= query
        own = key == query  # a padding query sees at least itself: its row stays finite (no NaN spreads)
        real = attention_mask[:, None, None, :].bool()
        visible = (real & causal) | own
        # Padding is all at the start of a row, so index distance is position distance.
        windowed = {w: (real & causal & (key > query - w)) | own for w in windows}
        return cls(batch, seq, visible, windowed)

    def mask(self, window: int | None) -> torch.Tensor:
        return self.visible if window is None else self.window_visible[window]


class ContiguousAttention(nn.Module):
    """A native attention layer's projections, norms and RoPE, attending over past + new K/V."""

    def __init__(self, attention: LlamaAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: PastKV
    ) -> torch.Tensor:
        a = self.attention
        q, k, v = a.project_qkv(x, cos, sin)
        b, s = meta.batch, meta.seq
        q = q.view(b, s, a.num_heads, a.head_dim).transpose(1, 2)  # [B, H, S, D]
        k = torch.cat((kv[0], k.view(b, s, a.num_kv_heads, a.head_dim).transpose(1, 2)), dim=2)
        v = torch.cat((kv[1], v.view(b, s, a.num_kv_heads, a.head_dim).transpose(1, 2)), dim=2)
        meta.presents += [k, v]
        if a.num_heads != a.num_kv_heads:  # GQA: each K/V head serves a group of query heads
            group = a.num_heads // a.num_kv_heads
            k = k[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)
            v = v[:, :, None].expand(-1, -1, group, -1, -1).flatten(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * a.scale
        if a.softcap is not None:
            scores = torch.tanh(scores / a.softcap) * a.softcap
        scores = scores.masked_fill(~meta.mask(a.window), float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
        return a.o_proj(out.transpose(1, 2).reshape(b * s, a.num_heads * a.head_dim))


class ExportDecoder(nn.Module):
    """forward(input_ids, attention_mask, position_ids, *past) -> (logits, *presents), flat
    tensors in the order of `past_names` / `present_names` (what tracing exporters take)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = exportable(model)
        for layer in self.model.layers:
            layer.self_attn = ContiguousAttention(cast(LlamaAttention, layer.self_attn))  # (as `exportable` checked)
        self.windows = {w for w in self.model.spec.layer_windows if w is not None}

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        batch, seq = input_ids.shape
        meta = PastKV.build(attention_mask, seq, self.windows)
        kv = [(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)]
        hidden = self.model(input_ids.reshape(-1), position_ids.reshape(-1), kv, meta)
        logits = self.model.compute_logits(hidden).view(batch, seq, -1)
        return (logits, *meta.presents)


def exportable(model: nn.Module) -> LlamaForCausalLM:
    """`model`, checked: only dense Llama-family decoders export (their attention and MLP are the
    ones handled here)."""
    families = "llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, phi3"
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(
            f"export supports the native Llama-family architectures ({families}), not {type(model).__name__}"
        )
    for layer in model.layers:
        if not isinstance(layer.self_attn, LlamaAttention) or not isinstance(layer.mlp, LlamaMLP):
            raise ValueError(
                f"export supports dense Llama-family layers ({families}); "
                f"{type(model).__name__} has {type(layer.mlp).__name__} layers (mixture of experts "
                "routing is data-dependent and is not exported)"
            )
    return model


def load_exportable(
    model_dir: Path, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None
) -> ExportDecoder:
    """The native model of `model_dir` (plain linear layers: no oneDNN packing, no quantization)."""
    from tokenmill.models.model_loader.loader import load_model

    model, _ = load_model(model_dir, dtype, device, progress=False, max_model_len=max_model_len, model_impl="native")
    return ExportDecoder(model).eval()


def empty_past(decoder: ExportDecoder, batch: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Past K/V of no tokens, one key and one value per layer."""
    spec = decoder.model.spec
    shape = (batch, spec.num_kv_heads, 0, spec.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * decoder.num_layers)]
