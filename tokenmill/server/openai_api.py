"""OpenAI completions and chat completions: request -> engine job -> response body or SSE chunks.

Each job is built in two steps so the HTTP layer can order them: `prepare` validates everything that
can be checked without the engine (so bad input never costs a queue slot), then the caller admits
the request, starts a `Generation`, and asks the job for either the full body or the stream chunks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from tokenmill.engine.detokenizer import TokenText
from tokenmill.engine.errors import InvalidRequest
from tokenmill.engine.input_processor import PromptInput, render_chat
from tokenmill.engine.outputs import RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams

from .errors import APIError, from_invalid_request
from .generation import Generation, failure_of
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
    _SamplingRequest,
    parse_request,
)
from .state import RequestRecord, ServerState
from .tools.plan import ToolPlan, constrained, plan_tools
from .tools.response import StreamedToolCalls, finish_reason, parsed_message

__all__ = ["ChatJob", "CompletionJob", "Job", "prepare_chat", "prepare_completion", "render_chat"]

T = TypeVar("T")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def usage_of(record: RequestRecord) -> Usage:
    outs = record.last_outputs.values()
    return Usage.of(sum(len(o.prompt_token_ids) for o in outs),
                    sum(c.num_tokens for o in outs for c in o.outputs),
                    cached_tokens=sum(o.num_cached_tokens for o in outs))


@dataclass
class Job:
    """What the HTTP layer needs from a validated request."""

    prompts: list[PromptInput]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def output_kind(self) -> RequestOutputKind:
        return RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY

    @property
    def n_seqs(self) -> int:
        return self.params.n * len(self.prompts)

    async def full(self, gen: Generation) -> BaseModel:
        raise NotImplementedError

    def chunks(self, gen: Generation) -> AsyncIterator[BaseModel]:
        raise NotImplementedError


async def _final_outputs(gen: Generation) -> dict[int, Any]:
    finals: dict[int, Any] = {}
    async for i, out in gen.outputs():
        _raise_on_failure(out)
        finals[i] = out
    return finals


def _raise_on_failure(out: Any) -> None:
    message = failure_of(out)
    if message is not None:
        raise APIError(500, f"Generation failed: {message}", code="engine_error")


# ---------------------------------------------------------------------------------------------- completions


@dataclass
class CompletionJob(Job):
    tokens: TokenText | None = None  # set when logprobs were requested

    async def full(self, gen: Generation) -> CompletionResponse:
        finals = await _final_outputs(gen)
        choices = []
        for i in sorted(finals):
            for o in finals[i].outputs:
                logprobs = self._logprobs(o.token_ids, o.logprobs, 0)[0] if self.tokens else None
                choices.append(CompletionChoice(index=self._index(i, o.index), text=o.text,
                                                logprobs=logprobs, finish_reason=o.finish_reason))
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=choices, usage=usage_of(gen.record))

    async def chunks(self, gen: Generation) -> AsyncIterator[BaseModel]:
        reported: set[int] = set()
        offsets: dict[int, int] = {}
        async for i, out in gen.outputs():
            _raise_on_failure(out)
            for o in out.outputs:
                index = self._index(i, o.index)
                if index in reported or not (o.text_delta or o.token_ids_delta or o.finish_reason):
                    continue
                if o.finish_reason:
                    reported.add(index)
                logprobs = None
                if self.tokens and o.logprobs_delta:
                    logprobs, offsets[index] = self._logprobs(o.token_ids_delta, o.logprobs_delta, offsets.get(index, 0))
                choice = CompletionChoice(index=index, text=o.text_delta, logprobs=logprobs, finish_reason=o.finish_reason)
                yield CompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice])
        if self.include_usage:
            yield CompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[],
                                  usage=usage_of(gen.record))

    def _index(self, prompt_index: int, choice_index: int) -> int:
        # OpenAI numbers a batch's choices prompt-major: prompt i's n choices are i*n .. i*n+n-1.
        return prompt_index * self.params.n + choice_index

    def _logprobs(self, token_ids: list[int], entries: list[Any] | None, offset: int) -> tuple[CompletionLogprobs, int]:
        assert self.tokens is not None
        lp = CompletionLogprobs()
        for tid, (chosen, top) in zip(token_ids, entries or []):
            text = self.tokens(tid)[0]
            lp.tokens.append(text)
            lp.token_logprobs.append(_finite(chosen))
            lp.top_logprobs.append({self.tokens(t)[0]: _finite(v) for t, v in top.items()})
            lp.text_offset.append(offset)
            offset += len(text)
        return lp, offset


async def prepare_completion(state: ServerState, record: RequestRecord, raw: bytes) -> CompletionJob:
    req: CompletionRequest = parse_request(CompletionRequest, raw)
    state.check_model(req.model)
    req.check_unsupported()
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = req.sampling_params(max_tokens=max_tokens, logprobs=req.logprobs)
    batch = req.prompts()
    processor = state.engine.input_processor
    escape = state.settings.escape_special_tokens_in_prompts

    def process() -> list[PromptInput]:
        return [processor.process(p, params, escape_special=escape) for p in batch]

    # Tokenizing a batch of long prompts (and parsing a big JSON schema) takes a while: keep it off the event loop.
    prompts = await _checked(asyncio.to_thread(process), req)
    if state.settings.log_prompts:
        record.prompt_text = repr(req.prompt)
    return CompletionJob(
        prompts=prompts, params=params, stream=req.stream, include_usage=req.include_usage_in_stream,
        model=state.engine.model_name, response_id=f"cmpl-{record.request_id}",
        tokens=state.engine.token_text if req.logprobs is not None else None,
    )


async def _checked(work: Awaitable[T], req: _SamplingRequest | None = None) -> T:
    """The input processor's typed errors as OpenAI 400s (naming the request's field, when given)."""
    try:
        return await work
    except InvalidRequest as exc:
        raise from_invalid_request(exc, req.api_param(exc.param) if req is not None else None) from None


# ---------------------------------------------------------------------------------------------- chat


@dataclass
class ChatJob(Job):
    tokens: TokenText | None = None
    top_logprobs: int = 0
    tools: ToolPlan | None = None  # set when the output is read as tool calls

    async def full(self, gen: Generation) -> ChatCompletionResponse:
        finals = await _final_outputs(gen)
        choices = []
        for o in finals[0].outputs:
            message, reason = AssistantMessage(content=o.text), o.finish_reason
            if self.tools is not None:
                message = parsed_message(self.tools.new_parser(), o.text)
                reason = finish_reason(o.finish_reason, called=bool(message.tool_calls))
            choices.append(ChatChoice(index=o.index, message=message, finish_reason=reason,
                                      logprobs=self._logprobs(o.token_ids, o.logprobs)))
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=choices, usage=usage_of(gen.record))

    async def chunks(self, gen: Generation) -> AsyncIterator[BaseModel]:
        # OpenAI opens every choice with a role-only delta; clients rely on it to start a message.
        for k in range(self.params.n):
            yield self._chunk(ChatStreamChoice(index=k, delta=ChatDelta(role="assistant", content="")))
        calls = {k: StreamedToolCalls(self.tools.new_parser()) for k in range(self.params.n)} if self.tools else {}
        reported: set[int] = set()
        async for _, out in gen.outputs():
            _raise_on_failure(out)
            for o in out.outputs:
                if o.index in reported or not (o.text_delta or o.token_ids_delta or o.finish_reason):
                    continue
                if o.finish_reason:
                    reported.add(o.index)
                logprobs = self._logprobs(o.token_ids_delta, o.logprobs_delta) if o.logprobs_delta else None
                if o.index in calls:
                    for choice in self._tool_choices(calls[o.index], o, logprobs):
                        yield self._chunk(choice)
                    continue
                yield self._chunk(ChatStreamChoice(index=o.index, delta=ChatDelta(content=o.text_delta),
                                                   logprobs=logprobs, finish_reason=o.finish_reason))
        if self.include_usage:
            yield ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[],
                                      usage=usage_of(gen.record))

    @staticmethod
    def _tool_choices(calls: StreamedToolCalls, o: Any, logprobs: ChatLogprobs | None) -> list[ChatStreamChoice]:
        """A parsed step as OpenAI streams it: content, then each call piece in its own chunk; the
        step's logprobs ride on the first chunk, the finish reason on the last (an empty delta
        carries them when the parser holds everything back)."""
        content, pieces = calls.step(o.text_delta, finished=o.finish_reason is not None)
        deltas = ([ChatDelta(content=content)] if content else []) + [ChatDelta(tool_calls=[p]) for p in pieces]
        if not deltas and (logprobs is not None or o.finish_reason):
            deltas = [ChatDelta()]
        choices = [ChatStreamChoice(index=o.index, delta=d) for d in deltas]
        if choices:
            choices[0].logprobs = logprobs
            choices[-1].finish_reason = finish_reason(o.finish_reason, calls.called)
        return choices

    def _chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, token_ids: list[int], entries: list[Any] | None) -> ChatLogprobs | None:
        if self.tokens is None:
            return None
        content = []
        for tid, (chosen, top) in zip(token_ids, entries or []):
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            content.append(TokenLogprob(
                **self._entry(tid, chosen),
                top_logprobs=[TopLogprob(**self._entry(t, v)) for t, v in ranked],
            ))
        return ChatLogprobs(content=content)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        assert self.tokens is not None
        text, raw = self.tokens(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}


async def prepare_chat(state: ServerState, record: RequestRecord, raw: bytes) -> ChatJob:
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
    state.check_model(req.model)
    logprobs = req.engine_logprobs()
    tools = plan_tools(req, state.tool_parser)
    processor = state.engine.input_processor
    trusted = state.settings.allow_special_tokens_in_messages
    # Templating + tokenizing a 1 MiB conversation takes a while: keep it off the event loop.
    rendered = await _checked(asyncio.to_thread(processor.render_chat_input, req.template_messages(),
                                                tools=req.template_tools(), special_tokens_in_content=trusted,
                                                **req.template_options()))
    requested = req.requested_max_tokens()
    try:  # OpenAI's default max_tokens is "the rest of the context"
        max_tokens = processor.remaining_context(len(rendered.prompt_token_ids)) if requested is None else requested
    except InvalidRequest as exc:
        raise from_invalid_request(exc) from None
    params = req.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
    if tools is not None and tools.output_schema is not None:  # tool_choice required / named
        params = await asyncio.to_thread(constrained, tools, req, params)  # parses the schema: off the loop
    prompt = await _checked(asyncio.to_thread(processor.process, rendered, params, param="messages"), req)
    if state.settings.log_prompts:
        record.prompt_text = repr(req.template_messages())
    return ChatJob(
        prompts=[prompt], params=params, stream=req.stream, include_usage=req.include_usage_in_stream,
        model=state.engine.model_name, response_id=f"chatcmpl-{record.request_id}",
        tokens=state.engine.token_text if logprobs is not None else None,
        top_logprobs=logprobs or 0, tools=tools,
    )
