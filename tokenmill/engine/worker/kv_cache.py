"""The paged K/V tensors of every layer, what a block of them costs, and how many blocks the
memory budget holds.

Block 0 is never handed out by the allocator (`engine/core/block_manager.py`): it stays zero and is
where padded attention positions point, so the rest of the cache can be left uninitialised (no
time spent zeroing gigabytes at start-up).
"""

from __future__ import annotations

from collections.abc import Sequence

import psutil
import torch

from tokenmill.engine.config import EngineConfig, parse_memory
from tokenmill.models.layers.kv_quant import row_width
from tokenmill.models.spec import ModelSpec

_CPU_DEFAULT_KV_CAP = 4 << 30  # like vLLM's CPU default KV space: plenty for a CPU's batch sizes


class KVCache:
    """The K/V tensors of every layer, shaped [num_blocks * block_size, kv_heads, head_dim] (an int8
    cache: head_dim + 4, each row's values and scale, see tokenmill.models.layers.kv_quant).

    All of them are views of one [2 * layers, blocks, block_size, kv_heads, head_dim] tensor, so a
    step zeroes its new blocks in every layer with a single call.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # Zeroed (and so paged in) up front: block 0 pads block tables, and first-touch page faults
        # are paid at startup rather than inside the first requests' steps. One block more than the
        # allocator hands out: padded rows of a CUDA-graph batch write their K/V there (`pad_slot`).
        width = row_width(head_dim, dtype)
        self.data = torch.zeros(
            2 * num_layers, num_blocks + 1, block_size, num_kv_heads, width, dtype=dtype, device=device
        )
        self.pad_slot = num_blocks * block_size
        slots = (num_blocks + 1) * block_size
        self.layers = [
            (self.data[2 * i].view(slots, num_kv_heads, width), self.data[2 * i + 1].view(slots, num_kv_heads, width))
            for i in range(num_layers)
        ]
        self.block_size = block_size

    def zero_blocks(self, blocks: Sequence[int]) -> None:
        """Zero newly allocated blocks: attention reads whole blocks, unused tails included."""
        # (a slice per run of consecutive blocks: zero_ on slices is several times faster than
        # index_fill_ over dim 1)
        for start, end in consecutive_runs(blocks):
            self.data[:, start:end].zero_()


def consecutive_runs(values: Sequence[int]) -> list[tuple[int, int]]:
    """Distinct ints as ascending runs [start, end) of consecutive values."""
    runs: list[tuple[int, int]] = []
    for value in sorted(values):
        if runs and value == runs[-1][1]:
            runs[-1] = (runs[-1][0], value + 1)
        elif not runs or value >= runs[-1][1]:
            runs.append((value, value + 1))
    return runs


def bytes_per_block(block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * row_width(head_dim, dtype) * dtype.itemsize


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    if config.kv_cache_memory:
        return parse_memory(config.kv_cache_memory)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.kv_cache_memory_fraction)
    return min(int(psutil.virtual_memory().available * config.kv_cache_memory_fraction), _CPU_DEFAULT_KV_CAP)


def num_kv_blocks(
    config: EngineConfig,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    extra_bytes_per_block: int = 0,
) -> tuple[int, int]:
    """(blocks the budget holds, bytes per block); never more blocks than every sequence slot at full
    length could use (x2 for the prefix cache). `extra_bytes_per_block`: another cache indexed by
    the same blocks (a draft model's)."""
    bs = config.block_size
    per_block = bytes_per_block(bs, spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype) + extra_bytes_per_block
    num_blocks = min(
        kv_budget_bytes(config, device) // per_block, 2 * config.max_num_seqs * -(-max_model_len // bs) + 1
    )
    if num_blocks < 2:
        raise ValueError(f"--kv-cache-memory is too small for a single {bs}-token block ({per_block} bytes)")
    return num_blocks, per_block
