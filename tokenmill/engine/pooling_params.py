"""Per-request embedding settings: how a prompt's final hidden states become one vector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tokenmill.errors import InvalidRequest

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[PoolingType, ...] = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: the prompt is prefilled, nothing is sampled, and the output is the
    pooled final-norm hidden state. Last-token pooling is vLLM's default for decoder LMs (the last
    position has attended to the whole prompt); mean pooling averages every position."""

    pooling: PoolingType = "last"
    normalize: bool = True  # L2-normalise the pooled vector (cosine similarity becomes a dot product)

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise InvalidRequest(
                f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}", param="pooling"
            )
        if not isinstance(self.normalize, bool):
            raise InvalidRequest("normalize must be a boolean", param="normalize")
