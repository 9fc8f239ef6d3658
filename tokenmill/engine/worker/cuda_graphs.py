"""CUDA graphs for decode steps (`--cuda-graphs`): one captured graph per (batch, context) bucket.

A decode step of a small model is hundreds of tiny kernels; launching them one by one from Python
costs more than running them. A CUDA graph replays the whole step with one launch. Graphs need
fixed shapes and fixed input addresses, so a decode-only batch is padded up to a batch-size
bucket and its block tables up to a context-width bucket (powers of two, in blocks), and its
inputs are copied into static buffers that every graph reads. Each bucket pair is captured the
first time a step needs it; a batch with prefill chunks, or larger than the largest bucket, runs
eagerly as before.

Padding rows decode token 0 at position 0, attend one position of the zero block 0 and write their
K/V into the cache's pad slot, which no sequence owns, so they touch nothing real.

Without CUDA (`capture=False`) the same static-buffer step runs eagerly: that is how the padding
logic is tested on machines without a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.engine.worker.kv_cache import KVCache
from tokenmill.models.layers.attention import AttentionMetadata, DecodeGroup

logger = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 64, then of 32: few graphs, little padding."""
    sizes = [1, 2, 4] + list(range(8, 65, 8))
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + 32)
    return [b for b in sizes if b < max_batch] + [max_batch]


def width_buckets(max_blocks: int) -> list[int]:
    """Block-table widths 1, 2, 4, ... up to the longest context."""
    widths = [1]
    while widths[-1] < max_blocks:
        widths.append(widths[-1] * 2)
    return widths


def _smallest_fitting(buckets: list[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass
class GraphInputs:
    """One decode step, padded to its bucket, on the host (built by the scheduling thread)."""

    num_seqs: int  # real rows; the rest are padding
    batch: int  # bucket sizes
    width: int
    input_ids: torch.Tensor  # [batch]; may hold placeholders of the previous step's tokens
    positions: torch.Tensor  # [batch]
    slot_mapping: torch.Tensor  # [batch]
    context_lens: torch.Tensor  # [batch]
    blocks: torch.Tensor  # [batch * width] block tables, row-major, padded with the zero block


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        block_size: int,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.capture = capture
        self.batch_sizes = batch_buckets(max_batch)
        self.widths = width_buckets(max_blocks)
        b, w = self.batch_sizes[-1], self.widths[-1]
        # Static inputs: every graph reads a prefix of these.
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(b, dtype=torch.long, device=device)
        self.context_lens = torch.ones(b, dtype=torch.long, device=device)
        self.blocks = torch.zeros(b * w, dtype=torch.long, device=device)
        self.slot_index = torch.arange(w * block_size, device=device)
        self.graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.batch_sizes[-1] and max_blocks <= self.widths[-1]

    def pad(
        self, input_ids: list[int], context_lens: list[int], slots: list[int], tables: list[list[int]]
    ) -> GraphInputs:
        """Host tensors of one decode step padded to its bucket (call only when `fits`)."""
        n = len(input_ids)
        batch = _smallest_fitting(self.batch_sizes, n)
        width = _smallest_fitting(self.widths, max(len(t) for t in tables))
        assert batch is not None and width is not None, "pad() of a step that does not fit"
        pad_rows = batch - n
        blocks = torch.zeros(batch, width, dtype=torch.long)
        for row, table in enumerate(tables):
            blocks[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        ctx = torch.tensor(context_lens + [1] * pad_rows, dtype=torch.long)
        return GraphInputs(
            num_seqs=n,
            batch=batch,
            width=width,
            input_ids=torch.tensor(input_ids + [0] * pad_rows, dtype=torch.long),
            positions=ctx - 1,
            slot_mapping=torch.tensor(slots + [self.kv_cache.pad_slot] * pad_rows, dtype=torch.long),
            context_lens=ctx,
            blocks=blocks.flatten(),
        )

    def run(self, inputs: GraphInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [num_seqs, vocab] of the step; `input_ids` are `inputs.input_ids` with
        placeholders resolved, on the device."""
        b, w = inputs.batch, inputs.width
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(inputs.slot_mapping, non_blocking=True)
        self.context_lens[:b].copy_(inputs.context_lens, non_blocking=True)
        self.blocks[: b * w].copy_(inputs.blocks, non_blocking=True)
        replay = self.graphs.get((b, w))
        if replay is None:
            replay = self.graphs[(b, w)] = self._capture(b, w)
        return replay()[: inputs.num_seqs]

    def _step(self, b: int, w: int) -> torch.Tensor:
        """The decode step over the static buffers (what a graph records)."""
        ctx = w * self.block_size
        mask = (self.slot_index[:ctx][None, :] < self.context_lens[:b, None]).view(b, 1, 1, ctx)
        group = DecodeGroup(0, b, self.blocks[: b * w], mask)
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:b], block_size=self.block_size, decode_groups=[group])
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_cache.layers, meta)
        return self.model.compute_logits(hidden)  # type: ignore[operator]  # (every model family's head)

    def _capture(self, b: int, w: int) -> Callable[[], torch.Tensor]:
        if not self.capture:
            return lambda: self._step(b, w)
        logger.info("capturing a CUDA graph for decode batch %d, context %d tokens", b, w * self.block_size)
        # Warm-up on a side stream (lazy cuBLAS/allocator set-up must not be recorded). It runs the
        # real step: the K/V it writes are the ones the replay writes again.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(b, w)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # One pool for all graphs: a replay may overwrite memory of another graph's output, which is
        # fine because each step's logits are sampled before the next step replays anything.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._step(b, w)

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay
