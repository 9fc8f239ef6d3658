"""A step's LoRA plan: which slot each adapter of the step sits in, and the step's rows grouped by
slot. Built on the scheduling thread (`LoRASlots.plan`), read by the model thread (`LoRAModel.begin`).

Slots are assigned LRU: an adapter keeps its slot while steps use it; a step that needs one that
is not resident takes a free slot or the least recently used one the step does not need. The
scheduler admits at most `--max-loras` distinct adapters into the running batch, so a step never
needs more slots than there are. A slot is overwritten on the model thread right before the
first step that needs the new adapter, after every earlier step has run, so a step still running
with the old adapter is never disturbed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.lora.types import LoRAAdapter


@dataclass(frozen=True)
class LoRABatch:
    """The LoRA part of a step input (host tensors and plain values, immutable)."""

    token_slots: torch.Tensor  # [tokens] the slot of each row of the step, -1 for the base model
    rows: torch.Tensor  # rows with an adapter, grouped by slot (token order within a slot)
    # The slots from the lowest to the highest the step uses, [first, end), and where each one's
    # group ends in `rows` (int32, grouped_mm's offs): GEMMs run over these slots only.
    slot_range: tuple[int, int]
    offsets: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, end) of every non-empty group
    adapters: tuple[tuple[int, LoRAAdapter], ...]  # (slot, adapter) of every adapter the step uses
    # When the groups are about equally large (decode steps): the rows as one [slots, width] block
    # for batched GEMMs (which beat grouped_mm's GEMM per group on CPU): the token each block
    # position reads (padding repeats a group's first row), and the block positions of `rows`.
    padded: tuple[torch.Tensor, torch.Tensor] | None = None


# Batched GEMMs over padded groups while padding adds at most this share of rows: one bmm over the
# padded groups beats grouped_mm's GEMM per group at decode-sized steps (`tokenmill bench features
# --only LoRA`).
_MAX_PADDING = 1.25


def _padded(rows: torch.Tensor, segments: Sequence[tuple[int, int, int]], num_slots: int) -> tuple | None:
    """The block layout of `LoRABatch.padded`, or None when the groups are too uneven (or a slot
    in the range has no rows)."""
    width = max(end - start for _, start, end in segments)
    if len(segments) != num_slots or width * num_slots > _MAX_PADDING * len(rows):
        return None
    gather: list[int] = []
    valid: list[int] = []
    for g, (_, start, end) in enumerate(segments):
        group = rows[start:end].tolist()
        gather += group + [group[0]] * (width - len(group))
        valid += range(g * width, g * width + len(group))
    return torch.tensor(gather, dtype=torch.long), torch.tensor(valid, dtype=torch.long)


class LoRASlots:
    """Which adapter sits in which slot (scheduling thread)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free = list(range(max_loras - 1, -1, -1))  # lowest first: steps span few slots

    def place(self, adapters: Sequence[LoRAAdapter]) -> dict[int, int]:
        """Slots for the step's distinct adapters (adapter id -> slot)."""
        wanted = {a.id for a in adapters}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} LoRA adapters; only {self.max_loras} slots")
        for adapter_id in wanted & self._slot_of.keys():
            self._slot_of.move_to_end(adapter_id)
        for adapter_id in sorted(wanted - self._slot_of.keys()):
            if self._free:
                slot = self._free.pop()
            else:  # evict the least recently used adapter this step does not need
                victim = next(i for i in self._slot_of if i not in wanted)
                slot = self._slot_of.pop(victim)
            self._slot_of[adapter_id] = slot
        return {adapter_id: self._slot_of[adapter_id] for adapter_id in wanted}

    def plan(self, row_adapters: Sequence[tuple[LoRAAdapter | None, int]]) -> LoRABatch | None:
        """The plan of a step whose rows come in runs of (adapter or None, number of rows), in the
        step's token order; None when no row has an adapter."""
        distinct = {a.id: a for a, _ in row_adapters if a is not None}
        if not distinct:
            return None
        slot_of = self.place(list(distinct.values()))
        token_slots = torch.tensor(
            [slot_of[a.id] if a is not None else -1 for a, n in row_adapters for _ in range(n)], dtype=torch.long
        )
        adapted = token_slots >= 0
        # Base rows sort after every slot; a stable sort keeps token order within a slot.
        keys = torch.where(adapted, token_slots, self.max_loras)
        rows = torch.argsort(keys, stable=True)[: int(adapted.sum())]
        counts = torch.bincount(token_slots[adapted], minlength=self.max_loras)
        ends = counts.cumsum(0)
        segments = tuple(
            (slot, int(ends[slot] - counts[slot]), int(ends[slot])) for slot in range(self.max_loras) if counts[slot]
        )
        first, end = segments[0][0], segments[-1][0] + 1
        return LoRABatch(
            token_slots,
            rows,
            (first, end),
            ends[first:end].to(torch.int32),
            segments,
            tuple(sorted((slot_of[i], a) for i, a in distinct.items())),
            _padded(rows, segments, end - first),
        )
