"""Structured outputs over HTTP, against a real `tokenmill serve` with overlap scheduling on:
OpenAI's `response_format` (json_schema, json_object) on chat and completions, vLLM's
`structured_outputs` and `guided_*` extras, streaming, n>1, stop strings, 400s naming the field;
and LangChain's `with_structured_output` against the default (instruct) model."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jiter
import jsonschema
import pytest

from tests.engine.test_structured_outputs import MAX_TOKENS, PERSON
from tests.utils.server import (
    ServerProcess,
    assert_openai_error,
    async_openai_client,
    model_id,
    openai_client,
    running_server,
)
from tests.utils.server import (
    post_json as post,
)

PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MSG = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    """Overlap scheduling on (CPU default: off): each step's grammar mask is filled only after the
    previous step's tokens land, while the model already runs the next forward pass."""
    with running_server(tiny_model_dir, server_log_dir, "--max-num-seqs", "8", "--overlap-scheduling") as proc:
        yield proc


def test_json_schema_output_validates_for_20_sampled_requests(server: ServerProcess) -> None:
    async def run() -> list:
        client = async_openai_client(server)
        async with client:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=model_id(server),
                        messages=MSG,
                        temperature=1.0,
                        max_tokens=MAX_TOKENS,
                        response_format=PERSON_FORMAT,
                    )
                    for _ in range(20)
                )
            )

    replies = asyncio.run(run())
    contents = [r.choices[0].message.content for r in replies]
    for reply, content in zip(replies, contents):
        assert reply.choices[0].finish_reason == "stop", content
        jsonschema.validate(json.loads(content), PERSON)
    assert len(set(contents)) >= 10


def test_response_format_on_completions(server: ServerProcess) -> None:
    client = openai_client(server)
    reply = client.completions.create(
        model=model_id(server),
        prompt="Person:",
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": PERSON_FORMAT},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), PERSON)
    # json_object: any object (unbounded strings: a random model may stop at max_tokens, on a valid prefix).
    for reply in (
        client.completions.create(
            model=model_id(server),
            prompt="JSON:",
            max_tokens=32,
            extra_body={"response_format": {"type": "json_object"}},
        ),
        client.chat.completions.create(
            model=model_id(server), messages=MSG, max_tokens=32, response_format={"type": "json_object"}
        ),
    ):
        choice = reply.choices[0]
        text = choice.text if hasattr(choice, "text") else choice.message.content
        assert text.startswith("{")
        parsed = (
            json.loads(text)
            if choice.finish_reason == "stop"
            else jiter.from_json(text.encode(), partial_mode="trailing-strings")
        )
        assert isinstance(parsed, dict), text


def test_vllm_extras(server: ServerProcess) -> None:
    cases = [
        ({"guided_regex": r"[a-z]{3}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-z]{3}-[0-9]{2}", t)),
        ({"guided_choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
        ({"guided_grammar": 'root ::= "x" [0-9] ("," [0-9])?'}, lambda t: re.fullmatch(r"x[0-9](,[0-9])?", t)),
        (
            {"guided_json": PERSON, "guided_decoding_backend": "xgrammar"},
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
        ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
        ({"structured_outputs": {"choice": ["1", "22"]}}, lambda t: t in ("1", "22")),
        (
            {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
            lambda t: t == json.dumps(json.loads(t), ensure_ascii=False),
        ),
    ]
    for extra, check in cases:
        for path, body in (("/v1/completions", {"prompt": "Answer:"}), ("/v1/chat/completions", {"messages": MSG})):
            r = post(server, path, {**body, "max_tokens": MAX_TOKENS, "temperature": 1.0, **extra})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert choice["finish_reason"] == "stop" and check(text), (extra, text)


def test_streamed_output_concatenates_to_the_same_valid_document(server: ServerProcess) -> None:
    client = openai_client(server)
    body = dict(
        model=model_id(server),
        messages=MSG,
        temperature=1.0,
        seed=1234,
        max_tokens=MAX_TOKENS,
        response_format=PERSON_FORMAT,
    )
    whole = client.chat.completions.create(**body).choices[0].message.content
    chunks = list(client.chat.completions.create(**body, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # really streamed
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


def test_n_choices_and_stop_strings(server: ServerProcess) -> None:
    client = openai_client(server)
    reply = client.chat.completions.create(
        model=model_id(server), messages=MSG, n=3, temperature=1.0, max_tokens=MAX_TOKENS, response_format=PERSON_FORMAT
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({c.message.content for c in reply.choices}) > 1
    # A stop string inside the constrained output ends it there.
    reply = client.completions.create(
        model=model_id(server),
        prompt="x",
        max_tokens=64,
        temperature=1.0,
        stop=[","],
        extra_body={"guided_regex": r"[a-z]{2}(,[a-z]{2}){3}"},
    )
    assert re.fullmatch(r"[a-z]{2}", reply.choices[0].text) and reply.choices[0].finish_reason == "stop"


DEEP_SCHEMA_TEXT = '{"type": "array", "items": ' * 400 + '{"type": "integer"}' + "}" * 400
NOT_THREE = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 3}}},
    "required": ["n"],
    "additionalProperties": False,
}


def test_invalid_specs_are_400s_naming_the_field(server: ServerProcess) -> None:
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
            "response_format.json_schema.schema",
            "Unsupported type",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", None),
        ({"guided_json": {"properties": 5}}, "guided_json", "properties"),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        ({"guided_regex": "(("}, "guided_regex", "parenthesis"),
        ({"guided_grammar": "root ::= nowhere"}, "guided_grammar", "nowhere"),
        ({"guided_choice": []}, "guided_choice", None),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar", "nowhere"),
        ({"structured_outputs": {"json": PERSON, "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "jsn"),
        ({"guided_json": PERSON, "response_format": {"type": "json_object"}}, "guided_json", "only one"),
        # Bounded before xgrammar parses them: a schema as JSON text like a dict.
        ({"guided_json": DEEP_SCHEMA_TEXT}, "guided_json", "nested more than 64 levels"),
        ({"structured_outputs": {"json": DEEP_SCHEMA_TEXT}}, "structured_outputs.json", "nested more than 64 levels"),
        ({"guided_regex": "a" * (256 << 10) + "b"}, "guided_regex", "the limit is 262144"),
        # What the grammar cannot enforce: vLLM's extras and strict: true refuse it, naming it.
        ({"guided_json": NOT_THREE}, "guided_json", "'not' cannot be enforced"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": NOT_THREE, "strict": True},
                }
            },
            "response_format.json_schema.schema",
            "'not' cannot be enforced (at #/properties/n)",
        ),
    ]
    for extra, param, words in cases:
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MSG})):
            err = assert_openai_error(post(server, path, {**body, "max_tokens": 4, **extra}), 400)
            assert err["param"] == param, (extra, err)
            assert words is None or words in err["message"], (extra, err)
    # Plain text stays plain text.
    r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    # Without strict the keyword is relaxed (the rest of the schema holds).
    relaxed = {"type": "json_schema", "json_schema": {"name": "x", "schema": NOT_THREE}}
    r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 40, "response_format": relaxed})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------------------------- LangChain


@pytest.fixture(scope="module")
def instruct_server(default_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    with running_server(default_model_dir, server_log_dir, "--max-num-seqs", "4", "--max-model-len", "2048") as proc:
        yield proc


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        "json_schema",
        "json_mode",
        "function_calling",
    ],
)
def test_langchain_with_structured_output(instruct_server: ServerProcess, method: str) -> None:
    """`ChatOpenAI(...).with_structured_output(PydanticModel)`: json_schema sends response_format
    json_schema, json_mode sends json_object, function_calling a named tool_choice; each comes back
    as a validated pydantic object."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person mentioned in the text."""

        name: str = Field(description="the person's first name", max_length=20)
        age: int = Field(description="age in years", ge=0, le=150)

    sent: list[dict] = []
    http = httpx.Client(timeout=120, event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]})
    llm = ChatOpenAI(
        model=model_id(instruct_server),
        base_url=f"{instruct_server.base_url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=64,
        max_retries=0,
        http_client=http,
    )
    structured = llm.with_structured_output(Person, method=method, include_raw=True)
    prompt = "Extract the person as a JSON object with keys name and age. Text: Ann is 31 years old and lives in Paris."
    result = structured.invoke(prompt)
    expected = {"json_schema": "json_schema", "json_mode": "json_object"}.get(method)
    if expected:  # the constraint really went to the server
        assert sent[-1]["response_format"]["type"] == expected, sent[-1]
    else:
        assert sent[-1]["tool_choice"] == {"type": "function", "function": {"name": "Person"}}, sent[-1]
    assert result["parsing_error"] is None, result
    person = result["parsed"]
    assert isinstance(person, Person) and person.name.strip() and 0 <= person.age <= 150
