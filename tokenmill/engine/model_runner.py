"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples."""

from __future__ import annotations

import torch

from tokenmill.engine.kv_cache import KVCache
from tokenmill.engine.sampler import Sampler, SamplerOutput
from tokenmill.engine.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.models.attention import AttentionMetadata, PrefillSegment


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_size: int, sampler: Sampler, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        # Test hook (fault injection): a callable(list[Sequence]) run before the forward pass.
        self.before_forward = None

    def _slots(self, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return block_table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _slots_per_row(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slot of position positions[i] in block table tables[i]."""
        rows = torch.arange(len(positions))
        return tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size

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
            seqs = [item.seq for item in batch.decodes]
            ctx_lens = torch.tensor([s.num_computed_tokens + 1 for s in seqs])
            max_blocks = max(len(s.block_table) for s in seqs)
            tables = torch.tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs], dtype=torch.long)
            ctx = torch.arange(max_blocks * bs)
            valid = ctx[None, :] < ctx_lens[:, None]  # [B, max_blocks * bs]
            positions = ctx_lens - 1  # each decode's new token
            pos_chunks.append(positions)
            slot_chunks.append(self._slots_per_row(tables, positions))
            ids.extend(s.token_ids[s.num_computed_tokens] for s in seqs)
            # Unused tail slots of a sequence's last block were zeroed when the block was allocated
            # and padded table entries are the zero block: masked positions never hold NaN garbage.
            meta.decode_blocks = tables.flatten().to(self.device)
            meta.decode_mask = valid.view(len(seqs), 1, 1, -1).to(self.device)
            meta.num_decodes = len(seqs)
            sample_rows.extend(num_prefill + j for j, item in enumerate(batch.decodes) if item.samples)

        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.cat(pos_chunks).to(self.device)
        meta.slot_mapping = torch.cat(slot_chunks).to(self.device)
        return input_ids, positions, meta, sample_rows

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> tuple[list[ScheduledSeq], SamplerOutput | None]:
        """Run one step; returns the scheduled items that sampled a token and the sampler's result."""
        if self.before_forward is not None:
            self.before_forward([item.seq for item in batch.all])
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        sampled = [item for item in batch.prefills if item.samples] + [item for item in batch.decodes if item.samples]
        if not sampled:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        return sampled, self.sampler(logits, [item.seq for item in sampled])
