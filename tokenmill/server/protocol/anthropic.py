"""/v1/messages (Anthropic's Messages API): the request, read into a chat conversation, and the
response shapes. Text, tools (tool_use / tool_result blocks), system, stop_sequences, structured
outputs (`output_config.format`) and thinking blocks (with --reasoning-parser) are served; images,
documents and server tools (web search, code execution ...) are a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field

from tokenmill.server.errors import bad_request
from tokenmill.server.protocol.base import LenientModel, NullMeansDefault, build_request, ignored, validate_item
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

MAX_MESSAGES = 4096


class ContentBlock(LenientModel):
    """One block of a message: text, tool_use (an assistant's call), tool_result (the user's answer
    to one), thinking; other types are refused when the conversation is read."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = ignored("thinking blocks are not signed here")


class AnthropicMessage(LenientModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(LenientModel):
    name: Annotated[str, AfterValidator(check_function_name)]
    description: str | None = None
    # A JSON schema of type object, checked off the event loop with the chat request's tools.
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" (or absent); server tools have versioned types
    cache_control: dict[str, Any] | None = ignored("prefix caching is automatic")


class AnthropicToolChoice(LenientModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(LenientModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(LenientModel):
    format: OutputFormat | None = None
    effort: str | None = ignored()


class MessagesRequest(NullMeansDefault):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)  # checked per type (read_tools)
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    # Accepted, no effect here.
    metadata: dict[str, Any] | None = ignored()
    thinking: dict[str, Any] | None = ignored("the reasoning parser reads what the model writes")
    service_tier: str | None = ignored()
    container: Any = ignored()
    cache_control: dict[str, Any] | None = ignored("prefix caching is automatic")
    diagnostics: Any = ignored()
    inference_geo: str | None = ignored()
    speed: str | None = ignored()
    user_profile_id: str | None = ignored()
    workspace_id: str | None = ignored()

    def read_tools(self) -> list[AnthropicTool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind not in (None, "custom"):
                raise bad_request(
                    f"tools[{i}] has type {kind!r}: only custom tools (name, description, input_schema) are "
                    "supported, not Anthropic's server tools",
                    param=f"tools[{i}].type",
                    code="unsupported_tool_type",
                )
            tools.append(validate_item(AnthropicTool, tool, f"tools[{i}]"))
        return tools

    def chat_request(self, tools: list[AnthropicTool]) -> ChatCompletionRequest:
        """The same generation as a chat completions request."""
        choice: Any = None
        parallel = True
        if self.tool_choice is not None:
            parallel = not self.tool_choice.disable_parallel_tool_use
            kind = self.tool_choice.type
            if kind == "tool":
                if not self.tool_choice.name:
                    raise bad_request("tool_choice of type tool needs a name", param="tool_choice.name")
                choice = NamedToolChoice(type="function", function=NamedFunction(name=self.tool_choice.name))
            else:
                choice = {"any": "required"}.get(kind, kind)
        fmt = self.output_config.format if self.output_config is not None else None
        return build_request(
            ChatCompletionRequest,
            dict(
                model=self.model,
                messages=self.chat_messages(),
                max_completion_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                stop=self.stop_sequences,
                tools=[
                    ToolDefinition(
                        type="function",
                        function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema),
                    )
                    for t in tools
                ]
                or None,
                tool_choice=choice,
                parallel_tool_calls=parallel,
                response_format=ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=fmt.schema_))
                if fmt is not None
                else None,
                stream=self.stream,
            ),
        )

    def chat_messages(self) -> list[ChatMessage]:
        """System text first; a user turn's tool_result blocks become tool messages (before its
        text), an assistant turn's tool_use blocks its tool_calls and thinking blocks its reasoning."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _text(self.system, "system", ("text",))
            messages.append(ChatMessage(role="system", content=system))
        for i, message in enumerate(self.messages):
            where = f"messages[{i}].content"
            if isinstance(message.content, str):
                messages.append(ChatMessage(role=message.role, content=message.content))
            elif message.role == "user":
                messages += _user_turn(message.content, where)
            else:
                messages.append(_assistant_turn(message.content, where))
        if not any(m.role != "system" for m in messages):
            raise bad_request("messages hold no text or tool blocks", param="messages")
        return messages


def _user_turn(blocks: list[ContentBlock], where: str) -> list[ChatMessage]:
    messages = []
    texts = []
    for k, block in enumerate(blocks):
        if block.type == "tool_result":
            result = block.content if isinstance(block.content, str) or block.content is None else None
            if result is None:
                result = _text(block.content, f"{where}[{k}].content", ("text",))  # type: ignore[arg-type]
            messages.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=result))
        elif block.type == "text":
            texts.append(block.text or "")
        else:
            raise _unsupported(block, f"{where}[{k}]")
    if texts:
        messages.append(ChatMessage(role="user", content="".join(texts)))
    return messages


def _assistant_turn(blocks: list[ContentBlock], where: str) -> ChatMessage:
    texts, thoughts, calls = [], [], []
    for k, block in enumerate(blocks):
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thoughts.append(block.thinking or "")
        elif block.type == "redacted_thinking":
            continue
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise bad_request("a tool_use block needs an id and a name", param=f"{where}[{k}]")
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append(MessageToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=arguments)))
        else:
            raise _unsupported(block, f"{where}[{k}]")
    return ChatMessage(
        role="assistant",
        content="".join(texts) or None,
        tool_calls=calls or None,
        reasoning_content="".join(thoughts) or None,
    )


def _text(blocks: list[ContentBlock], where: str, kinds: tuple[str, ...]) -> str:
    texts = []
    for k, block in enumerate(blocks):
        if block.type not in kinds:
            raise _unsupported(block, f"{where}[{k}]")
        texts.append(block.text or "")
    return "".join(texts)


def _unsupported(block: ContentBlock, where: str) -> Exception:
    return bad_request(
        f"{where} is a {block.type!r} block: only text, tool_use, tool_result and thinking blocks are supported",
        param=f"{where}.type",
        code="unsupported_content_type",
    )


# ---------------------------------------------------------------------------------------------- response


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class AnthropicResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage
