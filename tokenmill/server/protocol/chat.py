"""/v1/chat/completions: messages, tools, chat-template options, the response and its stream chunks."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol.base import ChoicesEnvelope, LenientModel, OmitUnset, ignored, not_supported_yet
from tokenmill.server.protocol.completions import PromptLogprobs
from tokenmill.server.protocol.sampling import SamplingRequest
from tokenmill.server.tools.definitions import check_function_name, check_tools


class ContentPart(LenientModel):
    """One part of a message's content; the input processor accepts text parts only."""

    type: str
    text: str | None = None


class FunctionCall(LenientModel):
    """A call an assistant made, as a history message carries it (`arguments`: JSON text)."""

    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends text; some clients send the object


class MessageToolCall(LenientModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        call = {"type": self.type, "function": self.function.model_dump(include={"name", "arguments"})}
        return call if self.id is None else {"id": self.id, **call}


class ChatMessage(LenientModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = ignored("chat templates do not render it")
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (content may be null)
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning, for templates that render it (Qwen3)
    function_call: dict[str, Any] | None = not_supported_yet()
    audio: dict[str, Any] | None = not_supported_yet()

    def for_template(self) -> dict[str, Any]:
        """What the chat template sees: the known fields that are set (unknown ones are ignored)."""
        message = self.model_dump(include=set(type(self).model_fields) - {"tool_calls"}, exclude_none=True)
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


MAX_TOOLS = 128


class FunctionDefinition(LenientModel):
    name: Annotated[str, AfterValidator(check_function_name)]
    description: str | None = None
    # A JSON schema of type object (absent: the function takes no arguments), checked off the event
    # loop (`tools.definitions.check_tools`).
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are schema-checked only when tool_choice forces the call


class ToolDefinition(LenientModel):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": self.function.model_dump(include={"name", "description", "parameters"}, exclude_none=True),
        }


def check_tool_definitions(tools: list[ToolDefinition] | None) -> None:
    """The tools' parameter schemas: sizes and validity (400 naming the field). Slow on large
    schemas: call it in a thread."""
    check_tools([tool.function.parameters for tool in tools or []])


class NamedFunction(LenientModel):
    name: str


class NamedToolChoice(LenientModel):
    """`{"type": "function", "function": {"name": ...}}`: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatTemplateOptions(LenientModel):
    """vLLM's chat-rendering extras, shared by chat completions and /tokenize."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # leave the last (assistant) message open for the model to continue
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    chat_template: str | None = not_supported_yet()  # a client-supplied template: the model's own is used

    def template_options(self) -> dict[str, Any]:
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template_kwargs": self.chat_template_kwargs,
        }


class ChatCompletionRequest(SamplingRequest, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
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

    def api_param(self, param: str | None, source: str | None = None) -> str | None:
        """(chat asks for the engine's logprobs count as top_logprobs)"""
        return "top_logprobs" if param == "logprobs" else super().api_param(param, source)

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions the chat template renders (also with tool_choice "none", as vLLM)."""
        return [t.for_template() for t in self.tools] if self.tools else None


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


class _WithReasoning(BaseModel):
    """vLLM's reasoning fields (--reasoning-parser): the same text under its older name
    (`reasoning_content`) and its newer one (`reasoning`); left out when there is none."""

    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _reasoning_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("reasoning_content", "reasoning"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class AssistantMessage(_WithReasoning):
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


class ChatCompletionResponse(ChoicesEnvelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None  # vLLM extra (of the rendered conversation), when asked for


class DeltaFunctionCall(OmitUnset):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitUnset):
    """A streamed piece of call `index`: the first has id, type, name and arguments ""; later ones
    carry argument fragments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(_WithReasoning):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_ChatChoiceBase):
    delta: ChatDelta


class ChatCompletionChunk(ChoicesEnvelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
