"""From landed tokens to what callers see: each choice's text (incremental detokenizing, stop
strings) and each request's `RequestOutput` in its output kind (vLLM's `OutputProcessor`).

It runs on the engine thread right after `Scheduler.update_from_output`, which hands it the
step's live sequences and the tokens each gained. A stop string is found in the text of those
tokens: it ends the choice after the token that completed it (a speculative step's later tokens
are dropped), and it names the reason in place of a "length" or grammar-complete end of that same
token, though not of a stop token id or EOS, which end a choice whatever its text.

It also keeps the requests in flight, answers repeats of finished deterministic requests from the
result cache, and stores what may be stored there when a request finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import SeqUpdate
from tokenmill.engine.core.sequence import Sequence
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.outputs import CompletionOutput, Logprob, PromptLogprob, RequestOutput, RequestOutputKind
from tokenmill.engine.result_cache import ResultCache
from tokenmill.engine.sampling_params import SamplingParams

# Ends a sequence: (sequence, finish reason, stop reason); `Scheduler.finish`.
EndSequence = Callable[[Sequence, str, str | int | None], None]


@dataclass
class _Choice:
    """One choice's text and how much of its output callers have seen."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer, or for an embedding
    reported_tokens: int = 0  # output tokens (and their logprobs) already in a RequestOutput

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""


@dataclass
class _Tracked:
    request: Request
    choices: list[_Choice] = field(default_factory=list)
    reported_prompt_logprobs: bool = False  # whether an output carried them


class OutputProcessor:
    def __init__(
        self, tokenizer: Any, result_cache: ResultCache, end: EndSequence, eos_token_ids: Iterable[int] = ()
    ) -> None:
        """`end`: how a stop string ends a sequence (the scheduler frees its blocks). `eos_token_ids`:
        left out of the text even with skip_special_tokens=false (unless the request ignores EOS)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.result_cache = result_cache
        self._end = end
        self._requests: dict[str, _Tracked] = {}
        self._cached: list[RequestOutput] = []  # result-cache answers, handed out by `take_cached`

    # -- requests in flight --------------------------------------------------------------------

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def request(self, request_id: str) -> Request | None:
        tracked = self._requests.get(request_id)
        return tracked.request if tracked is not None else None

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._cached)

    def answer_from_cache(self, request: Request) -> bool:
        """Whether a finished result answers `request` (its output comes with the next `take_cached`);
        otherwise a cacheable request remembers its key, to be stored when it finishes."""
        if not isinstance(request.params, SamplingParams):
            return False
        key = self.result_cache.key(
            request.prompt_token_ids, request.params, request.lora.id if request.lora is not None else None
        )
        if key is None:
            return False
        cached = self.result_cache.get(key)
        if cached is None:
            request.result_cache_key = key
            return False
        now = time.time()
        m = request.metrics
        m.first_scheduled_time = m.first_token_time = m.finished_time = now
        self._cached.append(
            RequestOutput(
                request.request_id,
                request.prompt,
                request.prompt_token_ids,
                cached,
                True,
                m,
                num_cached_tokens=len(request.prompt_token_ids),
            )
        )
        return True

    def take_cached(self) -> list[RequestOutput]:
        cached, self._cached = self._cached, []
        return cached

    def add(self, request: Request) -> None:
        """Follow a request whose sequences are made: each sampling choice gets its detokenizer."""
        params = request.params
        tracked = _Tracked(request)
        for seq in request.seqs:
            detokenizer = None
            if self.tokenizer is not None and isinstance(params, SamplingParams):
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    seq.prompt_token_ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    skip_special_tokens=params.skip_special_tokens,
                    silent_token_ids=() if params.ignore_eos else self.eos_token_ids,
                )
            tracked.choices.append(_Choice(seq, detokenizer))
        self._requests[request.request_id] = tracked

    # -- a landed step -------------------------------------------------------------------------

    def process(self, updates: Iterable[SeqUpdate]) -> list[RequestOutput]:
        """Add the text of the step's new tokens (ending choices at stop strings), then the output of
        each request the step touched, in the order of its first sequence."""
        touched: dict[str, _Tracked] = {}
        for update in updates:
            tracked = self._requests.get(update.seq.request_id)
            if tracked is None:
                continue
            self._add_text(tracked.choices[update.seq.index], update)
            touched.setdefault(update.seq.request_id, tracked)
        return [out for tracked in touched.values() if (out := self._output(tracked)) is not None]

    def output(self, request_id: str) -> RequestOutput | None:
        """The request's output now (after it was aborted or failed)."""
        tracked = self._requests.get(request_id)
        return self._output(tracked) if tracked is not None else None

    def _add_text(self, choice: _Choice, update: SeqUpdate) -> None:
        detokenizer = choice.detokenizer
        if detokenizer is None:
            return
        last = len(update.new_token_ids) - 1
        for i, token in enumerate(update.new_token_ids):
            stop = detokenizer.add_token(token)
            if stop is not None and not (i == last and update.stopped_on_token):
                self._end(update.seq, "stop", stop)
                update.seq.keep_outputs(update.first_output + i + 1)
                return

    # -- outputs -------------------------------------------------------------------------------

    def _output(self, tracked: _Tracked) -> RequestOutput | None:
        """The request's output of this step (None: nothing to hand out); a finished request is
        forgotten, and stored in the result cache when it may be."""
        request = tracked.request
        finished = request.finished
        if finished:
            self._requests.pop(request.request_id, None)
            if request.metrics.finished_time is None:
                request.metrics.finished_time = time.time()
            if request.result_cache_key is not None and request.error is None:
                self.result_cache.put(request.result_cache_key, [self._final(choice) for choice in tracked.choices])
        kind = request.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind is RequestOutputKind.DELTA:
            choices = [self._delta(choice) for choice in tracked.choices]
        else:
            choices = [self._cumulative(choice) for choice in tracked.choices]
        first = request.seqs[0] if request.seqs else None
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            choices,
            finished,
            request.metrics,
            request.error,
            num_cached_tokens=first.num_cached_tokens if first else 0,
            prompt_logprobs=self._new_prompt_logprobs(tracked),
            embedding=first.embedding if first else None,
            rejection=request.rejection,
        )

    @staticmethod
    def _new_prompt_logprobs(tracked: _Tracked) -> list[PromptLogprob | None] | None:
        """The prompt's logprobs (scored by choice 0) once all are landed, in one output only."""
        seq = tracked.request.seqs[0] if tracked.request.seqs else None
        if (
            seq is None
            or seq.prompt_logprobs is None
            or tracked.reported_prompt_logprobs
            or not seq.prompt_logprobs_done
        ):
            return None
        tracked.reported_prompt_logprobs = True
        return list(seq.prompt_logprobs)

    @staticmethod
    def _final(choice: _Choice) -> CompletionOutput:
        """The choice complete (for the result cache), whatever the output kind."""
        seq = choice.seq
        return _completion(seq, text=choice.text, token_ids=seq.resolved_output_ids, logprobs=_copy(seq.logprobs))

    @staticmethod
    def _delta(choice: _Choice) -> CompletionOutput:
        """Only what is new: O(new tokens + the stop-string holdback)."""
        seq = choice.seq
        start, end = choice.reported_tokens, seq.num_resolved_outputs
        choice.reported_tokens = end
        return _completion(
            seq,
            text="",
            token_ids=[],
            logprobs=None,
            text_delta=choice.detokenizer.take_delta(seq.is_finished) if choice.detokenizer else "",
            token_ids_delta=seq.output_token_ids[start:end],
            logprobs_delta=seq.logprobs[start:end] if seq.logprobs is not None else None,
        )

    @staticmethod
    def _cumulative(choice: _Choice) -> CompletionOutput:
        seq = choice.seq
        start, end = choice.reported_tokens, seq.num_resolved_outputs
        choice.reported_tokens = end
        delta = choice.detokenizer.take_delta(seq.is_finished) if choice.detokenizer else ""
        return _completion(
            seq,
            text=choice.detokenizer.visible_text if choice.detokenizer else "",
            token_ids=seq.output_token_ids[:end],
            logprobs=_copy(seq.logprobs),
            text_delta=delta,
            token_ids_delta=seq.output_token_ids[start:end],
            logprobs_delta=seq.logprobs[start:end] if seq.logprobs is not None else None,
        )


def _copy(logprobs: list[Logprob] | None) -> list[Logprob] | None:
    return list(logprobs) if logprobs is not None else None


def _completion(seq: Sequence, **fields: Any) -> CompletionOutput:
    return CompletionOutput(
        index=seq.index,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_tokens=seq.num_resolved_outputs,
        **fields,
    )
