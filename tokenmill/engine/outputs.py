"""What the engine hands back for a request: cumulative text and tokens per choice."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock stage timestamps (time.time()) of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

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


@dataclass
class CompletionOutput:
    """One choice of a request. `text`/`token_ids` are cumulative; `*_delta` are new since the last output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    # One entry per generated token: (chosen token logprob, {token_id: logprob} of the top alternatives).
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    logprobs_delta: list[tuple[float, dict[int, float]]] | None = None

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
