"""Batch invariance where tokenmill's row-invariant kernels do not run (CUDA, or a CPU without them):
every op whose per-row arithmetic can depend on the shape it is called with runs on fixed shapes only.

A library GEMM or reduction picks its kernel, tiling and split of the reduction by the shape of the
call (cuBLAS's heuristics, ATen's reduction configs): a row of a 7-row step and the same row of a
300-row step may be summed in different orders. Called on one fixed shape, the same kernel computes
every row the same way, whatever the other rows hold. So, with `--batch-invariant` on such a device:

- linear layers (their method wrapped in `FixedRowsMethod` at load) and norms (`FixedRows`) run on
  chunks of exactly ROWS rows, the last one padded;
- attention (`fixed_block_attention`) takes the step's queries in chunks of QUERY_ROWS and every
  query's keys in blocks of KEY_BLOCK, merged in key order by an online softmax: a query sees the
  same blocks in the same order whether it is decoded alone, is one row of a prefill chunk, or
  shares the step with any others (blocks past its position add exact zeros).

The price is the padding (a decode step of a few rows pays for ROWS) and one library call per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.models.layers.kv_quant import from_cache
from tokenmill.models.layers.linear import FusedProjection, Linear, LinearMethod

ROWS = 64  # rows per linear/norm call
QUERY_ROWS = 16  # queries per attention chunk
KEY_BLOCK = 64  # keys per attention block


def on_fixed_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """fn (an op whose output rows depend only on the same input rows) over x's rows (its last
    dimension a row) in calls of exactly `rows` rows, zero-padded."""
    flat = x.reshape(-1, x.shape[-1])
    count = flat.shape[0]
    padded = -(-max(count, 1) // rows) * rows
    if padded != count:
        flat = torch.cat([flat, flat.new_zeros(padded - count, flat.shape[1])])
    out = torch.cat([fn(chunk) for chunk in flat.split(rows)])[:count]
    return out.view(*x.shape[:-1], out.shape[-1])


class FixedRowsMethod(LinearMethod):
    """A linear layer's method (any: float or quantized) computing on fixed-size chunks of rows
    (on_fixed_rows), its logits too; the layer's tensors are the wrapped method's. Given to every
    linear layer at load (model_loader/linear_setup.py) where batch invariance runs without tokenmill's
    CPU kernels."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.name = f"{inner.name} on fixed rows"
        self.tensor_names = inner.tensor_names

    def create_weights(self, layer: Linear) -> None:
        self.inner.create_weights(layer)

    def packed_sizes(self, layer: Linear) -> list[tuple[int, torch.dtype]]:
        return self.inner.packed_sizes(layer)

    def process_weights_after_loading(self, layer: Linear, storage: list[torch.Tensor]) -> None:
        self.inner.process_weights_after_loading(layer, storage)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return on_fixed_rows(lambda rows: self.inner.apply(layer, rows), x)

    def logits(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return on_fixed_rows(lambda rows: self.inner.logits(layer, rows), x)

    def dequantized(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.dequantized(layer, dtype)

    def fused_projection(self, layer: Linear, activations: torch.dtype) -> FusedProjection | None:
        return None  # (the fused decoder layers take a step's rows as they come)

    def tied_embedding(self, layer: Linear, embedding: nn.Embedding) -> nn.Module | None:
        return self.inner.tied_embedding(layer, embedding)

    def streamed_tensors(self, layer: Linear) -> list[torch.Tensor]:
        return self.inner.streamed_tensors(layer)

    def describe(self, layer: Linear) -> str:
        return f"{self.inner.describe(layer)} on fixed rows"


class FixedRows(nn.Module):
    """A row-wise module that is not a linear layer (a norm) called on fixed-size chunks of rows
    (on_fixed_rows)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return on_fixed_rows(self.inner, x)

    def __getattr__(self, name: str) -> Any:  # (weight, eps ...: the wrapped module's)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


def fix_row_shapes(model: nn.Module, row_wise: tuple[type[nn.Module], ...]) -> int:
    """Wrap every module of `model` of the `row_wise` types in FixedRows; returns how many."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, FixedRows):
            continue
        for name, child in list(module.named_children()):
            if isinstance(child, row_wise):
                setattr(module, name, FixedRows(child))
                count += 1
    return count


def fixed_block_attention(
    q: torch.Tensor,  # [T, heads, dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, dim(+4 for int8 rows)]
    v_cache: torch.Tensor,
    query_start: torch.Tensor,  # [S] int32: each sequence's first query row
    query_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    context_lens: torch.Tensor,  # [S]: a sequence's queries are the last query_lens of its context
    block_size: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every query over its sequence's paged K/V in fp32, on fixed shapes (see
    the module docstring); returns [T, heads, dim] in q's dtype."""
    device, (tokens, heads, dim) = q.device, q.shape
    kv_heads = k_cache.shape[1]
    seqs = torch.arange(len(query_lens), device=device)
    seq_of = torch.repeat_interleave(seqs, query_lens.to(device).long(), output_size=tokens)
    row = torch.arange(tokens, device=device)
    first = (context_lens.to(device) - query_lens.to(device)).long()
    pos = first[seq_of] + row - query_start.to(device).long()[seq_of]
    tables = block_tables.to(device).long()
    padded = -(-max(tokens, 1) // QUERY_ROWS) * QUERY_ROWS
    extra = padded - tokens
    # padding queries: sequence 0's first position, outputs dropped
    qs = torch.cat([q.float(), q.new_zeros(extra, heads, dim, dtype=torch.float32)]) if extra else q.float()
    pos_p = torch.cat([pos, pos.new_zeros(extra)]) if extra else pos
    seq_p = torch.cat([seq_of, seq_of.new_zeros(extra)]) if extra else seq_of
    out = torch.empty(padded, heads, dim, dtype=torch.float32, device=device)
    offsets = torch.arange(KEY_BLOCK, device=device)
    group = heads // kv_heads
    for start in range(0, padded, QUERY_ROWS):
        chunk = slice(start, start + QUERY_ROWS)
        qc, pc, table = qs[chunk], pos_p[chunk], tables[seq_p[chunk]]
        m = torch.full((QUERY_ROWS, heads), float("-inf"), device=device)
        total = torch.zeros(QUERY_ROWS, heads, device=device)
        acc = torch.zeros(QUERY_ROWS, heads, dim, device=device)
        for first_key in range(0, int(pc.max()) + 1, KEY_BLOCK):
            keys = first_key + offsets  # [B]
            visible = keys[None, :] <= pc[:, None]  # [R, B]
            if window is not None:
                visible &= keys[None, :] > pc[:, None] - window
            block = (keys // block_size).clamp(max=table.shape[1] - 1)
            slots = table[:, block] * block_size + keys % block_size  # [R, B]
            k = from_cache(k_cache[slots], torch.float32).repeat_interleave(group, dim=2)  # [R, B, H, D]
            v = from_cache(v_cache[slots], torch.float32).repeat_interleave(group, dim=2)
            s = (qc[:, None] * k).sum(-1) * scale  # [R, B, H]
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            s = s.masked_fill(~visible[..., None], float("-inf"))
            m_new = torch.maximum(m, s.amax(1))
            seen = m_new > float("-inf")
            correction = torch.where(seen, torch.exp(m - m_new), torch.ones_like(m))
            p = torch.where(visible[..., None] & seen[:, None], torch.exp(s - m_new[:, None]), torch.zeros_like(s))
            v = v.masked_fill(~visible[..., None, None], 0.0)  # (no 0 x garbage from slots it cannot see)
            total = total * correction + p.sum(1)
            acc = acc * correction[..., None] + (p[..., None] * v).sum(1)
            m = m_new
        out[start : start + QUERY_ROWS] = acc / total[..., None]
    return out[:tokens].to(q.dtype)
