"""POST /v1/messages: Anthropic's Messages API on the chat pipeline, so Anthropic-SDK clients can use
a local model (as vLLM allows).

A request is read into a chat conversation (protocol.anthropic), planned and generated like a chat
completion (one choice), and its output, read by the same reasoning and tool-call parsers, comes
back as content blocks: `thinking`, `text`, `tool_use`. Streamed, the events are Anthropic's:
message_start, per block content_block_start / content_block_delta (text_delta, thinking_delta,
input_json_delta) / content_block_stop, then message_delta (stop reason, usage) and message_stop.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation, raise_on_failure
from tokenmill.server.openai_api import Job, final_outputs, plan_chat, usage_of
from tokenmill.server.output import OutputPiece, OutputReader, ParsedOutput
from tokenmill.server.protocol import parse_request
from tokenmill.server.protocol.anthropic import AnthropicResponse, AnthropicUsage, MessagesRequest
from tokenmill.server.protocol.base import renamed
from tokenmill.server.state import RequestRecord, ServerState


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class _Event(BaseModel):
    """An Anthropic stream event: its `type` and whatever that event holds."""

    model_config = ConfigDict(extra="allow")
    type: str


def _event(kind: str, **fields: Any) -> _Event:
    return _Event.model_validate({"type": kind, **fields})


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason(engine_reason: str | None, stop: str | int | None, called: bool) -> tuple[StopReason, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for how the output ended."""
    if engine_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


@dataclass
class MessagesJob(Job):
    new_reader: Callable[[], OutputReader] | None = None

    async def full(self, gen: Generation) -> AnthropicResponse:
        o = (await final_outputs(gen))[0].outputs[0]
        parsed = self.new_reader().whole(o.text) if self.new_reader is not None else ParsedOutput(None, o.text, [])
        blocks: list[dict[str, Any]] = []
        if parsed.reasoning is not None:
            blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content or not (parsed.calls or blocks):
            blocks.append({"type": "text", "text": parsed.content or ""})
        for call in parsed.calls:
            blocks.append(
                {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": json.loads(call.arguments)}
            )
        reason, sequence = stop_reason(o.finish_reason, o.stop_reason, bool(parsed.calls))
        return AnthropicResponse(
            id=self.response_id,
            model=self.model,
            content=blocks,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=self._usage(gen.record),
        )

    async def chunks(self, gen: Generation) -> AsyncIterator[BaseModel]:
        usage = self._usage(gen.record)
        message = AnthropicResponse(
            id=self.response_id,
            model=self.model,
            content=[],
            stop_reason=None,
            usage=usage.model_copy(update={"output_tokens": 0}),
        )
        yield _event("message_start", message=message.model_dump())
        blocks = _BlockStream()
        reader = self.new_reader() if self.new_reader is not None else None
        last: Any = None
        async for _, out in gen.outputs():
            raise_on_failure(out)
            last = out.outputs[0]
            finished = last.finish_reason is not None
            piece = (
                reader.step(last.text_delta, finished) if reader is not None else OutputPiece(content=last.text_delta)
            )
            for event in blocks.add(piece):
                yield event
        for event in blocks.close() if blocks.count else blocks.empty_text():
            yield event
        reason, sequence = stop_reason(last.finish_reason, last.stop_reason, blocks.called)
        final = self._usage(gen.record)
        yield _event(
            "message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=final.model_dump()
        )
        yield _event("message_stop")

    def sse(self, event: BaseModel) -> str:
        return f"event: {getattr(event, 'type', 'message')}\ndata: {event.model_dump_json()}\n\n"

    def sse_error(self, err: APIError) -> str:
        return self.sse(_event("error", error={"type": err.type, "message": err.message}))

    sse_end = ""

    def _usage(self, record: RequestRecord) -> AnthropicUsage:
        usage = usage_of(record)
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return AnthropicUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens, cache_read_input_tokens=cached
        )


class _BlockStream:
    """Output pieces -> content block events (one block open at a time, numbered in order)."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open: str | None = None  # the open block's type
        self.called = False

    def add(self, piece: OutputPiece) -> list[_Event]:
        events: list[_Event] = []
        if piece.reasoning:
            events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": piece.reasoning}))
        if piece.content:
            events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": piece.content}))
        for call in piece.calls:
            if call.name is not None:
                self.called = True
                events += self.close()
                events += self._start(
                    "tool_use", {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": {}}
                )
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def empty_text(self) -> list[_Event]:
        """An output of nothing: one empty text block."""
        return self._start("text", {"type": "text", "text": ""}) + self.close()

    def close(self) -> list[_Event]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.count - 1)]

    def _start(self, kind: str, block: dict[str, Any]) -> list[_Event]:
        if self.open == kind and kind != "tool_use":
            return []
        events = self.close()
        self.open, self.count = kind, self.count + 1
        return [*events, _event("content_block_start", index=self.count - 1, content_block=block)]

    def _delta(self, delta: dict[str, Any]) -> _Event:
        return _event("content_block_delta", index=self.count - 1, delta=delta)


# The chat request's field names in errors -> the Messages request's.
CHAT_NAMES = [
    (r"response_format\.json_schema\.schema|response_format", "output_config.format"),
    (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"max_completion_tokens", "max_tokens"),
    (r"\bstop\b", "stop_sequences"),
]


async def prepare_messages(state: ServerState, record: RequestRecord, raw: bytes) -> MessagesJob:
    req: MessagesRequest = parse_request(MessagesRequest, raw)
    tools = req.read_tools()
    try:
        plan = await plan_chat(state, record, req.chat_request(tools))
    except APIError as err:
        raise renamed(err, CHAT_NAMES) from None
    return MessagesJob(
        prompts=[plan.prompt],
        params=plan.params,
        stream=req.stream,
        include_usage=False,
        model=plan.model,
        response_id=f"msg_{uuid.uuid4().hex}",
        new_reader=plan.new_reader,
    )
