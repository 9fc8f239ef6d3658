"""Agent frameworks against a real `tokenmill serve`, through the client libraries users run: a full
tool loop (call -> tool result -> final answer) with the openai SDK, LangChain, litellm, the OpenAI
Agents SDK (on the Responses API) and the anthropic SDK (on the Messages API); the Responses API's
own features (streamed events, previous_response_id, GET / DELETE, structured outputs with
`responses.parse`, refusals of what it cannot serve); continuous usage stats; unknown paths logged.

A random model cannot decide to call a tool, so the server runs a scripted tiny GPT-2 (see
tool_models.scripted_turns_model) with a Hermes tool template: every client renders the same two
prompts (the question with the weather tool; then the call and its result), and the model answers
the first with a call and the second with FINAL.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.utils.server import (
    ServerProcess,
    assert_openai_error,
    async_openai_client,
    openai_client,
    sse_events,
)
from tests.utils.tool_models import HERMES_TEMPLATE, scripted_turns_model
from tokenmill.engine.input_processor import render_chat
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.response_store import ResponseStore

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = "What is the weather in Paris?"
CALL_ARGUMENTS = {"city": "Paris"}
CALL = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': CALL_ARGUMENTS})}\n</tool_call>"
RESULT = "sunny, 21 degrees"
FINAL = "It is sunny and 21 degrees in Paris."
CITY_QUESTION = "Describe Paris as JSON."
CITY = {"name": "Paris", "population": 2100000}
MODEL = "scripted-agent"


def _turn(tokenizer, messages: list[dict], tools: list[dict] | None) -> int:
    """The length of the prompt the server renders for this chat request."""
    request = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})
    return len(render_chat(tokenizer, request.template_messages(), tools=request.template_tools()))


def _history(call_id: str = "call_1") -> list[dict]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGUMENTS)},
    }
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]


@pytest.fixture(scope="module")
def agent_server(default_model_dir: Path, tmp_path_factory, server_log_dir: Path) -> Iterator[ServerProcess]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    turns = [
        (_turn(tokenizer, [{"role": "user", "content": QUESTION}], [WEATHER_TOOL]), CALL),
        (_turn(tokenizer, _history(), [WEATHER_TOOL]), FINAL),
        (_turn(tokenizer, [{"role": "user", "content": CITY_QUESTION}], None), json.dumps(CITY)),
    ]
    model = scripted_turns_model(default_model_dir, tmp_path_factory.mktemp("agents") / MODEL, HERMES_TEMPLATE, turns)
    proc = ServerProcess(model, server_log_dir, "--max-num-seqs", "8", "--responses-store-memory", "1MiB")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


# ---------------------------------------------------------------------------------------------- tool loops


def test_openai_sdk_tool_loop(agent_server: ServerProcess) -> None:
    client = openai_client(agent_server)
    messages: list = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == CALL_ARGUMENTS
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert final.choices[0].message.content == FINAL and final.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == FINAL


def test_langchain_tool_loop(agent_server: ServerProcess) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=f"{agent_server.base_url}/v1", api_key="unused", model=MODEL, max_retries=0)
    bound = llm.bind_tools([WEATHER_TOOL])
    messages: list = [HumanMessage(QUESTION)]
    ai = bound.invoke(messages)
    (call,) = ai.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", CALL_ARGUMENTS)
    messages += [ai, ToolMessage(RESULT, tool_call_id=call["id"])]
    assert bound.invoke(messages).content == FINAL


def test_langchain_tool_loop_on_the_responses_api(agent_server: ServerProcess) -> None:
    """LangChain's use_responses_api=True: the same loop as function_call / function_call_output items."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{agent_server.base_url}/v1", api_key="unused", model=MODEL, max_retries=0, use_responses_api=True
    )
    bound = llm.bind_tools([WEATHER_TOOL])
    messages: list = [HumanMessage(QUESTION)]
    ai = bound.invoke(messages)
    (call,) = ai.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", CALL_ARGUMENTS)
    messages += [ai, ToolMessage(RESULT, tool_call_id=call["id"])]
    assert bound.invoke(messages).text == FINAL


def test_litellm_tool_loop(agent_server: ServerProcess) -> None:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of litellm's price list
    import litellm

    options = dict(model=f"openai/{MODEL}", api_base=f"{agent_server.base_url}/v1", api_key="unused", num_retries=0)
    messages: list = [{"role": "user", "content": QUESTION}]
    first = litellm.completion(messages=messages, tools=[WEATHER_TOOL], **options)
    message = first.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL_ARGUMENTS
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = litellm.completion(messages=messages, tools=[WEATHER_TOOL], **options)
    assert final.choices[0].message.content == FINAL


def test_openai_agents_sdk_tool_loop(agent_server: ServerProcess) -> None:
    """Runner.run_sync with a function tool: the default model speaks the Responses API."""
    from agents import Agent, FunctionTool, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # (traces go to OpenAI by default)
    calls = []

    async def get_weather(context, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return RESULT

    tool = FunctionTool(
        name="get_weather",
        description=WEATHER_TOOL["function"]["description"],
        params_json_schema=WEATHER_TOOL["function"]["parameters"],
        on_invoke_tool=get_weather,
        strict_json_schema=False,
    )
    model = OpenAIResponsesModel(model=MODEL, openai_client=async_openai_client(agent_server))
    result = Runner.run_sync(Agent(name="weather", model=model, tools=[tool]), QUESTION)
    assert calls == [CALL_ARGUMENTS] and result.final_output == FINAL


def test_anthropic_sdk_tool_loop(agent_server: ServerProcess) -> None:
    """Messages API: tool_use, then tool_result -> the answer; streamed blocks add up to the message."""
    import anthropic

    client = anthropic.Anthropic(base_url=agent_server.base_url, api_key="unused", max_retries=0)
    function = WEATHER_TOOL["function"]
    tools = [{"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}]
    messages: list = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=tools)
    (use,) = first.content
    assert (use.type, use.name, use.input, first.stop_reason) == ("tool_use", "get_weather", CALL_ARGUMENTS, "tool_use")
    assert use.id.startswith("toolu_") and first.usage.output_tokens > 0 and first.usage.input_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=200, messages=messages, tools=tools) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "get_weather", CALL_ARGUMENTS)]
    assert streamed.stop_reason == "tool_use"
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    final = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=tools)
    assert [(b.type, b.text) for b in final.content] == [("text", FINAL)] and final.stop_reason == "end_turn"
    cut = client.messages.create(model=MODEL, max_tokens=3, messages=messages, tools=tools)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


# ---------------------------------------------------------------------------------------------- Responses API


def test_responses_function_call_loop_with_previous_response_id(agent_server: ServerProcess) -> None:
    """A function_call item, then its function_call_output continuing the stored response; the
    stored response is retrievable and deletable; with store=false nothing is kept."""
    client = openai_client(agent_server)
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    first = client.responses.create(model=MODEL, input=QUESTION, tools=tools)
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call",
        "get_weather",
        CALL_ARGUMENTS,
        "completed",
    )
    assert first.status == "completed" and first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    final = client.responses.create(model=MODEL, previous_response_id=first.id, input=[output], tools=tools)
    assert final.output_text == FINAL and final.previous_response_id == first.id
    # The same turn sent as items, without the store.
    items = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), output]
    assert client.responses.create(model=MODEL, input=items, tools=tools, store=False).output_text == FINAL
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    client.responses.delete(first.id)
    for gone in (first.id, "resp_unknown"):
        with pytest.raises(Exception) as exc:
            client.responses.retrieve(gone)
        assert exc.value.status_code == 404
    unstored = client.responses.create(model=MODEL, input=QUESTION, tools=tools, store=False)
    assert httpx.get(f"{agent_server.base_url}/v1/responses/{unstored.id}", timeout=60).status_code == 404
    err = assert_openai_error(
        httpx.post(
            f"{agent_server.base_url}/v1/responses",
            json={"input": "x", "previous_response_id": unstored.id},
            timeout=60,
        ),
        400,
        "previous_response_not_found",
    )
    assert err["param"] == "previous_response_id"


def test_responses_stream_events_in_order(agent_server: ServerProcess) -> None:
    """The openai SDK's stream helper (which checks the event sequence) rebuilds the same response;
    events are numbered from 0 and follow OpenAI's order for text and for a function call."""
    client = openai_client(agent_server)
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    with client.responses.stream(model=MODEL, input=QUESTION, tools=tools) as stream:
        events = list(stream)
        response = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas and json.loads("".join(deltas)) == CALL_ARGUMENTS
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (call,) = response.output
    assert call.type == "function_call" and json.loads(call.arguments) == CALL_ARGUMENTS
    history = [{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True)]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": RESULT})
    with client.responses.stream(model=MODEL, input=history, tools=tools) as stream:
        kinds = [e.type for e in stream]
        text = stream.get_final_response().output_text
    assert text == FINAL
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * kinds.count("response.output_text.delta"),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_responses_parse_structured_output(agent_server: ServerProcess) -> None:
    """client.responses.parse with a pydantic model: text.format json_schema is enforced and parsed."""
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        population: int

    parsed = openai_client(agent_server).responses.parse(model=MODEL, input=CITY_QUESTION, text_format=City)
    assert parsed.output_parsed == City(**CITY)


# A valid parameters schema over the 64 KiB limit of one function's.
BIG_PARAMETERS = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "description": "d" * 60} for i in range(1000)},
}


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_tool_type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["x"]}]}, "tools[0].type", "unsupported_tool_type"),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools[0].type", "unsupported_tool_type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name", None),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools[0].parameters", None),
        (  # checked off the event loop with the chat request's tools: the same size limits
            {"tools": [{"type": "function", "name": "f", "parameters": BIG_PARAMETERS}]},
            "tools[0].parameters",
            "tool_too_large",
        ),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type", "unsupported_input_item"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x", "detail": "auto"}]}]},
            "input[0].content[0].type",
            "unsupported_content_type",
        ),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice", None),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}}, "text.format", None),
        ({"input": []}, "input", None),
    ],
)
def test_responses_refuses_what_it_cannot_serve(server: ServerProcess, body: dict, param: str, code: str) -> None:
    err = assert_openai_error(
        httpx.post(f"{server.base_url}/v1/responses", json={"input": "Hi", **body}, timeout=60), 400, code
    )
    assert err["param"] == param, err


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
            "messages[0].content[0].type",
            "unsupported_content_type",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "unsupported_tool_type"),
        ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema", None),
        ({"tools": [{"name": "f", "input_schema": BIG_PARAMETERS}]}, "tools[0].input_schema", "tool_too_large"),
        ({"messages": [{"role": "user", "content": []}]}, "messages", None),
        ({"stop_sequences": [""]}, "stop_sequences", None),
        ({"max_tokens": 0}, "max_tokens", None),
        (
            {"tool_choice": {"type": "tool"}, "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
            "tool_choice.name",
            None,
        ),
    ],
)
def test_messages_refuses_what_it_cannot_serve(server: ServerProcess, body: dict, param: str, code: str) -> None:
    request = {"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], **body}
    err = assert_openai_error(httpx.post(f"{server.base_url}/v1/messages", json=request, timeout=60), 400, code)
    assert err["param"] == param, err


@pytest.mark.unit
def test_every_sdk_request_field_is_known() -> None:
    """Each field the installed SDKs can send is read, accepted as having no effect, or refused by
    name: none is an unknown field."""
    from anthropic.types.message_create_params import MessageCreateParamsBase
    from openai.types.responses.response_create_params import ResponseCreateParamsBase

    from tokenmill.server.protocol.anthropic import MessagesRequest
    from tokenmill.server.protocol.responses import ResponsesRequest

    assert set(ResponseCreateParamsBase.__annotations__) <= set(ResponsesRequest.model_fields)
    assert set(MessageCreateParamsBase.__annotations__) <= set(MessagesRequest.model_fields)


@pytest.mark.unit
def test_responses_input_limits_count_items_not_characters() -> None:
    from tokenmill.server.errors import APIError
    from tokenmill.server.protocol import parse_request
    from tokenmill.server.protocol.responses import MAX_INPUT_ITEMS, ResponsesRequest

    long_text = parse_request(ResponsesRequest, json.dumps({"input": "a" * (MAX_INPUT_ITEMS + 1)}).encode())
    assert len(long_text.input) == MAX_INPUT_ITEMS + 1
    items = [{"role": "user", "content": "a"}] * (MAX_INPUT_ITEMS + 1)
    with pytest.raises(APIError) as exc:
        parse_request(ResponsesRequest, json.dumps({"input": items}).encode())
    assert exc.value.param == "input"


@pytest.mark.unit
def test_response_store_is_bounded_least_recently_used_first() -> None:
    from tokenmill.server.protocol import ChatMessage

    turn = [ChatMessage(role="user", content="hi")]
    store = ResponseStore(capacity=3 * (60 + len(turn[0].model_dump_json())) + 10)  # room for three
    for name in ("a", "b", "c"):
        store.put(name, "x" * 60, turn)
    assert store.get("a") is not None  # now the most recently used
    store.put("d", "x" * 60, turn)
    assert [n for n in "abcd" if store.get(n) is not None] == ["a", "c", "d"]
    store.put("huge", "x" * 1000, turn)  # larger than the store: not kept, nothing evicted
    assert store.get("huge") is None and store.get("a") is not None
    assert store.delete("a") and not store.delete("a")


# ---------------------------------------------------------------------------------------------- small ones


def test_continuous_usage_stats_on_every_chunk(server: ServerProcess) -> None:
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far."""
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        timeout=60,
    ) as r:
        chunks = [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 5
    assert {u["prompt_tokens"] for u in usages} == {usages[0]["prompt_tokens"]}
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


def test_unknown_paths_are_logged_with_method_and_path(server: ServerProcess) -> None:
    assert httpx.post(f"{server.base_url}/v1/not/here", json={}, timeout=60).status_code == 404
    logged = [r for r in server.log_records() if r.get("msg") == "request to an unknown path"]
    assert {"level": "info", "method": "POST", "path": "/v1/not/here"}.items() <= logged[-1].items()
