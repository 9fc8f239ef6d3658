"""Draft-model proposals: a small model with the target's vocabulary guesses the next K tokens.

The draft model keeps its own K/V cache with the target's block count and block size and reads it
through the target's block tables, so it needs no allocator of its own: every block a sequence
holds has a draft slot too. Its cache stays in step with the target's: each step, before the
target runs, the draft computes every token the target computes in that step (prefill chunks and
plain decodes alike), and for each speculating sequence it then feeds its own guesses back, one
forward pass per draft token, the last one only to write that token's K/V (if the target accepts
every draft, the next step starts after it). Rejected drafts' K/V are overwritten when their
positions are computed again. Drafts are the draft model's argmax: a deterministic proposal,
which the sampler's rejection rule verifies exactly for greedy and sampled requests alike.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.engine.precision import Precision
from tokenmill.engine.setup import load_prepared_model, load_tokenizer
from tokenmill.engine.worker.kv_cache import KVCache, bytes_per_block
from tokenmill.engine.worker.model_runner import Chunk, build_forward
from tokenmill.engine.worker.tensors import to_device
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.models.model_loader.loader import load_spec
from tokenmill.models.spec import ModelSpec

logger = logging.getLogger(__name__)


def check_draft_model(draft_dir: Path, target: ModelSpec, target_tokenizer: Any) -> ModelSpec:
    """The draft model's spec, if it can propose tokens for the target; else a ValueError saying why."""
    spec = load_spec(draft_dir)
    if spec.vocab_size != target.vocab_size:
        raise ValueError(
            f"--speculative-model {draft_dir}: vocabulary of {spec.vocab_size} tokens, the model's has "
            f"{target.vocab_size}; a draft model must share the model's tokenizer"
        )
    draft_tokenizer = load_tokenizer(draft_dir)
    if (draft_tokenizer is None) != (target_tokenizer is None) or (
        draft_tokenizer is not None and draft_tokenizer.get_vocab() != target_tokenizer.get_vocab()
    ):
        raise ValueError(
            f"--speculative-model {draft_dir}: its tokenizer differs from the model's; a draft "
            "model must share the model's tokenizer"
        )
    return spec


def load_draft_model(
    config: EngineConfig, draft_dir: Path, precision: Precision, device: torch.device
) -> torch.nn.Module:
    """The draft model (checked by `check_draft_model`), prepared like the model (quantization,
    oneDNN, compile), unsharded."""
    draft_config = dataclasses.replace(config, model=str(draft_dir), tensor_parallel_size=1, model_impl="auto")
    model, _ = load_prepared_model(draft_config, draft_dir, precision, device)
    return model


class DraftProposer:
    def __init__(
        self,
        model: torch.nn.Module,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.spec = spec
        self.block_size = block_size
        self.device = device
        self.kv_cache = KVCache(
            spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype, device
        )
        self.fused_attention = cpu_kernels_available(device)

    @staticmethod
    def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        return bytes_per_block(block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype)

    @torch.inference_mode()
    def propose(self, batch: SchedulerOutput, fresh_blocks: Seq[int]) -> SchedulerOutput:
        """`batch` with its speculative decodes' draft tokens filled in (the draft's K/V of every
        token the step computes written on the way)."""
        self.kv_cache.zero_blocks(list(fresh_blocks))
        speculative = batch.speculative
        # Decodes shortest block table first (the unfused attention pads per length group); the
        # speculating ones sample their first draft.
        decodes = sorted(
            [(item, False) for item in batch.decodes] + [(item, True) for item in speculative],
            key=lambda pair: len(pair[0].seq.block_table),
        )
        order = [item for item, samples in decodes if samples]  # speculative decodes, in row order
        drafts: dict[int, list[int]] = {id(item): [] for item in speculative}
        chunks = [
            Chunk(
                item.seq.token_ids[item.num_computed_before : item.num_computed_before + item.num_new_tokens],
                item.num_computed_before,
                item.seq.block_table,
            )
            for item in batch.prefills
        ]
        next_tokens = self._forward(chunks, [_own_token(item, samples) for item, samples in decodes])
        for item, token in zip(order, next_tokens):
            drafts[id(item)].append(token)
        # Feed the drafts back: the one at index j (position c + 1 + j) yields the next, the last
        # only writes its K/V.
        for j in range(max((item.num_spec_tokens for item in speculative), default=0)):
            active = [item for item in order if item.num_spec_tokens > j]
            feeds = [
                Chunk(
                    [drafts[id(item)][j]],
                    item.num_computed_before + 1 + j,
                    item.seq.block_table,
                    int(j + 1 < item.num_spec_tokens),
                )
                for item in active
            ]
            next_tokens = self._forward([], feeds)
            for item, token in zip([i for i in active if i.num_spec_tokens > j + 1], next_tokens):
                drafts[id(item)].append(token)
        return batch.with_drafts([tuple(drafts[id(item)]) for item in speculative])

    def _forward(self, chunks: list[Chunk], decodes: list[Chunk]) -> list[int]:
        """Run the draft model over `chunks` and `decodes`; the argmax token of each sampled row."""
        forward = build_forward(chunks, decodes, self.block_size, self.fused_attention)
        dev = self.device
        hidden = self.model(
            forward.input_ids.to(dev), forward.positions.to(dev), self.kv_cache.layers, to_device(forward.meta, dev)
        )
        if not len(forward.sample_rows):
            return []
        logits = self.model.compute_logits(hidden[forward.sample_rows.to(dev)])  # type: ignore[operator]
        return logits[:, : self.spec.vocab_size].argmax(dim=-1).tolist()


def _own_token(item: ScheduledSeq, samples: bool) -> Chunk:
    """A decode's token (a speculating one's, sampled for the first draft) as a one-token chunk."""
    c = item.num_computed_before
    return Chunk([item.seq.token_ids[c]], c, item.seq.block_table, int(samples))
