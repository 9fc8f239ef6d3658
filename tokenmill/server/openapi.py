"""What /openapi.json says. The generation and tokenizer endpoints read their bodies themselves (to
parse tolerantly and answer every error in OpenAI's shape), so FastAPI cannot see their request
models: they are declared here, with the response models, streaming and the error responses, so
clients and API fuzzers (schemathesis) can test the API from its own spec."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tokenmill.server.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "Invalid request (bad JSON, a bad or unsupported field, a prompt over the context length)",
    401: "Missing or wrong API key (`--api-key`)",
    403: "Runtime LoRA updates are off (`--enable-lora-runtime-updates`)",
    404: "Unknown model (or LoRA adapter)",
    408: "The request body did not arrive within `--body-timeout`",
    413: "Request body over `--max-body-bytes`",
    415: "The body is not JSON (`Content-Type` must be application/json)",
    429: "Too many requests waiting (`--max-queue`); retry later",
    500: "The engine failed",
    503: "Draining or the engine is not running",
}


def json_body(*models: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads one of `models` as its JSON body."""
    refs = [{"$ref": _REF.format(model=m.__name__)} for m in models]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def text_responses(success: str, *error_statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route answering plain text on success (response_class=PlainTextResponse) and OpenAI's
    JSON errors otherwise (named explicitly: `errors` would document them as text too)."""
    error = {"application/json": {"schema": {"$ref": _REF.format(model=ErrorResponse.__name__)}}}
    return {
        200: {"description": success, "content": {"text/plain": {"schema": {"type": "string"}}}},
        **{s: {"description": _ERRORS[s], "content": error} for s in error_statuses},
    }


def generation_responses(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """JSON, or with `"stream": true` server-sent events (one `chunk` per event, or an error event
    if the engine fails mid-stream, then `[DONE]`), or an error."""
    event = {  # OpenAPI < 3.2: the schema of one event; `data` holds a JSON chunk or the final [DONE]
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": _REF.format(model=chunk.__name__)},
                                {"$ref": _REF.format(model=ErrorResponse.__name__)},
                            ]
                        },
                    },
                ]
            }
        },
    }
    ok = {
        "model": model,
        "description": "The completion; with `stream: true`, server-sent events: "
        "`data: {chunk}` lines, then `data: [DONE]`",
        "content": {"text/event-stream": {"schema": event}},
    }
    return {200: ok, **errors(400, 401, 404, 408, 413, 415, 429, 500, 503)}


def described(description: str) -> dict[int | str, dict[str, Any]]:
    """A generation endpoint whose bodies are another API's shapes (OpenAI Responses, Anthropic
    Messages), described in words, or an error."""
    stream = {"text/event-stream": {"schema": {"type": "string"}}}
    ok = {"description": description, "content": {"application/json": {"schema": {"type": "object"}}, **stream}}
    return {200: ok, **errors(400, 401, 404, 408, 413, 415, 429, 500, 503)}


def json_responses(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """A JSON body (never a stream), or an error."""
    return {200: {"model": model, "description": description}, **errors(400, 401, 404, 408, 413, 415, 429, 500, 503)}


def install(app: FastAPI, body_models: list[type[BaseModel]], event_models: list[type[BaseModel]]) -> None:
    """Generate the spec once, with the request bodies and stream events added to its component
    schemas, and without FastAPI's 422 (validation errors are 400s here)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _, defs = models_json_schema(
                [(m, "validation") for m in body_models] + [(m, "serialization") for m in event_models],
                ref_template=_REF,
            )
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(defs.get("$defs", {}))
            for operations in spec["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
