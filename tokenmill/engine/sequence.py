"""A sequence: one choice of one request, with its tokens, KV blocks and decoding state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.outputs import RequestMetrics
from tokenmill.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # choice index within the request
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks so far
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prefix_queried: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    # What the last RequestOutput already reported, so the next one carries only deltas.
    reported_text_len: int = 0
    reported_tokens: int = 0
    reported_logprobs: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.token_ids.append(token)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
