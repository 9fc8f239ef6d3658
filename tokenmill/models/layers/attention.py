"""Attention over the paged KV cache, shared by every model family.

The cache of one layer is a flat array of slots `[num_blocks * block_size, kv_heads, head_dim]`;
a sequence's block table maps its positions to slots. Tokens of one step are laid out
prefill chunks first, then one token per decoding sequence, so decodes run as one batched call.

On CPU with tokenmill's kernels built (tokenmill.kernels), decodes and chunks with cached context
are attended by one fused kernel call that reads K/V blocks in place (`AttentionMetadata.paged`);
chunks that start their sequence keep SDPA on the fresh K/V (no gather to avoid there), except under
batch invariance, where they go to the kernel too: SDPA's sums over a chunk's keys are not the
kernel's, so a position's bits would depend on whether its context came in one chunk or several.
Elsewhere decodes gather whole blocks into a padded tensor for SDPA (`decode_groups`); under batch
invariance every query is attended on fixed shapes there instead (fixed_shapes.fixed_block_attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.kernels import ops
from tokenmill.models.layers.fixed_shapes import fixed_block_attention
from tokenmill.models.layers.kv_quant import from_cache, to_cache


@dataclass
class PrefillSegment:
    """A chunk of one sequence's prompt: queries [start, end) of the step's tokens."""

    start: int
    end: int
    # Slots of all keys of this sequence up to the chunk's end, or None when the chunk starts the
    # sequence (then the fresh K/V are used directly with a causal mask).
    context_slots: torch.Tensor | None
    causal_mask: torch.Tensor | None  # [q_len, ctx_len] bool, with context_slots
    # Instead of context_slots: the slots of the cached keys before the chunk, the chunk's own keys
    # being the fresh K/V (see _attend_after_context).
    cached_slots: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    """Decoding sequences [start, end) of the step's decodes, padded to the group's longest context."""

    start: int
    end: int
    # [(end - start) * max_blocks] block ids, row-major: each block table padded with the zero
    # block 0 (whole-block gathers are much faster than per-slot gathers).
    blocks: torch.Tensor
    mask: torch.Tensor  # [end - start, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass
class PagedQueries:
    """Sequences the fused CPU kernel attends, reading their K/V blocks where they are: sequence s
    has rows query_start[s] : query_start[s] + query_lens[s] of the step's tokens as queries, the
    last query_lens[s] of its context_lens[s] positions (a decode is one query)."""

    query_start: torch.Tensor  # [S] int32
    query_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with the zero block
    context_lens: torch.Tensor  # [S] int32


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    block_size: int = 16
    prefills: list[PrefillSegment] = field(default_factory=list)
    num_prefill_tokens: int = 0
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    paged: PagedQueries | None = None  # queries for the fused CPU kernel (tokenmill.kernels)

    @property
    def paged_only(self) -> bool:
        """Whether every query of the step is attended by the fused CPU kernel."""
        return self.paged is not None and not self.prefills and not self.decode_groups


def _window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """True where a key is within the sliding window of a query, as HF masks it: q - k < window."""
    return key_pos[None, :] > query_pos[:, None] - window


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None
) -> torch.Tensor:
    """Attention of q [B, H, Lq, D] over k/v [B, Hkv, Lk, D]; mask (True = attend) broadcasts to
    [B, H, Lq, Lk], None means causal. Logit softcapping (Gemma 2) is not something SDPA can do:
    with a softcap the scores are computed explicitly, in HF's op order."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


@torch.compiler.disable  # data-dependent Python over segments: torch.compile graphs stop here
def paged_attention(
    q: torch.Tensor,  # [T, heads, dim]
    k: torch.Tensor,  # [T, kv_heads, dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache and attend; returns [T, heads * dim].

    `window`: sliding-window attention, each query sees only the keys of the last `window`
    positions (itself included). `softcap`: attention logits become softcap * tanh(logits / softcap).
    """
    # The cache may be narrower than the model (--kv-cache-dtype): K/V are rounded (or quantized, int8)
    # into it, and read back in the model's dtype (the CPU kernel converts as it reads).
    k_cache.index_copy_(0, meta.slot_mapping, to_cache(k, k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, to_cache(v, v_cache.dtype))
    q = q.contiguous()
    out = torch.empty_like(q)
    if meta.paged is not None:
        p = meta.paged
        paged = (p.query_start, p.query_lens, p.block_tables, p.context_lens, meta.block_size, scale, window, softcap)
        if ops.cpu_kernels_available(q.device):
            ops.paged_attention(q, k_cache, v_cache, out, *paged)
        else:  # (batch invariance: see fixed_shapes)
            out = fixed_block_attention(q, k_cache, v_cache, *paged)
    for seg in meta.prefills:
        n = seg.end - seg.start
        qs = q[seg.start : seg.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seg.cached_slots is not None:
            o = _attend_after_context(qs, k, v, k_cache, v_cache, seg, meta, scale, window, softcap)
            out[seg.start : seg.end] = o[0].transpose(0, 1)
            continue
        if seg.context_slots is None:  # the chunk starts its sequence: keys are the fresh K/V
            ks, vs, mask = k[seg.start : seg.end], v[seg.start : seg.end], None
            if window is not None and n > window:
                positions = torch.arange(n, device=q.device)
                mask = (positions[None, :] <= positions[:, None]) & _window_mask(positions, positions, window)
        else:
            slots, mask = seg.context_slots, seg.causal_mask
            assert mask is not None  # (set with context_slots)
            if window is not None:
                # Keys are positions 0..ctx-1 and the chunk's queries the last n of them; keys before
                # the first query's window are never seen: do not gather them.
                ctx = slots.shape[0]
                first = max(0, ctx - n - window + 1)
                key_pos = torch.arange(first, ctx, device=q.device)
                slots, mask = slots[first:], mask[:, first:] & _window_mask(key_pos[-n:], key_pos, window)
            ks, vs = from_cache(k_cache[slots], q.dtype), from_cache(v_cache[slots], q.dtype)
        o = _attend(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), mask, scale, softcap)
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    if meta.decode_groups:
        _attend_decode_groups(q, k_cache, v_cache, out, meta, scale, window, softcap)
    return out.flatten(1)


def _attend_after_context(
    qs: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seg: PrefillSegment,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """A long chunk after cached context: attention over the cached keys (all visible) and over the
    chunk's own keys (causal) as two flash-attention calls, merged by their log-sum-exps. PyTorch's
    flash kernel runs the blocks of both as GEMMs, faster than the paged kernel's per-tile dot
    products at thousands of queries (`tokenmill bench offline --long-prompts`). A sliding window or
    softcap takes the masked path over all the keys."""
    assert seg.cached_slots is not None
    fresh = slice(seg.start, seg.end)
    if window is not None or softcap is not None:
        slots = torch.cat([seg.cached_slots, meta.slot_mapping[fresh]])
        n, ctx = qs.shape[-2], slots.shape[0]
        key_pos = torch.arange(ctx, device=qs.device)
        mask = key_pos[None, :] <= key_pos[ctx - n :, None]
        if window is not None:
            first = max(0, ctx - n - window + 1)
            slots, key_pos, mask = slots[first:], key_pos[first:], mask[:, first:]
            mask = mask & _window_mask(torch.arange(ctx - n, ctx, device=qs.device), key_pos, window)
        ks, vs = from_cache(k_cache[slots], qs.dtype), from_cache(v_cache[slots], qs.dtype)
        return _attend(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), mask, scale, softcap)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cached_k = from_cache(k_cache[seg.cached_slots], qs.dtype).transpose(0, 1).unsqueeze(0)
    cached_v = from_cache(v_cache[seg.cached_slots], qs.dtype).transpose(0, 1).unsqueeze(0)
    before, lse_before = flash(qs, cached_k, cached_v, 0.0, False, scale=scale)[:2]
    own, lse_own = flash(
        qs, k[fresh].transpose(0, 1).unsqueeze(0), v[fresh].transpose(0, 1).unsqueeze(0), 0.0, True, scale=scale
    )[:2]
    lse = torch.logaddexp(lse_before, lse_own)
    merged = before.float() * torch.exp(lse_before - lse).unsqueeze(-1)
    merged += own.float() * torch.exp(lse_own - lse).unsqueeze(-1)
    return merged.to(qs.dtype)


def _attend_decode_groups(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> None:
    """Decodes without the CPU kernel: whole blocks gathered into a padded batch for SDPA."""
    k_blocks = k_cache.view(-1, meta.block_size, *k_cache.shape[1:])
    v_blocks = v_cache.view(-1, meta.block_size, *v_cache.shape[1:])
    for group in meta.decode_groups:
        start, end = meta.num_prefill_tokens + group.start, meta.num_prefill_tokens + group.end
        b, ctx = end - start, group.mask.shape[-1]
        qd = q[start:end].unsqueeze(2)  # [B, H, 1, D]
        kd = from_cache(k_blocks.index_select(0, group.blocks).view(b, ctx, *k_cache.shape[1:]), q.dtype).transpose(
            1, 2
        )
        vd = from_cache(v_blocks.index_select(0, group.blocks).view(b, ctx, *v_cache.shape[1:]), q.dtype).transpose(
            1, 2
        )
        mask = group.mask
        if window is not None:
            # The valid keys are a prefix of each row (its context length); keep its last `window`.
            ctx_lens = mask.sum(-1, keepdim=True)
            mask = mask & (torch.arange(ctx, device=q.device) >= ctx_lens - window)
        o = _attend(qd, kd, vd, mask, scale, softcap)
        out[start:end] = o.squeeze(2)
