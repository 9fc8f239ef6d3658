"""OpenAI wire format: request/response models for /v1/completions, /v1/chat/completions and the
tokenizer endpoints.

Parsing is tolerant where real clients need it and strict where a mistake would go unnoticed:
* every field of OpenAI's current request types is accepted (a test compares with the installed
  `openai` package). Fields that do not apply to a self-hosted model (`store`, `metadata`, `user`,
  `service_tier`, ...) are ignored and logged once per field;
* fields tokenmill does not implement yet and that would change the output (`echo`, `suffix`,
  ...) get a 400 saying so: never a silent ignore;
* structured outputs come in OpenAI's spelling (`response_format`) and vLLM's (`structured_outputs`,
  `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar`); a request sets at most one, and
  an invalid schema, regex or grammar is a 400 naming the field it came from;
* unknown fields are ignored with a warning, once per name (vLLM's behaviour);
* known fields are strictly typed (no "5" for 5) and range-checked: those stay 400s.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

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

from tokenmill.engine.errors import InvalidRequest
from tokenmill.engine.sampling_params import MAX_N, MAX_TOP_LOGPROBS, SamplingParams
from tokenmill.engine.structured_outputs import StructuredOutputsParams

from .errors import APIError, bad_request, from_invalid_request
from .tools.definitions import check_function_name, check_parameters_schema

logger = logging.getLogger(__name__)

MAX_BATCH_PROMPTS = 256
_IGNORED = "x-tokenmill-ignored"
_NOT_SUPPORTED = "x-tokenmill-not-supported"


def ignored(why: str = "it does not apply to a self-hosted model") -> Any:
    """A field accepted for compatibility that changes nothing here (logged once when sent)."""
    return Field(None, description=f"Accepted and ignored: {why}.", json_schema_extra={_IGNORED: True})


def not_supported_yet() -> Any:
    """A field that would change the output and is not implemented yet: setting it is a 400."""
    return Field(None, description="Not supported yet: a request that sets it gets 400.",
                 json_schema_extra={_NOT_SUPPORTED: True})


# Values of not-yet-supported fields that ask for nothing beyond the default (clients send them).
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v == [],
    "function_call": lambda v: v in ("none", "auto"),
    "modalities": lambda v: v == ["text"],
    "suffix": lambda v: v == "",
}


class _Lenient(BaseModel):
    """Known fields strictly typed; unknown ones kept aside in `model_extra` (see `screen_fields`)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False
    include_obfuscation: bool | None = ignored("streams are not obfuscated")


# Fields that OpenAI's API documents as "... or null" (and vLLM's optional extras): null means the
# default. The rest (and every value that is not null) stay strict.
_NULL_MEANS_DEFAULT = frozenset({
    "n", "temperature", "top_p", "stream", "presence_penalty", "frequency_penalty", "logprobs", "echo",
    "top_k", "min_p", "repetition_penalty", "add_generation_prompt", "continue_final_message",
    "parallel_tool_calls", "encoding_format",
})

_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def _token_id_key(key: str) -> str:
    # int() would read "1_0" as 10 and " 1", "+1" or "١" as numbers too: only plain decimal digits are ids.
    if not _TOKEN_ID.fullmatch(key):
        raise PydanticCustomError("token_id", "keys must be token ids (decimal integers)")
    return key


TokenIdKey = Annotated[str, AfterValidator(_token_id_key), WithJsonSchema({"type": "string", "pattern": "^[0-9]{1,10}$"})]


class JsonSchemaFormat(_Lenient):
    """`response_format.json_schema`: the output is JSON matching `schema`."""

    name: str | None = None  # OpenAI requires it; it names the schema and changes nothing here
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # Output always matches the schema exactly here (xgrammar's strict mode: no properties beyond the
    # schema's), whatever `strict` says.
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# Where each way of asking for structured output puts its spec, in the engine's StructuredOutputsParams.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _NullMeansDefault(_Lenient):
    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULL_MEANS_DEFAULT}
        return data


def _batch(value: Any, param: str) -> list[str | list[int]]:
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


class _SamplingRequest(_NullMeansDefault):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM-style extras)."""

    model: str | None = None  # optional: a single-model server knows what to serve
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[TokenIdKey, float] | None = None  # OpenAI sends token ids as JSON object keys
    # Extras beyond the OpenAI API (same names as vLLM so existing clients' extra_body works).
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # vLLM's scoring extra: the prompt tokens' logprobs with this many top alternatives each (not with stream).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Accepted, no effect here.
    user: str | None = ignored("end-user ids are only logged with --log-prompts")
    store: bool | None = ignored()
    metadata: dict[str, str] | None = ignored()
    service_tier: str | None = ignored()
    # Structured output, in OpenAI's spelling and vLLM's (at most one per request).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM: {"json"|"regex"|"choice"|"grammar"|"json_object": ...}
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = ignored("xgrammar is the only backend")
    guided_whitespace_pattern: str | None = ignored("JSON whitespace is bounded by the engine")

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def structured_output(self) -> tuple[StructuredOutputsParams, str] | None:
        """The request's structured-output constraint and the field it came from (None: free text)."""
        specs: list[tuple[dict[str, Any], str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            specs.append(({"json_object": True}, "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  param="response_format.json_schema.schema")
            specs.append(({"json": fmt.json_schema.schema_}, "response_format.json_schema.schema"))
        if self.structured_outputs is not None:
            specs.append((self.structured_outputs, "structured_outputs"))
        for name, kind in _GUIDED.items():
            if getattr(self, name) is not None:
                specs.append(({kind: getattr(self, name)}, name))
        if not specs:
            return None
        if len(specs) > 1:
            raise bad_request(f"set only one of {', '.join(source for _, source in specs)}: each constrains the "
                              "whole output", param=specs[1][1])
        values, source = specs[0]
        try:
            return StructuredOutputsParams.from_dict(values), source
        except InvalidRequest as exc:
            raise from_invalid_request(exc, self.api_param(exc.param, source)) from None

    def api_param(self, param: str | None, source: str | None = None) -> str | None:
        """The request field an engine error's `param` is about (structured output: where it was set)."""
        if source is None:
            found = self.structured_output() if param and param.startswith("structured_outputs") else None
            source = found[1] if found else None
        if source is None or source == "structured_outputs" or not param:
            return param
        return source

    def check_prompt_logprobs(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs are not available with stream=true", param="prompt_logprobs")

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """Translate to engine params; SamplingParams' own validation errors become 400s."""
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
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        constraint = self.structured_output()
        if constraint is not None:
            values["structured_outputs"] = constraint[0]
        try:
            return SamplingParams.from_dict(values)
        except InvalidRequest as exc:
            raise from_invalid_request(exc) from None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt tokens' first)
    suffix: str | None = not_supported_yet()

    def check_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must be equal to n (or unset)", param="best_of")
        self.check_prompt_logprobs()

    def engine_prompt_logprobs(self, max_tokens: int) -> int | None:
        """The prompt logprobs the engine computes: what echo with logprobs shows and what
        prompt_logprobs asks for (the larger top count serves both); max_tokens 0 with echo scores
        the prompt even without logprobs (the engine's prefill-only requests are scoring requests)."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        if wanted:
            return max(wanted)
        if max_tokens == 0:
            if not self.echo:
                raise bad_request("max_tokens must be at least 1 (0 only with echo or prompt_logprobs: score the "
                                  "prompt without generating)", param="max_tokens")
            return 0
        return None

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a single string/token list becomes a batch of one."""
        return _batch(self.prompt, "prompt")


class EmbeddingRequest(_NullMeansDefault):
    """OpenAI's /v1/embeddings body, plus tokenmill's pooling extras."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # only the model's own hidden size (no truncation)
    user: str | None = ignored("end-user ids are only logged with --log-prompts")
    # Extras: override the server's --embedding-pooling, or skip the L2 normalisation.
    pooling: Literal["last", "mean"] | None = None
    normalize: bool = True

    def inputs(self) -> list[str | list[int]]:
        return _batch(self.input, "input")


class ContentPart(_Lenient):
    """One part of a message's content; the input processor accepts text parts only."""

    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    """A call an assistant made, as a history message carries it (`arguments`: JSON text)."""

    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends text; some clients send the object


class MessageToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        call = {"type": self.type, "function": self.function.model_dump(include={"name", "arguments"})}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = ignored("chat templates do not render it")
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (content may be null)
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: dict[str, Any] | None = not_supported_yet()
    audio: dict[str, Any] | None = not_supported_yet()

    def for_template(self) -> dict[str, Any]:
        """What the chat template sees: the known fields that are set (unknown ones are ignored)."""
        message = self.model_dump(include=set(type(self).model_fields) - {"tool_calls"}, exclude_none=True)
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


MAX_TOOLS = 128


class FunctionDefinition(_Lenient):
    name: Annotated[str, AfterValidator(check_function_name)]
    description: str | None = None
    # A JSON schema of type object (checked with jsonschema); absent: the function takes no arguments.
    parameters: Annotated[dict[str, Any], AfterValidator(check_parameters_schema)] | None = None
    strict: bool | None = None  # arguments are schema-checked only when tool_choice forces the call


class ToolDefinition(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(
            include={"name", "description", "parameters"}, exclude_none=True)}


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    """`{"type": "function", "function": {"name": ...}}`: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatTemplateOptions(_Lenient):
    """vLLM's chat-rendering extras, shared by chat completions and /tokenize."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open for the model to continue
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    chat_template: str | None = not_supported_yet()  # a client-supplied template: the model's own is used

    def template_options(self) -> dict[str, Any]:
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(_SamplingRequest, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, "none" without
    parallel_tool_calls: bool = True  # false: at most one call per choice
    # Accepted, no effect here.
    prompt_cache_key: str | None = ignored("prefix caching is automatic")
    prompt_cache_options: dict[str, Any] | None = ignored("prefix caching is automatic")
    prompt_cache_retention: str | None = ignored("prefix caching is automatic")
    safety_identifier: str | None = ignored()
    reasoning_effort: str | None = ignored()
    verbosity: str | None = ignored()
    prediction: dict[str, Any] | None = ignored("predicted outputs only speed up OpenAI's models")
    # Would change the output; not implemented (the deprecated predecessors of tools/tool_choice).
    functions: list[dict[str, Any]] | None = not_supported_yet()
    function_call: str | dict[str, Any] | None = not_supported_yet()
    modalities: list[str] | None = not_supported_yet()
    audio: dict[str, Any] | None = not_supported_yet()
    web_search_options: dict[str, Any] | None = not_supported_yet()
    moderation: dict[str, Any] | None = not_supported_yet()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions the chat template renders (also with tool_choice "none", as vLLM)."""
        return [t.for_template() for t in self.tools] if self.tools else None


# ---------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not recomputed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # With echo, the first prompt token's entries are null (nothing precedes it), as OpenAI sends them.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry for one token."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: PromptLogprob}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra, when asked for


class _ChoicesEnvelope(BaseModel):
    """What OpenAI's completion responses and stream chunks put around their choices; each kind
    narrows `object` and `choices` (the fields keep this order)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionResponse(_ChoicesEnvelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class ToolCall(BaseModel):
    id: str  # call_...: a tool message answers it by tool_call_id
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null when the model only called tools
    tool_calls: list[ToolCall] | None = None


class _ChatChoiceBase(BaseModel):
    """What a chat choice has, whole (`message`) or streamed (`delta`)."""

    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChoice(_ChatChoiceBase):
    message: AssistantMessage


class ChatCompletionResponse(_ChoicesEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra (of the rendered conversation), when asked for


class _OmitUnset(BaseModel):
    """Serialized without null fields, as OpenAI sends tool-call deltas (only what this piece has)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OmitUnset):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitUnset):
    """A streamed piece of call `index`: the first has id, type, name and arguments ""; later ones
    carry argument fragments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_ChatChoiceBase):
    delta: ChatDelta


class ChatCompletionChunk(_ChoicesEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class CompletionChunk(CompletionResponse):
    """A streamed piece of a completion: OpenAI sends it in the response's own shape."""


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter: the directory it was loaded from (vLLM's field)
    parent: str | None = None  # a LoRA adapter: its base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


# ---------------------------------------------------------------------------------------------- tokenizer endpoints


class TokenizePromptRequest(_Lenient):
    """vLLM's /tokenize body for a raw prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's own BOS/EOS additions
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateOptions):
    """vLLM's /tokenize body for a conversation, rendered exactly as chat completions renders it."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False  # the chat template places the special tokens
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.for_template() for t in self.tools] if self.tools else None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------------------------------- LoRA adapters


class LoadLoRAAdapterRequest(_Lenient):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Lenient):
    """vLLM's /v1/unload_lora_adapter body (`lora_int_id` is accepted and not needed: names are unique)."""

    lora_name: str
    lora_int_id: int | None = None


class VersionResponse(BaseModel):
    version: str


class HealthStatus(BaseModel):
    status: str
    reason: str | None = None


# ---------------------------------------------------------------------------------------------- parsing


def parse_request(model: type[_Lenient], raw: bytes) -> Any:
    """Validate a JSON body (pydantic's errors become one OpenAI-style 400), then screen its fields."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc) from None
    screen_fields(request)
    return request


def screen_fields(model: BaseModel, path: str = "") -> None:
    """400 for a set field that is not supported yet; log ignored and unknown fields (once per name)."""
    for name in model.model_fields_set:
        value = getattr(model, name, None)
        if name in (model.model_extra or {}):
            _FIELD_LOG.once("unknown", _field_name(path + name))
            continue
        marker = type(model).model_fields[name].json_schema_extra or {}
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
            logger.info("request field has no effect here and is ignored (logged once per field)", extra={"field": name})


_FIELD_LOG = _FieldLog()


def validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    kind, loc = first["type"], first["loc"]
    if kind == "json_invalid":
        return bad_request(f"Invalid JSON body: {first['msg'].removeprefix('Invalid JSON: ')}", code="invalid_json")
    if not loc:
        return bad_request("The request body must be a JSON object", code="invalid_json")
    if loc[-1] == "[key]":  # a bad key of a mapping (logit_bias)
        param = _param_name(loc[:-2])
        return bad_request(f"Invalid key {str(loc[-2])!r} in '{param}': {first['msg']}", param=param,
                           code="invalid_value")
    param = _param_name(loc)
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
