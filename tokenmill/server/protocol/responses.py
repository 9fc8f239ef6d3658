"""/v1/responses (OpenAI's Responses API): the request, read into a chat conversation.

Input items are read with the `openai` package's own types (as vLLM does); responses and stream
events are built from them too (tokenmill.server.responses_api). What a self-hosted text model can
serve is served: text messages, function tools and their calls and outputs, instructions,
structured outputs (`text.format`), reasoning items; everything else (built-in tools such as
web_search, images and files, background responses) is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from openai.types.responses import (
    EasyInputMessage,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
)
from openai.types.responses.response_input_item import FunctionCallOutput, Message
from pydantic import AfterValidator, Field, TypeAdapter, ValidationError

from tokenmill.engine.sampling_params import MAX_TOP_LOGPROBS
from tokenmill.server.errors import bad_request
from tokenmill.server.protocol.base import (
    LenientModel,
    NullMeansDefault,
    build_request,
    ignored,
    not_supported_yet,
    validate_item,
)
from tokenmill.server.protocol.chat import (
    MAX_TOOLS,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    MessageToolCall,
    NamedFunction,
    NamedToolChoice,
    ToolDefinition,
)
from tokenmill.server.protocol.sampling import JsonSchemaFormat, ResponseFormat
from tokenmill.server.tools.definitions import check_function_name

MAX_INPUT_ITEMS = 4096


class FunctionToolSpec(LenientModel):
    """A function tool, as the Responses API spells it (flat: no `function` wrapper)."""

    type: Literal["function"]
    name: Annotated[str, AfterValidator(check_function_name)]
    description: str | None = None
    # A JSON schema of type object, checked off the event loop with the chat request's tools.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments are schema-checked only when tool_choice forces the call

    def for_chat(self) -> ToolDefinition:
        return ToolDefinition(
            type="function",
            function=FunctionDefinition(
                name=self.name, description=self.description, parameters=self.parameters, strict=self.strict
            ),
        )


class TextFormat(LenientModel):
    """`text.format`: text, any JSON object, or JSON matching `schema` (what `responses.parse` sends)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(LenientModel):
    format: TextFormat | None = None
    verbosity: str | None = ignored()


class ResponsesRequest(NullMeansDefault):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)  # checked per type (read_tools)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None  # null or absent: stored (OpenAI's default)
    previous_response_id: str | None = None
    background: bool | None = None  # refused unless false: responses are not run detached here
    # Accepted, no effect here.
    reasoning: dict[str, Any] | None = ignored("the reasoning parser reads what the model writes")
    include: list[str] | None = ignored()
    metadata: dict[str, str] | None = ignored()
    user: str | None = ignored()
    safety_identifier: str | None = ignored()
    service_tier: str | None = ignored()
    prompt_cache_key: str | None = ignored("prefix caching is automatic")
    prompt_cache_retention: str | None = ignored("prefix caching is automatic")
    truncation: str | None = ignored("a conversation longer than the context is a 400")
    stream_options: dict[str, Any] | None = ignored()
    prompt_cache_options: dict[str, Any] | None = ignored("prefix caching is automatic")
    context_management: Any = ignored("a conversation longer than the context is a 400")
    background_options: dict[str, Any] | None = ignored()
    access_programs: Any = ignored()
    image: Any = ignored()
    moderation: Any = ignored()
    # Would change the output; not implemented.
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tool_calls: int | None = not_supported_yet()
    prompt: dict[str, Any] | None = not_supported_yet()
    conversation: str | dict[str, Any] | None = not_supported_yet()

    def check_supported(self) -> None:
        if self.background:
            raise bad_request(
                "background responses are not supported: send the request without background (or with "
                "stream=true) and keep the connection open",
                param="background",
                code="unsupported_parameter",
            )
        if self.top_logprobs:
            raise bad_request("top_logprobs is not supported yet", param="top_logprobs", code="unsupported_parameter")

    def read_tools(self) -> list[FunctionToolSpec]:
        """The function tools; any other tool type (web_search, file_search, computer use, MCP ...) is
        a 400 naming it."""
        specs = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise bad_request(
                    f"tools[{i}] has type {kind!r}: only function tools are supported (built-in tools such as "
                    "web_search, file_search, code_interpreter, computer use and MCP are not)",
                    param=f"tools[{i}].type",
                    code="unsupported_tool_type",
                )
            specs.append(validate_item(FunctionToolSpec, tool, f"tools[{i}]"))
        return specs

    def chat_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice  # type: ignore[return-value]
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return NamedToolChoice(type="function", function=NamedFunction(name=choice["name"]))
        kind = choice.get("type") if isinstance(choice, dict) else choice
        raise bad_request(
            f"tool_choice {kind!r} is not supported: use none, auto, required or {{'type': 'function', 'name': ...}}",
            param="tool_choice",
        )

    def response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema_ is None:
            raise bad_request("text.format json_schema needs a schema", param="text.format.schema")
        return ResponseFormat(
            type="json_schema",
            json_schema=JsonSchemaFormat(
                name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict
            ),
        )

    def chat_request(self, messages: list[ChatMessage], tools: list[FunctionToolSpec]) -> ChatCompletionRequest:
        """The same generation as a chat completions request."""
        return build_request(
            ChatCompletionRequest,
            dict(
                model=self.model,
                messages=messages,
                max_completion_tokens=self.max_output_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                tools=[t.for_chat() for t in tools] or None,
                tool_choice=self.chat_tool_choice(),
                parallel_tool_calls=self.parallel_tool_calls,
                response_format=self.response_format(),
                stream=self.stream,
            ),
        )


# ---------------------------------------------------------------------------------------------- input -> chat

_INPUT_MESSAGE: TypeAdapter[EasyInputMessage | Message | ResponseOutputMessage] = TypeAdapter(
    EasyInputMessage | Message | ResponseOutputMessage
)
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def input_messages(req: ResponsesRequest, history: list[ChatMessage]) -> list[ChatMessage]:
    """The conversation a request continues (`history`, from previous_response_id), its instructions
    as a system message first, then its input items as chat messages: function_call items become the
    assistant's tool_calls, function_call_output items tool messages, a reasoning item the next
    assistant message's reasoning_content."""
    messages: list[ChatMessage] = []
    if req.instructions:
        messages.append(ChatMessage(role="system", content=req.instructions))
    messages += history
    if isinstance(req.input, str):
        return [*messages, ChatMessage(role="user", content=req.input)]
    if not req.input and not history:
        raise bad_request("input must not be empty", param="input")
    names: dict[str, str] = {}  # call_id -> function name (tool messages name the function)
    reasoning: str | None = None
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            message = _message(item, where)
            if message.role == "assistant" and reasoning is not None:
                message.reasoning_content, reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = _parsed(ResponseFunctionToolCall, item, where)
            names[call.call_id] = call.name
            tool_call = MessageToolCall(
                id=call.call_id, function=FunctionCall(name=call.name, arguments=call.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and i > 0 and _continues_turn(req.input[i - 1]):
                last.tool_calls = [*(last.tool_calls or []), tool_call]
            else:
                messages.append(
                    ChatMessage(role="assistant", content=None, tool_calls=[tool_call], reasoning_content=reasoning)
                )
                reasoning = None
        elif kind == "function_call_output":
            output = _parsed(FunctionCallOutput, item, where)
            text = output.output if isinstance(output.output, str) else _text_of(output.output, f"{where}.output")
            messages.append(
                ChatMessage(
                    role="tool", tool_call_id=output.call_id, content=text, name=names.get(output.call_id or "")
                )
            )
        elif kind == "reasoning":
            thought = _parsed(ResponseReasoningItem, item, where)
            reasoning = "".join(part.text for part in thought.content or []) or None
        else:
            raise bad_request(
                f"{where} has type {kind!r}: input items may be messages, function_call, function_call_output "
                "and reasoning",
                param=f"{where}.type",
                code="unsupported_input_item",
            )
    return messages


def _continues_turn(previous: Any) -> bool:
    """Whether an item is part of the assistant's turn a following function_call joins."""
    return isinstance(previous, dict) and (
        previous.get("type") == "function_call"
        or (previous.get("type", "message") == "message" and previous.get("role") == "assistant")
    )


def _message(item: dict[str, Any], where: str) -> ChatMessage:
    parsed = _parsed(_INPUT_MESSAGE, item, where)
    content = parsed.content if isinstance(parsed.content, str) else _text_of(parsed.content, f"{where}.content")
    return ChatMessage(role=parsed.role, content=content)


def _text_of(parts: list[Any], where: str) -> str:
    texts = []
    for k, part in enumerate(parts):
        kind = getattr(part, "type", None)
        if kind not in _TEXT_PARTS:
            raise bad_request(
                f"{where}[{k}] has type {kind!r}: only text content is supported",
                param=f"{where}[{k}].type",
                code="unsupported_content_type",
            )
        texts.append(part.refusal if kind == "refusal" else part.text)
    return "".join(texts)


def _parsed(model: Any, value: Any, where: str) -> Any:
    adapter = model if isinstance(model, TypeAdapter) else TypeAdapter(model)
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        field = ".".join(str(p) for p in first["loc"] if not str(p)[:1].isupper() and "[" not in str(p))
        param = f"{where}.{field}" if field else where
        raise bad_request(f"Invalid {where}: {first['msg']} ({param})", param=param) from None
