"""Parsed tool calls in OpenAI's response shapes: a message's `tool_calls`, or streamed deltas."""

from __future__ import annotations

import uuid

from tokenmill.server.protocol import AssistantMessage, DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from tokenmill.server.tools.parsers import ParsedDelta, ToolCallParser, parse_text

TOOL_CALLS = "tool_calls"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(engine_reason: str | None, called: bool) -> str | None:
    """ "tool_calls" when the choice called tools and ended on its own ("length" stays: a cut-off output)."""
    return TOOL_CALLS if called and engine_reason == "stop" else engine_reason


def parsed_message(parser: ToolCallParser, text: str) -> AssistantMessage:
    parsed = parse_text(parser, text)
    if not parsed.calls:
        return AssistantMessage(content=parsed.content)
    calls = [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls
    ]
    return AssistantMessage(content=parsed.content, tool_calls=calls)


class StreamedToolCalls:
    """One choice's parser in a stream: each text delta -> the content to send and the call deltas,
    as OpenAI streams them (a call's first delta: index, id, type, name, arguments ""; then argument
    fragments under the same index)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.called = False

    def step(self, text: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        parsed = self.parser.feed(text)
        if finished:
            last = self.parser.finish()
            parsed = ParsedDelta(parsed.content + last.content, parsed.calls + last.calls)
        deltas = []
        for piece in parsed.calls:
            if piece.name is not None:
                self.called = True
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
        return parsed.content, deltas
