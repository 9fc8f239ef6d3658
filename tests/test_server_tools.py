"""Tool calling against a real `tokenmill serve`: tool definitions and tool-call history reach the
model through its chat template, bad tool definitions are 400s naming the field, tool_choice
"auto" reads calls with the parser picked from the chat template, and streamed tool-call deltas
add up to the non-streamed calls.

The tiny random model cannot decide to call a tool, so the parsers' behaviour on realistic model
outputs is covered in test_tool_parsers.py; here the server serves a tiny model whose tokenizer
has a Hermes (Qwen 2.5-style) tool template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server_fixtures import (  # noqa: F401 - *_fixture are pytest fixtures
    ServerProcess,
    assert_openai_error,
    openai_client,
    server_fixture,
    server_log_dir_fixture,
    sse_events,
)
from tokenmill.server.settings import ServerSettings
from tool_templates import HERMES_TEMPLATE, with_chat_template

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "sunny, 21 degrees"},
]


@pytest.fixture(scope="module")
def hermes_server(tiny_model_dir: Path, tmp_path_factory, server_log_dir: Path) -> Iterator[ServerProcess]:
    model = with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("hermes") / "tiny-hermes", HERMES_TEMPLATE)
    proc = ServerProcess(model, server_log_dir, "--max-num-seqs", "8")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60.0)


def chat(server: ServerProcess, **body) -> dict:
    r = post(server, "/v1/chat/completions", {"max_tokens": 8, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream_chat(server: ServerProcess, **body) -> list[dict]:
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", timeout=60.0,
                      json={"max_tokens": 8, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]


def rendered(server: ServerProcess, **body) -> str:
    """The prompt text a chat request renders to (vLLM's /tokenize, then /detokenize)."""
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    return post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]


def test_parser_picked_from_the_chat_template(hermes_server: ServerProcess, server: ServerProcess) -> None:
    """Startup says which parser reads tool_choice "auto": hermes for a <tool_call> template, none (and
    why) for SmolLM2's template; a bad --tool-call-parser is a one-line error."""
    picked = [r for r in hermes_server.log_records() if "tool-call parser" in r.get("msg", "")]
    assert [r.get("tool_call_parser") for r in picked] == ["hermes"], picked
    assert any("no tool-call parser for this chat template" in r.get("msg", "") for r in server.log_records())
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerSettings(tool_call_parser="xml")


def test_tools_and_tool_history_are_rendered_by_the_chat_template(hermes_server: ServerProcess) -> None:
    """The tool definitions appear in the prompt (also with tool_choice "none"); an assistant message
    with tool_calls and null content, and the tool's answer, render as the template writes them, with
    the arguments as an object; the chat request is charged exactly that prompt."""
    bare = rendered(hermes_server, messages=ASK)
    with_tools = rendered(hermes_server, messages=ASK, tools=[WEATHER_TOOL, SEARCH_TOOL])
    assert "<tools>" not in bare and "<tools>" in with_tools
    assert json.dumps(WEATHER_TOOL) in with_tools and json.dumps(SEARCH_TOOL) in with_tools
    history = rendered(hermes_server, messages=HISTORY, tools=[WEATHER_TOOL])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call><|im_end|>\n') in history
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 degrees\n</tool_response><|im_end|>\n" in history
    assert history.endswith("<|im_start|>assistant\n")
    n_tokens = post(hermes_server, "/tokenize", {"messages": HISTORY, "tools": [WEATHER_TOOL]}).json()["count"]
    for choice in ("auto", "none"):
        body = chat(hermes_server, messages=HISTORY, tools=[WEATHER_TOOL], tool_choice=choice)
        assert body["usage"]["prompt_tokens"] == n_tokens


def test_tool_history_through_the_openai_client(hermes_server: ServerProcess) -> None:
    """The official client's message types (assistant tool_calls, tool results) are accepted."""
    client = openai_client(hermes_server)
    resp = client.chat.completions.create(model="tiny-hermes", messages=HISTORY, tools=[WEATHER_TOOL],
                                          max_tokens=4, temperature=0, parallel_tool_calls=False)
    assert resp.choices[0].message.role == "assistant" and resp.usage.completion_tokens == 4


def test_auto_output_without_a_call_is_the_text_streamed_or_not(hermes_server: ServerProcess) -> None:
    """With tool_choice "auto" the output goes through the Hermes parser; the random model writes no
    call, so the message is exactly the text tool_choice "none" gets (nothing held back or lost),
    and the stream carries the same text."""
    base = dict(messages=ASK, tools=[WEATHER_TOOL], max_tokens=12)
    plain = chat(hermes_server, tool_choice="none", **base)["choices"][0]
    auto = chat(hermes_server, **base)["choices"][0]
    assert plain["message"]["content"] and auto == plain and auto["message"]["tool_calls"] is None
    chunks = stream_chat(hermes_server, **base)
    deltas = [c["choices"][0] for c in chunks]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == plain["message"]["content"]
    assert deltas[-1]["finish_reason"] == plain["finish_reason"]
    assert not any(d["delta"].get("tool_calls") for d in deltas)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "strng"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "search"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                               "function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": 5, "content": "x"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_requests_are_400s_naming_the_field(hermes_server: ServerProcess, body: dict, param: str) -> None:
    err = assert_openai_error(post(hermes_server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, **body}), 400)
    assert err["param"] == param, err
