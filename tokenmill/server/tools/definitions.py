"""Tool definitions: checking their parameter schemas, and the JSON schema that forces a call.

Parameter schemas are checked by `check_tools`, off the event loop (validating a large schema
takes a while), and their size is bounded: MAX_TOOL_PARAMETERS_BYTES per function, MAX_TOOLS_BYTES
for a request's tools together (as compact JSON text).

`tool_choice: "required"` and a named function are enforced with structured output (as vLLM does,
whatever the model's own call format): the output must be the function's arguments object (named)
or a list of `{"name": ..., "arguments": ...}` objects, one per call (required).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema_rs
from pydantic_core import PydanticCustomError

from tokenmill.server.errors import bad_request

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_TOOL_PARAMETERS_BYTES = 64 << 10
MAX_TOOLS_BYTES = 128 << 10
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_function_name(name: str) -> str:
    """OpenAI's rule for function names."""
    if not _FUNCTION_NAME.fullmatch(name):
        raise PydanticCustomError("function_name", "function names are 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    return name


def check_tools(parameters: Sequence[Mapping[str, Any] | None]) -> None:
    """Each function's `parameters` (in tools order; None: no arguments) within the size limits and
    a valid JSON schema (its `$schema` draft, else 2020-12) of type object; a 400 naming the field.
    Call it in a thread: it takes a while on large schemas."""
    total = 0
    for i, schema in enumerate(parameters):
        if schema is None:
            continue
        param = f"tools[{i}].function.parameters"
        size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
        if size > MAX_TOOL_PARAMETERS_BYTES:
            raise bad_request(
                f"the parameters schema is {size} bytes of JSON; the limit is {MAX_TOOL_PARAMETERS_BYTES}",
                param=param,
                code="tool_too_large",
            )
        total += size
        if total > MAX_TOOLS_BYTES:
            raise bad_request(
                f"the tools' parameter schemas add up to more than {MAX_TOOLS_BYTES} bytes of JSON",
                param="tools",
                code="tool_too_large",
            )
    for i, schema in enumerate(parameters):
        if schema is not None:
            _check_parameters_schema(schema, f"tools[{i}].function.parameters")


# The meta-schemas jsonschema-rs knows (as $schema may name them). Another $schema, which it would
# try to fetch over the network, is checked against 2020-12's: a schema names no URL we fetch.
_META_SCHEMAS = frozenset(
    f"{scheme}://json-schema.org/{path}"
    for scheme in ("http", "https")
    for path in (
        "draft-04/schema",
        "draft-06/schema",
        "draft-07/schema",
        "draft/2019-09/schema",
        "draft/2020-12/schema",
    )
)


def _check_parameters_schema(schema: Mapping[str, Any], param: str) -> None:
    """A valid JSON schema (checked by jsonschema-rs, whose Rust validation is far faster than the
    jsonschema package's, which holds the GIL throughout) of type object."""
    meta = schema.get("$schema")
    known = isinstance(meta, str) and meta.rstrip("#") in _META_SCHEMAS
    document = dict(schema) if known else _without_meta(schema)
    try:
        jsonschema_rs.meta.validate(document)
    except jsonschema_rs.ValidationError as exc:
        where = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.instance_path)
        raise bad_request(
            f"Invalid value for '{param}': not a valid JSON schema: {exc.message} (at {where})", param=param
        ) from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise bad_request(f"Invalid value for '{param}': the schema must have type \"object\", got {kind}", param=param)


def _without_meta(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in schema.items() if key != "$schema"}


def arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(parameters) if parameters else dict(NO_ARGUMENTS)


def required_calls_schema(functions: Sequence[tuple[str, Mapping[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """One or more calls (exactly one unless `parallel`), each to one of `functions` (name,
    parameters) with arguments valid for it. Each function's parameters move under the root's
    `$defs` (as `f0`, `f1`, ...), their root-relative `$ref`s rewritten to point there, so `#`,
    `#/properties/...` and their own `$defs` still resolve inside the combined schema."""
    alternatives: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for i, (name, parameters) in enumerate(functions):
        key = f"f{i}"
        defs[key] = _rebase_refs(arguments_schema(parameters), f"#/$defs/{key}")
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of `node` whose root-relative refs (`#`, `#/...`; not anchors) point below `base` instead."""
    if isinstance(node, dict):
        return {k: (_rebased(v, base) if k == "$ref" else _rebase_refs(v, base)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _rebased(ref: Any, base: str) -> Any:
    return base + ref[1:] if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")) else ref
