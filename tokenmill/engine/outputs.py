"""What the engine hands back for a request, per choice; how much of it depends on the request's
`RequestOutputKind` (vLLM's): the whole text each step, only what is new, or one final output."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequest

# (logprob of the chosen token, {token id: logprob} of the top alternatives), per generated token.
Logprob = tuple[float, dict[int, float]]


class RequestOutputKind(enum.Enum):
    # Every output carries the text, tokens and logprobs so far, and what is new (O(length) per step).
    CUMULATIVE = "cumulative"
    # Every output carries only what is new (`*_delta`, O(new) per step): streaming.
    DELTA = "delta"
    # One output, when the request finishes, with everything (offline and non-streaming calls).
    FINAL_ONLY = "final_only"


@dataclass
class RequestMetrics:
    """Wall-clock stage timestamps (time.time()) of one request."""

    arrival_time: float  # queued in the engine
    # Chat rendering, tokenization and validation of the prompt, before arrival (None: not recorded).
    tokenize_start_time: float | None = None
    tokenize_end_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Speculative decoding, summed over the request's choices: verification steps, draft tokens
    # proposed in them, and how many of those the model accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None: nothing was proposed)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Tokens generated per verification step: the accepted drafts plus the model's own token."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class RankedLogprob:
    """A token's logprob and its rank among the vocabulary (1 = the most likely), like vLLM's Logprob."""

    logprob: float
    rank: int


PromptLogprob = dict[int, RankedLogprob]  # a prompt token's own logprob first, then the top alternatives


@dataclass
class CompletionOutput:
    """One choice of a request. `*_delta` are new since this request's previous output; `text`,
    `token_ids` and `logprobs` are everything so far (left empty by DELTA outputs); `num_tokens`
    counts the tokens generated so far in every kind."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    # One entry per generated token: (chosen token logprob, {token_id: logprob} of the top alternatives).
    logprobs: list[Logprob] | None = None
    logprobs_delta: list[Logprob] | None = None
    num_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed inside the engine (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it), else {token id: RankedLogprob} with the prompt's own token first, then the top
    # alternatives. Delivered once, in the first output after the whole prompt was prefilled.
    prompt_logprobs: list[PromptLogprob | None] | None = None
    embedding: list[float] | None = None  # a PoolingParams request's pooled vector (in its final output)
    # The request failed because of its input, found bad only in the engine (a grammar too costly
    # to compile or match): `error` says why; front ends answer it as bad input.
    rejection: InvalidRequest | None = None
