"""Shared pieces of the OpenAI wire format: lenient models, ignored and unsupported fields, usage, errors, parsing."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    WithJsonSchema,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tokenmill.server.errors import APIError, bad_request

logger = logging.getLogger(__name__)


MAX_BATCH_PROMPTS = 256


_IGNORED = "x-tokenmill-ignored"


_NOT_SUPPORTED = "x-tokenmill-not-supported"


def ignored(why: str = "it does not apply to a self-hosted model") -> Any:
    """A field accepted for compatibility that changes nothing here (logged once when sent)."""
    return Field(None, description=f"Accepted and ignored: {why}.", json_schema_extra={_IGNORED: True})


def not_supported_yet() -> Any:
    """A field that would change the output and is not implemented yet: setting it is a 400."""
    return Field(
        None,
        description="Not supported yet: a request that sets it gets 400.",
        json_schema_extra={_NOT_SUPPORTED: True},
    )


# Values of not-yet-supported fields that ask for nothing beyond the default (clients send them).
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v in ("none", "auto"),
    "modalities": lambda v: v == ["text"],
    "suffix": lambda v: v == "",
}


class LenientModel(BaseModel):
    """Known fields strictly typed; unknown ones kept aside in `model_extra` (see `screen_fields`)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(LenientModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk
    include_obfuscation: bool | None = ignored("streams are not obfuscated")


# Fields that OpenAI's API documents as "... or null" (and vLLM's optional extras): null means the
# default. The rest (and every value that is not null) stay strict.
_NULL_MEANS_DEFAULT = frozenset(
    {
        "n",
        "temperature",
        "top_p",
        "stream",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "echo",
        "top_k",
        "min_p",
        "repetition_penalty",
        "add_generation_prompt",
        "continue_final_message",
        "parallel_tool_calls",
        "encoding_format",
        "skip_special_tokens",
    }
)


_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _token_id_key(key: str) -> str:
    # int() would read "1_0" as 10 and " 1", "+1" or "١" as numbers too: only plain decimal digits are ids.
    if not _TOKEN_ID.fullmatch(key):
        raise PydanticCustomError("token_id", "keys must be token ids (decimal integers)")
    return key


TokenIdKey = Annotated[
    str, AfterValidator(_token_id_key), WithJsonSchema({"type": "string", "pattern": "^[0-9]{1,10}$"})
]


class NullMeansDefault(LenientModel):
    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULL_MEANS_DEFAULT}
        return data


def as_batch(value: Any, param: str) -> list[str | list[int]]:
    """A prompt/input field as a batch: a single string or token list becomes a batch of one."""
    if isinstance(value, str):
        batch: list[str | list[int]] = [value]
    elif not value:
        raise bad_request(f"{param} must not be empty", param=param)
    elif isinstance(value[0], int):
        batch = [value]
    else:
        batch = list(value)
    if len(batch) > MAX_BATCH_PROMPTS:
        raise bad_request(f"at most {MAX_BATCH_PROMPTS} prompts per request", param=param)
    return batch  # each one is checked by the input processor


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not recomputed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class ChoicesEnvelope(BaseModel):
    """What OpenAI's completion responses and stream chunks put around their choices; each kind
    narrows `object` and `choices` (the fields keep this order)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class OmitUnset(BaseModel):
    """Serialized without null fields, as OpenAI sends tool-call deltas (only what this piece has)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


def parse_request(model: type[LenientModel], raw: bytes) -> Any:
    """Validate a JSON body (pydantic's errors become one OpenAI-style 400), then screen its fields."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    screen_fields(request)
    return request


def build_request(model: type[BaseModel], values: dict[str, Any]) -> Any:
    """A request built from another API's request (a Responses or Messages request read as a chat
    request): what the target refuses (no messages at all) is the client's 400."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise validation_error(exc) from None


def renamed(err: APIError, names: list[tuple[str, str]]) -> APIError:
    """A chat-request error as another API names its fields (`names`: regex -> replacement, applied
    to the param and the message), e.g. response_format.json_schema.schema -> text.format.schema."""
    param, message = err.param, err.message
    for pattern, replacement in names:
        if param is not None:
            param = re.sub(pattern, replacement, param)
        message = re.sub(pattern, replacement, message)
    return APIError(err.status, message, code=err.code, param=param, type=err.type, headers=err.headers)


def validate_item(model: type[LenientModel], value: Any, where: str) -> Any:
    """One item of a list the request holds as raw objects (a tool of a given type), validated as
    `model`: errors name the item (`where`, e.g. tools[2])."""
    try:
        item = model.model_validate(value)
    except ValidationError as exc:
        err = validation_error(exc)
        raise bad_request(f"Invalid {where}: {err.message}", param=f"{where}.{err.param}") from None
    screen_fields(item, f"{where}.")
    return item


def screen_fields(model: BaseModel, path: str = "") -> None:
    """400 for a set field that is not supported yet; log ignored and unknown fields (once per name)."""
    for name in model.model_fields_set:
        value = getattr(model, name, None)
        if name in (model.model_extra or {}):
            _FIELD_LOG.once("unknown", _field_name(path + name))
            continue
        extra = type(model).model_fields[name].json_schema_extra
        marker = extra if isinstance(extra, dict) else {}  # (ours are dicts; pydantic also allows a callable)
        where = f"{path}{name}"
        if value is None:
            continue
        if marker.get(_NOT_SUPPORTED) and not _HARMLESS.get(name, lambda _: False)(value):
            raise bad_request(f"'{where}' is not supported yet", param=where, code="unsupported_parameter")
        if marker.get(_IGNORED):
            _FIELD_LOG.once("ignored", _field_name(where))
        for i, item in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(item, BaseModel):
                screen_fields(item, f"{where}[{i}]." if isinstance(value, list) else f"{where}.")


def _field_name(where: str) -> str:
    return re.sub(r"\[\d+\]", "[]", where)[:80]  # one log line per field, not per message index


class _FieldLog:
    """Logs each ignored or unknown field name once per process, and at most `limit` names (a
    client making up new names must not grow memory or the log)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._seen: set[tuple[str, str]] = set()

    def once(self, kind: str, name: str) -> None:
        key = (kind, name)
        if key in self._seen or len(self._seen) >= self.limit:
            return
        self._seen.add(key)
        if kind == "unknown":
            logger.warning("unknown request field ignored (logged once per field)", extra={"field": name})
        else:
            logger.info(
                "request field has no effect here and is ignored (logged once per field)", extra={"field": name}
            )


_FIELD_LOG = _FieldLog()


_LONE_SURROGATE = re.compile(r"(?:unexpected end of hex escape|lone leading surrogate in hex escape) (?P<where>at .*)")


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind, loc = first["type"], first["loc"]
    if kind == "json_invalid":
        reason = first["msg"].removeprefix("Invalid JSON: ")
        # jiter's names for a \uD800-\uDFFF escape that is not half of a surrogate pair.
        where = _LONE_SURROGATE.match(reason)
        if where:
            reason = (
                f"a lone surrogate escape (\\uD800-\\uDFFF not in a high-low pair) {where['where']}: JSON strings "
                "must be valid Unicode"
            )
        return bad_request(f"Invalid JSON body: {reason}", code="invalid_json")
    if not loc:
        return bad_request("The request body must be a JSON object", code="invalid_json")
    if loc[-1] == "[key]":  # a bad key of a mapping (logit_bias)
        param = _param_name(loc[:-2])
        return bad_request(
            f"Invalid key {str(loc[-2])!r} in '{param}': {first['msg']}", param=param, code="invalid_value"
        )
    param = _param_name(loc)
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param=param)
    # A union field (prompt, stop, content) fails once per alternative: one message says it better.
    top = loc[0]
    if sum(1 for e in errors if e["loc"] and e["loc"][0] == top) > 1 and len(loc) > 1 and not isinstance(loc[1], int):
        return bad_request(f"Invalid type for '{top}'", param=str(top), code="invalid_type")
    return bad_request(
        f"Invalid value for '{param}': {first['msg']}",
        param=param,
        code="invalid_type" if kind.endswith("_type") else "invalid_value",
    )


def _param_name(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; pydantic's union-branch labels are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool"):
            continue
        else:
            out += f".{part}" if out else part
    return out
