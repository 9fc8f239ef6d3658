"""The synchronous engine: requests in, one scheduler + model step at a time, outputs out."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.engine import faults
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.block_manager import BlockAllocator
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.engine.core.sequence import Sequence
from tokenmill.engine.detokenizer import TokenText
from tokenmill.engine.input_processor import InputProcessor, PromptInput
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestMetrics, RequestOutput, RequestOutputKind
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.precision import resolve_kv_cache_dtype, resolve_precision
from tokenmill.engine.result_cache import ResultCache
from tokenmill.engine.sample.sampler import Sampler
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.setup import (
    check_tensor_parallel,
    load_prepared_model,
    load_tokenizer,
    num_kv_blocks,
    resolve_device,
)
from tokenmill.engine.spec_decode import check_speculative_config
from tokenmill.engine.spec_decode.draft import DraftProposer, check_draft_model, load_draft_model
from tokenmill.engine.spec_decode.ngram import NgramProposer
from tokenmill.engine.structured_output.manager import StructuredOutputManager
from tokenmill.engine.worker.cuda_graphs import DecodeGraphs
from tokenmill.engine.worker.kv_cache import KVCache
from tokenmill.engine.worker.model_runner import ModelRunner, StepInput
from tokenmill.engine.worker.tensor_parallel import TensorParallelGroup, rank_device
from tokenmill.errors import InvalidRequest, RequestFailed
from tokenmill.lora.batch import LoRASlots
from tokenmill.lora.layers import LoRAModel
from tokenmill.lora.registry import LoRARegistry, parse_lora_module
from tokenmill.models.model_loader.hub import resolve_model

if TYPE_CHECKING:
    from tokenmill.lora.types import LoRAAdapter

logger = logging.getLogger(__name__)

_GRAMMAR_POLL_S = 0.01  # how long an otherwise idle step waits for a grammar compile


@dataclass
class LaunchedStep:
    scheduled: SchedulerOutput  # what the scheduling thread planned (live sequences: this thread only)
    step_input: StepInput  # what the model thread runs
    future: Future  # -> (ModelRunnerOutput, model-thread seconds)


def _init_model_thread(num_threads: int, device: torch.device) -> None:
    torch.set_num_threads(num_threads)  # intra-op threads are set per calling thread
    if device.type == "cuda":
        # So is the current CUDA device. An index-less "cuda" means the creating thread's current device
        # (resolved by the caller): set_device rejects a device without an index.
        torch.cuda.set_device(device.index)


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device with its index: an index-less "cuda" is this thread's current device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self._inflight: deque[LaunchedStep] = deque()
        self._model_thread: ThreadPoolExecutor | None = None
        self.device = resolve_device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_dir = resolve_model(config.model)
        self.precision = resolve_precision(config.dtype, self.device, self.model_dir)
        self.dtype = self.precision.compute
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.precision.weights)
        self.model_name = config.served_model_name or self.model_dir.name
        self.tokenizer = load_tokenizer(self.model_dir)
        self.token_text = TokenText(self.tokenizer) if self.tokenizer is not None else None
        self.tp_group: TensorParallelGroup | None = None
        check_speculative_config(config)
        config.check_lora()
        lora_modules = [parse_lora_module(text) for text in config.lora_modules or ()]
        check_tensor_parallel(config, self.model_dir, self.device)
        if config.tensor_parallel_size > 1:
            self.device = rank_device(self.device, 0)
            self.tp_group = TensorParallelGroup(config, self.device)  # workers load their shards meanwhile
        try:
            self.model, self.spec = load_prepared_model(
                config, self.model_dir, self.precision, self.device, progress=progress
            )
            # LoRA: the model's target layers wrapped, with --max-loras slots each (before the KV budget is taken).
            self.lora_model = (
                LoRAModel(self.model, config.max_loras, config.max_lora_rank, self.dtype, self.device)
                if config.lora_enabled
                else None
            )
        except BaseException:
            self.close()
            raise
        self.loras = (
            None
            if self.lora_model is None
            else LoRARegistry(
                self.lora_model.targets, self.lora_model.hf_to_local, config.max_lora_rank, self.dtype, self.model_name
            )
        )
        self.block_size = config.block_size
        self.max_model_len = min(config.max_model_len or self.spec.max_position, self.spec.max_position)
        self._draft: tuple[torch.nn.Module, Any] | None = None  # (model, spec) with --speculative-method draft
        if config.speculative_method == "draft":
            self._draft = self._load_draft()
        # Structured outputs: grammars compile on their own threads; requests wait there meanwhile.
        self.structured_outputs: StructuredOutputManager[Request] = StructuredOutputManager(
            self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids
        )
        self._build_cache()
        self.input_processor = InputProcessor(self.tokenizer, self.spec.vocab_size, self.max_model_len)
        self.eos_token_ids = set(self.spec.eos_token_ids)
        self.result_cache = ResultCache(config.result_cache_size)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.result_cache, self.scheduler.finish, self.spec.eos_token_ids
        )
        self._seq_ids = count()
        self.step_listeners: list[Callable[[StepStats], None]] = []
        self.num_steps = 0
        overlap = config.overlap_scheduling
        if config.speculative_method is not None:
            if overlap:
                logger.warning(
                    "--overlap-scheduling is off with speculative decoding: drafts are proposed from "
                    "each step's tokens, so a step cannot be planned before the previous one lands"
                )
            overlap = False
        elif overlap is None:  # auto: a GPU runs the model while the CPU prepares; a CPU has no core to spare
            overlap = self.device.type == "cuda"
        if overlap:
            # The model runs on its own thread, one step ahead of the completions.
            self._model_thread = ThreadPoolExecutor(
                1,
                "tokenmill-model",
                initializer=_init_model_thread,
                initargs=(torch.get_num_threads(), _indexed(self.device)),
            )
        faults.install(self)  # test-only hook, off unless TOKENMILL_FAULT_INJECTION=1
        try:
            for module in lora_modules:
                self.loras.load(module.name, module.path, module.base_model_name)
        except BaseException:
            self.close()
            raise

    def _load_draft(self) -> tuple[torch.nn.Module, Any]:
        draft_dir = resolve_model(self.config.speculative_model)
        try:
            draft_spec = check_draft_model(draft_dir, self.spec, self.tokenizer)
            model = load_draft_model(self.config, draft_dir, self.precision, self.device)
        except BaseException:
            self.close()
            raise
        if draft_spec.max_position < self.max_model_len:
            logger.warning(
                "the draft model's context is %d tokens: max_model_len lowered from %d",
                draft_spec.max_position,
                self.max_model_len,
            )
            self.max_model_len = draft_spec.max_position
        return model, draft_spec

    def _build_cache(self) -> None:
        spec, bs, config = self.spec, self.block_size, self.config
        draft_bytes = DraftProposer.bytes_per_block(self._draft[1], bs, self.dtype) if self._draft else 0
        num_blocks, per_block = num_kv_blocks(config, spec, self.kv_dtype, self.device, self.max_model_len, draft_bytes)
        usable_tokens = (num_blocks - 1) * bs  # block 0 is the allocator's zero block
        if usable_tokens < self.max_model_len:
            logger.warning("KV cache holds %d tokens: max_model_len lowered from %d", usable_tokens, self.max_model_len)
            self.max_model_len = usable_tokens
        if self.tp_group is not None:
            self.tp_group.broadcast(num_blocks)  # every rank's cache has the same block ids
        self.allocator = BlockAllocator(num_blocks, bs, self.config.enable_prefix_caching)
        self.kv_cache = KVCache(
            spec.num_layers, num_blocks, bs, spec.num_kv_heads, spec.head_dim, self.kv_dtype, self.device
        )
        ngram = config.speculative_method == "ngram"
        lora = self.lora_model
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            max(config.max_num_batched_tokens, 1),
            self.max_model_len,
            spec.eos_token_ids,
            config.num_speculative_tokens if config.speculative_method else 0,
            NgramProposer(config.ngram_prompt_lookup_min, config.ngram_prompt_lookup_max) if ngram else None,
            lora.max_loras if lora else None,
            self.structured_outputs,
        )
        self.drafter = None
        if self._draft is not None:
            self.drafter = DraftProposer(*self._draft, num_blocks, bs, self.dtype, self.device)
        self.sampler = Sampler(spec.vocab_size, self.config.seed, self.device)
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            bs,
            self.sampler,
            self.device,
            self.tp_group,
            self._decode_graphs(),
            lora,
            LoRASlots(lora.max_loras) if lora else None,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens, %s (%.1f MiB%s)",
            num_blocks,
            bs,
            str(self.kv_dtype).removeprefix("torch."),
            num_blocks * per_block / 2**20,
            ", the draft model's included" if self._draft else "",
        )
        if config.speculative_method:
            source = (
                f"n-grams of {config.ngram_prompt_lookup_min}-{config.ngram_prompt_lookup_max} tokens looked "
                "up in the prompt and output"
                if ngram
                else f"draft model {config.speculative_model}"
            )
            logger.info(
                "speculative decoding: up to %d draft tokens per sequence and step from %s",
                config.num_speculative_tokens,
                source,
            )

    def _decode_graphs(self) -> DecodeGraphs | None:
        if not self.config.cuda_graphs:
            return None
        if self.device.type != "cuda":
            logger.warning("--cuda-graphs needs a CUDA device: decode steps run eagerly on %s", self.device)
            return None
        if self.tp_group is not None:
            logger.warning("--cuda-graphs is not used with tensor parallelism: decode steps run eagerly")
            return None
        if not getattr(self.model, "supports_cuda_graphs", True):
            reason = getattr(self.model, "cuda_graphs_blocker", None) or (
                f"this model's MoE experts run as a per-expert loop here (int8, or no grouped_mm for {self.dtype} "
                "on this GPU), which capture forbids"
            )
            logger.warning("--cuda-graphs: %s: decode steps run eagerly", reason)
            return None
        return DecodeGraphs(
            self.model,
            self.kv_cache,
            self.block_size,
            self.config.max_num_seqs,
            -(-self.max_model_len // self.block_size),
            self.device,
        )

    # -- requests ----------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int] | PromptInput,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora: LoRAAdapter | None = None,
    ) -> Request:
        """Validate and tokenize (thread-safe, touches no engine state); `add` queues it. `lora`: the
        adapter to run it with (or the one a processed PromptInput carries)."""
        checked = self.input_processor.process(prompt, params, lora=lora)
        if checked.lora is not None and self.loras is None:
            raise InvalidRequest("this engine serves no LoRA adapters (start it with --enable-lora)", param="model")
        metrics = RequestMetrics(
            arrival_time=arrival_time or time.time(),
            tokenize_start_time=checked.processing_start,
            tokenize_end_time=checked.processing_end,
        )
        return Request(
            request_id, checked.prompt, checked.prompt_token_ids, params, metrics, output_kind, lora=checked.lora
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
                )
            ]
        return [
            Sequence(next(self._seq_ids), request.request_id, i, prompt, params, request.metrics, lora=request.lora)
            for i in range(params.n)
        ]

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        self.add(self.make_request(request_id, prompt, params or SamplingParams(), arrival_time, output_kind))

    def abort(self, request_id: str) -> RequestOutput | None:
        return self._end_request(request_id, "abort", None)

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        return self._end_request(request_id, "error", message)

    def _end_request(self, request_id: str, reason: str, error: str | None) -> RequestOutput | None:
        """Finish every unfinished choice of a request now and free its blocks."""
        request = self.output_processor.request(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason, error=error)
        return self.output_processor.output(request_id)

    def close(self) -> None:
        """Stop the model thread, the grammar compilers and the tensor-parallel workers."""
        for step in self._inflight:  # a step waiting for its grammar mask must not wait forever
            step.step_input.cancel_grammar_mask("the engine is closing")
        if self._model_thread is not None:
            self._model_thread.shutdown(wait=True)
        if getattr(self, "structured_outputs", None) is not None:
            self.structured_outputs.close()
        if self.tp_group is not None:
            self.tp_group.close()

    def has_unfinished(self) -> bool:
        return self.output_processor.has_unfinished() or bool(self._inflight)

    # -- the step ----------------------------------------------------------------------------
    #
    # A step is launched (scheduled, prepared, advanced as if its tokens were known, handed to the
    # model) and later completed (sampled tokens appended, stop checks, outputs). Without overlap
    # scheduling one step() does both. With it, step() launches step N+1 while step N still runs on
    # the model thread, then completes step N: scheduling, input preparation, detokenization and
    # output building all happen while the model works.

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
        return cached + outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Hand requests whose grammar is ready to the scheduler; fail those whose grammar did not
        compile. Returns the failed requests' outputs."""
        ready, failed = self.structured_outputs.take_ready()
        for request in ready:
            for seq in request.seqs:
                self.scheduler.add(seq)
        return [out for request, message in failed if (out := self.fail(request.request_id, message)) is not None]

    def _launch(self) -> LaunchedStep | None:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        fresh = self.allocator.take_fresh()
        if self.drafter is not None:
            scheduled = self._propose(scheduled, fresh)
        step_input = self.runner.prepare(scheduled, fresh, self.scheduler.take_released())
        launched = LaunchedStep(scheduled, step_input, Future())
        if not self._inflight:  # no step before it is running: its rows' earlier tokens are all known
            self._fill_grammar_mask(launched)
        launched.future = self._submit(step_input)
        return launched

    def _propose(self, scheduled: SchedulerOutput, fresh: list[int]) -> SchedulerOutput:
        """The step with the draft model's tokens; without drafts if the draft model failed (the
        requests go on without speculation for this step; it cannot make a token wrong)."""
        try:
            return self.drafter.propose(scheduled, fresh)
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
