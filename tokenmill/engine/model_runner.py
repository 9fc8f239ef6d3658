"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.sampler import Sampler, SamplerOutput
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.models.attention import AttentionMetadata, DecodeGroup, PrefillSegment

# Cost of one extra decode-attention call, in padded (sequence x block) gathers: splitting the
# decodes into length groups stops paying for padding once a group would save fewer than this.
_GROUP_OVERHEAD_BLOCKS = 24
_MAX_DECODE_GROUPS = 4


def split_by_length(num_blocks: list[int], overhead: int = _GROUP_OVERHEAD_BLOCKS,
                    max_groups: int = _MAX_DECODE_GROUPS) -> list[tuple[int, int]]:
    """Cut ascending block counts into contiguous groups [start, end) that minimise the padded
    gather size (each group is padded to its longest, last member) plus `overhead` per group."""
    # Cuts only fall between runs of equal counts: a DP over the (few) distinct counts.
    ends = [i + 1 for i in range(len(num_blocks)) if i + 1 == len(num_blocks) or num_blocks[i + 1] != num_blocks[i]]
    runs = len(ends)
    inf = float("inf")
    # best[g][r]: cheapest cover of the first r runs with g groups; cut[g][r]: runs before the last group.
    best = [[inf] * (runs + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (runs + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    for g in range(1, max_groups + 1):
        for r in range(1, runs + 1):
            width = num_blocks[ends[r - 1] - 1]
            for j in range(g - 1, r):
                first = ends[j - 1] if j else 0
                cost = best[g - 1][j] + (ends[r - 1] - first) * width + overhead
                if cost < best[g][r]:
                    best[g][r], cut[g][r] = cost, j
    groups = min(range(1, max_groups + 1), key=lambda g: best[g][runs])
    bounds, r = [], runs
    for g in range(groups, 0, -1):
        j = cut[g][r]
        bounds.append((ends[j - 1] if j else 0, ends[r - 1]))
        r = j
    return bounds[::-1]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, sampler: Sampler,
                 device: torch.device, tp_group: Any = None) -> None:
        self.model = model
        self.tp_group = tp_group  # TensorParallelGroup: workers replay each step's inputs
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        # Test hook (fault injection): a callable(list[Sequence]) run before the forward pass.
        self.before_forward = None

    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return block_table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _decode_groups(self, seqs: list, ctx_lens: torch.Tensor) -> list[DecodeGroup]:
        """Decodes (sorted by context) in length groups, each padded only to its own longest table."""
        bs = self.block_size
        groups = []
        for start, end in split_by_length([len(s.block_table) for s in seqs]):
            members = seqs[start:end]
            width = max(len(s.block_table) for s in members)
            tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in members], dtype=torch.long)
            # Unused tail slots of a sequence's last block were zeroed when the block was allocated
            # and padded table entries are the zero block: masked positions never hold NaN garbage.
            valid = torch.arange(width * bs)[None, :] < ctx_lens[start:end, None]
            groups.append(DecodeGroup(start, end, tables.flatten().to(self.device),
                                      valid.view(end - start, 1, 1, -1).to(self.device)))
        return groups

    def prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the step's tokens (prefill chunks first, then decodes) and build attention metadata."""
        bs = self.block_size
        ids: list[int] = []
        pos_chunks: list[torch.Tensor] = []
        slot_chunks: list[torch.Tensor] = []
        segments: list[PrefillSegment] = []
        sample_rows: list[int] = []
        for item in batch.prefills:
            seq, n = item.seq, item.num_new_tokens
            start, c = len(ids), seq.num_computed_tokens
            ids.extend(seq.token_ids[c : c + n])
            table = torch.tensor(seq.block_table, dtype=torch.long)
            positions = torch.arange(c, c + n)
            pos_chunks.append(positions)
            slot_chunks.append(self._slots(table, positions))
            if c == 0:
                segments.append(PrefillSegment(start, start + n, None, None))
            else:
                ctx = torch.arange(c + n)
                mask = ctx[None, :] <= positions[:, None]
                segments.append(PrefillSegment(start, start + n, self._slots(table, ctx).to(self.device), mask.to(self.device)))
            if item.samples:
                sample_rows.append(start + n - 1)
        num_prefill = len(ids)

        meta = AttentionMetadata(slot_mapping=torch.empty(0), block_size=bs, prefills=segments,
                                 num_prefill_tokens=num_prefill)
        if batch.decodes:
            # Shortest block table first, so that length groups are contiguous runs of the decodes.
            batch.decodes.sort(key=lambda item: len(item.seq.block_table))
            seqs = [item.seq for item in batch.decodes]
            ctx_lens = torch.tensor([s.num_computed_tokens + 1 for s in seqs])
            positions = ctx_lens - 1  # each decode's new token
            last_blocks = torch.tensor([s.block_table[p // bs] for s, p in zip(seqs, positions.tolist())], dtype=torch.long)
            pos_chunks.append(positions)
            slot_chunks.append(last_blocks * bs + positions % bs)
            ids.extend(s.token_ids[s.num_computed_tokens] for s in seqs)
            meta.decode_groups = self._decode_groups(seqs, ctx_lens)
            meta.num_decodes = len(seqs)
            sample_rows.extend(num_prefill + j for j, item in enumerate(batch.decodes) if item.samples)

        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.cat(pos_chunks).to(self.device)
        meta.slot_mapping = torch.cat(slot_chunks).to(self.device)
        return input_ids, positions, meta, sample_rows

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, fresh_blocks: list[int]) -> tuple[list[ScheduledSeq], SamplerOutput | None]:
        """Run one step (zeroing newly allocated blocks first); returns the scheduled items that
        sampled a token and the sampler's result."""
        if self.before_forward is not None:
            self.before_forward([item.seq for item in batch.all])
        self.kv_cache.zero_blocks(fresh_blocks)
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        if self.tp_group is not None:
            self.tp_group.broadcast((fresh_blocks, input_ids, positions, meta))
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        sampled = [item for item in batch.prefills if item.samples] + [item for item in batch.decodes if item.samples]
        if not sampled:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        return sampled, self.sampler(logits, [item.seq for item in sampled])
