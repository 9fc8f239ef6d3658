"""A request: its prompt, sampling parameters and the sequences of its choices, and the outputs it
hands back each step (what they carry follows its `RequestOutputKind`)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.core.sequence import Sequence
from tokenmill.engine.outputs import CompletionOutput, RankedLogprob, RequestMetrics, RequestOutput, RequestOutputKind
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.result_cache import CacheKey
from tokenmill.engine.sampling_params import SamplingParams

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
    grammar: Future | None = None  # structured outputs: the compiled grammar (the request waits for it)
    lora: LoRAAdapter | None = None  # the LoRA adapter it runs with (None: the base model)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def error(self) -> str | None:
        return next((s.error for s in self.seqs if s.error), None)

    def output(self) -> RequestOutput | None:
        """What is new since the last output, in this request's output kind; None when there is
        nothing to hand out yet (FINAL_ONLY before the end). Marks what it reports as reported."""
        finished = self.finished
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.time()
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            choices = [self._delta(seq) for seq in self.seqs]
        else:
            choices = [self._cumulative(seq) for seq in self.seqs]
        return self._wrap(choices, finished)

    def final_choices(self) -> list[CompletionOutput]:
        """Every choice complete (for the result cache), whatever the output kind."""
        return [
            _choice(
                seq,
                text=seq.detokenizer.text if seq.detokenizer else "",
                token_ids=seq.resolved_output_ids,
                logprobs=_copy(seq.logprobs),
            )
            for seq in self.seqs
        ]

    def _wrap(self, choices: list[CompletionOutput], finished: bool) -> RequestOutput:
        first = self.seqs[0] if self.seqs else None
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            choices,
            finished,
            self.metrics,
            self.error,
            num_cached_tokens=first.num_cached_tokens if first else 0,
            prompt_logprobs=self._new_prompt_logprobs(),
            embedding=first.embedding if first else None,
        )

    def _new_prompt_logprobs(self) -> list[dict[int, RankedLogprob] | None] | None:
        """The prompt's logprobs (scored by choice 0) once all are landed, in one output only."""
        seq = self.seqs[0] if self.seqs else None
        if seq is None or seq.prompt_logprobs is None or seq.reported_prompt_logprobs or not seq.prompt_logprobs_done:
            return None
        seq.reported_prompt_logprobs = True
        return list(seq.prompt_logprobs)

    @staticmethod
    def _delta(seq: Sequence) -> CompletionOutput:
        """Only what is new: O(new tokens + the stop-string holdback)."""
        start, end = seq.reported_tokens, seq.num_resolved_outputs
        seq.reported_tokens = end
        return _choice(
            seq,
            text="",
            token_ids=[],
            logprobs=None,
            text_delta=seq.detokenizer.take_delta(seq.is_finished) if seq.detokenizer else "",
            token_ids_delta=seq.output_token_ids[start:end],
            logprobs_delta=seq.logprobs[start:end] if seq.logprobs is not None else None,
        )

    @staticmethod
    def _cumulative(seq: Sequence) -> CompletionOutput:
        start, end = seq.reported_tokens, seq.num_resolved_outputs
        seq.reported_tokens = end
        delta = seq.detokenizer.take_delta(seq.is_finished) if seq.detokenizer else ""
        return _choice(
            seq,
            text=seq.detokenizer.visible_text if seq.detokenizer else "",
            token_ids=seq.output_token_ids[:end],
            logprobs=_copy(seq.logprobs),
            text_delta=delta,
            token_ids_delta=seq.output_token_ids[start:end],
            logprobs_delta=seq.logprobs[start:end] if seq.logprobs is not None else None,
        )


def _copy(logprobs: list | None) -> list | None:
    return list(logprobs) if logprobs is not None else None


def _choice(seq: Sequence, **fields) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_tokens=seq.num_resolved_outputs,
        **fields,
    )
