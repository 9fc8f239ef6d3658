"""A sequence: one choice of one request, with its tokens, KV blocks and decoding state."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.engine.outputs import Logprob, PromptLogprob, RequestMetrics
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.lora.types import LoRAAdapter


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
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks so far
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    prefix_queried: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[Logprob] | None = None
    # Structured outputs: the xgrammar matcher at the state after the resolved output tokens
    # (`StructuredOutputManager`'s, set when the grammar is compiled, before the sequence is scheduled).
    grammar: Any = None
    # Scoring (params.prompt_logprobs, computed by choice 0 only): one entry per prompt token landed
    # so far, None for the first.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # An embedding request (prefill only): the fp32 sum of the pooled rows of the current epoch's
    # chunks, and the finished vector.
    pooling: PoolingParams | None = None
    pooled_sum: torch.Tensor | None = None
    embedding: list[float] | None = None
    lora: LoRAAdapter | None = None  # the adapter its tokens run with (None: the base model)
    priority: int = 0  # with --scheduling-policy priority: lower values are scheduled first

    @property
    def priority_key(self) -> tuple[int, float, int]:
        """Its place under priority scheduling: priority, then arrival, then creation order."""
        return self.priority, self.metrics.arrival_time, self.seq_id

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.wants_prompt_logprobs:
            self.prompt_logprobs = [None]

    @property
    def prefix_cache_keys(self) -> bytes:
        """What its blocks' K/V depend on besides the tokens (in every block's hash): KV blocks
        computed with an adapter are only shared by requests of the same adapter."""
        return b"" if self.lora is None else self.lora.prefix_cache_key

    @property
    def constrained(self) -> bool:
        """Its output must match a grammar (structured outputs)."""
        return self.params.structured_outputs is not None

    @property
    def prefill_only(self) -> bool:
        """Scores or embeds its prompt and samples nothing (max_tokens 0, or an embedding)."""
        return self.pooling is not None or self.params.max_tokens == 0

    @property
    def wants_prompt_logprobs(self) -> bool:
        # The choices of a request share the prompt: choice 0 alone scores it.
        return self.params.prompt_logprobs is not None and self.index == 0 and self.pooling is None

    @property
    def prompt_logprobs_done(self) -> bool:
        return self.prompt_logprobs is None or len(self.prompt_logprobs) == len(self.prompt_token_ids)

    def prompt_logprob_range(self, first: int, count: int) -> tuple[int, int]:
        """Positions [start, end) of a chunk of `count` tokens from `first` whose logits score the
        next prompt token and are not landed yet; (0, 0) when none."""
        if self.prompt_logprobs is None:
            return 0, 0
        start = max(first, len(self.prompt_logprobs) - 1)  # (recomputed chunks are not scored twice)
        end = min(first + count, len(self.prompt_token_ids) - 1)  # the last position predicts an output
        return (start, end) if start < end else (0, 0)

    def add_prompt_logprobs(self, first_position: int, entries: Seq[PromptLogprob]) -> None:
        """Land the entries scored by positions `first_position`, ...: entry i scores prompt token
        first_position + i + 1. Entries landed before (a step that ran before a preemption) are kept."""
        assert self.prompt_logprobs is not None
        for i, entry in enumerate(entries):
            index = first_position + i + 1
            assert index <= len(self.prompt_logprobs), (index, len(self.prompt_logprobs))
            if index == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)

    def add_pooled(self, rows_sum: torch.Tensor) -> None:
        self.pooled_sum = rows_sum if self.pooled_sum is None else self.pooled_sum + rows_sum

    def pooled_embedding(self) -> list[float]:
        """The embedding from the fp32 sum of the prompt's pooled rows (its last row alone for "last")."""
        assert self.pooling is not None and self.pooled_sum is not None, "no pooled rows"
        vector = self.pooled_sum
        if self.pooling.pooling == "mean":
            vector = vector / len(self.prompt_token_ids)
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
        return vector.tolist()

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
        """The oldest pending token is now known; with none pending, `token` is a further token of
        the step that just landed (a speculative step yields several) and is appended."""
        if not self.num_pending:
            self.append_pending(token)
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

    def keep_outputs(self, count: int) -> None:
        """Forget the output tokens after the first `count` (an ended sequence whose text stopped
        before the last tokens a speculative step gave it)."""
        assert self.is_finished and not self.num_pending
        del self.output_token_ids[count:]
        del self.token_ids[len(self.prompt_token_ids) + count :]
        if self.logprobs is not None:
            del self.logprobs[count:]

    def finish(self, reason: str, stop_reason: str | int | None = None, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
