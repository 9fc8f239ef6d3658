"""--reasoning-parser qwen3 against a real `tokenmill serve`: a thinking model's section comes back as
reasoning_content / reasoning in chat (streamed as reasoning deltas), as a reasoning item in the
Responses API and a thinking block in the Messages API; tool calls and structured outputs apply
after it; chat_template_kwargs {"enable_thinking": false} leaves nothing to split.

The server runs a scripted tiny GPT-2 (tool_models.scripted_turns_model) with a Qwen3-style template
that answers each test conversation with a scripted thought and answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.utils.server import ServerProcess, openai_client, sse_events
from tests.utils.tool_models import QWEN3_TEMPLATE, scripted_turns_model
from tokenmill.engine.input_processor import render_chat
from tokenmill.server.protocol import ChatCompletionRequest

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = "What is the weather in Paris?"
THOUGHT = "\nThe user wants the weather in Paris.\n"
CALL_ARGUMENTS = {"city": "Paris"}
CALL_REPLY = (
    f"<think>{THOUGHT}</think>\n\n<tool_call>\n"
    f"{json.dumps({'name': 'get_weather', 'arguments': CALL_ARGUMENTS})}\n</tool_call>"
)
CITY_QUESTION = "Describe Paris as JSON."
CITY_THOUGHT = "\nA name and a population.\n"
CITY = {"name": "Paris", "population": 2100000}
QUICK_QUESTION = "Answer at once, without thinking about it at all: " * 4 + "hello?"
QUICK = "Hello!"
CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "City",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
            "required": ["name", "population"],
            "additionalProperties": False,
        },
    },
}
MODEL = "scripted-thinker"


def _turn(tokenizer, question: str, tools: list[dict] | None, **kwargs) -> int:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": question}], "tools": tools}
    )
    return len(render_chat(tokenizer, request.template_messages(), tools=request.template_tools(), **kwargs))


@pytest.fixture(scope="module")
def thinker(default_model_dir: Path, tmp_path_factory, server_log_dir: Path) -> Iterator[ServerProcess]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = QWEN3_TEMPLATE
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    turns = [
        (_turn(tokenizer, QUESTION, [WEATHER_TOOL]), CALL_REPLY),
        (_turn(tokenizer, CITY_QUESTION, None), f"<think>{CITY_THOUGHT}</think>\n\n{json.dumps(CITY)}"),
        (_turn(tokenizer, QUICK_QUESTION, None, **no_thinking), QUICK),
    ]
    model = scripted_turns_model(default_model_dir, tmp_path_factory.mktemp("thinker") / MODEL, QWEN3_TEMPLATE, turns)
    proc = ServerProcess(model, server_log_dir, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _chat(server: ServerProcess, **body) -> dict:
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_reasoning_then_tool_call_streamed_or_not(thinker: ServerProcess) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    choice = _chat(thinker, messages=messages, tools=[WEATHER_TOOL])["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT and message["content"] is None
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == CALL_ARGUMENTS and choice["finish_reason"] == "tool_calls"
    with httpx.stream(
        "POST",
        f"{thinker.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL], "stream": True},
        timeout=60,
    ) as r:
        deltas = [json.loads(e)["choices"][0]["delta"] for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.get("reasoning") or "" for d in deltas) == THOUGHT
    assert not "".join(d.get("content") or "" for d in deltas)  # no <think> or markup leaks into the answer
    arguments = "".join(t["function"].get("arguments") or "" for d in deltas for t in d.get("tool_calls") or [])
    assert json.loads(arguments) == CALL_ARGUMENTS
    # The reasoning streams before the call.
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert all(not d.get("reasoning") for d in deltas[first_call:])


def test_structured_output_applies_after_the_reasoning(thinker: ServerProcess) -> None:
    """response_format's grammar lets the thought come first: the scripted answer gets through as it
    is (a grammar holding the output to the schema from its first token would not let `<think>` out)."""
    message = _chat(thinker, messages=[{"role": "user", "content": CITY_QUESTION}], response_format=CITY_FORMAT)[
        "choices"
    ][0]["message"]
    assert message["reasoning_content"] == CITY_THOUGHT and json.loads(message["content"]) == CITY


def test_enable_thinking_false_leaves_no_reasoning(thinker: ServerProcess) -> None:
    body = _chat(
        thinker,
        messages=[{"role": "user", "content": QUICK_QUESTION}],
        chat_template_kwargs={"enable_thinking": False},
    )
    message = body["choices"][0]["message"]
    assert message["content"] == QUICK and "reasoning_content" not in message and "reasoning" not in message


def test_responses_reasoning_item(thinker: ServerProcess) -> None:
    client = openai_client(thinker)
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    response = client.responses.create(model=MODEL, input=QUESTION, tools=tools)
    reasoning, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert call.type == "function_call" and json.loads(call.arguments) == CALL_ARGUMENTS
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    with client.responses.stream(model=MODEL, input=QUESTION, tools=tools) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    parsed = client.responses.create(
        model=MODEL,
        input=CITY_QUESTION,
        text={"format": {"type": "json_schema", "name": "City", "schema": CITY_FORMAT["json_schema"]["schema"]}},
    )
    assert json.loads(parsed.output_text) == CITY and parsed.output[0].type == "reasoning"


def test_messages_thinking_block(thinker: ServerProcess) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=thinker.base_url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    message = client.messages.create(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": QUESTION}], tools=tools
    )
    thinking, use = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", THOUGHT)
    assert (use.type, use.input, message.stop_reason) == ("tool_use", CALL_ARGUMENTS, "tool_use")
    with client.messages.stream(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": QUESTION}], tools=tools
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"] and streamed.content[0].thinking == THOUGHT
