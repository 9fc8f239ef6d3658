"""OpenAI wire format: request/response models for /v1/completions and /v1/chat/completions.

Requests are strict (no "5" for 5, no unknown fields) because OpenAI rejects those too, and a silently
ignored misspelt parameter ("max_token") is worse than a clear 400.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tokenmill.engine.errors import InvalidRequest
from tokenmill.engine.sampling_params import SamplingParams

from .errors import APIError, bad_request, from_invalid_request

MAX_BATCH_PROMPTS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


# Fields that OpenAI's API documents as "... or null" (and vLLM's optional extras): null means the
# default. The rest (and every value that is not null) stay strict.
_NULL_MEANS_DEFAULT = frozenset({
    "n", "temperature", "top_p", "stream", "presence_penalty", "frequency_penalty", "logprobs", "echo",
    "top_k", "min_p", "repetition_penalty",
})


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM-style extras)."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULL_MEANS_DEFAULT}
        return data

    model: str | None = None  # optional: a single-model server knows what to serve
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; only ever logged as-is when --log-prompts
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # OpenAI sends token ids as JSON object keys
    # Extras beyond the OpenAI API (same names as vLLM so existing clients' extra_body works).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Translate to engine params; SamplingParams' own validation errors become 400s."""
        try:
            logit_bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids", param="logit_bias") from None
        values: dict[str, Any] = dict(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            n=self.n,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=logit_bias,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        try:
            return SamplingParams.from_dict(values)
        except InvalidRequest as exc:
            raise from_invalid_request(exc) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must be equal to n (or unset)", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a single string/token list becomes a batch of one."""
        p = self.prompt
        if isinstance(p, str):
            batch: list[str | list[int]] = [p]
        elif not p:
            raise bad_request("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            batch = [p]  # type: ignore[list-item]
        else:
            batch = list(p)  # type: ignore[arg-type]
        if len(batch) > MAX_BATCH_PROMPTS:
            raise bad_request(f"at most {MAX_BATCH_PROMPTS} prompts per request", param="prompt")
        return batch  # each one is checked by the input processor


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


# ---------------------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------------------------- parsing


def parse_request(model: type[_Strict], raw: bytes) -> Any:
    """Validate a JSON body, turning pydantic's errors into one OpenAI-style 400."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind, loc = first["type"], first["loc"]
    if kind == "json_invalid":
        return bad_request(f"Invalid JSON body: {first['msg'].removeprefix('Invalid JSON: ')}", code="invalid_json")
    if not loc:
        return bad_request("The request body must be a JSON object", code="invalid_json")
    param = _param_name(loc)
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param)
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'", param=param)
    # A union field (prompt, stop, content) fails once per alternative: one message says it better.
    top = loc[0]
    if sum(1 for e in errors if e["loc"] and e["loc"][0] == top) > 1 and len(loc) > 1 and not isinstance(loc[1], int):
        return bad_request(f"Invalid type for '{top}'", param=str(top), code="invalid_type")
    return bad_request(f"Invalid value for '{param}': {first['msg']}", param=param,
                       code="invalid_type" if kind.endswith("_type") else "invalid_value")


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
