"""Tool definitions: checking their parameter schemas, and the JSON schema that forces a call.

`tool_choice: "required"` and a named function are enforced with structured output (as vLLM does,
whatever the model's own call format): the output must be the function's arguments object (named)
or a list of `{"name": ..., "arguments": ...}` objects, one per call (required).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from pydantic_core import PydanticCustomError

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_function_name(name: str) -> str:
    """OpenAI's rule for function names."""
    if not _FUNCTION_NAME.fullmatch(name):
        raise PydanticCustomError("function_name", "function names are 1 to 64 characters of a-z, A-Z, 0-9, _ and -")
    return name


def check_parameters_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's `parameters`: a valid JSON schema (its `$schema` draft, else 2020-12) of type object."""
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise PydanticCustomError(
            "json_schema",
            "not a valid JSON schema: {error} (at {where})",
            {"error": exc.message, "where": exc.json_path},
        ) from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise PydanticCustomError("json_schema", 'the schema must have type "object", got {kind}', {"kind": kind})
    return schema


def arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(parameters) if parameters else dict(NO_ARGUMENTS)


def required_calls_schema(functions: Sequence[tuple[str, Mapping[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """One or more calls (exactly one unless `parallel`), each to one of `functions` (name,
    parameters) with arguments valid for it. Each function's `$defs` move to the root under a
    per-function prefix, so their `$ref`s still resolve inside the combined schema."""
    alternatives: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for i, (name, parameters) in enumerate(functions):
        arguments, own_defs = _hoist_defs(arguments_schema(parameters), prefix=f"f{i}_")
        defs.update(own_defs)
        alternatives.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


_DEFS_KEYS = ("$defs", "definitions")


def _hoist_defs(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    schema = copy.deepcopy(schema)
    defs: dict[str, Any] = {}
    for key in _DEFS_KEYS:
        for name, sub in (schema.pop(key, None) or {}).items():
            defs[prefix + name] = sub
    if not defs:
        return schema, {}
    renamed = {f"#/{key}/{name.removeprefix(prefix)}": f"#/$defs/{name}" for key in _DEFS_KEYS for name in defs}
    return _rewrite_refs(schema, renamed), _rewrite_refs(defs, renamed)


def _rewrite_refs(node: Any, renamed: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {
            k: (renamed.get(v, v) if k == "$ref" and isinstance(v, str) else _rewrite_refs(v, renamed))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rewrite_refs(v, renamed) for v in node]
    return node
