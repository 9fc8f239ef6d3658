"""/tokenize and /detokenize."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    Field,
)

from tokenmill.server.protocol.base import LenientModel
from tokenmill.server.protocol.chat import MAX_TOOLS, ChatMessage, ChatTemplateOptions, ToolDefinition


class TokenizePromptRequest(LenientModel):
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


class DetokenizeRequest(LenientModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
