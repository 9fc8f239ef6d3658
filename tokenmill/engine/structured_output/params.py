"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list of
strings, or an EBNF grammar (vLLM's `StructuredOutputsParams`, with xgrammar doing the work).

A spec is checked when the request arrives (`validate`, from the input processor): xgrammar turns
it into a grammar, and what it cannot parse is an `InvalidRequest` naming the field, so the API
answers 400 before the request costs anything. Compiling the grammar against the vocabulary (the
slow part) happens later, off the engine thread (`tokenmill.engine.structured_output.grammar`).

A spec is user input that costs time and memory, so it is bounded before xgrammar sees it: at most
MAX_SPEC_BYTES of text (a schema as compact JSON, a regex, a grammar, the choices together), and a
schema (a dict, or JSON text: parsed first) at most MAX_SCHEMA_DEPTH levels of nesting (xgrammar's
parse time grows about with the cube of it).

JSON-schema keywords xgrammar cannot enforce (`not`, `if`/`then`/`else`, dependencies,
`propertyNames`, `contains`, `uniqueItems`, `allOf` of several schemas, `oneOf` of branches that
may overlap, formats it does not know, refs it cannot resolve) are an InvalidRequest naming them
with `strict` (the default: vLLM's extras, OpenAI's `strict: true`); without it they are relaxed:
the output follows the rest of the schema.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequest

# The standard library's regex parser (re._parser since Python 3.11, sre_parse before): where a
# pattern's anchors sit.
sre_parse: Any = importlib.import_module("re._parser" if sys.version_info >= (3, 11) else "sre_parse")

# Whitespace between JSON elements: at most this many characters. Unbounded whitespace lets a model
# that likes newlines never finish the document (xgrammar's default is unbounded); 32 still allows
# pretty-printing several levels deep.
MAX_JSON_WHITESPACE = 32
MAX_CHOICES = 1024
MAX_SPEC_BYTES = 256 << 10
MAX_SCHEMA_DEPTH = 64
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


# What identifies a compiled grammar: (kind, the spec's text, disable_any_whitespace, reasoning).
SpecKey = tuple[str, str, bool, ReasoningSection | None]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints. `json` is a JSON schema (a dict, or its JSON text);
    `json_object` asks for any JSON object; `choice` for exactly one of the strings; `grammar` is
    EBNF (GBNF) text with a `root` rule. `disable_any_whitespace` makes JSON compact (no
    whitespace but one space after `,` and `:`). `strict`: a schema keyword xgrammar cannot
    enforce is an error (else it is relaxed)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    strict: bool = True
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
    def from_dict(cls, values: dict[str, Any], strict: bool = True) -> StructuredOutputsParams:
        """From user input (vLLM's `structured_outputs` object), naming unknown fields."""
        if not isinstance(values, dict):
            raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(set(values) - {*_KINDS, "disable_any_whitespace", "whitespace_pattern", "backend"})
        if unknown:
            raise InvalidRequest(
                f"unknown structured_outputs field(s): {', '.join(unknown)}", param=f"structured_outputs.{unknown[0]}"
            )
        # vLLM's backend choice and whitespace pattern have no meaning with one backend: ignored.
        given = {k: v for k, v in values.items() if k not in ("whitespace_pattern", "backend") and v is not None}
        return cls(**given, strict=strict)

    @property
    def kind(self) -> str:
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    @property
    def key(self) -> SpecKey:
        """What identifies the compiled grammar (the compile cache's key)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(list(value), ensure_ascii=False)
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
        size = len(self.key[1].encode("utf-8", "surrogatepass"))
        if size > MAX_SPEC_BYTES:
            raise InvalidRequest(
                f"structured_outputs.{kind} is {size} bytes; the limit is {MAX_SPEC_BYTES}",
                param=param,
                code="structured_output_too_large",
            )
        if kind == "json":
            check_schema_depth(self.schema(), param)

    def schema(self) -> dict[str, Any]:
        """The JSON schema (`json` as a dict: JSON text parsed, once)."""
        schema = self.__dict__.get("_schema")
        if schema is None:
            assert self.json is not None, "schema() of a json spec"
            schema = self.json if isinstance(self.json, dict) else _parsed_schema(self.json)
            object.__setattr__(self, "_schema", schema)
        return schema

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
                problem = unenforceable(self.schema(), strict=self.strict)
                if problem:
                    raise InvalidRequest(
                        f"Invalid JSON schema: {problem}", param="structured_outputs.json", code="unsupported_schema"
                    )
                schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
                return _strict_json_strings(xgr.Grammar.from_json_schema(schema, **self._json_format()))
            if kind == "json_object":
                return _strict_json_strings(
                    xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **self._json_format())
                )
            if kind == "regex":
                assert self.regex is not None
                check_anchors(self.regex, "structured_outputs.regex")
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


def _parsed_schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidRequest(
            f"structured_outputs.json is nested more than {MAX_SCHEMA_DEPTH} levels deep",
            param="structured_outputs.json",
            code="structured_output_too_large",
        ) from None
    except ValueError as exc:
        raise InvalidRequest(f"Invalid JSON schema: not valid JSON ({exc})", param="structured_outputs.json") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(
            "structured_outputs.json must be a JSON schema (an object)", param="structured_outputs.json"
        )
    return schema


def check_schema_depth(schema: Any, param: str) -> None:
    """InvalidRequest if `schema` nests objects and arrays more than MAX_SCHEMA_DEPTH deep."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequest(
                f"{param} is nested more than {MAX_SCHEMA_DEPTH} levels deep",
                param=param,
                code="structured_output_too_large",
            )
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


# JSON-schema keywords xgrammar 0.2.9 ignores: an output may break them.
_IGNORED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "propertyNames",
    "contains",
    "minContains",
    "maxContains",
    "$dynamicRef",
    "$recursiveRef",
)
# The formats xgrammar enforces (by syntax: a date's day may not exist in its month).
FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Keywords whose value is a schema, a list of schemas, or an object of schemas.
_SCHEMA = ("additionalProperties", "items", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def unenforceable(schema: dict[str, Any], strict: bool) -> str | None:
    """What in `schema` xgrammar cannot enforce, named with where it is ("'not' at #/properties/a");
    None when everything can be. Without `strict` only what xgrammar would misread (regex anchors
    in `pattern`) counts: the rest is relaxed."""
    stack: list[tuple[Any, str]] = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        problem = _pattern_problem(node) or (_keyword_problem(node, schema) if strict else None)
        if problem:
            return f"{problem} (at {where})"
        for key in _SCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{where}/{key}"))
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key]))
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in node[key].items())
    return None


def _pattern_problem(node: dict[str, Any]) -> str | None:
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        try:
            check_anchors(pattern, "")
        except InvalidRequest as exc:
            return f"the pattern {pattern!r}: {exc.message.removeprefix('Invalid regex: ')}"
    return None


def _keyword_problem(node: dict[str, Any], root: dict[str, Any]) -> str | None:
    for key in _IGNORED_KEYWORDS:
        if key in node:
            return f"'{key}' cannot be enforced"
    if node.get("uniqueItems") is True:
        return "'uniqueItems' cannot be enforced"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema cannot be enforced"
    if isinstance(node.get("oneOf"), list) and len(node["oneOf"]) > 1 and not _disjoint(node["oneOf"], root):
        return "'oneOf' of branches that may overlap cannot be enforced (only one may match): use anyOf"
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        return f"'format': {fmt!r} cannot be enforced (enforced: {', '.join(sorted(FORMATS))})"
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        return f"'$ref': {ref!r} cannot be resolved (only refs within the schema, '#' or '#/...')"
    return None


def _disjoint(branches: list[Any], root: dict[str, Any]) -> bool:
    """Whether no value can match two of the `oneOf` branches, for the two cases xgrammar gets
    right: branches of different JSON types, or objects told apart by a required property with a
    different constant in each (a discriminator)."""
    resolved = [_resolve(b, root) for b in branches]
    kinds = [_types(b) for b in resolved]
    known = [k for k in kinds if k]
    if len(known) == len(kinds) and all(not (a & b) for i, a in enumerate(known) for b in known[i + 1 :]):
        return True
    tags = [_constants(b) for b in resolved]
    for name in set.intersection(*(set(t) for t in tags)) if all(tags) else ():
        values = [json.dumps(t[name], sort_keys=True) for t in tags]
        if len(set(values)) == len(values):
            return True
    return False


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """A branch behind a local `$ref` (one level), else the branch."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#"):
        return schema
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else schema


def _types(schema: Any) -> set[str] | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
    if not kinds or not all(isinstance(k, str) for k in kinds):
        return None
    return kinds | {"number"} if "integer" in kinds else kinds | {"integer"} if "number" in kinds else kinds


def _constants(schema: Any) -> dict[str, Any]:
    """The required properties of an object schema that have one possible value."""
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        return {}
    found = {}
    for name in schema.get("required") or ():
        prop = schema["properties"].get(name)
        if isinstance(prop, dict) and "const" in prop:
            found[name] = prop["const"]
        elif isinstance(prop, dict) and isinstance(prop.get("enum"), list) and len(prop["enum"]) == 1:
            found[name] = prop["enum"][0]
    return found


# Zero-width assertions xgrammar cannot enforce: it ignores ^ and $ anywhere but at the ends of the
# pattern (with a warning on stderr), reads \A and \Z as the letters A and Z, and has no \b or \B.
_ANCHORS = {
    sre_parse.AT_BEGINNING: "^",
    sre_parse.AT_END: "$",
    sre_parse.AT_BEGINNING_STRING: "\\A",
    sre_parse.AT_END_STRING: "\\Z",
    sre_parse.AT_BOUNDARY: "\\b",
    sre_parse.AT_NON_BOUNDARY: "\\B",
}


def check_anchors(pattern: str, param: str) -> None:
    """InvalidRequest for a regex anchor that would be dropped or misread: `^` is allowed only at the
    start of the pattern and `$` only at its end (the whole output matches the pattern anyway)."""
    try:
        tree = list(sre_parse.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return  # xgrammar's own parser has the last word on syntax
    if tree and tree[0] == (sre_parse.AT, sre_parse.AT_BEGINNING):
        tree = tree[1:]
    if tree and tree[-1] == (sre_parse.AT, sre_parse.AT_END):
        tree = tree[:-1]
    found = next(_assertions(tree), None)
    if found is not None:
        raise InvalidRequest(
            f"Invalid regex: the anchor {_ANCHORS.get(found, str(found))} is not supported there: a pattern may "
            "start with ^ and end with $ (it always matches the whole output); no other ^, $, \\A, \\Z, \\b or \\B",
            param=param,
        )


def _assertions(node: Any) -> Any:
    """The AT codes anywhere inside a parsed pattern (or part of one)."""
    if isinstance(node, tuple) and len(node) == 2 and node[0] == sre_parse.AT:
        yield node[1]
    elif isinstance(node, (list, tuple, sre_parse.SubPattern)):
        for item in node:
            yield from _assertions(item)


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
