"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list of
strings, or an EBNF grammar (vLLM's `StructuredOutputsParams`, with xgrammar doing the work).

A spec is checked when the request arrives (`validate`, from the input processor): xgrammar turns
it into a grammar, and what it cannot parse is an `InvalidRequest` naming the field, so the API
answers 400 before the request costs anything. Compiling the grammar against the vocabulary (the
slow part) happens later, off the engine thread (`tokenmill.engine.structured_output.grammar`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequest

# Whitespace between JSON elements: at most this many characters. Unbounded whitespace lets a model
# that likes newlines never finish the document (xgrammar's default is unbounded); 32 still allows
# pretty-printing several levels deep.
MAX_JSON_WHITESPACE = 32
MAX_CHOICES = 1024
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class ReasoningSection:
    """Free text a thinking model writes before the constrained output, ending with `end`. With
    `start`, the section is optional and opens with it; without, the output starts inside it."""

    end: str
    start: str | None = None

    def structural_tag(self) -> dict[str, Any]:
        """The section (and the whitespace after it) as an xgrammar structural tag."""
        section: dict[str, Any] = {
            "type": "sequence",
            "elements": [
                {"type": "tag", "begin": self.start or "", "content": {"type": "any_text"}, "end": self.end},
                {"type": "regex", "pattern": rf"\s{{0,{MAX_JSON_WHITESPACE}}}"},
            ],
        }
        if self.start is not None:
            section = {"type": "optional", "content": section}
        return {"type": "structural_tag", "format": section}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints. `json` is a JSON schema (a dict, or its JSON text);
    `json_object` asks for any JSON object; `choice` for exactly one of the strings; `grammar` is
    EBNF (GBNF) text with a `root` rule. `disable_any_whitespace` makes JSON compact (no
    whitespace but one space after `,` and `:`)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    # A reasoning section before the constrained output (server: --reasoning-parser); not user input.
    reasoning: ReasoningSection | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar"
                + (f" (got {', '.join(given)})" if given else ""),
                param="structured_outputs",
            )
        self._check_types()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """From user input (vLLM's `structured_outputs` object), naming unknown fields."""
        if not isinstance(values, dict):
            raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(set(values) - {*_KINDS, "disable_any_whitespace", "whitespace_pattern", "backend"})
        if unknown:
            raise InvalidRequest(
                f"unknown structured_outputs field(s): {', '.join(unknown)}", param=f"structured_outputs.{unknown[0]}"
            )
        # vLLM's backend choice and whitespace pattern have no meaning with one backend: ignored.
        return cls(**{k: v for k, v in values.items() if k not in ("whitespace_pattern", "backend") and v is not None})

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool, ReasoningSection | None]:
        """What identifies the compiled grammar (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            text = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            text = json.dumps(list(value))
        else:
            text = str(value)
        return kind, text, self.disable_any_whitespace, self.reasoning

    def _check_types(self) -> None:
        kind = self.kind
        value = getattr(self, kind)
        param = f"structured_outputs.{kind}"
        if kind == "json" and not isinstance(value, (dict, str)):
            raise InvalidRequest("structured_outputs.json must be a JSON schema (an object)", param=param)
        if kind == "json_object" and value is not True:
            raise InvalidRequest("structured_outputs.json_object must be true", param=param)
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise InvalidRequest(f"{param} must be a non-empty string", param=param)
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequest("structured_outputs.choice must be a list of non-empty strings", param=param)
            if len(value) > MAX_CHOICES:
                raise InvalidRequest(f"structured_outputs.choice allows at most {MAX_CHOICES} strings", param=param)
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequest(
                "disable_any_whitespace must be a boolean", param="structured_outputs.disable_any_whitespace"
            )

    def validate(self) -> Any:
        """The spec as an `xgrammar.Grammar`, built once (the compiler reuses it); InvalidRequest
        naming the field when xgrammar cannot parse it. Thread-safe (worst case: built twice)."""
        grammar = self.__dict__.get("_grammar")
        if grammar is None:
            grammar = self._build()
            object.__setattr__(self, "_grammar", grammar)  # not a field: stays out of eq, repr, asdict
        return grammar

    def _build(self) -> Any:
        import xgrammar as xgr

        grammar = self._build_output()
        if self.reasoning is None:
            return grammar
        section = xgr.Grammar.from_structural_tag(json.dumps(self.reasoning.structural_tag()))
        return xgr.Grammar.concat(section, grammar)

    def _build_output(self) -> Any:
        import xgrammar as xgr

        kind = self.kind
        try:
            if kind == "json":
                schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
                return _strict_json_strings(xgr.Grammar.from_json_schema(schema, **self._json_format()))
            if kind == "json_object":
                return _strict_json_strings(
                    xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **self._json_format())
                )
            if kind == "regex":
                assert self.regex is not None
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                assert self.choice is not None
                # An EBNF alternation of string literals (JSON string escapes are EBNF's too).
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
                )
            assert self.grammar is not None
            return xgr.Grammar.from_ebnf(self.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {
                "json": "JSON schema",
                "json_object": "JSON object grammar",
                "regex": "regex",
                "choice": "choice list",
                "grammar": "grammar",
            }[kind]
            raise InvalidRequest(
                f"Invalid {what}: {_xgrammar_message(exc)}", param=f"structured_outputs.{kind}"
            ) from None

    def _json_format(self) -> dict[str, Any]:
        if self.disable_any_whitespace:
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


# xgrammar 0.2.9 writes the characters of a length-bounded string (minLength/maxLength) as
# [^"\\\r\n], which lets raw control characters (U+0000-U+001F) into the string: not JSON (RFC 8259
# wants them escaped; json.loads rejects them). Its other string rules exclude them; so do we.
_LAX_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def _strict_json_strings(grammar: Any) -> Any:
    import xgrammar as xgr

    text = str(grammar)
    if _LAX_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR))


# "[17:51:01] /project/cpp/json_schema_converter.cc:5082: Unsupported type "foo"" -> the last part.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


def _xgrammar_message(exc: BaseException) -> str:
    text = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
    text = text.removeprefix("Check failed: (error.empty()) is false: ")
    return text.splitlines()[0] if text else type(exc).__name__
