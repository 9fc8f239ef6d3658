"""What the LoRA modules share: an adapter's matrices, what a wrapped layer accepts, a loaded adapter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoRAWeights:
    """One adapter matrix pair of one wrapped layer: `part` is the fused part it adapts (None: the
    whole layer); `a` [r, in], `b` [out of the part (or layer), r] with the scale folded in."""

    part: int | None
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoRATarget:
    """What an adapter may put into one wrapped layer."""

    in_features: int
    part_sizes: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A loaded adapter: its matrices per wrapped layer (CPU, model dtype), immutable once built."""

    name: str
    path: str
    id: int
    rank: int
    weights: Mapping[str, tuple[LoRAWeights, ...]] = field(repr=False)
    base_model_name: str | None = None

    @property
    def prefix_cache_key(self) -> bytes:
        """The extra key of this adapter's prefix-cache blocks (in every block's hash)."""
        return f"lora:{self.id}".encode()
