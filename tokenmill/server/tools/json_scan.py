"""Incremental scanning of one function call written as a JSON object, as models write them:
`{"name": "get_weather", "arguments": {"city": "Paris"}}` (Llama 3 says "parameters").

The arguments are kept as the exact JSON text the model wrote, not re-serialized: a streamed call's
argument fragments are then slices of that text as it arrives, so they always concatenate to the
arguments of the same call parsed at once. The scanner only tracks nesting and strings to find where
values end; `json.loads` of the whole object has the last word on validity.
"""

from __future__ import annotations

import json
from enum import Enum, auto

ARGUMENT_KEYS = ("arguments", "parameters")
EMPTY_ARGUMENTS = "{}"


class _Kind(Enum):
    OBJECT = auto()  # {...} or [...]: ends at the bracket that closes the first
    STRING = auto()  # "...": ends at the unescaped closing quote
    SCALAR = auto()  # true, 12.5, null: ends before a delimiter


class ValueScan:
    """Where one JSON value ends, fed a character at a time (its text collected in `chars`)."""

    def __init__(self, first: str) -> None:
        self.kind = _Kind.OBJECT if first in "{[" else _Kind.STRING if first == '"' else _Kind.SCALAR
        self.chars: list[str] = []
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    @property
    def text(self) -> str:
        return "".join(self.chars)

    def scan(self, text: str, i: int) -> int:
        """Consume text[i:] up to the end of the value; returns the index after the last consumed char."""
        chars, n = self.chars, len(text)
        while i < n:
            c = text[i]
            if self.kind is _Kind.SCALAR:
                if c in ",}]" or c.isspace():  # the delimiter belongs to the enclosing object
                    self.done = True
                    return i
                chars.append(c)
                i += 1
                continue
            chars.append(c)
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.kind is _Kind.STRING:
                        self.done = True
                        return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i
        return i


class _Step(Enum):
    OPEN = auto()  # before "{"
    KEY_OR_END = auto()
    COLON = auto()
    VALUE_START = auto()
    VALUE = auto()
    COMMA_OR_END = auto()
    CLOSED = auto()  # the closing brace is consumed; checked once the feed's text is recorded
    DONE = auto()
    FAILED = auto()


class CallScanner:
    """Scans one call object. `name` is set once its string is complete; `arguments()` grows as the
    arguments value arrives. `done`/`failed` tell how the object ended; text after its closing
    brace is left to the caller (`feed` returns where it stopped)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.failed = False
        self._step = _Step.OPEN
        self._raw: list[str] = []  # every consumed character run, for the final json.loads check
        self._key: ValueScan | None = None
        self._key_text = ""
        self._value: ValueScan | None = None
        self._args: ValueScan | None = None
        self._args_final: str | None = None

    @property
    def done(self) -> bool:
        return self._step is _Step.DONE

    @property
    def raw(self) -> str:
        return "".join(self._raw)

    def arguments(self) -> str:
        """The arguments text known so far: an object's JSON text grows as it streams; a string-encoded
        object (some models quote it) appears decoded once complete; absent or null is "{}" at the end."""
        if self._args_final is not None:
            return self._args_final
        if self._args is not None and self._args.kind is _Kind.OBJECT:
            return self._args.text
        return ""

    def feed(self, text: str, start: int = 0) -> int:
        i = start
        n = len(text)
        while i < n and self._step not in (_Step.CLOSED, _Step.DONE, _Step.FAILED):
            step = self._step
            if step is _Step.VALUE:
                assert self._value is not None
                i = self._value.scan(text, i)
                if self._value.done:
                    self._end_value()
                continue
            if step is _Step.KEY_OR_END and self._key is not None:  # inside a key string
                i = self._key.scan(text, i)
                if self._key.done:
                    self._end_key()
                continue
            c = text[i]
            if c.isspace():
                i += 1
                continue
            i += 1
            if step is _Step.OPEN:
                self._expect(c == "{", _Step.KEY_OR_END)
            elif step is _Step.KEY_OR_END:
                if c == "}":
                    self._step = _Step.CLOSED
                elif c == '"':
                    self._key = ValueScan(c)
                    self._key.scan(c, 0)
                else:
                    self._fail()
            elif step is _Step.COLON:
                self._expect(c == ":", _Step.VALUE_START)
            elif step is _Step.VALUE_START:
                self._start_value(c)
            elif step is _Step.COMMA_OR_END:
                if c == ",":
                    self._step = _Step.KEY_OR_END
                elif c == "}":
                    self._step = _Step.CLOSED
                else:
                    self._fail()
        self._raw.append(text[start:i])
        if self._step is _Step.CLOSED:
            self._check_closed()
        return i

    def _expect(self, ok: bool, then: _Step) -> None:
        if ok:
            self._step = then
        else:
            self._fail()

    def _fail(self) -> None:
        self._step = _Step.FAILED
        self.failed = True

    def _end_key(self) -> None:
        assert self._key is not None
        try:
            self._key_text = json.loads(self._key.text)
        except ValueError:
            self._fail()
            return
        self._key = None
        self._step = _Step.COLON

    def _start_value(self, first: str) -> None:
        if first in ",:}]":
            self._fail()
            return
        value = ValueScan(first)
        is_arguments = self._key_text in ARGUMENT_KEYS and self._args is None
        if is_arguments:
            if first == "[":  # arguments are an object, never a list
                self._fail()
                return
            self._args = value
        value.scan(first, 0)
        self._value = value
        self._step = _Step.VALUE

    def _end_value(self) -> None:
        value = self._value
        assert value is not None
        self._value = None
        self._step = _Step.COMMA_OR_END
        if self._key_text == "name" and self.name is None:
            name = loads_or_invalid(value.text)
            if isinstance(name, str) and name:
                self.name = name
            else:
                self._fail()
        elif value is self._args and value.kind is not _Kind.OBJECT:
            decoded = loads_or_invalid(value.text)
            if decoded is None and value.text == "null":
                self._args_final = EMPTY_ARGUMENTS
            elif isinstance(decoded, str) and isinstance(loads_or_invalid(decoded), dict):
                self._args_final = decoded
            else:
                self._fail()

    def _check_closed(self) -> None:
        """The object is complete: valid JSON with a name, and arguments that are an object."""
        if not isinstance(loads_or_invalid(self.raw), dict) or self.name is None:
            self._fail()
            return
        if (
            self._args is not None
            and self._args.kind is _Kind.OBJECT
            and not isinstance(loads_or_invalid(self._args.text), dict)
        ):
            self._fail()
            return
        if self._args_final is None and self._args is None:
            self._args_final = EMPTY_ARGUMENTS
        self._step = _Step.DONE


_INVALID = object()


def loads_or_invalid(text: str) -> object:
    """json.loads, or a sentinel that equals nothing a JSON text can decode to."""
    try:
        return json.loads(text)
    except ValueError:
        return _INVALID
