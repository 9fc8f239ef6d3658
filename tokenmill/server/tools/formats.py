"""More tool-call formats, with the guarantees of `parsers` (streamed deltas add up to the calls
parsed whole; text that only looks like a call stays content):

* `mistral`: `[TOOL_CALLS]` then a JSON list of call objects (Mistral 7B v0.3, Nemo, Small 3.1) or,
  per call, `name[ARGS]{...}` (Small 3.2, Magistral, Devstral; `[CALL_ID]id` may precede `[ARGS]`);
* `pythonic`: a Python list of keyword calls, `[get_weather(city="Paris"), now()]` (Llama 3.2 / 4,
  Gemma 3 and ToolACE prompts);
* `qwen3_coder`: Qwen3-Coder's XML, `<tool_call><function=NAME><parameter=KEY>value</parameter>
  </function></tool_call>`, each value typed by the function's parameter schema;
* `phi4_mini_json`: Phi-4-mini's `functools[{"name": ..., "arguments": {...}}, ...]`.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tokenmill.server.tools.json_scan import EMPTY_ARGUMENTS, ValueScan, loads_or_invalid
from tokenmill.server.tools.parsers import ParsedDelta, ToolSchemas, _CallsInText, _Mode

_NAME = re.compile(r"[A-Za-z0-9_.\-]*")


class _ListOfCallObjects(_CallsInText):
    """Calls as JSON objects in a list after an opening marker: `,` between them, `]` after the last."""

    def __init__(self, max_calls: int | None, tools: ToolSchemas | None) -> None:
        super().__init__(max_calls, _Mode.TEXT, tools)
        self._opener = ""  # the marker (and bracket) before the current call: content if it is no call
        self._in_list = False

    def _after_call(self, out: ParsedDelta, final: bool) -> bool:
        rest = self._pending.lstrip()
        if self._in_list:
            if rest.startswith(","):
                after = rest[1:].lstrip()
                if after.startswith("{"):
                    self._opener, self._pending = rest[: len(rest) - len(after)], after
                    self._start_call()
                    return True
                if not final and not after:
                    return False  # "," with the next call not begun
            elif rest.startswith("]"):
                self._pending = rest[1:]
            elif not final and not rest:
                return False
            self._in_list = False
        self._content.call_ends()
        self._mode = _Mode.TEXT
        return True

    def _text_of_non_call(self) -> str:
        return self._opener + self._call_text


class Phi4MiniJsonParser(_ListOfCallObjects):
    """Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]`; text before it is content."""

    OPEN = "functools["
    MARKERS = (OPEN,)

    def __init__(self, max_calls: int | None = None, tools: ToolSchemas | None = None) -> None:
        super().__init__(max_calls, tools)

    def _before_call(self, out: ParsedDelta, final: bool) -> bool:
        if self._content_until(out, final, (self.OPEN,)) is None:
            return False
        self._opener, self._in_list = self.OPEN, True
        self._start_call()
        return True


class MistralParser(_ListOfCallObjects):
    """Mistral: `[TOOL_CALLS]` then `[{...}, ...]` (or one `{...}`), or `name[ARGS]{...}` once per call.
    [TOOL_CALLS] and [ARGS] are special tokens of Mistral's tokenizers: its outputs keep them."""

    OPEN = "[TOOL_CALLS]"
    MARKERS = (OPEN,)
    KEEPS_SPECIAL_TOKENS = True

    def __init__(self, max_calls: int | None = None, tools: ToolSchemas | None = None) -> None:
        super().__init__(max_calls, tools)
        self._opened = False  # the marker is consumed; what follows decides the call's layout

    def _before_call(self, out: ParsedDelta, final: bool) -> bool:
        if not self._opened:
            if self._content_until(out, final, (self.OPEN,)) is None:
                return False
            self._opened, self._opener = True, self.OPEN
        rest = self._pending.lstrip()
        if not rest and not final:
            return False
        self._opened = False
        self._opener += self._pending[: len(self._pending) - len(rest)]
        self._in_list = rest.startswith("[")
        if self._in_list:
            self._opener, rest = self._opener + "[", rest[1:]
        self._pending = rest
        # "[" opens a list of call objects, "{" one object; anything else is name[ARGS]{...}.
        self._start_call(None if self._in_list or rest.startswith("{") else _NamedArguments())
        return True


class _NamedArguments:
    """Mistral's `name[ARGS]{...}` (`name[CALL_ID]id[ARGS]{...}`), read like `CallScanner` reads an object."""

    ARGS = "[ARGS]"
    CALL_ID = "[CALL_ID]"

    def __init__(self) -> None:
        self.name: str | None = None
        self.failed = False
        self.done = False
        self._name = ""
        self._reading_id = False
        self._arguments: ValueScan | None = None

    def arguments(self) -> str:
        return self._arguments.text if self._arguments is not None else ""

    def feed(self, text: str, start: int = 0) -> int:
        i = start
        while i < len(text) and not (self.done or self.failed):
            if self.name is None:
                i, waiting = self._name_step(text, i)
                if waiting:
                    break
                continue
            if self._arguments is None:
                if text[i].isspace():
                    i += 1
                    continue
                if text[i] != "{":
                    self.failed = True
                    break
                self._arguments = ValueScan("{")
            i = self._arguments.scan(text, i)
            if self._arguments.done:
                self.done = isinstance(loads_or_invalid(self._arguments.text), dict)
                self.failed = not self.done
        return i

    def _name_step(self, text: str, i: int) -> tuple[int, bool]:
        """Read the name (or the call id) up to its marker; (next index, waiting for more text)."""
        bracket = text.find("[", i)
        piece = text[i : bracket if bracket >= 0 else len(text)]
        if not self._reading_id:
            if not _NAME.fullmatch(piece):
                self.failed = True
                return i, False
            self._name += piece
        i += len(piece)
        if bracket < 0:
            return i, True
        rest = text[bracket:]
        markers = (self.ARGS,) if self._reading_id else (self.ARGS, self.CALL_ID)
        marker = next((m for m in markers if rest.startswith(m)), None)
        if marker is None:
            self.failed = not any(m.startswith(rest) for m in markers)
            return i, not self.failed  # a partial marker waits for the rest of it
        if marker == self.CALL_ID:
            self._reading_id = True
        elif self._name:
            self.name = self._name
        else:
            self.failed = True
        return i + len(marker), False


# ---------------------------------------------------------------------------------------------- pythonic


class PythonicParser(_CallsInText):
    """`[get_weather(city="Paris", unit="celsius"), now()]`: the output opens with a Python list of
    calls with keyword arguments of literal values (Llama 4 wraps it in <|python_start|>). Each call
    is sent once the list goes on past it, so `[f(x) for x in y]` or `[link](url)` stays content."""

    PYTHON_START = "<|python_start|>"

    def __init__(self, max_calls: int | None = None, tools: ToolSchemas | None = None) -> None:
        super().__init__(max_calls, _Mode.START, tools)
        self._opener = ""

    def _before_call(self, out: ParsedDelta, final: bool) -> bool:
        rest = self._pending.lstrip()
        if rest.startswith(self.PYTHON_START):
            rest = rest[len(self.PYTHON_START) :].lstrip()
        if not final and (not rest or self.PYTHON_START.startswith(rest)):
            return False
        if not rest.startswith("["):
            self._mode = _Mode.PLAIN
            return True
        self._opener = self._pending[: len(self._pending) - len(rest) + 1]
        self._pending = rest[1:]
        self._start_call(_PythonCall())
        return True

    def _after_call(self, out: ParsedDelta, final: bool) -> bool:
        rest = self._pending.lstrip()  # the call ended before a "," or "]"
        if rest.startswith(","):
            self._opener, self._pending = self._pending[: len(self._pending) - len(rest) + 1], rest[1:]
            self._start_call(_PythonCall())
            return True
        self._pending = rest[1:]
        self._content.call_ends()
        self._mode = _Mode.PLAIN
        return True

    def _broken(self, out: ParsedDelta) -> None:
        assert self._call is not None
        if self._call.index > 0:  # the list broke after calls were sent
            self.failed = True
            self._mode = _Mode.PLAIN
        else:
            super()._broken(out)

    def _text_of_non_call(self) -> str:
        return self._opener + self._call_text


class _PythonCall:
    """One `name(key=value, ...)` of a pythonic list, read like `CallScanner` reads an object: its
    name and arguments (as JSON) appear together once a "," or "]" follows it."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.failed = False
        self.done = False
        self._chars: list[str] = []
        self._depth = 0
        self._quote: str | None = None
        self._escaped = False
        self._closed = False
        self._arguments = ""

    def arguments(self) -> str:
        return self._arguments

    def feed(self, text: str, start: int = 0) -> int:
        i = start
        while i < len(text) and not (self.done or self.failed):
            c = text[i]
            if self._closed:  # after ")": a call only when the list goes on
                if c in ",]":
                    self._read("".join(self._chars))
                    return i
                self.failed = not c.isspace()
            elif self._depth == 0:
                if c == "(":
                    self._depth = 1
                elif not (c.isalnum() or c in "_.-" or (c.isspace() and not "".join(self._chars).strip())):
                    self.failed = True
                    return i
            else:
                self._in_arguments(c)
            self._chars.append(c)
            i += 1
        return i

    def _in_arguments(self, c: str) -> None:
        if self._quote is not None:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == self._quote:
                self._quote = None
        elif c in "'\"":
            self._quote = c
        elif c in "([{":
            self._depth += 1
        elif c in ")]}":
            self._depth -= 1
            self._closed = self._depth == 0

    def _read(self, text: str) -> None:
        try:
            call = ast.parse(text.strip(), mode="eval").body
            if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
                raise ValueError("not a call with keyword arguments")
            name = ast.unparse(call.func)
            if not _NAME.fullmatch(name):
                raise ValueError("not a function name")
            arguments = {k.arg: _literal(k.value) for k in call.keywords}
        except (SyntaxError, ValueError, TypeError, RecursionError):
            self.failed = True
            return
        self.name = name
        self._arguments = json.dumps(arguments, ensure_ascii=False) if arguments else EMPTY_ARGUMENTS
        self.done = True


_NAMED_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.AST) -> Any:
    """A Python (or JSON-spelled: true, null) literal as a JSON value."""
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    value = ast.literal_eval(node)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise ValueError(f"not a JSON value: {type(value).__name__}")


# ---------------------------------------------------------------------------------------------- Qwen3-Coder


class Qwen3CoderParser(_CallsInText):
    """Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nvalue\\n</parameter>\\n</function>\\n
    </tool_call>` (a bare `<function=` opens a call too). A value is text, read as the type its
    parameter's schema gives (integer, number, boolean, object, array; else a string)."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    MARKERS = (OPEN, CLOSE)

    def __init__(self, max_calls: int | None = None, tools: ToolSchemas | None = None) -> None:
        super().__init__(max_calls, _Mode.TEXT, tools)
        self._opener = ""

    def _before_call(self, out: ParsedDelta, final: bool) -> bool:
        marker = self._content_until(out, final, (self.OPEN, _XmlCall.FUNCTION))
        if marker is None:
            return False
        if marker == _XmlCall.FUNCTION:  # the call itself: the scanner reads it
            self._opener, self._pending = "", marker + self._pending
        else:
            self._opener = marker
        self._start_call(_XmlCall(self.tools))
        return True

    def _after_call(self, out: ParsedDelta, final: bool) -> bool:
        rest = self._pending.lstrip()
        if rest.startswith(self.CLOSE):
            self._pending = rest[len(self.CLOSE) :]
        elif not final and self.CLOSE.startswith(rest):
            return False
        self._content.call_ends()
        self._mode = _Mode.TEXT
        return True

    def _text_of_non_call(self) -> str:
        return self._opener + self._call_text


class _XmlCall:
    """One `<function=NAME>...</function>`, read like `CallScanner` reads an object: the name counts
    once a parameter (or the end) follows it; the arguments' JSON grows by one key at a time as each
    parameter ends, and closes with the function."""

    FUNCTION = "<function="
    PARAMETER = "<parameter="
    END_PARAMETER = "</parameter>"
    END_FUNCTION = "</function>"

    def __init__(self, tools: ToolSchemas) -> None:
        self.tools = tools
        self.name: str | None = None
        self.failed = False
        self.done = False
        self._function: str | None = None
        self._json = ""
        self._key: str | None = None  # the parameter whose value is being read

    def arguments(self) -> str:
        return self._json

    def feed(self, text: str, start: int = 0) -> int:
        i = start
        while not (self.done or self.failed):
            used = self._step(text, i)
            if used is None:
                break
            i = used
        return i

    def _step(self, text: str, i: int) -> int | None:
        """One element from text[i]; the index after it, or None when more text is needed."""
        if self._key is not None:
            return self._value(text, i)
        while i < len(text) and text[i].isspace():
            i += 1
        rest = text[i:]
        if self._function is None:
            return self._tag(rest, i, self.FUNCTION, self._open_function)
        if rest.startswith(self.END_FUNCTION):
            self.name = self._function
            self._json = self._json + "}" if self._json else EMPTY_ARGUMENTS
            self.done = True
            return i + len(self.END_FUNCTION)
        if rest.startswith(self.PARAMETER) or self.PARAMETER.startswith(rest):
            return self._tag(rest, i, self.PARAMETER, self._open_parameter)
        if self.END_FUNCTION.startswith(rest):
            return None  # (empty, or a partial closing tag)
        self.failed = True
        return None

    def _tag(self, rest: str, i: int, opening: str, then: Any) -> int | None:
        """`<function=NAME>` / `<parameter=KEY>`: `then(NAME)` once the ">" arrives."""
        if not rest.startswith(opening):
            self.failed = not opening.startswith(rest)
            return None
        end = rest.find(">", len(opening))
        value = rest[len(opening) : end if end >= 0 else len(rest)]
        if not _NAME.fullmatch(value):
            self.failed = True
            return None
        if end < 0:
            return None
        if not value:
            self.failed = True
            return None
        then(value)
        return i + end + 1

    def _open_function(self, name: str) -> None:
        self._function = name

    def _open_parameter(self, key: str) -> None:
        self.name, self._key = self._function, key

    def _value(self, text: str, i: int) -> int | None:
        """A parameter's text, up to </parameter> (or the next tag when a model leaves it out)."""
        rest = text[i:]
        ends = [
            (k, tag) for tag in (self.END_PARAMETER, self.PARAMETER, self.END_FUNCTION) if (k := rest.find(tag)) >= 0
        ]
        if not ends:
            return None
        k, tag = min(ends)
        assert self._key is not None and self.name is not None
        value = _typed_value(rest[:k], _parameter_schema(self.tools.get(self.name), self._key))
        self._json += ("{" if not self._json else ", ") + json.dumps(self._key) + ": "
        self._json += json.dumps(value, ensure_ascii=False)
        self._key = None
        return i + k + (len(tag) if tag == self.END_PARAMETER else 0)


def _parameter_schema(parameters: Any, key: str) -> dict[str, Any]:
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    schema = properties.get(key) if isinstance(properties, dict) else None
    return schema if isinstance(schema, dict) else {}


def _schema_types(schema: dict[str, Any]) -> set[str]:
    kinds = schema.get("type")
    found = (
        {kinds}
        if isinstance(kinds, str)
        else {k for k in kinds if isinstance(k, str)}
        if isinstance(kinds, list)
        else set()
    )
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            if isinstance(option, dict):
                found |= _schema_types(option)
    if "enum" in schema and not found:
        found |= {type_name for v in schema["enum"] for type_name in [_json_type(v)] if type_name}
    return found


def _json_type(value: Any) -> str | None:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else None


def _typed_value(text: str, schema: dict[str, Any]) -> Any:
    """A parameter's text (one newline either side is layout) as its schema's type; text it cannot be
    read as stays a string."""
    text = text.removeprefix("\n").removesuffix("\n")
    kinds = _schema_types(schema)
    if not kinds or "string" in kinds:
        return text
    value = text.strip()
    if value == "null" and "null" in kinds | {"object", "array", "integer", "number", "boolean"}:
        return None
    if "boolean" in kinds and value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        decoded = json.loads(value)
    except ValueError:
        try:  # maybe a Python literal (single quotes, True)
            decoded = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, RecursionError):
            return text
    if "integer" in kinds and isinstance(decoded, float) and decoded.is_integer():
        decoded = int(decoded)
    wanted: dict[str, type | tuple[type, ...]] = {
        "integer": int,
        "number": (int, float),
        "boolean": bool,
        "object": dict,
        "array": list,
    }
    if any(
        isinstance(decoded, wanted[k]) and not (k != "boolean" and isinstance(decoded, bool))
        for k in kinds
        if k in wanted
    ):
        return decoded
    return text
