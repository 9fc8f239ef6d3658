"""vLLM-compatible /tokenize and /detokenize, with the same tokenization and chat rendering as the
generation endpoints (so a client can count a prompt's tokens exactly as generation will)."""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic_core

from tokenmill.errors import InvalidRequest
from tokenmill.server.errors import bad_request, from_invalid_request
from tokenmill.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeResponse,
    check_tool_definitions,
    parse_request,
)
from tokenmill.server.state import ServerState


def _is_chat(raw: bytes) -> bool:
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        return False  # parse_request reports the JSON error
    return isinstance(body, dict) and "messages" in body


async def tokenize(state: ServerState, raw: bytes) -> TokenizeResponse:
    req: TokenizePromptRequest | TokenizeChatRequest = parse_request(
        TokenizeChatRequest if _is_chat(raw) else TokenizePromptRequest, raw
    )
    state.check_model(req.model)
    processor = state.engine.input_processor
    settings = state.settings
    if isinstance(req, TokenizeChatRequest):
        if req.add_special_tokens:
            raise bad_request(
                "add_special_tokens is not supported with messages: the chat template places the special tokens",
                param="add_special_tokens",
            )
        if req.tools:  # validating large parameter schemas takes a while: off the event loop
            await asyncio.to_thread(check_tool_definitions, req.tools)
        work: Any = asyncio.to_thread(
            processor.render_chat,
            req.template_messages(),
            tools=req.template_tools(),
            special_tokens_in_content=settings.allow_special_tokens_in_messages,
            **req.template_options(),
        )
    else:
        work = asyncio.to_thread(
            processor.tokenize,
            req.prompt,
            add_special_tokens=req.add_special_tokens,
            escape_special=settings.escape_special_tokens_in_prompts,
        )
    try:
        tokens = await work  # a 1 MiB prompt takes a while: off the event loop
    except InvalidRequest as exc:
        raise from_invalid_request(exc) from None
    strs = processor.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens, token_strs=strs)


async def detokenize(state: ServerState, raw: bytes) -> DetokenizeResponse:
    req: DetokenizeRequest = parse_request(DetokenizeRequest, raw)
    state.check_model(req.model)
    processor = state.engine.input_processor
    if processor.tokenizer is None:
        raise bad_request("this model has no tokenizer", param="tokens")
    vocab = processor.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise bad_request(f"tokens must be token ids in [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(processor.tokenizer.decode, req.tokens)
    return DetokenizeResponse(prompt=text)
