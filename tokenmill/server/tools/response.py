"""Parsed outputs in OpenAI's chat shapes: a message (content, reasoning, `tool_calls`), or streamed deltas."""

from __future__ import annotations

import uuid

from tokenmill.server.output import OutputPiece, ParsedOutput
from tokenmill.server.protocol import (
    AssistantMessage,
    ChatDelta,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tokenmill.server.tools.parsers import CallDelta

TOOL_CALLS = "tool_calls"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(engine_reason: str | None, called: bool) -> str | None:
    """ "tool_calls" when the choice called tools and ended on its own ("length" stays: a cut-off output)."""
    return TOOL_CALLS if called and engine_reason == "stop" else engine_reason


def chat_message(parsed: ParsedOutput) -> AssistantMessage:
    calls = [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls
    ]
    return AssistantMessage(
        content=parsed.content,
        tool_calls=calls or None,
        reasoning_content=parsed.reasoning,
        reasoning=parsed.reasoning,
    )


def chat_deltas(piece: OutputPiece) -> list[ChatDelta]:
    """A streamed step as OpenAI streams it (vLLM's reasoning fields first): reasoning, content, then
    each call piece in its own delta (a call's first: index, id, type, name, arguments ""; then
    argument fragments under the same index)."""
    deltas = []
    if piece.reasoning:
        deltas.append(ChatDelta(reasoning_content=piece.reasoning, reasoning=piece.reasoning))
    if piece.content:
        deltas.append(ChatDelta(content=piece.content))
    return deltas + [ChatDelta(tool_calls=[call]) for c in piece.calls for call in _call_deltas(c)]


def _call_deltas(piece: CallDelta) -> list[DeltaToolCall]:
    deltas = []
    if piece.name is not None:
        deltas.append(
            DeltaToolCall(
                index=piece.index,
                id=new_call_id(),
                type="function",
                function=DeltaFunctionCall(name=piece.name, arguments=""),
            )
        )
    if piece.arguments:
        deltas.append(DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments)))
    return deltas
