"""Tool calling against a real `tokenmill serve`: tool definitions and tool-call history reach the
model through its chat template, bad tool definitions are 400s naming the field, tool_choice
"auto" reads calls with the parser picked from the chat template, and streamed tool-call deltas
add up to the non-streamed calls.

A random model cannot decide to call a tool, so the server runs a scripted tiny GPT-2 (see
tool_models.scripted_model) with a Hermes (Qwen 2.5-style) tool template, which answers the test
conversation with text and two <tool_call>s and anything else with whatever its weights give.
tool_choice "required" and named functions are enforced with structured outputs, whatever the
model and its template: the tiny random Llama (SmolLM2's template, no parser) is made to call.
The parsers' edge cases (malformed calls, every split of the stream) are in test_tool_parsers.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.utils.server import ServerProcess, assert_openai_error, model_id, openai_client, running_server, sse_events
from tests.utils.tool_models import HERMES_TEMPLATE, scripted_model
from tokenmill.engine.input_processor import render_chat
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.settings import ServerSettings

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def function_with_properties(name: str, count: int) -> dict:
    """A valid tool whose parameters schema is about 60 bytes of JSON per property."""
    properties = {f"p{i}": {"type": "string", "description": "d" * 30} for i in range(count)}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc123",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_abc123", "content": "sunny, 21 degrees"},
]


# What the scripted model answers to ASK with tools=[WEATHER_TOOL, SEARCH_TOOL]: text, then two calls.
REPLY_TEXT = "Let me check both."
REPLY_CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("search", {"query": 'events in Paris "today"', "limit": 3}),
]
REPLY = (
    REPLY_TEXT
    + "\n"
    + "\n".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>" for name, args in REPLY_CALLS
    )
)
MODEL = "scripted-hermes"


@pytest.fixture(scope="module")
def tool_server(default_model_dir: Path, tmp_path_factory, server_log_dir: Path) -> Iterator[ServerProcess]:
    """A model with a Hermes tool template that answers ASK (with both tools offered) by REPLY,
    rendered exactly as the server renders that request."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = HERMES_TEMPLATE
    request = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER_TOOL, SEARCH_TOOL]})
    prompt = render_chat(tokenizer, request.template_messages(), tools=request.template_tools())
    model = scripted_model(default_model_dir, tmp_path_factory.mktemp("tools") / MODEL, HERMES_TEMPLATE, prompt, REPLY)
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
    with httpx.stream(
        "POST",
        f"{server.base_url}/v1/chat/completions",
        timeout=60.0,
        json={"max_tokens": 8, "temperature": 0, "stream": True, **body},
    ) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(e) for e in sse_events(r.iter_lines()) if e != "[DONE]"]


def rendered(server: ServerProcess, **body) -> str:
    """The prompt text a chat request renders to (vLLM's /tokenize, then /detokenize)."""
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    return post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]


def test_parser_picked_from_the_chat_template(tool_server: ServerProcess, server: ServerProcess) -> None:
    """Startup says which parser reads tool_choice "auto": hermes for a <tool_call> template, none (and
    why) for SmolLM2's template; a bad --tool-call-parser is a one-line error."""
    picked = [r for r in tool_server.log_records() if "tool-call parser" in r.get("msg", "")]
    assert [r.get("tool_call_parser") for r in picked] == ["hermes"], picked
    assert any("no tool-call parser for this chat template" in r.get("msg", "") for r in server.log_records())
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ServerSettings(tool_call_parser="xml")


def test_tools_and_tool_history_are_rendered_by_the_chat_template(tool_server: ServerProcess) -> None:
    """The tool definitions appear in the prompt (also with tool_choice "none"); an assistant message
    with tool_calls and null content, and the tool's answer, render as the template writes them, with
    the arguments as an object; the chat request is charged exactly that prompt."""
    bare = rendered(tool_server, messages=ASK)
    with_tools = rendered(tool_server, messages=ASK, tools=[WEATHER_TOOL, SEARCH_TOOL])
    assert "<tools>" not in bare and "<tools>" in with_tools
    assert json.dumps(WEATHER_TOOL) in with_tools and json.dumps(SEARCH_TOOL) in with_tools
    history = rendered(tool_server, messages=HISTORY, tools=[WEATHER_TOOL])
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"unit": "celsius"}}\n</tool_call><|im_end|>\n'
    ) in history
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 degrees\n</tool_response><|im_end|>\n" in history
    assert history.endswith("<|im_start|>assistant\n")
    n_tokens = post(tool_server, "/tokenize", {"messages": HISTORY, "tools": [WEATHER_TOOL]}).json()["count"]
    for choice in ("auto", "none"):
        body = chat(tool_server, messages=HISTORY, tools=[WEATHER_TOOL], tool_choice=choice)
        assert body["usage"]["prompt_tokens"] == n_tokens


def test_tool_history_through_the_openai_client(tool_server: ServerProcess) -> None:
    """The official client's message types (assistant tool_calls, tool results) are accepted."""
    client = openai_client(tool_server)
    resp = client.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=[WEATHER_TOOL], max_tokens=4, temperature=0, parallel_tool_calls=False
    )
    assert resp.choices[0].message.role == "assistant" and resp.usage.completion_tokens == 4


def test_auto_output_without_a_call_is_the_text_streamed_or_not(tool_server: ServerProcess) -> None:
    """With tool_choice "auto" the output goes through the Hermes parser; the random model writes no
    call, so the message is exactly the text tool_choice "none" gets (nothing held back or lost),
    and the stream carries the same text."""
    base = dict(messages=ASK, tools=[WEATHER_TOOL], max_tokens=12)
    plain = chat(tool_server, tool_choice="none", **base)["choices"][0]
    auto = chat(tool_server, **base)["choices"][0]
    assert plain["message"]["content"] and auto == plain and auto["message"]["tool_calls"] is None
    chunks = stream_chat(tool_server, **base)
    deltas = [c["choices"][0] for c in chunks]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == plain["message"]["content"]
    assert deltas[-1]["finish_reason"] == plain["finish_reason"]
    assert not any(d["delta"].get("tool_calls") for d in deltas)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param({"content": None}, id="null (openai SDK, LangChain, openai-agents)"),
        pytest.param({}, id="absent (litellm)"),
    ],
)
def test_the_tool_result_turn_is_accepted_by_a_template_without_tools(server: ServerProcess, content: dict) -> None:
    """The second request of every tool loop, on SmolLM2's template (which concatenates `content`):
    the assistant's calls without content render as empty text, not a 400."""
    assistant = {k: v for k, v in HISTORY[1].items() if k != "content"} | content
    body = chat(server, messages=[HISTORY[0], assistant, HISTORY[2]], tools=[WEATHER_TOOL], max_tokens=2)
    assert body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strng"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        # Size limits: 64 KiB of JSON per parameters schema, 128 KiB for all of them.
        ({"tools": [WEATHER_TOOL, function_with_properties("big", 1200)]}, "tools[1].function.parameters"),
        ({"tools": [function_with_properties(f"f{i}", 700) for i in range(4)]}, "tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "search"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {
                "tools": [
                    WEATHER_TOOL,
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        (  # strict: true and a keyword the grammar cannot enforce
            {
                "tools": [
                    WEATHER_TOOL,
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {"type": "object", "properties": {"a": {"type": "integer", "not": {}}}},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.name",
        ),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": 5, "content": "x"}]}, "messages[1].tool_call_id"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(tool_server: ServerProcess, body: dict, param: str) -> None:
    err = assert_openai_error(
        post(tool_server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, **body}), 400
    )
    assert err["param"] == param, err


# ---------------------------------------------------------------------------------------------- auto: real calls


def test_auto_reads_the_calls_the_model_writes(tool_server: ServerProcess) -> None:
    """Through the official client: the text before the calls is the content, each call has its own
    call_ id, type function, the name, and the arguments as JSON text; finish_reason tool_calls."""
    client = openai_client(tool_server)
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER_TOOL, SEARCH_TOOL], temperature=0, max_tokens=200
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == REPLY_TEXT
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", name, args) for name, args in REPLY_CALLS
    ]
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == 2
    # tool_choice "none": the same generation, not parsed.
    none = chat(tool_server, messages=ASK, tools=[WEATHER_TOOL, SEARCH_TOOL], tool_choice="none", max_tokens=200)
    assert none["choices"][0]["message"] == {"role": "assistant", "content": REPLY, "tool_calls": None}
    assert none["choices"][0]["finish_reason"] == "stop"
    # parallel_tool_calls=false: the first call only.
    one = chat(tool_server, messages=ASK, tools=[WEATHER_TOOL, SEARCH_TOOL], parallel_tool_calls=False, max_tokens=200)
    (call,) = one["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and one["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_tool_calls_are_openai_deltas_that_add_up_to_the_calls(tool_server: ServerProcess) -> None:
    """Streamed: the text streams as content with no markup in it; each call opens with a delta of
    index, id, type, name and arguments "", then argument fragments only; everything concatenates
    to the non-streamed message (same greedy tokens), n=2 choices streamed side by side."""
    body = dict(messages=ASK, tools=[WEATHER_TOOL, SEARCH_TOOL], max_tokens=200, n=2)
    whole = chat(tool_server, **body)
    chunks = stream_chat(tool_server, **body)
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        content = "".join(d["delta"].get("content") or "" for d in deltas)
        assert content == REPLY_TEXT and "<" not in content
        calls: list[dict] = []
        pieces = [t for d in deltas for t in d["delta"].get("tool_calls") or []]
        for piece in pieces:
            if "id" in piece:
                assert piece["index"] == len(calls) and piece["type"] == "function"
                assert set(piece) == {"index", "id", "type", "function"} and piece["function"]["arguments"] == ""
                calls.append({"id": piece["id"], "type": "function", "function": dict(piece["function"])})
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
                calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
        assert len(pieces) > 2 * len(calls) + 2, "arguments arrive in several fragments"
        expected = whole["choices"][index]["message"]["tool_calls"]
        assert [c["function"] for c in calls] == [c["function"] for c in expected]
        assert deltas[-1]["finish_reason"] == "tool_calls"


def test_langchain_bind_tools_gets_tool_calls(tool_server: ServerProcess) -> None:
    """LangChain's ChatOpenAI with bind_tools: AIMessage.tool_calls, invoked and streamed."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{tool_server.base_url}/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    bound = llm.bind_tools([WEATHER_TOOL, SEARCH_TOOL])
    message = bound.invoke(ASK[0]["content"])
    assert [(c["name"], c["args"]) for c in message.tool_calls] == REPLY_CALLS
    assert message.content == REPLY_TEXT and message.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for chunk in bound.stream(ASK[0]["content"]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == REPLY_CALLS
    assert streamed.content == REPLY_TEXT


# ---------------------------------------------------------------------------------------------- required / named


# Bounded strings and enums: a random model's constrained output ends well within max_tokens.
BOUNDED_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
BOUNDED_SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 12},
                "filters": {"type": "array", "items": {"$ref": "#/$defs/Filter"}, "maxItems": 2},
            },
            "required": ["query", "filters"],
            "additionalProperties": False,
            "$defs": {
                "Filter": {
                    "type": "object",
                    "properties": {
                        "field": {"enum": ["date", "place"]},
                        "value": {"type": "integer", "minimum": 0, "maximum": 99},
                    },
                    "required": ["field", "value"],
                    "additionalProperties": False,
                }
            },
        },
    },
}
# (room for a sampled reply of several calls: at 200 tokens one seed's third call was cut off)
FORCED = dict(messages=ASK, tools=[BOUNDED_WEATHER, BOUNDED_SEARCH], max_tokens=400, temperature=1.0)
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (BOUNDED_WEATHER, BOUNDED_SEARCH)}


def assert_valid_calls(message: dict, names: set[str]) -> list[dict]:
    import jsonschema

    calls = message["tool_calls"]
    assert calls and message["content"] is None, message
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
    return calls


@pytest.mark.slow
def test_required_returns_calls_whose_arguments_fit_their_schema(server: ServerProcess) -> None:
    """tool_choice "required" on a model with no tool template and no parser: every sampled reply is
    one or more calls to the offered functions with arguments valid for that function's schema
    ($refs included); parallel_tool_calls=false allows exactly one."""
    names = {"get_weather", "search"}
    called = set()
    for seed in range(6):
        body = chat(server, **FORCED, tool_choice="required", seed=seed)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        called |= {c["function"]["name"] for c in assert_valid_calls(choice["message"], names)}
    assert called == names  # sampling picks either function
    single = chat(server, **FORCED, tool_choice="required", parallel_tool_calls=False, seed=1, n=4)
    for choice in single["choices"]:
        assert len(assert_valid_calls(choice["message"], names)) == 1


def test_named_tool_choice_calls_that_function(server: ServerProcess) -> None:
    """A named function through the official client: exactly that function, valid arguments."""
    client = openai_client(server)
    for name in ("search", "get_weather"):
        resp = client.chat.completions.create(
            model=model_id(server), **FORCED, seed=3, tool_choice={"type": "function", "function": {"name": name}}
        )
        message = resp.choices[0].message.model_dump()
        (call,) = assert_valid_calls(message, {name})
        assert resp.choices[0].finish_reason == "tool_calls"


def test_forced_calls_stream_as_deltas_that_add_up_to_the_calls(server: ServerProcess) -> None:
    """Seeded, so streamed and whole runs sample the same tokens: the streamed deltas (a named call's
    first delta comes before any argument text) concatenate to the non-streamed calls."""
    for choice in ("required", {"type": "function", "function": {"name": "search"}}):
        body = dict(FORCED, tool_choice=choice, seed=11)
        whole = chat(server, **body)["choices"][0]["message"]["tool_calls"]
        deltas = [c["choices"][0]["delta"] for c in stream_chat(server, **body) if c["choices"]]
        assert not any(d.get("content") for d in deltas)
        calls: list[dict] = []
        for piece in (t for d in deltas for t in d.get("tool_calls") or []):
            if "id" in piece:
                calls.append(dict(piece["function"]))
            else:
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
        assert calls == [c["function"] for c in whole], choice


def test_langchain_forced_tool_calls_and_structured_output(server: ServerProcess) -> None:
    """LangChain: bind_tools with tool_choice "required" and with a named tool give AIMessage.tool_calls
    with schema-valid args; with_structured_output(method="function_calling") parses into the model."""
    import jsonschema
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(
        base_url=f"{server.base_url}/v1",
        api_key="unused",
        model=model_id(server),
        temperature=1.0,
        max_tokens=200,
        max_retries=0,
        seed=5,
    )
    for tool_choice, names in (("required", {"get_weather", "search"}), ("search", {"search"})):
        message = llm.bind_tools([BOUNDED_WEATHER, BOUNDED_SEARCH], tool_choice=tool_choice).invoke("Weather in Paris?")
        assert message.tool_calls and {c["name"] for c in message.tool_calls} <= names, message
        for call in message.tool_calls:
            jsonschema.validate(call["args"], PARAMETERS[call["name"]])

    class City(BaseModel):
        """A city and its population."""

        name: str = Field(max_length=10)
        population: int = Field(ge=0, le=10_000_000)

    city = llm.with_structured_output(City, method="function_calling").invoke("Describe Paris.")
    assert isinstance(city, City) and 0 <= city.population <= 10_000_000


# ---------------------------------------------------------------------------------------------- special-token markers

MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}"
    "{%- else %}{{ m.content }}{%- endif %}"
    "{%- endfor %}"
)
MISTRAL_REPLY = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'


@pytest.fixture(scope="module")
def mistral_server(default_model_dir: Path, tmp_path_factory, server_log_dir: Path) -> Iterator[ServerProcess]:
    """A tokenizer where [TOOL_CALLS] is a special token (as in Mistral's), and a model that answers ASK
    with a call in Mistral's v11 layout; the parser is picked from the template."""
    from transformers import AutoTokenizer

    from tests.utils.tool_models import scripted_turns_model

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer.chat_template = MISTRAL_TEMPLATE
    tokenizer_dir = tmp_path_factory.mktemp("mistral-tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    request = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [WEATHER_TOOL]})
    n = len(render_chat(tokenizer, request.template_messages(), tools=request.template_tools()))
    model = scripted_turns_model(
        tokenizer_dir, tmp_path_factory.mktemp("mistral") / "scripted-mistral", MISTRAL_TEMPLATE, [(n, MISTRAL_REPLY)]
    )
    with running_server(model, server_log_dir) as proc:
        yield proc


def test_mistral_markers_are_special_tokens_kept_for_the_parser(mistral_server: ServerProcess) -> None:
    """The [TOOL_CALLS] special token reaches the parser (the output is detokenized with special tokens
    for it), streamed or not; without tools parsing (tool_choice none) special tokens stay out."""
    picked = [r.get("tool_call_parser") for r in mistral_server.log_records() if "tool-call parser" in r.get("msg", "")]
    assert picked == ["mistral"]
    body = dict(messages=ASK, tools=[WEATHER_TOOL], max_tokens=60)
    message = chat(mistral_server, **body)["choices"][0]["message"]
    (call,) = message["tool_calls"]
    assert message["content"] is None and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    deltas = [c["choices"][0]["delta"] for c in stream_chat(mistral_server, **body) if c["choices"]]
    arguments = "".join(t["function"].get("arguments") or "" for d in deltas for t in d.get("tool_calls") or [])
    assert arguments == call["function"]["arguments"] and not any(d.get("content") for d in deltas)
    plain = chat(mistral_server, **body, tool_choice="none")["choices"][0]["message"]["content"]
    assert plain == MISTRAL_REPLY.removeprefix("[TOOL_CALLS]")
