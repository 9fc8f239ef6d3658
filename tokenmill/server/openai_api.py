"""OpenAI completions and chat completions: request -> engine job -> response body or SSE chunks.

Each job is built in two steps so the HTTP layer can order them: `prepare` validates everything that
can be checked without the engine (so bad input never costs a queue slot), then the caller admits
the request, starts a `Generation`, and asks the job for either the full body or the stream chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel

from tokenmill.engine.detokenizer import TokenText
from tokenmill.engine.input_processor import PromptInput, render_chat
from tokenmill.engine.outputs import RankedLogprob, RequestOutputKind
from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.errors import InvalidRequest
from tokenmill.server.errors import APIError, from_invalid_request
from tokenmill.server.generation import Generation, raise_on_failure
from tokenmill.server.output import OutputReader, output_readers
from tokenmill.server.protocol import (
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
    PromptLogprob,
    PromptLogprobs,
    SamplingRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
    check_tool_definitions,
    parse_request,
)
from tokenmill.server.reasoning import reasoning_plan
from tokenmill.server.state import RequestRecord, ServerState
from tokenmill.server.tools.plan import constrained, plan_tools
from tokenmill.server.tools.response import chat_deltas, chat_message, finish_reason

__all__ = ["ChatJob", "CompletionJob", "Job", "prepare_chat", "prepare_completion", "render_chat"]

T = TypeVar("T")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_MIN_LOGPROB = -9999.0  # JSON has no -inf


def _finite(x: float) -> float:
    return x if math.isfinite(x) else _MIN_LOGPROB


def usage_of(record: RequestRecord) -> Usage:
    outs = record.last_outputs.values()
    return Usage.of(
        sum(len(o.prompt_token_ids) for o in outs),
        sum(c.num_tokens for o in outs for c in o.outputs),
        cached_tokens=sum(o.num_cached_tokens for o in outs),
    )


@dataclass
class Job:
    """What the HTTP layer needs from a validated request."""

    prompts: list[PromptInput]
    params: SamplingParams | PoolingParams
    stream: bool
    include_usage: bool
    model: str
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    usage_on_every_chunk: bool = False  # vLLM's continuous_usage_stats

    @property
    def output_kind(self) -> RequestOutputKind:
        return RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY

    @property
    def n_seqs(self) -> int:
        """Sequences the request runs: n per prompt (embeddings: one)."""
        return (self.params.n if isinstance(self.params, SamplingParams) else 1) * len(self.prompts)

    async def full(self, gen: Generation) -> BaseModel:
        raise NotImplementedError

    def chunks(self, gen: Generation) -> AsyncIterator[BaseModel]:
        raise NotImplementedError

    def sse(self, event: BaseModel) -> str:
        """One stream event as text/event-stream."""
        return f"data: {event.model_dump_json()}\n\n"

    def sse_error(self, err: APIError) -> str:
        """A failure after the stream started, reported in-band."""
        return f"data: {json.dumps(err.body())}\n\n"

    sse_end = "data: [DONE]\n\n"  # what closes the stream

    async def stream_events(self, gen: Generation) -> AsyncIterator[BaseModel]:
        """The stream's chunks; with continuous usage stats, each carries the usage so far."""
        async for chunk in self.chunks(gen):
            if self.usage_on_every_chunk and getattr(chunk, "usage", False) is None:
                usage = usage_of(gen.record)
                if not gen.record.last_outputs:  # (the role chunks come before the first output)
                    usage = Usage.of(sum(len(p.prompt_token_ids) for p in self.prompts), 0)
                chunk.usage = usage  # type: ignore[attr-defined]
            yield chunk


async def final_outputs(gen: Generation, prompt_logprobs: dict[int, Any] | None = None) -> dict[int, Any]:
    """The last output of each prompt; `prompt_logprobs` (when given) collects each prompt's prompt
    logprobs, which the engine delivers in one output only."""
    finals: dict[int, Any] = {}
    async for i, out in gen.outputs():
        raise_on_failure(out)
        finals[i] = out
        if prompt_logprobs is not None and out.prompt_logprobs is not None:
            prompt_logprobs[i] = out.prompt_logprobs
    return finals


def _top_of(entry: dict[int, RankedLogprob], token: int, num_top: int) -> list[tuple[int, RankedLogprob]]:
    """A prompt token's own logprob and its top `num_top` alternatives (the engine may hold more)."""
    return [(t, lp) for t, lp in entry.items() if t == token or lp.rank <= num_top]


def vllm_prompt_logprobs(entries: list[Any], prompt_ids: list[int], num_top: int, tokens: TokenText) -> PromptLogprobs:
    """vLLM's prompt_logprobs shape: null for the first token, then {token id: {logprob, rank, decoded_token}}."""
    out: PromptLogprobs = [None]
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        out.append(
            {
                str(t): PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=tokens(t)[0])
                for t, lp in _top_of(entry, token, num_top)
            }
        )
    return out


# ---------------------------------------------------------------------------------------------- completions


@dataclass
class CompletionJob(Job):
    params: SamplingParams
    tokens: TokenText | None = None  # set when any logprobs are shown
    num_logprobs: int | None = None  # `logprobs`: top alternatives per shown token
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` extra
    echo_texts: list[str] | None = None  # with echo: each prompt's text, shown before its completion
    # Streaming state: choices that ended, logprob text offsets, and each prompt's prompt logprobs.
    _ended: set[int] = field(default_factory=set, init=False)
    _offsets: dict[int, int] = field(default_factory=dict, init=False)
    _prompt_entries: dict[int, Any] = field(default_factory=dict, init=False)

    @property
    def echo(self) -> bool:
        return self.echo_texts is not None

    async def full(self, gen: Generation) -> CompletionResponse:
        finals = await final_outputs(gen, self._prompt_entries)
        choices = []
        for i in sorted(finals):
            for o in finals[i].outputs:
                choice, _ = self._choice(
                    i, finals[i], o.index, o.text, o.token_ids, o.logprobs, o.finish_reason, first=True, offset=0
                )
                choices.append(choice)
        return CompletionResponse(
            id=self.response_id, created=self.created, model=self.model, choices=choices, usage=usage_of(gen.record)
        )

    async def chunks(self, gen: Generation) -> AsyncIterator[BaseModel]:
        held: dict[int, list[Any]] = {}  # outputs of a prompt whose echoed logprobs are not known yet
        async for i, out in gen.outputs():
            raise_on_failure(out)
            if out.prompt_logprobs is not None:
                self._prompt_entries[i] = out.prompt_logprobs
            if self.echo and self.num_logprobs is not None and i not in self._prompt_entries:
                held.setdefault(i, []).append(out)  # (the engine scores the prompt with choice 0)
                continue
            for pending in held.pop(i, []) + [out]:
                for choice in self._stream_choices(i, pending):
                    yield CompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice])
        if self.include_usage:
            yield CompletionChunk(
                id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage_of(gen.record)
            )

    def _stream_choices(self, prompt_index: int, out: Any) -> list[CompletionChoice]:
        choices = []
        for o in out.outputs:
            index = self._index(prompt_index, o.index)
            if index in self._ended or not (o.text_delta or o.token_ids_delta or o.finish_reason):
                continue
            if o.finish_reason:
                self._ended.add(index)
            first = index not in self._offsets  # the echo rides on a choice's first chunk
            choice, self._offsets[index] = self._choice(
                prompt_index,
                out,
                o.index,
                o.text_delta,
                o.token_ids_delta,
                o.logprobs_delta,
                o.finish_reason,
                first=first,
                offset=self._offsets.get(index, 0),
            )
            if choice.logprobs is not None and not choice.logprobs.tokens:
                choice.logprobs = None  # (a piece with text but no new token, or only the finish reason)
            choices.append(choice)
        return choices

    def _choice(
        self,
        prompt_index: int,
        out: Any,
        choice_index: int,
        text: str,
        token_ids: list[int],
        entries: list[Any] | None,
        finish_reason: str | None,
        *,
        first: bool,
        offset: int,
    ) -> tuple[CompletionChoice, int]:
        """A choice (or a streamed piece of one): with echo, the first piece starts with the prompt."""
        echo_text = self.echo_texts[prompt_index] if self.echo_texts is not None and first else None
        echo_prompt = echo_text is not None
        logprobs = None
        if self.num_logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo_prompt:
                offset = self._add_prompt_logprobs(
                    logprobs, out.prompt_token_ids, self._prompt_entries[prompt_index], offset
                )
            offset = self._add_logprobs(logprobs, token_ids, entries, offset)
        prompt_logprobs = None
        if self.prompt_logprobs is not None and first:
            assert self.tokens is not None  # (set whenever logprobs are shown)
            prompt_logprobs = vllm_prompt_logprobs(
                self._prompt_entries[prompt_index], out.prompt_token_ids, self.prompt_logprobs, self.tokens
            )
        if echo_text is not None:
            text = echo_text + text
        choice = CompletionChoice(
            index=self._index(prompt_index, choice_index),
            text=text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_logprobs=prompt_logprobs,
        )
        return choice, offset

    def _index(self, prompt_index: int, choice_index: int) -> int:
        # OpenAI numbers a batch's choices prompt-major: prompt i's n choices are i*n .. i*n+n-1.
        return prompt_index * self.params.n + choice_index

    def _add_prompt_logprobs(
        self, lp: CompletionLogprobs, prompt_ids: list[int], entries: list[Any], offset: int
    ) -> int:
        """The echoed prompt tokens, as OpenAI shows them: null logprob and alternatives for the first."""
        assert self.tokens is not None and self.num_logprobs is not None
        for i, token in enumerate(prompt_ids):
            text = self.tokens(token)[0]
            lp.tokens.append(text)
            if i == 0:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                lp.token_logprobs.append(_finite(entries[i][token].logprob))
                lp.top_logprobs.append(
                    {self.tokens(t)[0]: _finite(v.logprob) for t, v in _top_of(entries[i], token, self.num_logprobs)}
                )
            lp.text_offset.append(offset)
            offset += len(text)
        return offset

    def _add_logprobs(
        self, lp: CompletionLogprobs, token_ids: list[int], entries: list[Any] | None, offset: int
    ) -> int:
        assert self.tokens is not None
        for tid, (chosen, top) in zip(token_ids, entries or []):
            text = self.tokens(tid)[0]
            lp.tokens.append(text)
            lp.token_logprobs.append(_finite(chosen))
            lp.top_logprobs.append({self.tokens(t)[0]: _finite(v) for t, v in top.items()})
            lp.text_offset.append(offset)
            offset += len(text)
        return offset


async def prepare_completion(state: ServerState, record: RequestRecord, raw: bytes) -> CompletionJob:
    req: CompletionRequest = parse_request(CompletionRequest, raw)
    adapter = state.resolve_model(req.model)
    req.check_unsupported()
    defaults = state.engine.generation_defaults
    max_tokens = defaults.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS) if req.max_tokens is None else req.max_tokens
    params = req.sampling_params(
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=req.engine_prompt_logprobs(max_tokens),
        defaults=defaults,
    )
    batch = req.prompts()
    processor = state.engine.input_processor
    escape = state.settings.escape_special_tokens_in_prompts

    def process() -> list[PromptInput]:
        return [processor.process(p, params, escape_special=escape, lora=adapter, priority=req.priority) for p in batch]

    # Tokenizing a batch of long prompts (and parsing a big JSON schema) takes a while: keep it off the event loop.
    prompts = await _checked(asyncio.to_thread(process), req)
    echo_texts = None
    if req.echo:  # a token-id prompt is echoed as its text, special tokens included
        echo_texts = await asyncio.to_thread(
            lambda: [
                p.prompt if p.prompt is not None else processor.tokenizer.decode(p.prompt_token_ids) for p in prompts
            ]
        )
    if state.settings.log_prompts:
        record.prompt_text = repr(req.prompt)
    shows_logprobs = req.logprobs is not None or req.prompt_logprobs is not None
    return CompletionJob(
        prompts=prompts,
        params=params,
        stream=req.stream,
        include_usage=req.include_usage_in_stream,
        usage_on_every_chunk=req.usage_on_every_chunk,
        model=state.model_name(adapter),
        response_id=f"cmpl-{record.request_id}",
        tokens=state.engine.token_text if shows_logprobs else None,
        num_logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs,
        echo_texts=echo_texts,
    )


async def _checked(work: Awaitable[T], req: SamplingRequest | None = None) -> T:
    """The input processor's typed errors as OpenAI 400s (naming the request's field, when given)."""
    try:
        return await work
    except InvalidRequest as exc:
        raise from_invalid_request(exc, req.api_param(exc.param) if req is not None else None) from None


# ---------------------------------------------------------------------------------------------- chat


@dataclass
class ChatJob(Job):
    params: SamplingParams
    tokens: TokenText | None = None
    top_logprobs: int = 0
    new_reader: Callable[[], OutputReader] | None = None  # set when the output is read as reasoning / tool calls
    prompt_logprobs: int | None = None  # vLLM's extra: of the rendered conversation, in the response

    async def full(self, gen: Generation) -> ChatCompletionResponse:
        entries: dict[int, Any] = {}
        finals = await final_outputs(gen, entries)
        choices = []
        for o in finals[0].outputs:
            message, reason = AssistantMessage(content=o.text), o.finish_reason
            if self.new_reader is not None:
                parsed = self.new_reader().whole(o.text)
                message, reason = chat_message(parsed), finish_reason(o.finish_reason, called=bool(parsed.calls))
            choices.append(
                ChatChoice(
                    index=o.index,
                    message=message,
                    finish_reason=reason,
                    logprobs=self._logprobs(o.token_ids, o.logprobs),
                )
            )
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            assert self.tokens is not None  # (set whenever logprobs are shown)
            prompt_logprobs = vllm_prompt_logprobs(
                entries[0], finals[0].prompt_token_ids, self.prompt_logprobs, self.tokens
            )
        return ChatCompletionResponse(
            id=self.response_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_of(gen.record),
            prompt_logprobs=prompt_logprobs,
        )

    async def chunks(self, gen: Generation) -> AsyncIterator[BaseModel]:
        # OpenAI opens every choice with a role-only delta; clients rely on it to start a message.
        for k in range(self.params.n):
            yield self._chunk(ChatStreamChoice(index=k, delta=ChatDelta(role="assistant", content="")))
        readers = {k: self.new_reader() for k in range(self.params.n)} if self.new_reader is not None else {}
        reported: set[int] = set()
        async for _, out in gen.outputs():
            raise_on_failure(out)
            for o in out.outputs:
                if o.index in reported or not (o.text_delta or o.token_ids_delta or o.finish_reason):
                    continue
                if o.finish_reason:
                    reported.add(o.index)
                logprobs = self._logprobs(o.token_ids_delta, o.logprobs_delta) if o.logprobs_delta else None
                if o.index in readers:
                    for choice in self._parsed_choices(readers[o.index], o, logprobs):
                        yield self._chunk(choice)
                    continue
                yield self._chunk(
                    ChatStreamChoice(
                        index=o.index,
                        delta=ChatDelta(content=o.text_delta),
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                    )
                )
        if self.include_usage:
            yield ChatCompletionChunk(
                id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage_of(gen.record)
            )

    @staticmethod
    def _parsed_choices(reader: OutputReader, o: Any, logprobs: ChatLogprobs | None) -> list[ChatStreamChoice]:
        """A parsed step as OpenAI streams it (see `chat_deltas`); the step's logprobs ride on the first
        chunk, the finish reason on the last (an empty delta carries them when the parsers hold
        everything back)."""
        deltas = chat_deltas(reader.step(o.text_delta, finished=o.finish_reason is not None))
        if not deltas and (logprobs is not None or o.finish_reason):
            deltas = [ChatDelta()]
        choices = [ChatStreamChoice(index=o.index, delta=d) for d in deltas]
        if choices:
            choices[0].logprobs = logprobs
            choices[-1].finish_reason = finish_reason(o.finish_reason, reader.called)
        return choices

    def _chunk(self, choice: ChatStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, token_ids: list[int], entries: list[Any] | None) -> ChatLogprobs | None:
        if self.tokens is None or self.params.logprobs is None:
            return None
        content = []
        for tid, (chosen, top) in zip(token_ids, entries or []):
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[: self.top_logprobs]
            content.append(
                TokenLogprob(
                    **self._entry(tid, chosen),
                    top_logprobs=[TopLogprob(**self._entry(t, v)) for t, v in ranked],
                )
            )
        return ChatLogprobs(content=content)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        assert self.tokens is not None
        text, raw = self.tokens(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}


@dataclass
class ChatPlan:
    """A chat request made ready for the engine, whichever API it came through (chat completions,
    Responses, Anthropic Messages): its prompt, params, and how each choice's output is read."""

    prompt: PromptInput
    params: SamplingParams
    new_reader: Callable[[], OutputReader] | None
    model: str
    logprobs: int | None


async def plan_chat(state: ServerState, record: RequestRecord, req: ChatCompletionRequest) -> ChatPlan:
    """Render, tokenize and check a chat request: tools against tool_choice, the reasoning section
    (structured outputs and forced calls apply after it), the prompt against the model."""
    adapter = state.resolve_model(req.model)
    req.check_prompt_logprobs()
    logprobs = req.engine_logprobs()
    if req.tools:  # validating large parameter schemas takes a while: off the event loop
        await asyncio.to_thread(check_tool_definitions, req.tools)
    tools = plan_tools(req, state.tool_parser)
    processor = state.engine.input_processor
    trusted = state.settings.allow_special_tokens_in_messages
    # Templating + tokenizing a 1 MiB conversation takes a while: keep it off the event loop.
    rendered = await _checked(
        asyncio.to_thread(
            processor.render_chat_input,
            req.template_messages(),
            tools=req.template_tools(),
            special_tokens_in_content=trusted,
            **req.template_options(),
        )
    )
    reasoning = reasoning_plan(state.settings.reasoning_parser, processor.tokenizer, rendered.prompt_token_ids)
    section = reasoning.section() if reasoning is not None else None
    requested = req.requested_max_tokens()
    defaults = state.engine.generation_defaults
    max_tokens = requested
    if max_tokens is None:  # OpenAI's default: the rest of the context (at most the generation config's)
        try:
            max_tokens = processor.remaining_context(len(rendered.prompt_token_ids))
        except InvalidRequest as exc:
            raise from_invalid_request(exc) from None
        max_tokens = min(max_tokens, defaults.get("max_tokens", max_tokens))
    params = req.sampling_params(
        max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs, defaults=defaults
    )
    if tools is not None and tools.output_schema is not None:  # tool_choice required / named
        params = await asyncio.to_thread(constrained, tools, req, params, section)  # parses the schema: off the loop
    elif params.structured_outputs is not None and section is not None:
        params = dataclasses.replace(
            params, structured_outputs=dataclasses.replace(params.structured_outputs, reasoning=section)
        )
    if tools is not None and tools.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    process = functools.partial(processor.process, param="messages", lora=adapter, priority=req.priority)
    prompt = await _checked(asyncio.to_thread(process, rendered, params), req)
    if state.settings.log_prompts:
        record.prompt_text = repr(req.template_messages())
    return ChatPlan(prompt, params, output_readers(tools, reasoning), state.model_name(adapter), logprobs)


async def prepare_chat(state: ServerState, record: RequestRecord, raw: bytes) -> ChatJob:
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, raw)
    plan = await plan_chat(state, record, req)
    return ChatJob(
        prompts=[plan.prompt],
        params=plan.params,
        stream=req.stream,
        include_usage=req.include_usage_in_stream,
        usage_on_every_chunk=req.usage_on_every_chunk,
        model=plan.model,
        response_id=f"chatcmpl-{record.request_id}",
        tokens=state.engine.token_text if plan.logprobs is not None or req.prompt_logprobs is not None else None,
        top_logprobs=plan.logprobs or 0,
        new_reader=plan.new_reader,
        prompt_logprobs=req.prompt_logprobs,
    )
