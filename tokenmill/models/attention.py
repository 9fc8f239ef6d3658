"""Attention over the paged KV cache, shared by every model family.

The cache of one layer is a flat array of slots `[num_blocks * block_size, kv_heads, head_dim]`;
a sequence's block table maps its positions to slots. Tokens of one step are laid out
prefill chunks first, then one token per decoding sequence, so decodes run as one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    """A chunk of one sequence's prompt: queries [start, end) of the step's tokens."""

    start: int
    end: int
    # Slots of all keys of this sequence up to the chunk's end, or None when the chunk starts the
    # sequence (then the fresh K/V are used directly with a causal mask).
    context_slots: torch.Tensor | None
    causal_mask: torch.Tensor | None  # [q_len, ctx_len] bool, with context_slots


@dataclass
class DecodeGroup:
    """Decoding sequences [start, end) of the step's decodes, padded to the group's longest context."""

    start: int
    end: int
    # [(end - start) * max_blocks] block ids, row-major: each block table padded with the zero
    # block 0 (whole-block gathers are ~5x faster than per-slot gathers).
    blocks: torch.Tensor
    mask: torch.Tensor  # [end - start, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    block_size: int = 16
    prefills: list[PrefillSegment] = field(default_factory=list)
    num_prefill_tokens: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    num_decodes: int = 0


@torch.compiler.disable  # data-dependent Python over segments: torch.compile graphs stop here
def paged_attention(
    q: torch.Tensor,  # [T, heads, dim]
    k: torch.Tensor,  # [T, kv_heads, dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache and attend; returns [T, heads * dim]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for seg in meta.prefills:
        qs = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seg.context_slots is None:
            ks = k[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
            vs = v[seg.start : seg.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            ks = k_cache[seg.context_slots].transpose(0, 1).unsqueeze(0)
            vs = v_cache[seg.context_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.causal_mask, scale=scale, enable_gqa=gqa)
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    k_blocks = k_cache.view(-1, meta.block_size, *k_cache.shape[1:])
    v_blocks = v_cache.view(-1, meta.block_size, *v_cache.shape[1:])
    for group in meta.decode_groups:
        start, end = meta.num_prefill_tokens + group.start, meta.num_prefill_tokens + group.end
        b, ctx = end - start, group.mask.shape[-1]
        qd = q[start:end].unsqueeze(2)  # [B, H, 1, D]
        kd = k_blocks.index_select(0, group.blocks).view(b, ctx, *k_cache.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
        vd = v_blocks.index_select(0, group.blocks).view(b, ctx, *v_cache.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask, scale=scale, enable_gqa=gqa)
        out[start:end] = o.squeeze(2)
    return out.flatten(1)
