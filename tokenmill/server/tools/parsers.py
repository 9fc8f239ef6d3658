"""Tool-call parsers: one choice's generated text -> content and function calls, token by token.

A parser is fed the text as it is generated (`feed`) and told when it ends (`finish`); each step
returns the content to show and the call deltas to send (a call's first delta names it, later ones
carry argument fragments). A non-streamed response runs the same parser over the whole text at
once (`parse_text`), so streamed deltas always concatenate to the non-streamed calls.

Text that only looks like the start of a call (a partial `<tool_call>`) is held back until it is
decided, so no markup leaks into the content. Whitespace next to a call is not content.

Formats are named for `--tool-call-parser` in catalog.py, which also picks the default from the
chat template (`default_parser_name`); more formats are in formats.py. `ArgumentsOnly` and
`JsonCallList` read the output of a request whose tool_choice (a named function / required) was
enforced with a JSON schema.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, ClassVar, Protocol

from tokenmill.server.tools.json_scan import CallScanner, ValueScan, loads_or_invalid

logger = logging.getLogger(__name__)

# The request's functions: each one's parameters schema (None: no parameters), by name.
ToolSchemas = Mapping[str, Mapping[str, Any] | None]


@dataclass
class CallDelta:
    """A piece of call number `index`: its first piece has the name (arguments ""), later ones arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ParsedText:
    """A whole output: `content` is None when calls were made and no text is left around them."""

    content: str | None
    calls: list[ParsedCall]


class ToolCallParser(ABC):
    """Splits one choice's text into content and calls as it streams. `max_calls` (1 when the request
    sets parallel_tool_calls=false) drops any call beyond it. `tools`: the functions the request
    offers, their parameters schemas by name (None: any function); a call to another is no call,
    like a malformed one. `failed` is set when a call was started but turned out malformed: a
    non-streamed response then returns the whole text as content."""

    # Strings the parser must see in the output text (not dropped by the detokenizer as special tokens).
    MARKERS: ClassVar[tuple[str, ...]] = ()
    # The model writes its markers as special tokens (Mistral's [TOOL_CALLS]): outputs read by this
    # parser are detokenized with them (vLLM's skip_special_tokens=false).
    KEEPS_SPECIAL_TOKENS: ClassVar[bool] = False

    def __init__(self, max_calls: int | None = None, tools: ToolSchemas | None = None) -> None:
        self.max_calls = max_calls
        self.tools = tools or {}  # each offered function's parameters schema, by name
        self.names = None if tools is None else frozenset(tools)
        self.failed = False
        self._calls: list[_Call] = []

    @abstractmethod
    def feed(self, text: str) -> ParsedDelta:
        """The next piece of generated text."""

    @abstractmethod
    def finish(self) -> ParsedDelta:
        """The text has ended: release what was held back."""

    # Shared call bookkeeping ------------------------------------------------------------------

    def _new_call(self, scanner: CallReader | None = None) -> _Call:
        dropped = self.max_calls is not None and len(self._calls) >= self.max_calls
        call = _Call(len(self._calls), dropped, scanner)
        self._calls.append(call)
        return call


class CallReader(Protocol):
    """Reads one call's text as it arrives (`CallScanner` for a JSON object; other formats have
    their own): `name` once known, `arguments()` as the JSON text known so far, and how it ended."""

    name: str | None
    failed: bool

    @property
    def done(self) -> bool: ...

    def feed(self, text: str, start: int = 0) -> int:
        """Consume text[start:] as far as it belongs to the call; the index after what was used."""
        ...

    def arguments(self) -> str: ...


class _Call:
    """One call being scanned, and what of it was sent."""

    def __init__(self, index: int, dropped: bool, scanner: CallReader | None = None) -> None:
        self.index = index
        self.dropped = dropped  # beyond max_calls: scanned (to find its end) but never sent
        self.scanner: CallReader = scanner if scanner is not None else CallScanner()
        self.started = False
        self._sent = 0  # characters of the arguments sent

    def deltas(self) -> list[CallDelta]:
        """What became known since the last call: the name first, then new argument text."""
        if self.dropped or self.scanner.failed or self.scanner.name is None:
            return []
        out = []
        if not self.started:
            self.started = True
            out.append(CallDelta(self.index, name=self.scanner.name))
        arguments = self.scanner.arguments()
        if len(arguments) > self._sent:
            out.append(CallDelta(self.index, arguments=arguments[self._sent :]))
            self._sent = len(arguments)
        return out


class _Content:
    """Content text with the whitespace next to calls dropped. Trailing whitespace is held until it
    is known whether a call follows; whitespace dropped before a call that turns out not to be one
    is given back (`restore`)."""

    def __init__(self) -> None:
        self._held = ""
        self._before_call = ""
        self._skip_leading = False

    def add(self, text: str) -> str:
        if self._skip_leading:
            stripped = text.lstrip()
            if not stripped:
                return ""
            text, self._skip_leading = stripped, False
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body

    def call_starts(self) -> None:
        self._before_call, self._held = self._held, ""

    def restore(self) -> str:
        """The call was not one: its leading whitespace is content after all."""
        text, self._before_call = self._before_call, ""
        return text

    def call_ends(self) -> None:
        self._held, self._before_call, self._skip_leading = "", "", True

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (may become it)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


# ---------------------------------------------------------------------------------------------- registry


def parse_text(parser: ToolCallParser, text: str) -> ParsedText:
    """A whole output at once (non-streamed responses): the same parser run over all of it."""
    first, last = parser.feed(text), parser.finish()
    if parser.failed:
        return ParsedText(content=text, calls=[])
    calls: dict[int, ParsedCall] = {}
    for delta in first.calls + last.calls:
        if delta.name is not None:
            calls[delta.index] = ParsedCall(delta.name, "")
        calls[delta.index].arguments += delta.arguments
    content = first.content + last.content
    return ParsedText(content=content if content or not calls else None, calls=list(calls.values()))


# ---------------------------------------------------------------------------------------------- formats


class _Mode(Enum):
    START = auto()  # nothing decided yet (Llama 3: is the output a call?)
    TEXT = auto()  # content, watching for the start of a call
    CALL = auto()  # inside a call's JSON object
    AFTER_CALL = auto()  # the object is closed: a closing tag, a separator or text may follow
    PLAIN = auto()  # the rest is content, whatever it contains


class _CallsInText(ToolCallParser):
    """Formats whose calls are JSON objects within the text. Subclasses read what comes before a
    call (`_before_call`) and after one (`_after_call`) and say what a call that turned out to be
    no call was (`_text_of_non_call`)."""

    def __init__(self, max_calls: int | None, mode: _Mode, tools: ToolSchemas | None = None) -> None:
        super().__init__(max_calls, tools)
        self._mode = mode
        self._pending = ""  # received, not yet handed on
        self._content = _Content()
        self._call: _Call | None = None
        self._call_text = ""  # the current call's text, given back as content if it is no call

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        self._run(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._run(out, final=True)
        if self._mode is _Mode.CALL:  # cut off inside a call (max_tokens)
            self._broken(out)
        out.content += self._content.add(self._pending) + self._content.flush()
        self._pending = ""
        return out

    def _run(self, out: ParsedDelta, final: bool) -> None:
        """Consume `_pending` as far as it can be decided (all of it when `final`)."""
        while True:
            if self._mode is _Mode.CALL:
                if self._scan_call(out):
                    return
            elif self._mode is _Mode.PLAIN:
                out.content += self._content.add(self._pending)
                self._pending = ""
                return
            elif self._mode is _Mode.AFTER_CALL:
                if not self._after_call(out, final):
                    return
            elif not self._before_call(out, final):  # START or TEXT
                return

    @abstractmethod
    def _before_call(self, out: ParsedDelta, final: bool) -> bool:
        """START or TEXT: look for the start of a call; False while more text is needed."""

    @abstractmethod
    def _after_call(self, out: ParsedDelta, final: bool) -> bool:
        """AFTER_CALL: a closing tag, a separator or text; False while more text is needed."""

    @abstractmethod
    def _text_of_non_call(self) -> str:
        """The text of the current call, which turned out to be no call."""

    def _start_call(self, scanner: CallReader | None = None) -> None:
        self._call, self._call_text, self._mode = self._new_call(scanner), "", _Mode.CALL

    def _content_until(self, out: ParsedDelta, final: bool, markers: tuple[str, ...]) -> str | None:
        """TEXT: hand on the content before the first of `markers` and consume the marker (returned);
        None while there is none (a partial one at the end is held back unless `final`)."""
        found = [(i, m) for m in markers if (i := self._pending.find(m)) >= 0]
        if not found:
            keep = 0 if final else max(partial_suffix(self._pending, m) for m in markers)
            cut = len(self._pending) - keep
            out.content += self._content.add(self._pending[:cut])
            self._pending = self._pending[cut:]
            return None
        start, marker = min(found)
        out.content += self._content.add(self._pending[:start])
        self._content.call_starts()
        self._pending = self._pending[start + len(marker) :]
        return marker

    def _scan_call(self, out: ParsedDelta) -> bool:
        """Hand pending text to the current call; True while it needs more."""
        assert self._call is not None
        used = self._call.scanner.feed(self._pending)
        self._call_text += self._pending[:used]
        self._pending = self._pending[used:]
        name = self._call.scanner.name
        if name is not None and self.names is not None and name not in self.names:
            self._broken(out)  # (its first delta is sent with the name: nothing of it was)
            return False
        out.calls += self._call.deltas()
        if self._call.scanner.failed:
            self._broken(out)
        elif self._call.scanner.done:
            self._mode = _Mode.AFTER_CALL
        else:
            return True
        return False

    def _broken(self, out: ParsedDelta) -> None:
        """The current call is malformed: if nothing of it was sent, it was text after all; the rest
        of the output is content either way."""
        assert self._call is not None
        if self._call.started:
            self.failed = True
            logger.debug("malformed tool call after its first delta was sent")
        else:
            out.content += self._content.restore() + self._content.add(self._text_of_non_call())
        self._mode = _Mode.PLAIN


class HermesParser(_CallsInText):
    """Hermes 2 Pro / Qwen 2.5 / Qwen 3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    any number of them, with text before, between and after. A missing closing tag ends the call at
    its closing brace."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    MARKERS = (OPEN, CLOSE)

    def __init__(self, max_calls: int | None = None, tools: ToolSchemas | None = None) -> None:
        super().__init__(max_calls, _Mode.TEXT, tools)

    def _before_call(self, out: ParsedDelta, final: bool) -> bool:
        if self._content_until(out, final, (self.OPEN,)) is None:
            return False
        self._start_call()
        return True

    def _after_call(self, out: ParsedDelta, final: bool) -> bool:
        rest = self._pending.lstrip()
        if rest.startswith(self.CLOSE):
            self._pending = rest[len(self.CLOSE) :]
        elif not final and self.CLOSE.startswith(rest):
            return False  # whitespace or part of the closing tag so far
        self._content.call_ends()
        self._mode = _Mode.TEXT
        return True

    def _text_of_non_call(self) -> str:
        return self.OPEN + self._call_text


class Llama3JsonParser(_CallsInText):
    """Llama 3.1 / 3.2 JSON tool calls: the output is `{"name": ..., "parameters": {...}}`, optionally
    after `<|python_tag|>`, several separated by `;`. An output that does not start with a call
    object (after whitespace) is plain content, as is a first object without a name."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None, tools: ToolSchemas | None = None) -> None:
        super().__init__(max_calls, _Mode.START, tools)
        self._lead = ""  # whitespace / python tag before the first call

    def _before_call(self, out: ParsedDelta, final: bool) -> bool:
        rest = self._pending.lstrip()
        if rest.startswith(self.PYTHON_TAG):
            rest = rest[len(self.PYTHON_TAG) :].lstrip()
        if not final and (not rest or self.PYTHON_TAG.startswith(rest)):
            return False
        if not rest.startswith("{"):
            self._mode = _Mode.PLAIN
            return True
        self._lead = self._pending[: len(self._pending) - len(rest)]
        self._pending = rest
        self._start_call()
        return True

    def _after_call(self, out: ParsedDelta, final: bool) -> bool:
        rest = self._pending.lstrip()
        after = rest[1:].lstrip() if rest.startswith(";") else None
        if after is not None and after.startswith("{"):
            self._pending = after
            self._start_call()
            return True
        if not final and not (after if after is not None else rest):
            return False  # whitespace, or "; " with the next call not begun
        self._content.call_ends()
        self._mode = _Mode.PLAIN
        return True

    def _text_of_non_call(self) -> str:
        assert self._call is not None
        # The first object holding no call: the output is plain JSON, all of it content.
        return self._lead + self._call_text if self._call.index == 0 else self._call_text


class ArgumentsOnly(ToolCallParser):
    """tool_choice naming one function: the output (held to the function's parameter schema) is
    the arguments object itself; the call's first delta is sent before any of it arrives."""

    def __init__(self, name: str) -> None:
        super().__init__(max_calls=1)
        self.name = name
        self._named = False
        self._value: ValueScan | None = None
        self._sent = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._named:
            self._named = True
            out.calls.append(CallDelta(0, name=self.name))
        if self._value is None:
            text = text.lstrip()
            if not text:
                return out
            self._value = ValueScan(text[0])
        if not self._value.done:
            self._value.scan(text, 0)
        arguments = self._value.text
        if len(arguments) > self._sent:
            out.calls.append(CallDelta(0, arguments=arguments[self._sent :]))
            self._sent = len(arguments)
        return out

    def finish(self) -> ParsedDelta:
        out = self.feed("")
        if self._value is None or not isinstance(loads_or_invalid(self._value.text), dict):
            self.failed = True
        return out


class JsonCallList(ToolCallParser):
    """tool_choice "required": the output (held to a JSON schema) is a list of call objects,
    `[{"name": ..., "arguments": {...}}, ...]`."""

    # After each structural character, what may come next ("{" starts a call object).
    _NEXT = {"[": "{]", ",": "{", "]": ""}

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self._pending = ""
        self._expect = "["
        self._call: _Call | None = None

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while not self.failed:
            if self._call is not None:
                used = self._call.scanner.feed(self._pending)
                self._pending = self._pending[used:]
                out.calls += self._call.deltas()
                self.failed = self._call.scanner.failed
                if not self._call.scanner.done:
                    break
                self._call, self._expect = None, ",]"
                continue
            rest = self._pending.lstrip()
            if not rest:
                self._pending = ""
                break
            if rest[0] not in self._expect:
                self.failed = True
            elif rest[0] == "{":
                self._call, self._pending = self._new_call(), rest  # the scanner reads the brace
            else:
                self._expect, self._pending = self._NEXT[rest[0]], rest[1:]
        return out

    def finish(self) -> ParsedDelta:
        out = self.feed("")
        if self._expect != "" or not self._calls:
            self.failed = True
        return out
