"""The int8 KV cache (`--kv-cache-dtype int8`): what a cache row holds and how K/V go in and out.

Each token's K (or V) row of one kv head is stored as head_dim int8 values followed by their fp32
scale (4 bytes), in one [slots, kv_heads, head_dim + 4] int8 tensor per layer: symmetric, one scale
per token and head (absmax / 127), as vLLM's and OpenVINO's CPU backends quantize per token. The
scale living in the row keeps every cache operation (block zeroing, prefix sharing, the slot
mapping) what it is for the float caches, and the attention kernel reads a row and its scale from
one cache line run. A quarter of the fp32 cache's bytes plus 4 per row (68 instead of 256 for a
head_dim of 64): attention reads less from memory and the cache holds ~3.8x the tokens.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # an fp32 scale after each row's values


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` per cache row of one kv head."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows [..., head_dim] as the cache stores them."""
    if cache_dtype != torch.int8:
        return x.to(cache_dtype)
    x = x.float()
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    values = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back as K/V [..., head_dim] in `dtype` (int8 rows are scaled back)."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)
