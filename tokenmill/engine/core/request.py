"""A request: its prompt, sampling parameters and the sequences of its choices (what its outputs
carry follows its `RequestOutputKind`; the output processor builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.core.sequence import Sequence
from tokenmill.engine.outputs import RequestMetrics, RequestOutputKind
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.result_cache import CacheKey
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.errors import InvalidRequest

if TYPE_CHECKING:
    from tokenmill.lora.types import LoRAAdapter


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding request
    metrics: RequestMetrics
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    seqs: list[Sequence] = field(default_factory=list)
    result_cache_key: CacheKey | None = None  # set when a finished result may be stored
    lora: LoRAAdapter | None = None  # the LoRA adapter it runs with (None: the base model)
    priority: int = 0  # with --scheduling-policy priority: lower values are scheduled first
    # Set when its input turned out bad only in the engine (a grammar too costly to compile or to
    # match): the front ends answer it as bad input (HTTP 400), not as a server failure.
    rejection: InvalidRequest | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def error(self) -> str | None:
        return next((s.error for s in self.seqs if s.error), None)
