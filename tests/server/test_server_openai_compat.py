"""OpenAI/vLLM API compatibility against the shared real `tokenmill serve`: what current clients send
is accepted (ignored fields logged once, unknown ones warned about), what would change the output and
is not implemented is a clear 400, known fields stay strict, and the standard extra endpoints work
(/v1/models/{id}, /tokenize, /detokenize, /health, /version, cached_tokens in usage)."""

from __future__ import annotations

import json
import time
import typing

import httpx
import openai
import pytest

from tests.utils.server import ServerProcess, assert_openai_error, model_id, openai_client
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, StreamOptions

MSG = [{"role": "user", "content": "Say something"}]


def post(
    server: ServerProcess, path: str, body: object, content_type: str | None = "application/json", **kwargs
) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60.0, **kwargs)


def log_lines(server: ServerProcess, msg_part: str, field: str) -> list[dict]:
    return [r for r in server.log_records() if msg_part in r.get("msg", "") and r.get("field") == field]


# ---------------------------------------------------------------------------------------------- tolerant parsing


def _openai_fields(typed_dict: type) -> set[str]:
    return set(typing.get_type_hints(typed_dict))


@pytest.mark.unit
def test_every_field_of_the_openai_request_types_is_a_known_field() -> None:
    """The installed `openai` package's request types: every field is one the server knows (and so
    supports, ignores on purpose, or rejects as not supported yet), none falls to "unknown"."""
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.chat.chat_completion_stream_options_param import ChatCompletionStreamOptionsParam

    stream = {"stream"}  # only in the Streaming/NonStreaming variants
    assert _openai_fields(completion_params.CompletionCreateParamsBase) | stream <= set(CompletionRequest.model_fields)
    assert _openai_fields(chat_params.CompletionCreateParamsBase) | stream <= set(ChatCompletionRequest.model_fields)
    assert _openai_fields(ChatCompletionStreamOptionsParam) <= set(StreamOptions.model_fields)
    message_types = typing.get_args(
        typing.get_args(typing.get_type_hints(chat_params.CompletionCreateParamsBase)["messages"])[0]
    )
    assert len(message_types) >= 5, message_types
    for message_type in message_types:
        assert _openai_fields(message_type) <= set(ChatMessage.model_fields), message_type


def test_fields_current_clients_send_are_accepted_and_ignored(server: ServerProcess) -> None:
    """store/metadata/service_tier & co through the official client: 200, the same greedy output as
    without them, one INFO line per ignored field (not one per request); an unknown field: a WARNING."""
    client = openai_client(server)
    plain = client.chat.completions.create(model=model_id(server), messages=MSG, max_tokens=6, temperature=0)
    extras = dict(
        store=True,
        metadata={"team": "a"},
        service_tier="auto",
        user="u-1",
        parallel_tool_calls=False,
        prompt_cache_key="k",
        safety_identifier="s",
        reasoning_effort="low",
        verbosity="low",
        extra_body={"bogus_field_xyz": {"a": 1}},
    )
    for _ in range(2):
        resp = client.chat.completions.create(
            model=model_id(server), messages=MSG, max_tokens=6, temperature=0, **extras
        )
        assert resp.choices[0].message.content == plain.choices[0].message.content
    text = client.completions.create(
        model=model_id(server),
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        user="u-2",
        extra_body={"store": False, "metadata": {"k": "v"}},
    )
    assert text.usage.completion_tokens == 4
    time.sleep(0.2)
    for field in (
        "store",
        "metadata",
        "service_tier",
        "user",
        "prompt_cache_key",
        "safety_identifier",
        "reasoning_effort",
        "verbosity",
    ):
        lines = log_lines(server, "ignored", field)
        assert len(lines) == 1 and lines[0]["level"] == "info", (field, lines)
    (unknown,) = log_lines(server, "unknown request field", "bogus_field_xyz")
    assert unknown["level"] == "warning"


def test_known_fields_stay_strict(server: ServerProcess) -> None:
    """Wrong types and out-of-range values on known fields (ignored ones included) are 400s naming the field."""
    cases = [
        ("/v1/chat/completions", {"messages": MSG, "store": "yes"}, "store"),
        ("/v1/chat/completions", {"messages": MSG, "metadata": {"k": 1}}, "metadata.k"),
        ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": MSG, "add_generation_prompt": "no"}, "add_generation_prompt"),
        ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        # the field that is out of range is the one named
        ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 100}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 100}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
        # "1_0" is not token 10 (Python's int() would say it is), nor are " 1", "+1" or "١"
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1_0": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {" 1": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"+1": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"\u0661": 5}}, "logit_bias"),
    ]
    for path, body, param in cases:
        err = assert_openai_error(post(server, path, {"max_tokens": 2, **body}), 400)
        assert err["param"] == param, (body, err)
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": {"10": 5}}).status_code == 200


def test_bodies_must_be_json(server: ServerProcess) -> None:
    """A text/plain (or form) body is a 415, even when its bytes are JSON; no Content-Type,
    or JSON with parameters, is fine."""
    body = {"prompt": "x", "max_tokens": 2}
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "text/plain; charset=utf-8"):
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            err = assert_openai_error(
                post(server, path, body, content_type=content_type), 415, "unsupported_media_type"
            )
            assert content_type.split(";")[0] in err["message"]
    for content_type in (None, "application/json; charset=utf-8", "Application/JSON"):
        assert post(server, "/v1/completions", body, content_type=content_type).status_code == 200, content_type


def test_a_lone_surrogate_escape_is_named_as_such(server: ServerProcess) -> None:
    """A \\uD800-\\uDFFF escape outside a high-low pair is no Unicode: a 400 that says so (not an
    "unexpected end of hex escape"); a proper pair is a character like any other."""
    for path, raw in (
        ("/v1/completions", r'{"prompt": "hi \ud800 there", "max_tokens": 2}'),
        ("/v1/completions", r'{"prompt": "a\ud83d", "max_tokens": 2}'),
        ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "hi \udc00"}], "max_tokens": 2}'),
        ("/tokenize", r'{"prompt": "\ud800\ud800"}'),
    ):
        err = assert_openai_error(post(server, path, raw), 400, "invalid_json")
        assert "lone surrogate escape" in err["message"] and "line 1 column" in err["message"], err
    assert post(server, "/v1/completions", r'{"prompt": "ok \ud83d\ude00", "max_tokens": 2}').status_code == 200
    err = assert_openai_error(post(server, "/v1/completions", r'{"prompt": "\u12"}'), 400, "invalid_json")
    assert "surrogate" not in err["message"]


def test_what_would_change_the_output_is_not_silently_ignored(server: ServerProcess) -> None:
    """Not implemented yet, would change the output: 400 `unsupported_parameter` naming the field.
    Values that ask for nothing beyond the default are accepted."""
    rejected = [
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
                    *MSG,
                ]
            },
            "messages[0].function_call",
        ),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ]
    for path, body, param in rejected:
        full = {"messages": MSG, "max_tokens": 2, **body} if "chat" in path else {"max_tokens": 2, **body}
        err = assert_openai_error(post(server, path, full), 400, "unsupported_parameter")
        assert err["param"] == param and "not supported yet" in err["message"], err
    harmless = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "functions": None,
    }
    assert post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2, **harmless}).status_code == 200
    assert (
        post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "echo": False, "suffix": ""}).status_code
        == 200
    )


def test_chat_template_options_reach_the_template(server: ServerProcess) -> None:
    """vLLM's add_generation_prompt / continue_final_message / chat_template_kwargs: the prompt a
    chat request is charged for is exactly /tokenize's rendering with the same options."""

    def tokens(**options) -> list[int]:
        r = post(server, "/tokenize", {"messages": messages, **options})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    def prompt_tokens(**options) -> int:
        r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **options})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    messages = [*MSG, {"role": "assistant", "content": "Once upon"}]
    with_prompt, without = tokens(), tokens(add_generation_prompt=False)
    continued = tokens(add_generation_prompt=False, continue_final_message=True)
    assert len(with_prompt) > len(without) > len(continued)  # "<|im_start|>assistant\n" / "<|im_end|>\n" dropped
    assert without[: len(continued)] == continued
    assert prompt_tokens() == len(with_prompt)
    assert prompt_tokens(add_generation_prompt=False) == len(without)
    assert prompt_tokens(add_generation_prompt=False, continue_final_message=True) == len(continued)
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == len(with_prompt)
    # The kwargs really are handed to the template renderer: one that names its own argument is refused.
    err = assert_openai_error(
        post(
            server,
            "/v1/chat/completions",
            {"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"tokenize": False}},
        ),
        400,
    )
    assert err["param"] == "chat_template_kwargs"
    err = assert_openai_error(
        post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "continue_final_message": True}),
        400,
    )
    assert err["param"] == "continue_final_message"


# ---------------------------------------------------------------------------------------------- endpoints


def test_models_retrieve(server: ServerProcess) -> None:
    client = openai_client(server)
    card = client.models.retrieve(model_id(server))
    assert card.id == model_id(server) and card.object == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    assert_openai_error(httpx.get(f"{server.base_url}/v1/models/org/no-such-model"), 404, "model_not_found")


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    r = post(server, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    max_model_len = openai_client(server).models.list().data[0].max_model_len
    assert body["count"] == len(body["tokens"]) > 5 and body["max_model_len"] == max_model_len
    assert len(body["token_strs"]) == body["count"]
    completion = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]
    # The same ids as a token-id prompt: same generation.
    by_ids = post(server, "/v1/completions", {"prompt": body["tokens"], "max_tokens": 4, "temperature": 0}).json()
    by_text = post(server, "/v1/completions", {"prompt": text, "max_tokens": 4, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["count"] <= body["count"]

    back = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    assert assert_openai_error(post(server, "/detokenize", {"tokens": [10**7]}), 400)["param"] == "tokens"
    assert_openai_error(post(server, "/detokenize", {"tokens": "abc"}), 400)
    assert_openai_error(post(server, "/tokenize", {"prompt": "x", "model": "nope"}), 404, "model_not_found")
    assert_openai_error(post(server, "/tokenize", {"messages": MSG, "add_special_tokens": True}), 400)
    assert_openai_error(post(server, "/tokenize", {}), 400)


def test_health_and_version(server: ServerProcess) -> None:
    import tokenmill

    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json() == {"version": tokenmill.__version__}


def test_cached_tokens_reported_from_the_prefix_cache(server: ServerProcess) -> None:
    """usage.prompt_tokens_details.cached_tokens: 0 for a new prompt, every full block but the last
    token's for the same prompt again (block size 16)."""
    client = openai_client(server)
    prompt = "A long shared document about cached prefixes. " * 12 + str(time.time())  # new to the cache
    first = client.completions.create(model=model_id(server), prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model_id(server), prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 16 * ((n - 1) // 16)
    assert second.choices[0].text == first.choices[0].text
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=model_id(server), messages=messages, max_tokens=1)
    again = client.chat.completions.create(model=model_id(server), messages=messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 16 * ((again.usage.prompt_tokens - 1) // 16)


def test_openapi_documents_the_real_schemas(server: ServerProcess) -> None:
    """Request bodies read by hand are documented with their models, streams and errors
    too, /metrics as text/plain, and no 422 (validation errors are 400s). schemathesis then tests
    the API from this spec (tests/stress/test_stress_schemathesis.py)."""
    spec = httpx.get(f"{server.base_url}/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/detokenize", "DetokenizeRequest"),
    ):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
    assert {"prompt", "logprobs", "logit_bias", "max_tokens"} <= set(schemas["CompletionRequest"]["properties"])
    assert {"messages", "top_logprobs", "chat_template_kwargs", "tools"} <= set(
        schemas["ChatCompletionRequest"]["properties"]
    )
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    ok = spec["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionResponse"}
    assert "text/event-stream" in ok
    assert {"400", "401", "404", "413", "415", "429", "503"} <= set(
        spec["paths"]["/v1/completions"]["post"]["responses"]
    )
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert not [p for p, ops in spec["paths"].items() for op in ops.values() if "422" in op["responses"]]
    assert "HTTPValidationError" not in schemas


def test_tokenizer_endpoints_survive_a_client_leaving_mid_body(server: ServerProcess) -> None:
    import socket

    before = len(server.log_records())
    head = (
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        b'{"prompt": "'
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head)
        time.sleep(0.3)
    time.sleep(0.5)
    records = server.log_records()[before:]
    assert not [r for r in records if r["level"] in ("error", "critical") or "exc" in r], records
    assert post(server, "/tokenize", {"prompt": "still fine"}).status_code == 200
