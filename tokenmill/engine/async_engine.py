"""asyncio front of the engine: the engine loop runs in its own thread, callers await outputs.

Tokenization and validation run on the caller's side (in a worker thread) while the engine
thread runs model steps, so new requests never wait behind Python work of the model loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.request import Request
from tokenmill.engine.detokenizer import TokenText
from tokenmill.engine.heap import trim_heap
from tokenmill.engine.input_processor import InputProcessor, PromptInput
from tokenmill.engine.llm_engine import EngineStats, LLMEngine, StepStats
from tokenmill.engine.outputs import RequestOutput, RequestOutputKind
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.errors import InvalidRequest
from tokenmill.lora.registry import LoRARegistry

__all__ = ["AsyncEngine", "EngineStats", "StepStats"]

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5
_TRIM_INTERVAL_S = 1.0


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put_nowait(out)


class AsyncEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self._inbox: queue.SimpleQueue[Request | str] = queue.SimpleQueue()  # a request to add, or an id to abort
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._failed: BaseException | None = None
        # The engine is built (weights loaded and packed) on the thread that then runs its steps, so
        # that only that thread ever opens OpenMP regions: each thread that does gets its own team of
        # OpenMP workers, and with more of them than cores libgomp stops spinning between regions
        # (each region then wakes its workers from sleep). Built on the caller's thread, the model's
        # GEMMs and kernels run slower on the engine thread: `python bench/openmp_teams.py`.
        built: Future[LLMEngine] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(config, progress, built), name="tokenmill-engine", daemon=True
        )
        self._thread.start()
        self.engine = built.result()  # (raises what building it raised)
        self._stats = self.engine.stats()
        self.engine.structured_outputs.warm()  # a server: structured outputs should not wait for a cold start

    # -- facts about the model ----------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def token_text(self) -> TokenText | None:
        return self.engine.token_text

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def served_model_names(self) -> list[str]:
        """Every name requests may give the base model (--served-model-name); model_name is the first."""
        return self.engine.served_model_names

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling settings of requests that leave them unset (--generation-config), by SamplingParams name."""
        return self.engine.generation_defaults

    @property
    def loras(self) -> LoRARegistry | None:
        """The LoRA adapters requests may select by name (None: LoRA is off)."""
        return self.engine.loras

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def hidden_size(self) -> int:
        """The length of an embedding (the final hidden state)."""
        return self.engine.spec.hidden_size

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._failed is None and not self._stopping

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its last step (safe to read from any thread)."""
        return self._stats

    def add_step_listener(self, listener: Callable[[StepStats], None]) -> None:
        self.engine.step_listeners.append(listener)

    # -- requests -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int] | PromptInput,
        params: SamplingParams | PoolingParams,
        request_id: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs (of `output_kind`) as tokens arrive; closing the iterator early aborts the request
        (PoolingParams: an embedding, in the final output). InvalidRequest when the input is bad, also
        when the engine finds it out later (a grammar too costly to compile or to match).
        A `PromptInput` (from `input_processor.process`) is queued as it is; text or token ids are
        processed here first (InvalidRequest on bad input)."""
        if not self.is_alive():
            raise RuntimeError("the engine is not running")
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        if isinstance(prompt, PromptInput):  # already tokenized and checked: only the cheap checks are left
            request = self.engine.make_request(request_id, prompt, params, output_kind=output_kind)
        else:  # tokenizing a long prompt takes a while: keep it off the event loop
            request = await loop.run_in_executor(
                None, functools.partial(self.engine.make_request, request_id, prompt, params, output_kind=output_kind)
            )
        stream: asyncio.Queue = asyncio.Queue()
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use", code="duplicate_request_id")
        self._streams[request_id] = (loop, stream)
        self._send(request)
        del request  # the engine's now: freed (matchers and all) when it finishes, not when this generator goes
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.rejection is not None:  # bad input found in the engine: InvalidRequest, like add()'s
                    finished = True
                    raise item.rejection
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(request_id)

    async def abort(self, request_id: str) -> None:
        self._send(request_id)

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self.engine.close()

    # -- the engine thread --------------------------------------------------------------------

    def _send(self, item: Request | str) -> None:
        """To the engine thread: a request to add, or the id of one to abort."""
        self._inbox.put(item)
        self._wakeup.set()

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, one wake-up of each waiting event loop for all of them: a wake-up per
        output (a write to the loop's pipe, then the loop thread taking the GIL back and forth with
        this one) costs a many-stream load much of its throughput (`tokenmill bench serve
        --max-concurrency 64`)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, out)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, str):
                self.engine.abort(item)
                continue
            try:
                self.engine.add(item)
            except InvalidRequest as exc:
                self._deliver(exc, item.request_id)

    def _run(self, config: EngineConfig, progress: bool, built: Future[LLMEngine]) -> None:
        try:
            engine = LLMEngine(config, progress=progress)
        except BaseException as exc:
            built.set_exception(exc)
            return
        self.engine = engine
        built.set_result(engine)
        self._loop()

    def _loop(self) -> None:
        trims_left, last_trim = 0, 0.0
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._stats = self.engine.stats()
                    # What the finished requests held goes back to the system: at once, and again a
                    # little later for what other threads release after them (responses, streams).
                    if trims_left and time.monotonic() - last_trim >= _TRIM_INTERVAL_S:
                        trim_heap()
                        trims_left, last_trim = trims_left - 1, time.monotonic()
                    self._wakeup.wait(_IDLE_WAIT_S)
                    self._wakeup.clear()
                    continue
                trims_left = 2
                self._deliver_step(self.engine.step())
                self._stats = self.engine.stats()
        except BaseException as exc:
            logger.exception("engine loop died")
            self._failed = exc
            for request_id in list(self._streams):
                self._deliver(RuntimeError(f"engine loop died: {exc}"), request_id)
