"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API on the chat pipeline.

A request is read into a chat conversation (protocol.responses), planned and generated like a chat
completion (one choice), and its output, read by the same reasoning and tool-call parsers, comes
back as output items: a `reasoning` item, a `message` with output_text, `function_call` items.
Streamed, the events follow OpenAI's sequence (response.created, response.in_progress, per item
output_item.added / content_part.added / deltas / done, then response.completed, whose status is
"incomplete" when max_output_tokens cut it, as vLLM sends it); the final response holds exactly the
streamed items.

Responses with `store` (the default) are kept in memory, bounded by --responses-store-memory
(least recently used first out), for `previous_response_id` and GET / DELETE; they live as long as
the server process.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from openai.types.responses import (
    FunctionTool,
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseErrorEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextConfig,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_content_part_added_event import PartReasoningText
from openai.types.responses.response_content_part_done_event import PartReasoningText as DonePartReasoningText
from openai.types.responses.response_reasoning_item import Content as ReasoningContent
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from openai.types.responses.tool_choice_function import ToolChoiceFunction
from pydantic import BaseModel

from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.generation import Generation, raise_on_failure
from tokenmill.server.openai_api import Job, final_outputs, plan_chat, usage_of
from tokenmill.server.output import OutputPiece, OutputReader, ParsedOutput
from tokenmill.server.protocol import ChatMessage, FunctionCall, MessageToolCall, parse_request
from tokenmill.server.protocol.base import renamed
from tokenmill.server.protocol.responses import FunctionToolSpec, ResponsesRequest, input_messages
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.state import RequestRecord, ServerState


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def stored_response(state: ServerState, response_id: str) -> str:
    stored = state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.body


def delete_response(state: ServerState, response_id: str) -> dict[str, Any]:
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"No response with id {response_id!r} is stored here.", code="not_found", param="response_id")


# ---------------------------------------------------------------------------------------------- the job


@dataclass
class ResponsesJob(Job):
    request: ResponsesRequest | None = None
    tools: list[FunctionToolSpec] = field(default_factory=list)
    new_reader: Callable[[], OutputReader] | None = None
    conversation: list[ChatMessage] = field(default_factory=list)  # the input, without the instructions
    store: ResponseStore | None = None
    count_tokens: Callable[[str], int] | None = None  # for the usage's reasoning_tokens

    async def full(self, gen: Generation) -> Response:
        o = (await final_outputs(gen))[0].outputs[0]
        parsed = self.new_reader().whole(o.text) if self.new_reader is not None else ParsedOutput(None, o.text, [])
        return await self._finished(_items_of(parsed), o.finish_reason, gen.record)

    async def chunks(self, gen: Generation) -> AsyncIterator[BaseModel]:
        events = _EventStream()
        yield events.number(
            ResponseCreatedEvent(type="response.created", sequence_number=0, response=self._response("in_progress", []))
        )
        yield events.number(
            ResponseInProgressEvent(
                type="response.in_progress", sequence_number=0, response=self._response("in_progress", [])
            )
        )
        reader = self.new_reader() if self.new_reader is not None else None
        reason = None
        async for _, out in gen.outputs():
            raise_on_failure(out)
            o = out.outputs[0]
            reason = o.finish_reason or reason
            finished = o.finish_reason is not None
            piece = reader.step(o.text_delta, finished) if reader is not None else OutputPiece(content=o.text_delta)
            for event in events.add(piece):
                yield event
        for event in events.close() if events.items or events.open else events.empty_message():
            yield event
        response = await self._finished(events.items, reason, gen.record)
        # Also when the response is incomplete (its status says so), as vLLM: the openai SDK's stream
        # helper only finishes on response.completed.
        yield events.number(ResponseCompletedEvent(type="response.completed", sequence_number=0, response=response))

    def sse(self, event: BaseModel) -> str:
        return f"event: {getattr(event, 'type', 'message')}\ndata: {event.model_dump_json(exclude_none=True)}\n\n"

    def sse_error(self, err: APIError) -> str:
        event = ResponseErrorEvent(type="error", sequence_number=0, code=err.code, message=err.message, param=err.param)
        return self.sse(event)

    sse_end = ""

    async def _finished(self, items: list[Any], finish_reason: str | None, record: RequestRecord) -> Response:
        incomplete = finish_reason == "length"
        usage = usage_of(record)
        thought = "".join(c.text for item in items if item.type == "reasoning" for c in item.content or [])
        reasoning_tokens = (
            await asyncio.to_thread(self.count_tokens, thought) if thought and self.count_tokens is not None else 0
        )
        response = self._response(
            "incomplete" if incomplete else "completed",
            items,
            usage=ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0,
                    cache_write_tokens=0,
                ),
                output_tokens=usage.completion_tokens,
                output_tokens_details=OutputTokensDetails(
                    reasoning_tokens=min(reasoning_tokens, usage.completion_tokens)
                ),
                total_tokens=usage.total_tokens,
            ),
            incomplete=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        )
        if self.store is not None:
            body = response.model_dump_json(exclude_none=True)
            self.store.put(self.response_id, body, [*self.conversation, *_as_messages(items)])
        return response

    def _response(
        self, status: str, output: list[Any], usage: ResponseUsage | None = None, incomplete: Any = None
    ) -> Response:
        req = self.request
        assert req is not None
        choice = req.chat_tool_choice()
        text = (
            req.text.model_dump(by_alias=True, exclude_none=True)
            if req.text is not None
            else {"format": {"type": "text"}}
        )
        return Response(
            id=self.response_id,
            object="response",
            created_at=self.created,
            model=self.model,
            status=status,  # type: ignore[arg-type]
            output=output,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            temperature=req.temperature,
            top_p=req.top_p,
            tool_choice=ToolChoiceFunction(type="function", name=choice.function.name)
            if choice is not None and not isinstance(choice, str)
            else (choice or "auto"),
            tools=[
                FunctionTool(
                    type="function", name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                )
                for t in self.tools
            ],
            text=ResponseTextConfig.model_validate(text),
            background=False,
            usage=usage,
            incomplete_details=incomplete,
            completed_at=time.time() if status != "in_progress" else None,
            error=None,
        )


def _message(text: str, item_id: str | None = None, status: str = "completed") -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id=item_id or _id("msg"),
        type="message",
        role="assistant",
        status=status,  # type: ignore[arg-type]
        content=[ResponseOutputText(type="output_text", text=text, annotations=[], logprobs=[])]
        if status == "completed"
        else [],
    )


def _reasoning(text: str | None, item_id: str | None = None) -> ResponseReasoningItem:
    if text is None:
        return ResponseReasoningItem(id=item_id or _id("rs"), type="reasoning", summary=[], status="in_progress")
    return ResponseReasoningItem(
        id=item_id or _id("rs"),
        type="reasoning",
        summary=[],
        content=[ReasoningContent(type="reasoning_text", text=text)],
        status="completed",
    )


def _function_call(
    name: str, arguments: str, item_id: str | None = None, call_id: str | None = None, done: bool = True
) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        id=item_id or _id("fc"),
        call_id=call_id or _id("call"),
        type="function_call",
        name=name,
        arguments=arguments,
        status="completed" if done else "in_progress",
    )


def _items_of(parsed: ParsedOutput) -> list[Any]:
    items: list[Any] = []
    if parsed.reasoning is not None:
        items.append(_reasoning(parsed.reasoning))
    if parsed.content or (not parsed.calls and parsed.reasoning is None):
        items.append(_message(parsed.content or ""))
    items += [_function_call(c.name, c.arguments) for c in parsed.calls]
    return items


def _as_messages(items: list[Any]) -> list[ChatMessage]:
    """Output items as the assistant turn a later request continues from."""
    text = "".join(part.text for item in items if item.type == "message" for part in item.content)
    thought = "".join(c.text for item in items if item.type == "reasoning" for c in item.content or [])
    calls = [
        MessageToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
        for item in items
        if item.type == "function_call"
    ]
    return [
        ChatMessage(role="assistant", content=text or None, tool_calls=calls or None, reasoning_content=thought or None)
    ]


class _EventStream:
    """Output pieces -> Responses stream events, numbered in order; `items` are the finished items."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._sequence = 0
        self._kind: str | None = None  # the open item: "reasoning", "message" or "function_call"
        self._item_id = ""
        self._text = ""
        self._call: tuple[str, str] = ("", "")  # the open call's call_id and name

    def number(self, event: Any) -> Any:
        event.sequence_number = self._sequence
        self._sequence += 1
        return event

    def add(self, piece: OutputPiece) -> list[Any]:
        events: list[Any] = []
        if piece.reasoning:
            events += self._open("reasoning")
            self._text += piece.reasoning
            events.append(
                self._event(
                    ResponseReasoningTextDeltaEvent,
                    type="response.reasoning_text.delta",
                    content_index=0,
                    delta=piece.reasoning,
                )
            )
        if piece.content:
            events += self._open("message")
            self._text += piece.content
            events.append(
                self._event(
                    ResponseTextDeltaEvent,
                    type="response.output_text.delta",
                    content_index=0,
                    delta=piece.content,
                    logprobs=[],
                )
            )
        for call in piece.calls:
            if call.name is not None:
                events += self.close()
                self._kind, self._item_id, self._text = "function_call", _id("fc"), ""
                self._call = (_id("call"), call.name)
                item = _function_call(call.name, "", self._item_id, self._call[0], done=False)
                events.append(self._added(item))
            if call.arguments:
                self._text += call.arguments
                events.append(
                    self._event(
                        ResponseFunctionCallArgumentsDeltaEvent,
                        type="response.function_call_arguments.delta",
                        delta=call.arguments,
                    )
                )
        return [self.number(e) for e in events]

    @property
    def open(self) -> bool:
        return self._kind is not None

    def empty_message(self) -> list[Any]:
        """An output of nothing: an empty message, as OpenAI always answers with one."""
        return self._open("message") + self.close()

    def close(self) -> list[Any]:
        """Finish the open item (its done events)."""
        events: list[Any] = []
        item: Any
        if self._kind == "reasoning":
            item = _reasoning(self._text, self._item_id)
            events += [
                self._event(
                    ResponseReasoningTextDoneEvent,
                    type="response.reasoning_text.done",
                    content_index=0,
                    text=self._text,
                ),
                self._event(
                    ResponseContentPartDoneEvent,
                    type="response.content_part.done",
                    content_index=0,
                    part=DonePartReasoningText(type="reasoning_text", text=self._text),
                ),
            ]
        elif self._kind == "message":
            item = _message(self._text, self._item_id)
            events += [
                self._event(
                    ResponseTextDoneEvent,
                    type="response.output_text.done",
                    content_index=0,
                    text=self._text,
                    logprobs=[],
                ),
                self._event(
                    ResponseContentPartDoneEvent,
                    type="response.content_part.done",
                    content_index=0,
                    part=item.content[0],
                ),
            ]
        elif self._kind == "function_call":
            item = _function_call(self._call[1], self._text, self._item_id, self._call[0])
            events.append(
                self._event(
                    ResponseFunctionCallArgumentsDoneEvent,
                    type="response.function_call_arguments.done",
                    arguments=self._text,
                )
            )
        else:
            return []
        events.append(
            ResponseOutputItemDoneEvent(
                type="response.output_item.done", sequence_number=0, output_index=len(self.items), item=item
            )
        )
        self.items.append(item)
        self._kind = None
        return [self.number(e) for e in events]

    def _open(self, kind: str) -> list[Any]:
        if self._kind == kind:
            return []
        events = self.close()
        self._kind, self._item_id, self._text = kind, _id("rs" if kind == "reasoning" else "msg"), ""
        if kind == "reasoning":
            part: Any = PartReasoningText(type="reasoning_text", text="")
            item: Any = _reasoning(None, self._item_id)
        else:
            part = ResponseOutputText(type="output_text", text="", annotations=[], logprobs=[])
            item = _message("", self._item_id, status="in_progress")
        return events + [
            self.number(self._added(item)),
            self.number(
                self._event(
                    ResponseContentPartAddedEvent, type="response.content_part.added", content_index=0, part=part
                )
            ),
        ]

    def _added(self, item: Any) -> ResponseOutputItemAddedEvent:
        return ResponseOutputItemAddedEvent(
            type="response.output_item.added", sequence_number=0, output_index=len(self.items), item=item
        )

    def _event(self, cls: type, **fields: Any) -> Any:
        return cls(sequence_number=0, item_id=self._item_id, output_index=len(self.items), **fields)


# ---------------------------------------------------------------------------------------------- prepare

# The chat request's field names in errors -> the Responses request's.
CHAT_NAMES = [
    (r"response_format\.json_schema\.schema|response_format", "text.format"),
    (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"max_completion_tokens|max_tokens", "max_output_tokens"),
    (r"\bmessages\b", "input"),
]


async def prepare_responses(state: ServerState, record: RequestRecord, raw: bytes) -> ResponsesJob:
    req: ResponsesRequest = parse_request(ResponsesRequest, raw)
    req.check_supported()
    store = state.responses
    history: list[ChatMessage] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id)
        if previous is None:
            raise bad_request(
                f"Previous response with id {req.previous_response_id!r} not found (responses are kept in this "
                "server's memory while they fit --responses-store-memory, with store=true).",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = [m.model_copy(deep=True) for m in previous.conversation]
    tools = req.read_tools()
    messages = input_messages(req, history)
    try:
        plan = await plan_chat(state, record, req.chat_request(messages, tools))
    except APIError as err:
        raise renamed(err, CHAT_NAMES) from None
    tokenizer = state.engine.input_processor.tokenizer
    return ResponsesJob(
        prompts=[plan.prompt],
        params=plan.params,
        stream=req.stream,
        include_usage=False,
        model=plan.model,
        response_id=_id("resp"),
        request=req,
        tools=tools,
        new_reader=plan.new_reader,
        conversation=messages[1:] if req.instructions else messages,
        store=store if req.store is not False and store.capacity > 0 else None,
        count_tokens=(lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
        if tokenizer is not None
        else None,
    )
