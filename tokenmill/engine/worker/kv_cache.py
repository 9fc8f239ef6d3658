"""The paged K/V tensors of every layer, and what a block of them costs.

Block 0 is never handed out by the allocator (`engine/core/block_manager.py`): it stays zero and is
where padded attention positions point, so the rest of the cache can be left uninitialised (no
time spent zeroing gigabytes at start-up).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.models.layers.kv_quant import row_width


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
        # (a slice per run of consecutive blocks: index_fill_ over dim 1 took 53 us for one block and
        # 1.2 ms for 32 on the 2-core EPYC, zero_ on slices 18 us and 0.47 ms)
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
