"""The HTTP/gRPC server against a real `tokenmill serve` subprocess running the tiny random model.

One shared server (`server` of tests/utils/server.py, one for the whole run) keeps this file fast;
lifecycle tests that need their own flags (API key, tiny queue, SIGTERM) live in test_server_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from tests.utils.server import (
    MALFORMED_MESSAGES,
    ServerProcess,
    assert_openai_error,
    async_openai_client,
    openai_client,
    raw_grpc_call,
    sse_events,
)

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    """Greedy reference outputs from the offline API: prompt -> (text, token ids)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="64MiB")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    refs = {p: (o.outputs[0].text, list(o.outputs[0].token_ids)) for p, o in zip(PROMPTS, outs)}
    del llm, outs
    gc.collect()
    return refs


def post(server: ServerProcess, path: str, body: object, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=60.0, **kwargs)


# ---------------------------------------------------------------------------------------------- basics


def test_health_and_models(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health/live").status_code == 200
    assert httpx.get(f"{server.base_url}/health/ready").status_code == 200
    models = openai_client(server).models.list()
    assert [m.id for m in models.data] == [Path(server.proc.args[server.proc.args.index("--model") + 1]).name]


@pytest.mark.smoke
def test_greedy_completion_matches_offline(server: ServerProcess, offline) -> None:
    client = openai_client(server)
    model = client.models.list().data[0].id
    for prompt in PROMPTS:
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert resp.choices[0].text == offline[prompt][0]
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == MAX_TOKENS
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + MAX_TOKENS


@pytest.mark.smoke
def test_streaming_concatenates_to_non_streaming(server: ServerProcess, offline) -> None:
    client = openai_client(server)
    prompt = PROMPTS[0]
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline[prompt][0]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_explicit_nulls_mean_defaults(server: ServerProcess, offline) -> None:
    """OpenAI's API takes null for its optional fields (clients other than the official SDK send
    them); null is the default, not a 400. A null where no default exists stays an error."""
    prompt = PROMPTS[0]
    nulls = {
        "n": None,
        "top_p": None,
        "stream": None,
        "presence_penalty": None,
        "frequency_penalty": None,
        "logprobs": None,
        "seed": None,
        "stop": None,
        "logit_bias": None,
        "top_k": None,
        "min_p": None,
        "repetition_penalty": None,
        "echo": None,
        "user": None,
    }
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **nulls})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == [offline[prompt][0]]
    assert body["choices"][0]["logprobs"] is None
    r = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "temperature": None,
            "logprobs": None,
            "n": None,
            "stream": None,
        },
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    assert_openai_error(post(server, "/v1/completions", {"prompt": None, "max_tokens": 2}), 400)
    assert_openai_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "ignore_eos": None}), 400)


@pytest.mark.smoke
def test_chat_completion_and_stream(server: ServerProcess) -> None:
    client = openai_client(server)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 0

    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens


def test_n_batch_prompts_and_logprobs(server: ServerProcess, offline) -> None:
    client = openai_client(server)
    model = client.models.list().data[0].id
    # A batch of prompts: choices are prompt-major and match single-prompt greedy output.
    resp = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [offline[PROMPTS[0]][0]] * 2 + [offline[PROMPTS[1]][0]] * 2
    assert resp.usage.completion_tokens == 4 * MAX_TOKENS

    # Token-id prompts and legacy logprobs.
    ids = client.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0, logprobs=2)
    lp = ids.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == ids.choices[0].text and lp.text_offset[0] == 0

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)


def test_request_id_header(server: ServerProcess) -> None:
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.json()["id"] == "cmpl-trace-42"
    bad = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "a b\tc"})
    assert bad.headers["x-request-id"] != "a b\tc" and len(bad.headers["x-request-id"]) == 32
    # Every response carries one, errors included; the finished request is logged under it, without the prompt.
    assert "x-request-id" in post(server, "/v1/completions", b"{").headers
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [r for r in server.log_records() if r.get("request_id") == "trace-42"]
        if lines:
            break
        time.sleep(0.1)
    (line,) = lines
    assert line["status"] == "ok" and line["completion_tokens"] == 1 and "prompt" not in line
    assert {"queue_s", "ttft_s", "decode_s", "total_s"} <= set(line)


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_counters_move_by_known_amounts(server: ServerProcess) -> None:
    before = server.metrics()
    client = openai_client(server)
    model = client.models.list().data[0].id
    usages = [
        client.completions.create(model=model, prompt=p, max_tokens=3 + i, temperature=0).usage
        for i, p in enumerate(PROMPTS)
    ]
    after = server.metrics()
    ok = 'tokenmill_requests_total{endpoint="/v1/completions",status="ok"}'
    assert after[ok] - before[ok] == len(PROMPTS)
    assert after["tokenmill_generation_tokens_total"] - before["tokenmill_generation_tokens_total"] == sum(
        u.completion_tokens for u in usages
    )
    assert after["tokenmill_prompt_tokens_total"] - before["tokenmill_prompt_tokens_total"] == sum(
        u.prompt_tokens for u in usages
    )
    assert (
        after["tokenmill_e2e_request_latency_seconds_count"] - before["tokenmill_e2e_request_latency_seconds_count"]
        == 3
    )
    for name in (
        "tokenmill_num_requests_waiting",
        "tokenmill_num_requests_running",
        "tokenmill_kv_cache_usage_ratio",
        "tokenmill_prefix_cache_hit_rate",
        "tokenmill_num_preemptions_total",
        "tokenmill_generation_tokens_per_second",
        "tokenmill_time_to_first_token_seconds_count",
        "tokenmill_time_per_output_token_seconds_count",
        "tokenmill_request_queue_time_seconds_count",
        "tokenmill_batch_size_count",
    ):
        assert name in after, name
    assert after["tokenmill_generation_tokens_per_second"] > 0


def requests_total(metrics: dict[str, float], endpoint: str, status: str) -> float:
    return metrics[f'tokenmill_requests_total{{endpoint="{endpoint}",status="{status}"}}']


def test_client_errors_are_not_server_errors(server: ServerProcess) -> None:
    """400/404/413 count as `invalid`, never as `error` (which the alerts page on)."""
    from tokenmill.server.metrics import REQUEST_STATUSES

    before = server.metrics()
    exported = {
        (e, s)
        for e in ("/v1/completions", "/v1/chat/completions", "/tokenmill.v1.Generation/Generate")
        for s in REQUEST_STATUSES
        if f'tokenmill_requests_total{{endpoint="{e}",status="{s}"}}' in before
    }
    assert len(exported) == 3 * len(REQUEST_STATUSES), "every status series is exported from the start"
    bad = [
        b"{not json",
        {"prompt": "x", "max_tokens": -1},
        {"prompt": "x", "model": "no-such-model"},
        {"prompt": "a" * (1 << 20)},
    ]
    for body in bad:
        assert 400 <= post(server, "/v1/completions", body).status_code < 500
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    with grpc.insecure_channel(server.grpc_target) as channel, pytest.raises(grpc.RpcError):
        raw_grpc_call(channel, "Generate", MALFORMED_MESSAGES[0])
    time.sleep(0.2)  # gRPC counts after the status is sent
    after = server.metrics()
    for endpoint, count in (
        ("/v1/completions", len(bad)),
        ("/v1/chat/completions", 1),
        ("/tokenmill.v1.Generation/Generate", 1),
    ):
        assert requests_total(after, endpoint, "invalid") - requests_total(before, endpoint, "invalid") == count
        assert requests_total(after, endpoint, "error") == requests_total(before, endpoint, "error")


def test_32_concurrent_streams_batch_together(server: ServerProcess) -> None:
    async def run() -> list[tuple[str, str | None]]:
        client = async_openai_client(server)
        model = (await client.models.list()).data[0].id

        async def one(i: int) -> tuple[str, str | None]:
            stream = await client.completions.create(
                model=model, prompt=f"Request number {i}", max_tokens=8, temperature=0, stream=True
            )
            text, finish = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    before = server.metrics()
    results = asyncio.run(run())
    assert all(finish == "length" and text for text, finish in results)
    after = server.metrics()
    steps = after["tokenmill_batch_size_count"] - before["tokenmill_batch_size_count"]
    single = after['tokenmill_batch_size_bucket{le="1.0"}'] - before['tokenmill_batch_size_bucket{le="1.0"}']
    assert steps > 0 and single < steps, "expected engine steps running more than one sequence"
    assert after['tokenmill_batch_size_bucket{le="4.0"}'] < after['tokenmill_batch_size_bucket{le="8.0"}']


def test_disconnect_mid_stream_frees_kv(server: ServerProcess) -> None:
    aborted = 'tokenmill_requests_total{endpoint="/v1/completions",status="aborted"}'
    before = server.metrics()[aborted]
    body = {"prompt": "Tell me a long story", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
        for _ in range(3):
            next(events)
        assert server.metrics()["tokenmill_kv_cache_usage_ratio"] > 0
    # Leaving the `with` closed the connection; the server must abort and free the blocks.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = server.metrics()
        if (
            m["tokenmill_kv_cache_usage_ratio"] == 0
            and m["tokenmill_num_requests_running"] == 0
            and m[aborted] > before
        ):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"KV not freed after disconnect: {m}")


# ---------------------------------------------------------------------------------------------- errors


def test_bad_inputs_get_openai_errors_while_a_stream_runs(server: ServerProcess) -> None:
    stream_result: dict[str, object] = {}

    def long_stream() -> None:
        body = {"prompt": "Keep going", "max_tokens": 64, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as r:
            payloads = list(sse_events(r.iter_lines()))
        chunks = [json.loads(p) for p in payloads if p != "[DONE]"]
        stream_result.update(
            done=payloads[-1] == "[DONE]",
            text="".join(c["choices"][0]["text"] for c in chunks),
            finish=chunks[-1]["choices"][0]["finish_reason"],
        )

    t = threading.Thread(target=long_stream)
    t.start()
    try:
        cases: list[tuple[object, int, str | None]] = [
            (b"{not json", 400, "invalid_json"),
            (b"[1, 2]", 400, "invalid_json"),
            ({"max_tokens": 4}, 400, None),  # missing prompt
            ({"prompt": "x", "max_tokens": "4"}, 400, "invalid_type"),
            ({"prompt": "x", "max_tokens": 0}, 400, None),
            ({"prompt": "x", "max_tokens": -3}, 400, None),
            ({"prompt": "x", "max_tokens": 10**9}, 400, None),
            ({"prompt": "x", "max_tokens": 2048}, 400, "context_length_exceeded"),
            ({"prompt": "x " * 3000, "max_tokens": 4}, 400, "context_length_exceeded"),
            ({"prompt": "x", "temperature": -1}, 400, None),
            ({"prompt": "x", "n": 0}, 400, None),
            ({"prompt": "x", "guided_regex": "(("}, 400, None),
            ({"prompt": "x", "model": "no-such-model"}, 404, "model_not_found"),
            ({"prompt": "x", "priority": 1}, 400, None),  # the server's policy is fcfs
            ({"prompt": ""}, 400, None),
            ({"prompt": [10**7]}, 400, None),
            ({"prompt": "a" * (1 << 20)}, 413, "request_too_large"),
        ]
        for body, status, code in cases:
            r = post(server, "/v1/completions", body)
            err = assert_openai_error(r, status, code)
            if status == 400:
                assert err["type"] == "invalid_request_error"
        assert_openai_error(post(server, "/v1/chat/completions", {"messages": []}), 400)
        assert_openai_error(
            post(server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}), 400
        )
        assert_openai_error(httpx.get(f"{server.base_url}/v1/nothing-here"), 404)
        # The official client maps them to its exception classes.
        import openai

        client = openai_client(server)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=0)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    finally:
        t.join(timeout=120)
    assert stream_result == {"done": True, "text": stream_result["text"], "finish": "length"}
    assert stream_result["text"]


# ---------------------------------------------------------------------------------------------- gRPC


def test_grpc_matches_http(server: ServerProcess, offline) -> None:
    from tokenmill.server.proto import tokenmill_pb2 as pb
    from tokenmill.server.proto import tokenmill_pb2_grpc as pb_grpc

    prompt = PROMPTS[1]
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        chunks = list(stub.GenerateStream(request, timeout=60))
        assert "".join(c.text for c in chunks) == offline[prompt][0]
        assert [t for c in chunks for t in c.token_ids] == offline[prompt][1]
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == MAX_TOKENS
        assert all(not c.finish_reason for c in chunks[:-1])

        unary = stub.Generate(request, timeout=60)
        assert unary.text == offline[prompt][0] and list(unary.token_ids) == offline[prompt][1]

        by_ids = stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=2), timeout=60)
        assert by_ids.usage.prompt_tokens == 3 and len(by_ids.token_ids) == 2

        for bad in (
            pb.GenerateRequest(prompt=""),
            pb.GenerateRequest(prompt="x", max_tokens=0),
            pb.GenerateRequest(prompt_token_ids=[10**7]),
            pb.GenerateRequest(prompt="x", prompt_token_ids=[1]),
            pb.GenerateRequest(prompt="x", max_tokens=5000),
            pb.GenerateRequest(prompt="x", top_p=2.0),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.GenerateStream(bad, timeout=30))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client = openai_client(server)
    http = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    assert http.choices[0].text == offline[prompt][0]


def test_grpc_malformed_message_is_invalid_argument(server: ServerProcess) -> None:
    """Bytes that are not a GenerateRequest: INVALID_ARGUMENT, one WARNING line each, no traceback."""
    from tokenmill.server.proto import tokenmill_pb2 as pb

    before = len(server.log_records())
    with grpc.insecure_channel(server.grpc_target) as channel:
        for method in ("Generate", "GenerateStream"):
            for payload in MALFORMED_MESSAGES:
                with pytest.raises(grpc.RpcError) as exc:
                    raw_grpc_call(channel, method, payload)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, payload, exc.value)
                assert exc.value.details().startswith("Malformed request message"), exc.value.details()
        # The same channel still serves a well-formed request sent as raw bytes.
        good = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString()
        (reply,) = raw_grpc_call(channel, "Generate", good)
        assert pb.GenerateResponse.FromString(reply).usage.completion_tokens == 2
    time.sleep(0.5)  # the request log lines are written after the status is sent
    records = server.log_records()[before:]
    warnings = [r for r in records if r["level"] == "warning" and "malformed gRPC message" in r["msg"]]
    assert len(warnings) == 2 * len(MALFORMED_MESSAGES), records
    assert not [r for r in records if r["level"] in ("error", "critical") or "exc" in r], records
    assert "Traceback" not in server.log_tail(20000)


def test_grpc_reflection_and_health(server: ServerProcess) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.grpc_target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"tokenmill.v1.Generation", "grpc.health.v1.Health"} <= services, services
        # What grpcurl does: the service's methods and message fields come from the server, no .proto needed.
        from google.protobuf.descriptor_pool import DescriptorPool

        pool = DescriptorPool(db)
        service = pool.FindServiceByName("tokenmill.v1.Generation")
        assert {m.name for m in service.methods} == {"Generate", "GenerateStream"}
        assert "prompt_token_ids" in pool.FindMessageTypeByName("tokenmill.v1.GenerateRequest").fields_by_name

        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "tokenmill.v1.Generation"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
        with pytest.raises(grpc.RpcError) as exc:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND


def test_chat_fallback_template_when_tokenizer_has_none(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from tokenmill.server.openai_api import render_chat
    from tokenmill.server.protocol import ChatMessage

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = None
    messages = [
        ChatMessage.model_validate_json('{"role": "system", "content": "Be brief."}'),
        ChatMessage.model_validate_json('{"role": "user", "content": [{"type": "text", "text": "hi"}]}'),
    ]
    assert tokenizer.decode(render_chat(tokenizer, messages)) == "system: Be brief.\nuser: hi\nassistant:"
