"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

`prepare` runs on the scheduling thread and builds host tensors only; `run` runs on the model
thread (the same thread without overlap scheduling). They meet in a `StepInput`, the only thing the
model thread reads, and `run` answers with a `ModelRunnerOutput`, the only thing the scheduler
lands. With overlap scheduling the next step is prepared while the previous one runs, so its
decode inputs are not known yet: they are placeholders (see `sequence.placeholder`) that `run`
replaces with the previous step's sampled tokens, on the device, without a round trip through Python.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from tokenmill.engine.runner_output import ModelRunnerOutput, PromptScores
from tokenmill.engine.sample.sampler import Sampler, SamplingInput
from tokenmill.engine.structured_output.grammar import GrammarMask
from tokenmill.engine.worker.cuda_graphs import DecodeGraphs, GraphInputs
from tokenmill.engine.worker.kv_cache import KVCache
from tokenmill.engine.worker.prefill_outputs import PrefillWork
from tokenmill.engine.worker.tensors import to_device
from tokenmill.kernels.ops import cpu_kernels_available
from tokenmill.lora.batch import LoRABatch, LoRASlots
from tokenmill.lora.layers import LoRAModel
from tokenmill.models.layers.attention import AttentionMetadata, DecodeGroup, PagedQueries, PrefillSegment

# Cost of one extra decode-attention call, in padded (sequence x block) gathers: splitting the
# decodes into length groups stops paying for padding once a group would save fewer than this.
_GROUP_OVERHEAD_BLOCKS = 24
_MAX_DECODE_GROUPS = 4


def split_by_length(
    num_blocks: list[int], overhead: int = _GROUP_OVERHEAD_BLOCKS, max_groups: int = _MAX_DECODE_GROUPS
) -> list[tuple[int, int]]:
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


class StepSkipped(Exception):
    """A step launched after a failed one is not run: it may read tokens or K/V that never came."""


@dataclass(frozen=True)
class RowRef:
    """Which sequence a scheduled row belongs to (for hooks and error reports; not the sequence)."""

    seq_id: int
    request_id: str


@dataclass(frozen=True)
class StepInput:
    """One step, as the model thread sees it: tensors on the host and plain values, built by the
    scheduling thread from the scheduler's output. Nothing in it is shared with live sequences."""

    rows: tuple[RowRef, ...]  # every scheduled sequence, in the order of the step's tokens
    fresh_blocks: tuple[int, ...]  # blocks allocated for this step: zeroed before it runs
    input_ids: torch.Tensor  # may hold placeholders of the previous step's tokens
    positions: torch.Tensor
    meta: AttentionMetadata | None  # None for a CUDA-graph step
    sample_rows: torch.Tensor  # rows of the hidden states (or of the graph's logits) to sample from
    sampling: SamplingInput | None  # None when no row samples
    has_placeholders: bool  # input_ids holds placeholders (read on the model thread: no tensor op for it)
    graph: GraphInputs | None = None
    released_seq_ids: tuple[int, ...] = ()  # sequences ended since the last step (the sampler drops their RNGs)
    prefill: PrefillWork | None = None  # prompt rows to score or pool (never on a CUDA-graph step)
    lora: LoRABatch | None = None  # per-row LoRA slots, when a row runs with an adapter (never on a graph step)

    @property
    def grammar_mask(self) -> GrammarMask | None:
        """The allowed tokens of its constrained rows (filled by the scheduling thread)."""
        return self.sampling.grammar if self.sampling is not None else None

    def cancel_grammar_mask(self, reason: str) -> None:
        """Release a model thread waiting for this step's grammar mask, which will never be filled."""
        if self.grammar_mask is not None:
            self.grammar_mask.cancel(reason)


@dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence that a forward pass runs, at positions start, start + 1, ...; the
    logits of its last `num_sampled` rows are wanted."""

    token_ids: Seq[int]
    start: int
    block_table: list[int]
    num_sampled: int = 0


@dataclass(frozen=True)
class ForwardInput:
    """Host tensors of one eager forward pass."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the hidden states whose logits are wanted, in chunk order
    has_placeholders: bool  # input_ids holds placeholders of the previous step's tokens


# Chunks of at least this many tokens after cached context attend as two flash-attention calls
# (the cached keys, then the chunk's own, causal) rather than through the paged kernel, whose
# per-tile dot products run slower than GEMMs at thousands of queries (`tokenmill bench offline
# --long-prompts`).
LONG_CHUNK_QUERIES = 1024


def _host(values: Any, dtype: Any = np.int64) -> torch.Tensor:
    """A host tensor of Python ints (or an array) through numpy: torch.tensor on a list costs a few
    times more a call than numpy and from_numpy, and a decode step builds about ten (host time:
    `tokenmill bench profile`)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))


def _paged_queries(rows: list[tuple[int, int, list[int], int]], block_size: int) -> PagedQueries:
    """The fused kernel's view of a step, built once for all layers: per sequence its first query
    row, query count, block table (only the blocks its context uses, padded with the zero block) and
    context length."""
    used = [table[: -(-ctx // block_size)] for _, _, table, ctx in rows]
    width = max(len(t) for t in used)
    starts, lens, contexts = zip(*[(r[0], r[1], r[3]) for r in rows])
    return PagedQueries(
        query_start=_host(starts, np.int32),
        query_lens=_host(lens, np.int32),
        block_tables=_host([t + [0] * (width - len(t)) for t in used], np.int32),
        context_lens=_host(contexts, np.int32),
    )


def _decode_groups(tables: list[list[int]], ctx_lens: torch.Tensor, block_size: int) -> list[DecodeGroup]:
    """Decodes (sorted by context) in length groups, each padded only to its own longest table."""
    groups = []
    for start, end in split_by_length([len(t) for t in tables]):
        members = tables[start:end]
        width = max(len(t) for t in members)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in members], dtype=torch.long)
        # Unused tail slots of a sequence's last block were zeroed when the block was allocated
        # and padded table entries are the zero block: masked positions never hold NaN garbage.
        valid = torch.arange(width * block_size)[None, :] < ctx_lens[start:end, None]
        groups.append(DecodeGroup(start, end, padded.flatten(), valid.view(end - start, 1, 1, -1)))
    return groups


def _slots(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    return block_table[positions // block_size] * block_size + positions % block_size


def build_forward(
    chunks: Seq[Chunk], decodes: Seq[Chunk], block_size: int, fused_attention: bool, paged_prefill: bool = False
) -> ForwardInput:
    """Flatten chunks of several tokens (prefill chunks, speculative decodes) and then one-token
    decodes (best sorted by block table length) into one forward pass over the paged cache.
    `fused_attention`: decodes and chunks with cached context attend on the paged kernel;
    `paged_prefill`: the chunks that start their sequence too (else SDPA over their fresh K/V, whose
    sums are not the kernel's: other bits than the same positions in later chunks or decodes), and
    long chunks after cached context (else two flash-attention calls, likewise)."""
    bs = block_size
    ids: list[int] = []
    pos_chunks: list[np.ndarray] = []
    slot_chunks: list[np.ndarray] = []
    segments: list[PrefillSegment] = []
    paged: list[tuple[int, int, list[int], int]] = []  # fused kernel: (first row, queries, table, context)
    sample_rows: list[int] = []
    for chunk in chunks:
        n, c, start = len(chunk.token_ids), chunk.start, len(ids)
        ids.extend(chunk.token_ids)
        table = np.asarray(chunk.block_table, dtype=np.int64)
        positions = np.arange(c, c + n, dtype=np.int64)
        pos_chunks.append(positions)
        slot_chunks.append(_slots(table, positions, bs))
        if c == 0 and not (fused_attention and paged_prefill):
            segments.append(PrefillSegment(start, start + n, None, None))
        elif fused_attention and n >= LONG_CHUNK_QUERIES and not paged_prefill:
            cached = _host(_slots(table, np.arange(c, dtype=np.int64), bs))
            segments.append(PrefillSegment(start, start + n, None, None, cached_slots=cached))
        elif fused_attention:
            paged.append((start, n, chunk.block_table, c + n))
        else:
            ctx = np.arange(c + n, dtype=np.int64)
            mask = ctx[None, :] <= positions[:, None]
            segments.append(PrefillSegment(start, start + n, _host(_slots(table, ctx, bs)), torch.from_numpy(mask)))
        sample_rows.extend(range(start + n - chunk.num_sampled, start + n))
    num_prefill = len(ids)

    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), block_size=bs, prefills=segments, num_prefill_tokens=num_prefill
    )
    if decodes:
        tables = [d.block_table for d in decodes]
        computed = [d.start for d in decodes]
        positions = np.array(computed, dtype=np.int64)  # each decode's new token
        last_blocks = np.array([t[c // bs] for t, c in zip(tables, computed)], dtype=np.int64)
        pos_chunks.append(positions)
        slot_chunks.append(last_blocks * bs + positions % bs)
        ids.extend(d.token_ids[0] for d in decodes)
        if fused_attention:
            paged.extend((num_prefill + j, 1, t, c + 1) for j, (t, c) in enumerate(zip(tables, computed)))
        else:
            meta.decode_groups = _decode_groups(tables, _host(positions + 1), bs)
        sample_rows.extend(num_prefill + j for j, d in enumerate(decodes) if d.num_sampled)

    meta.slot_mapping = _host(np.concatenate(slot_chunks))
    meta.paged = _paged_queries(paged, bs) if paged else None
    input_ids = np.asarray(ids, dtype=np.int64)
    return ForwardInput(
        _host(input_ids), _host(np.concatenate(pos_chunks)), meta, _host(sample_rows), bool((input_ids < 0).any())
    )


def _chunk(item: ScheduledSeq) -> Chunk:
    """A scheduled sequence's tokens in the step: its own, then its draft tokens."""
    c, seq = item.num_computed_before, item.seq
    tokens = seq.token_ids[c : c + item.num_known_tokens]
    if item.num_spec_tokens:
        assert len(item.draft_tokens) == item.num_spec_tokens, "draft tokens were never filled in"
        tokens = tokens + list(item.draft_tokens)
    return Chunk(tokens, c, seq.block_table, (1 + item.num_spec_tokens) if item.samples else 0)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        tp_group: Any = None,
        graphs: DecodeGraphs | None = None,
        lora: LoRAModel | None = None,
        lora_slots: LoRASlots | None = None,
        batch_invariant: bool = False,
    ) -> None:
        self.model = model
        self.tp_group = tp_group  # TensorParallelGroup: workers replay each step's inputs
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        self.graphs = graphs
        self.lora = lora  # model thread: the wrapped layers and their slots
        self.lora_slots = lora_slots  # scheduling thread: which adapter goes to which slot
        # Decodes and chunks with cached context attend with the fused CPU kernel, reading K/V in place
        # (batch invariance where it does not run: the same metadata, attended on fixed shapes).
        self.fused_attention = cpu_kernels_available(device) or batch_invariant
        # Batch invariance: every prompt chunk on that kernel too, so that a position's bits do not
        # depend on how its context was split into chunks.
        self.paged_prefill = batch_invariant
        # Test hook (fault injection): a callable(rows: tuple[RowRef, ...]) run before the forward pass.
        self.before_forward = None
        # Model-thread state: the last step's sampled tokens (placeholders index them), and whether a
        # step failed since the engine last recovered (later steps are then skipped).
        self._last_tokens: torch.Tensor | None = None
        self._last_token_list: list[int] | None = None
        self._failed = False

    # -- scheduling thread ---------------------------------------------------------------------

    def prepare(self, batch: SchedulerOutput, fresh_blocks: list[int], released_seq_ids: list[int]) -> StepInput:
        """Flatten the step's tokens (prefill chunks first, then decodes) and build attention metadata.
        Reads the scheduled sequences (block tables, token ids) without changing anything."""
        sampled = batch.sampled
        sampling = None
        if sampled:
            sampling = SamplingInput.of(
                [item.seq for item in sampled],
                [item.num_tokens_before - len(item.seq.prompt_token_ids) for item in sampled],
                self.sampler.vocab_size,
                [item.draft_tokens for item in sampled] if batch.speculative else None,
            )
        prefill = PrefillWork.of(batch.all)
        lora = None
        if self.lora_slots is not None:
            lora = self.lora_slots.plan([(item.seq.lora, item.num_new_tokens) for item in batch.all])
        meta: AttentionMetadata | None
        # (graphs keep no hidden states and were captured without adapters)
        graph = None if prefill is not None or lora is not None else self._prepare_graph(batch)
        if graph is not None:
            input_ids, positions, meta = graph.input_ids, graph.positions, None
            sample_rows = torch.tensor([j for j, item in enumerate(batch.decodes) if item.samples], dtype=torch.long)
            has_placeholders = bool((graph.input_ids < 0).any())
        else:
            forward = build_forward(
                [_chunk(item) for item in batch.chunks],
                [_chunk(item) for item in batch.decodes],
                self.block_size,
                self.fused_attention,
                self.paged_prefill,
            )
            input_ids, positions, meta = forward.input_ids, forward.positions, forward.meta
            sample_rows, has_placeholders = forward.sample_rows, forward.has_placeholders
        return StepInput(
            rows=tuple(RowRef(item.seq.seq_id, item.seq.request_id) for item in batch.all),
            fresh_blocks=tuple(fresh_blocks),
            input_ids=input_ids,
            positions=positions,
            meta=meta,
            sample_rows=sample_rows,
            sampling=sampling,
            has_placeholders=has_placeholders,
            graph=graph,
            released_seq_ids=tuple(released_seq_ids),
            prefill=prefill,
            lora=lora,
        )

    def _prepare_graph(self, batch: SchedulerOutput) -> GraphInputs | None:
        """Padded inputs of a decode-only step that a CUDA graph can run, else None."""
        if self.graphs is None or batch.chunks or not batch.decodes:
            return None
        tables = [item.seq.block_table for item in batch.decodes]
        if not self.graphs.fits(len(tables), max(len(t) for t in tables)):
            return None
        bs = self.block_size
        positions = [item.num_computed_before for item in batch.decodes]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        return self.graphs.pad(
            [item.seq.token_ids[p] for item, p in zip(batch.decodes, positions)],
            [p + 1 for p in positions],
            slots,
            tables,
        )

    # -- model thread --------------------------------------------------------------------------

    def recover(self) -> None:
        """The engine has dealt with a failed step: run steps again."""
        self._failed = False
        self._last_tokens = self._last_token_list = None

    @torch.inference_mode()
    def run(self, step: StepInput) -> ModelRunnerOutput:
        """Zero the step's new blocks, run the model, sample, and score or pool prompt rows."""
        if self._failed:
            raise StepSkipped("an earlier step failed")
        try:
            return self._run(step)
        except BaseException:
            self._failed = True
            raise

    def _run(self, step: StepInput) -> ModelRunnerOutput:
        self.sampler.release(step.released_seq_ids)
        if self.before_forward is not None:
            self.before_forward(step.rows)
        input_ids = self._resolve_placeholders(step)
        self.kv_cache.zero_blocks(step.fresh_blocks)
        prompt_logprobs: dict[int, PromptScores] = {}
        pooled: dict[int, torch.Tensor] = {}
        logits: torch.Tensor | None = None
        if step.graph is not None:
            assert self.graphs is not None  # (a graph step is only prepared with graphs)
            logits = self.graphs.run(step.graph, input_ids)
            if len(step.sample_rows) != step.graph.num_seqs:
                logits = logits[step.sample_rows.to(self.device)]
        else:
            assert step.meta is not None  # (an eager step always has its metadata)
            positions = step.positions.to(self.device, non_blocking=True)
            # (on the host already: no copy of the metadata)
            meta = step.meta if self.device.type == "cpu" else to_device(step.meta, self.device, non_blocking=True)
            if self.tp_group is not None:
                self.tp_group.broadcast((step.fresh_blocks, input_ids, positions, meta))
            hidden = self._forward(step, input_ids, positions, meta)
            if step.sampling is not None:
                # (sample rows ascend: as many as the hidden rows are all of them, in order, and need no index)
                rows = hidden if len(step.sample_rows) == hidden.shape[0] else hidden[step.sample_rows.to(self.device)]
                logits = self._compute_logits(rows)
            if step.prefill is not None:
                prompt_logprobs, pooled = step.prefill.compute(hidden, self._compute_logits, self.sampler.vocab_size)
        if step.sampling is None or logits is None:
            self._last_tokens = self._last_token_list = None
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs, pooled=pooled)
        result = self.sampler(logits, step.sampling, self._last_token_list)
        self._last_tokens, self._last_token_list = result.token_tensor, result.tokens
        return ModelRunnerOutput(
            result.tokens,
            result.logprobs,
            result.accepted,
            result.accepted_logprobs,
            prompt_logprobs=prompt_logprobs,
            pooled=pooled,
        )

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)  # type: ignore[operator]  # (every model family's head)

    def _forward(
        self, step: StepInput, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        lora = self.lora
        if step.lora is None or lora is None:  # (a step plans LoRA rows only when LoRA is on)
            return self.model(input_ids, positions, self.kv_cache.layers, meta)
        lora.begin(step.lora, self.device)
        try:
            return self.model(input_ids, positions, self.kv_cache.layers, meta)
        finally:
            lora.end()

    def _resolve_placeholders(self, step: StepInput) -> torch.Tensor:
        input_ids = step.input_ids.to(self.device, non_blocking=True)
        if not step.has_placeholders:
            return input_ids
        if self._last_tokens is None:
            raise RuntimeError("a step refers to the previous step's tokens, but it sampled none")
        rows = (-input_ids - 1).clamp(min=0)  # placeholder_row, vectorised (0 for real ids)
        return torch.where(input_ids < 0, self._last_tokens[rows], input_ids)
