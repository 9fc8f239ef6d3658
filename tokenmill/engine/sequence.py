"""A sequence: one choice of one request, with its tokens, KV blocks and decoding state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.outputs import Logprob, RequestMetrics
from tokenmill.engine.sampling_params import SamplingParams


def placeholder(row: int) -> int:
    """Stand-in for the token sampled in row `row` of the step that is running now (ids are >= 0)."""
    return -(row + 1)


def placeholder_row(token: int) -> int:
    """The row a placeholder stands for (the inverse of `placeholder`)."""
    return -token - 1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # choice index within the request
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or being written by a launched step)
    block_table: list[int] = field(default_factory=list)
    # Tokens sampled by steps still running are in token_ids/output_token_ids as placeholders at the end
    # (see `placeholder`); `num_pending` counts them. The scheduler plans the next step as if they were known.
    num_pending: int = 0
    finishing: bool = False  # its pending token ends it (max_tokens / context): schedule it no more
    epoch: int = 0  # bumped whenever its blocks are freed (preemption), so stale step results are recognised
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks so far
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prefix_queried: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[Logprob] | None = None
    reported_tokens: int = 0  # output tokens (and their logprobs) already in a RequestOutput
    # Structured outputs: the xgrammar matcher at the state after the resolved output tokens (set when
    # the grammar is compiled, before the sequence is scheduled; advanced only by the scheduler).
    grammar: Any = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_resolved_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def num_resolved_outputs(self) -> int:
        return len(self.output_token_ids) - self.num_pending

    @property
    def resolved_output_ids(self) -> list[int]:
        return self.output_token_ids[: len(self.output_token_ids) - self.num_pending]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_pending(self, placeholder: int) -> None:
        """A launched step will sample this sequence's next token: hold its place."""
        self.output_token_ids.append(placeholder)
        self.token_ids.append(placeholder)
        self.num_pending += 1

    def resolve(self, token: int, logprob: Logprob | None = None) -> None:
        """The oldest pending token is now known."""
        out_index = len(self.output_token_ids) - self.num_pending
        self.output_token_ids[out_index] = token
        self.token_ids[len(self.token_ids) - self.num_pending] = token
        self.num_pending -= 1
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()

    def drop_pending(self, count: int | None = None) -> None:
        """Forget the newest `count` pending tokens, or all of them (the sequence ended, or the steps
        sampling them were taken back)."""
        drop = self.num_pending if count is None else count
        assert 0 <= drop <= self.num_pending, (drop, self.num_pending)
        if drop:
            del self.output_token_ids[-drop:]
            del self.token_ids[-drop:]
            self.num_pending -= drop

    def finish(self, reason: str, stop_reason: str | int | None = None, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
