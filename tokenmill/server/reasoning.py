"""Reasoning parsers (`--reasoning-parser`): a thinking model's `<think>...</think>` section is
split from its answer, as vLLM's `deepseek_r1` and `qwen3` parsers do.

Where the output starts is read from the end of the rendered prompt: a template that opens the
section itself (DeepSeek-R1's `<think>\\n`, Qwen3's thinking variants) leaves the output inside it;
one that closes it (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`) leaves no
reasoning to read. Otherwise the output may open the section with `<think>`; output that does not
is all reasoning up to `</think>` for DeepSeek-R1 (it always thinks) and all answer for Qwen3.

A section cut off by max_tokens is reasoning. The whitespace between the section and the answer is
layout, not answer. Streamed and whole outputs are read by the same parser, so the streamed pieces
always add up to the whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from tokenmill.engine.structured_output.params import ReasoningSection
from tokenmill.server.tools.parsers import partial_suffix

START = "<think>"
END = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")
_PROMPT_TAIL_TOKENS = 16  # enough to hold "<think>\n\n</think>\n\n" in any vocabulary


class _State(Enum):
    START = auto()  # the output may open a section
    REASONING = auto()
    ANSWER_START = auto()  # right after the section: whitespace is layout
    ANSWER = auto()


@dataclass
class ReasoningSplit:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits one choice's text into reasoning and the rest, piece by piece (`feed`, then `finish`)."""

    def __init__(self, state: _State, unopened_is_reasoning: bool) -> None:
        self._state = state
        self._unopened_is_reasoning = unopened_is_reasoning
        self._pending = ""

    def feed(self, text: str) -> ReasoningSplit:
        self._pending += text
        return self._run(final=False)

    def finish(self) -> ReasoningSplit:
        return self._run(final=True)

    def _run(self, final: bool) -> ReasoningSplit:
        out = ReasoningSplit()
        while self._pending:
            state = self._state
            if state is _State.START:
                rest = self._pending.lstrip()
                if rest.startswith(START):
                    self._pending, self._state = rest[len(START) :], _State.REASONING
                elif not final and START.startswith(rest):
                    break  # (whitespace or part of the tag so far)
                else:
                    self._state = _State.REASONING if self._unopened_is_reasoning else _State.ANSWER
            elif state is _State.REASONING:
                end = self._pending.find(END)
                if end >= 0:
                    out.reasoning += self._pending[:end]
                    self._pending, self._state = self._pending[end + len(END) :], _State.ANSWER_START
                    continue
                keep = 0 if final else partial_suffix(self._pending, END)
                out.reasoning += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                break
            elif state is _State.ANSWER_START:
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = _State.ANSWER
            else:
                out.content += self._pending
                self._pending = ""
        return out


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's outputs are read: where each starts (from the prompt) and the parser's rule."""

    name: str
    state: _State

    @classmethod
    def for_prompt(cls, name: str, prompt_tail: str) -> ReasoningPlan:
        tail = prompt_tail.rstrip()
        if tail.endswith(END):
            state = _State.ANSWER_START
        elif tail.endswith(START):
            state = _State.REASONING
        else:
            state = _State.START
        return cls(name, state)

    @property
    def thinks(self) -> bool:
        """Whether the output may hold reasoning (not when the prompt already closed the section)."""
        return self.state is not _State.ANSWER_START

    def new_parser(self) -> ReasoningParser:
        return ReasoningParser(self.state, unopened_is_reasoning=self.name == "deepseek_r1")

    def section(self) -> ReasoningSection | None:
        """What a structured-output grammar lets come before the constrained answer (None: nothing)."""
        if not self.thinks:
            return None
        if self.state is _State.REASONING or self.name == "deepseek_r1":
            return ReasoningSection(end=END)  # the output is reasoning up to the end tag
        return ReasoningSection(end=END, start=START)  # an optional section


def reasoning_plan(name: str | None, tokenizer: object, prompt_token_ids: list[int]) -> ReasoningPlan | None:
    """The plan for a request whose prompt is `prompt_token_ids` (None without a reasoning parser)."""
    if name is None:
        return None
    tail = tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:])  # type: ignore[attr-defined]
    return ReasoningPlan.for_prompt(name, tail)
