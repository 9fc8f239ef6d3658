"""The synchronous engine: requests in, one scheduler + model step at a time, outputs out.

`build_engine` (engine/builder.py) makes the parts; `LLMEngine` runs them: it queues requests,
launches and completes steps (with overlap scheduling, one ahead on the model thread), takes a
failed step back, and reports stats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Any

from tokenmill.engine.builder import build_engine
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import SchedulerOutput
from tokenmill.engine.core.sequence import Sequence
from tokenmill.engine.detokenizer import TokenText
from tokenmill.engine.input_processor import PromptInput
from tokenmill.engine.outputs import RequestMetrics, RequestOutput, RequestOutputKind
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.spec_decode.draft import DraftProposer
from tokenmill.engine.structured_output.budget import GrammarTooExpensive, too_expensive_message
from tokenmill.engine.worker.model_runner import StepInput
from tokenmill.errors import InvalidRequest, RequestFailed

if TYPE_CHECKING:
    from tokenmill.lora.types import LoRAAdapter

logger = logging.getLogger(__name__)

_GRAMMAR_POLL_S = 0.01  # how long an otherwise idle step waits for a grammar compile


@dataclass
class LaunchedStep:
    scheduled: SchedulerOutput  # what the scheduling thread planned (live sequences: this thread only)
    step_input: StepInput  # what the model thread runs
    future: Future  # -> (ModelRunnerOutput, model-thread seconds)


def _timed(fn: Callable[[StepInput], Any], step: StepInput) -> tuple[Any, float]:
    start = time.perf_counter()
    return fn(step), time.perf_counter() - start


@dataclass
class StepStats:
    batch_size: int  # sequences in the step
    num_prefill_tokens: int  # prompt tokens computed in the step (bench profile counts tokens per step)
    num_decode_tokens: int  # decoding sequences' tokens, draft tokens included
    step_time_s: float  # model-thread time (forward pass and sampling)


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_blocks_total: int
    num_blocks_free: int
    num_preemptions_total: int
    prefix_cache_hit_rate: float
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    result_cache_hits_total: int = 0
    result_cache_misses_total: int = 0
    result_cache_entries: int = 0
    spec_decode_num_drafts: int = 0  # speculative decoding: verification steps of a sequence
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()  # [i]: drafts accepted at position i
    max_loras: int = 0  # LoRA slots (0: LoRA off)
    lora_running: tuple[str, ...] = ()  # the adapters of the running requests, by name
    lora_waiting: tuple[str, ...] = ()  # the adapters of the waiting requests


class LLMEngine:
    """Runs the parts `build_engine` makes for a config; one thread calls it (the engine thread)."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        parts = build_engine(config, progress)
        self.parts = parts
        # Facts about the model and its cache (read by front ends, benchmarks and tests).
        self.config = config
        self.device = parts.device
        self.model_dir = parts.model_dir
        self.model_name = parts.model_name
        self.served_model_names = parts.served_model_names
        self.generation_defaults = parts.generation_defaults
        self.model = parts.model
        self.spec = parts.spec
        self.precision = parts.precision
        self.dtype = parts.precision.compute
        self.kv_dtype = parts.kv_dtype
        self.block_size = config.block_size
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = set(parts.spec.eos_token_ids)
        self.tokenizer = parts.tokenizer
        self.token_text = TokenText(parts.tokenizer) if parts.tokenizer is not None else None
        self.loras = parts.loras
        self.lora_model = parts.lora_model
        self.kv_cache = parts.kv_cache
        # What a step runs through.
        self.input_processor = parts.input_processor
        self.structured_outputs = parts.structured_outputs
        # An engine dropped without close() leaves no grammar compiler processes behind.
        weakref.finalize(self, parts.structured_outputs.close)
        self.scheduler = parts.scheduler
        self.allocator = parts.allocator
        self.drafter = parts.drafter
        self.runner = parts.runner
        self.output_processor = parts.output_processor
        self.result_cache = parts.output_processor.result_cache
        self._model_thread = parts.model_thread
        self._inflight: deque[LaunchedStep] = deque()
        self._seq_ids = count()
        self.step_listeners: list[Callable[[StepStats], None]] = []
        self.num_steps = 0

    # -- requests ----------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation defaults (--generation-config) for what is unset."""
        return SamplingParams.from_dict(dict(self.generation_defaults))

    def make_request(
        self,
        request_id: str,
        prompt: str | Seq[int] | PromptInput,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora: LoRAAdapter | None = None,
        priority: int | None = None,
    ) -> Request:
        """Validate and tokenize (thread-safe, touches no engine state); `add` queues it. A PromptInput
        that `input_processor.process` made (with these params) is taken as it is. `lora`: the adapter
        to run it with (or the one a processed PromptInput carries); `priority` likewise (vLLM's: lower
        first, with --scheduling-policy priority)."""
        if isinstance(prompt, PromptInput) and prompt.processed:
            checked = prompt if lora is None else dataclasses.replace(prompt, lora=lora)
        else:
            checked = self.input_processor.process(prompt, params, lora=lora)
        if checked.lora is not None and self.loras is None:
            raise InvalidRequest("this engine serves no LoRA adapters (start it with --enable-lora)", param="model")
        priority = checked.priority if priority is None else priority
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidRequest(
                f"priority {priority} needs priority scheduling (start the engine with --scheduling-policy priority)",
                param="priority",
            )
        metrics = RequestMetrics(
            arrival_time=arrival_time or time.time(),
            tokenize_start_time=checked.processing_start,
            tokenize_end_time=checked.processing_end,
        )
        return Request(
            request_id,
            checked.prompt,
            checked.prompt_token_ids,
            params,
            metrics,
            output_kind,
            lora=checked.lora,
            priority=priority,
        )

    def add(self, request: Request) -> None:
        if request.request_id in self.output_processor:
            raise InvalidRequest(f"request id {request.request_id!r} is already running", code="duplicate_request_id")
        constraint = request.params.structured_outputs if isinstance(request.params, SamplingParams) else None
        self.structured_outputs.check(constraint)
        if self.output_processor.answer_from_cache(request):
            return
        request.seqs = self._sequences(request)
        self.output_processor.add(request)
        if constraint is None:
            for seq in request.seqs:
                self.scheduler.add(seq)
        else:  # scheduled once its grammar is compiled (see _admit_compiled); others run meanwhile
            self.structured_outputs.add(request, constraint)

    def _sequences(self, request: Request) -> list[Sequence]:
        """One sequence per choice; an embedding is one prefill-only sequence (its sampling params
        are never used). The choices share the prompt, which never changes."""
        prompt = tuple(request.prompt_token_ids)
        params = request.params
        if isinstance(params, PoolingParams):
            return [
                Sequence(
                    next(self._seq_ids),
                    request.request_id,
                    0,
                    prompt,
                    SamplingParams(),
                    request.metrics,
                    pooling=params,
                    lora=request.lora,
                    priority=request.priority,
                )
            ]
        return [
            Sequence(
                next(self._seq_ids),
                request.request_id,
                i,
                prompt,
                params,
                request.metrics,
                lora=request.lora,
                priority=request.priority,
            )
            for i in range(params.n)
        ]

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int] | PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        priority: int = 0,
    ) -> None:
        self.add(
            self.make_request(
                request_id, prompt, params or SamplingParams(), arrival_time, output_kind, priority=priority
            )
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        return self._end_request(request_id, "abort", None)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        return self._end_request(request_id, "error", message)

    def reject(self, request_id: str, exc: InvalidRequest) -> RequestOutput | None:
        """Fail a request whose input turned out bad in the engine (answered as bad input)."""
        request = self.output_processor.request(request_id)
        if request is not None:
            request.rejection = exc
        return self._end_request(request_id, "error", exc.message)

    def _end_request(self, request_id: str, reason: str, error: str | None) -> RequestOutput | None:
        """Finish every unfinished choice of a request now and free its blocks (and withdraw it from
        its grammar's compile, which stops when nobody else waits for it)."""
        request = self.output_processor.request(request_id)
        if request is None:
            return None
        self.structured_outputs.withdraw(request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason, error=error)
        return self.output_processor.output(request_id)

    def close(self) -> None:
        """Stop the model thread, the grammar compilers and the tensor-parallel workers."""
        for step in self._inflight:  # a step waiting for its grammar mask must not wait forever
            step.step_input.cancel_grammar_mask("the engine is closing")
        self.parts.close()

    def has_unfinished(self) -> bool:
        return self.output_processor.has_unfinished() or bool(self._inflight)

    # -- the step ----------------------------------------------------------------------------
    #
    # A step is launched (scheduled, prepared, advanced as if its tokens were known, handed to the
    # model) and later completed (its ModelRunnerOutput landed by the scheduler, then text, stop
    # strings and outputs by the output processor). Without overlap scheduling one step() does
    # both. With it, step() launches step N+1 while step N still runs on the model thread, then
    # completes step N: scheduling, input preparation, detokenization and output building all
    # happen while the model works.

    def step(self) -> list[RequestOutput]:
        cached = self.output_processor.take_cached()
        outputs = self._admit_compiled()
        launched = self._launch()
        if launched is not None:
            self._inflight.append(launched)
        elif not self._inflight:  # nothing to run but maybe compiles: wait a little for one
            self.structured_outputs.wait_for_compile(_GRAMMAR_POLL_S)
        keep = 1 if self._model_thread is not None and launched is not None else 0
        while len(self._inflight) > keep:
            outputs.extend(self._complete(self._inflight.popleft()))
            if self._inflight:  # the next step's rows now know every earlier token
                self._fill_grammar_mask(self._inflight[0])
        outputs.extend(self._stop_costly_grammars())
        return cached + outputs

    def _stop_costly_grammars(self) -> list[RequestOutput]:
        """Reject the requests whose matchers ran over their budget (see structured_output.budget):
        their grammar must not slow every other stream down."""
        costly = {s.request_id for s in self.scheduler.running if self.structured_outputs.over_budget(s)}
        message = too_expensive_message()
        return [out for rid in sorted(costly) if (out := self.reject(rid, GrammarTooExpensive(message))) is not None]

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand requests whose grammar is ready to the scheduler; fail those whose grammar did not
        compile (reject those whose grammar is too costly to compile: their input's fault). Returns
        the failed requests' outputs."""
        ready, failed, rejected = self.structured_outputs.take_ready()
        for request in ready:
            for seq in request.seqs:
                self.scheduler.add(seq)
        outputs = [out for request, message in failed if (out := self.fail(request.request_id, message)) is not None]
        outputs += [out for request, exc in rejected if (out := self.reject(request.request_id, exc)) is not None]
        return outputs

    def _launch(self) -> LaunchedStep | None:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        fresh = self.allocator.take_fresh()
        if self.drafter is not None:
            scheduled = self._propose(self.drafter, scheduled, fresh)
        step_input = self.runner.prepare(scheduled, fresh, self.scheduler.take_released())
        launched = LaunchedStep(scheduled, step_input, Future())
        if not self._inflight:  # no step before it is running: its rows' earlier tokens are all known
            self._fill_grammar_mask(launched)
        launched.future = self._submit(step_input)
        return launched

    @staticmethod
    def _propose(drafter: DraftProposer, scheduled: SchedulerOutput, fresh: list[int]) -> SchedulerOutput:
        """The step with the draft model's tokens; without drafts if the draft model failed (the
        requests go on without speculation for this step; it cannot make a token wrong)."""
        try:
            return drafter.propose(scheduled, fresh)
        except Exception:
            logger.exception("the draft model failed: this step runs without speculation")
            return scheduled.without_drafts()

    def _fill_grammar_mask(self, step: LaunchedStep) -> None:
        """The step's allowed-token bitmask, which the model thread waits for before sampling."""
        mask = step.step_input.grammar_mask
        if mask is not None and not mask.filled:
            self.structured_outputs.fill_mask(mask, [item.seq for item in step.scheduled.sampled])

    def _submit(self, step: StepInput) -> Future:
        if self._model_thread is not None:
            return self._model_thread.submit(_timed, self.runner.run, step)
        future: Future = Future()
        try:
            future.set_result(_timed(self.runner.run, step))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        try:
            result, seconds = step.future.result()
        except Exception as exc:
            return self._recover(step, exc)
        updates = self.scheduler.update_from_output(step.scheduled, result)
        self.num_steps += 1
        batch = step.scheduled
        self._notify(
            StepStats(
                len(batch.all),
                sum(i.num_new_tokens for i in batch.prefills),
                len(batch.decodes) + sum(i.num_new_tokens for i in batch.speculative),
                seconds,
            )
        )
        return self.output_processor.process(updates)

    def _recover(self, failed: LaunchedStep, exc: Exception) -> list[RequestOutput]:
        """A step failed: take it and every later launched step back (the model thread skips those),
        fail the requests it names, and let the rest run again from where they were."""
        later = list(self._inflight)
        self._inflight.clear()
        for step in later:
            with contextlib.suppress(Exception):
                step.future.result()
        for step in reversed([failed, *later]):
            self.allocator.fresh.extend(step.step_input.fresh_blocks)  # not zeroed yet
            self.scheduler.take_back(step.scheduled)
            step.step_input.cancel_grammar_mask("the step was taken back")
        self.runner.recover()
        if isinstance(exc, RequestFailed):
            ids, message = exc.request_ids, str(exc)
        else:
            logger.error("model step failed", exc_info=exc)
            ids, message = (
                {row.request_id for row in failed.step_input.rows},
                f"internal error in the model step: {exc}",
            )
        return [o for rid in sorted(ids) if (o := self.fail(rid, message)) is not None]

    def _notify(self, stats: StepStats) -> None:
        for listener in self.step_listeners:
            try:
                listener(stats)
            except Exception:
                logger.exception("step listener failed")

    def stats(self) -> EngineStats:
        a = self.allocator
        rc = self.result_cache.stats()
        spec = self.scheduler.spec_stats
        return EngineStats(
            num_waiting=len(self.scheduler.waiting) + self.structured_outputs.num_waiting_seqs,
            num_running=len(self.scheduler.running),
            kv_cache_usage=a.usage,
            num_blocks_total=a.num_blocks,
            num_blocks_free=a.num_free,
            num_preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_hit_rate=a.stats.hit_rate,
            prefix_cache_queries_total=a.stats.queries,
            prefix_cache_hits_total=a.stats.hits,
            result_cache_hits_total=rc.hits,
            result_cache_misses_total=rc.misses,
            result_cache_entries=rc.entries,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(spec.accepted_per_position),
            max_loras=0 if self.lora_model is None else self.lora_model.max_loras,
            lora_running=_adapter_names(self.scheduler.running),
            lora_waiting=_adapter_names(self.scheduler.waiting),
        )


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The distinct adapters of `seqs`, sorted (a copy first: the engine thread may change them)."""
    return tuple(sorted({seq.lora.name for seq in list(seqs) if seq.lora is not None}))
