"""One choice's generated text read as reasoning, answer text and tool calls, for every API
(chat completions, Responses, Anthropic Messages): the reasoning parser takes its section off the
front, and the tool-call parser reads the rest. Streamed and whole outputs go through the same
parsers, so the streamed pieces always add up to the whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.server.reasoning import ReasoningParser, ReasoningPlan
from tokenmill.server.tools.parsers import CallDelta, ParsedCall, ToolCallParser, parse_text
from tokenmill.server.tools.plan import ToolPlan


@dataclass
class OutputPiece:
    """What one streamed step adds: reasoning text, answer text, and call deltas (a call's first
    names it, later ones carry argument text)."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class ParsedOutput:
    """A whole output. `content` is None when nothing but calls (or reasoning) was written."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


class OutputReader:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self.called = False  # a call was sent

    def step(self, text: str, finished: bool) -> OutputPiece:
        """The next piece of generated text (`finished`: the last one)."""
        reasoning, answer = self._split(text, finished)
        if self._tools is None:
            return OutputPiece(reasoning, answer)
        parsed = self._tools.feed(answer)
        if finished:
            last = self._tools.finish()
            parsed.content += last.content
            parsed.calls += last.calls
        self.called = self.called or any(c.name is not None for c in parsed.calls)
        return OutputPiece(reasoning, parsed.content, parsed.calls)

    def whole(self, text: str) -> ParsedOutput:
        """A whole output at once (a malformed call makes the answer all content, as vLLM)."""
        reasoning, answer = self._split(text, finished=True)
        thought = reasoning or None if self._reasoning is not None else None
        if self._tools is None:
            return ParsedOutput(thought, answer if answer or thought is None else None, [])
        parsed = parse_text(self._tools, answer)
        content = parsed.content if parsed.content or thought is None else None
        return ParsedOutput(thought, content, parsed.calls)

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        if self._reasoning is None:
            return "", text
        split = self._reasoning.feed(text)
        if finished:
            last = self._reasoning.finish()
            split.reasoning += last.reasoning
            split.content += last.content
        return split.reasoning, split.content


def output_readers(tools: ToolPlan | None, reasoning: ReasoningPlan | None) -> Callable[[], OutputReader] | None:
    """A maker of one reader per choice; None when the output is plain text."""
    if tools is None and reasoning is None:
        return None
    return lambda: OutputReader(
        reasoning.new_parser() if reasoning is not None else None, tools.new_parser() if tools is not None else None
    )
