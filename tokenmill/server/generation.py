"""The engine side of one API request: one engine generator per prompt, shared by HTTP and gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from tokenmill.engine.input_processor import PromptInput
from tokenmill.engine.outputs import RequestOutput, RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.errors import InvalidRequest
from tokenmill.server.errors import APIError, from_invalid_request
from tokenmill.server.state import RequestRecord, ServerState

logger = logging.getLogger(__name__)

_END = object()


class Generation:
    """Submits every prompt of a request and yields `(prompt_index, RequestOutput)` as tokens arrive.

    Prompts come checked by the input processor; `start()` still pulls the first output of each
    prompt before the caller commits to a response, so that a failure on submission becomes a clean
    error instead of a broken stream. `aclose()` closes the engine generators, which aborts
    unfinished requests and frees their KV blocks; it is safe to call more than once.
    """

    def __init__(self, state: ServerState, record: RequestRecord) -> None:
        self.state = state
        self.record = record
        self._gens: list[AsyncIterator[Any]] = []
        self._firsts: list[Any] = []
        self._iter: Any = None
        self._closed = False

    async def start(self, prompts: list[PromptInput], params: SamplingParams, output_kind: RequestOutputKind) -> None:
        """Submit every prompt; streams want DELTA outputs, whole responses FINAL_ONLY."""
        engine = self.state.engine
        self._gens = [
            engine.generate(p, params, request_id=self.state.engine_request_id(self.record, i), output_kind=output_kind)
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(self._first(g) for g in self._gens), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                await self.aclose()
                raise result
        self._firsts = list(results)

    async def _first(self, gen: AsyncIterator[Any]) -> Any:
        try:
            return await gen.__anext__()
        except InvalidRequest as exc:  # the engine's contract for bad input
            raise from_invalid_request(exc) from None
        except StopAsyncIteration:
            raise APIError(500, "The engine returned no output for this request.", code="engine_error") from None
        except (asyncio.CancelledError, APIError):
            raise
        except Exception as exc:
            if not self.state.engine.is_alive():  # generate() refuses once the engine loop is gone
                raise APIError(503, "The inference engine is not running.", code="engine_unavailable") from None
            logger.exception("engine failed to start request %s", self.record.request_id)
            raise APIError(
                500, f"The engine failed to start this request ({type(exc).__name__}).", code="engine_error"
            ) from None

    def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        """Every output of every prompt, in arrival order; the primed first outputs come first."""
        # Kept so aclose() can shut the merge pumps down before closing the generators they iterate.
        self._iter = self._outputs()
        return self._iter

    async def _outputs(self) -> AsyncGenerator[tuple[int, Any], None]:
        try:
            # aclosing: closing us must close the inner generators now (their merge pumps iterate the
            # engine streams, which aclose() is about to close), not whenever they are collected.
            async with contextlib.aclosing(self._engine_outputs()) as outputs:
                async for item in outputs:
                    yield item
        except (APIError, GeneratorExit):
            raise
        except InvalidRequest as exc:  # bad input the engine found out mid-way (a grammar too costly)
            raise from_invalid_request(exc) from None
        except Exception as exc:  # e.g. the engine loop died under us: a 500 for this request, no traceback
            logger.error("engine stream of %s failed: %s", self.record.request_id, exc)
            raise APIError(500, f"The engine failed while generating ({exc}).", code="engine_error") from None

    async def _engine_outputs(self) -> AsyncGenerator[tuple[int, Any], None]:
        for i, first in enumerate(self._firsts):
            self.state.on_output(self.record, i, first)
            yield i, first
        pending = [i for i, first in enumerate(self._firsts) if not first.finished]
        if len(pending) == 1:  # the common case: no tasks, no queue
            i = pending[0]
            async for out in self._gens[i]:
                self.state.on_output(self.record, i, out)
                yield i, out
            return
        if pending:
            async with contextlib.aclosing(self._merge(pending)) as merged:
                async for i, out in merged:
                    self.state.on_output(self.record, i, out)
                    yield i, out

    async def _merge(self, indices: list[int]) -> AsyncGenerator[tuple[int, Any], None]:
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in self._gens[i]:
                    await queue.put((i, out))
            except Exception as exc:  # surfaced to the consumer, not lost in a task
                await queue.put((i, exc))
            finally:
                await queue.put((i, _END))

        tasks = [asyncio.ensure_future(pump(i)) for i in indices]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._iter is not None:
            await self._iter.aclose()
        for gen in self._gens:
            try:
                await gen.aclose()  # type: ignore[attr-defined]
            except Exception:  # closing must not mask the request's real outcome
                logger.exception("closing engine stream of %s failed", self.record.request_id)


def failure_of(out: RequestOutput) -> str | None:
    """The engine's error message if this output reports a failed request, else None."""
    if out.error or any(o.finish_reason == "error" for o in out.outputs):
        return out.error or "generation failed inside the engine"
    if out.finished and any(o.finish_reason == "abort" for o in out.outputs):
        return "the engine aborted this request"
    return None


def raise_on_failure(out: RequestOutput) -> None:
    """A failed request's output as the API's 500 (HTTP and gRPC alike)."""
    message = failure_of(out)
    if message is not None:
        raise APIError(500, f"Generation failed: {message}", code="engine_error")
