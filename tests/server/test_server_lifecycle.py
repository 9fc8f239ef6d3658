"""Server behaviour that needs its own flags: API key, back-pressure (429) and SIGTERM drain.

One server (key from $TOKENMILL_API_KEY, --max-num-seqs 1 --max-queue 1) serves the whole module;
the drain test runs last because it ends the process.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from tests.utils.server import (
    MALFORMED_MESSAGES,
    ServerProcess,
    assert_openai_error,
    openai_client,
    raw_grpc_call,
    sse_events,
)

API_KEY = "test-key-5f2c"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def small_server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tiny_model_dir,
        server_log_dir,
        "--max-num-seqs",
        "1",
        "--max-queue",
        "1",
        "--drain-timeout",
        "30",
        "--log-format",
        "text",
        env={"TOKENMILL_API_KEY": API_KEY},
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def completion(server: ServerProcess, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/completions", json=body, headers=headers if headers is not None else AUTH, timeout=120
    )


def test_api_key_required_on_v1_only(small_server: ServerProcess) -> None:
    import openai

    url = small_server.base_url
    assert_openai_error(httpx.get(f"{url}/v1/models"), 401, "invalid_api_key")
    assert_openai_error(httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(completion(small_server, {"prompt": "hi", "max_tokens": 1}, headers={}), 401)
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    assert completion(small_server, {"prompt": "hi", "max_tokens": 2}).status_code == 200
    for open_path in ("/health/live", "/health/ready", "/health", "/version", "/metrics"):
        assert httpx.get(f"{url}{open_path}").status_code == 200, open_path
    for docs_path in ("/openapi.json", "/docs", "/redoc"):  # the API's docs need the key too
        assert_openai_error(httpx.get(f"{url}{docs_path}"), 401, "invalid_api_key")
        assert httpx.get(f"{url}{docs_path}", headers=AUTH).status_code == 200, docs_path
    assert "/v1/completions" in httpx.get(f"{url}/openapi.json", headers=AUTH).json()["paths"]
    assert_openai_error(httpx.get(f"{url}/v1/models/anything"), 401, "invalid_api_key")
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert_openai_error(httpx.post(f"{url}{path}", json=body), 401, "invalid_api_key")
        assert httpx.post(f"{url}{path}", json=body, headers=AUTH).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai_client(small_server, api_key="nope").models.list()
    # Wrong keys are `unauthorized` in the metrics, not server errors.
    before = small_server.metrics()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert_openai_error(completion(small_server, {"prompt": "hi", "max_tokens": 1}, headers=headers), 401)
    after = small_server.metrics()
    key = 'tokenmill_requests_total{{endpoint="/v1/completions",status="{}"}}'
    assert after[key.format("unauthorized")] - before[key.format("unauthorized")] == 2
    assert after[key.format("error")] == before[key.format("error")]
    assert openai_client(small_server, api_key=API_KEY).models.list().data

    from tokenmill.server.proto import tokenmill_pb2 as pb
    from tokenmill.server.proto import tokenmill_pb2_grpc as pb_grpc

    with grpc.insecure_channel(small_server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=1), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Generate(
            pb.GenerateRequest(prompt="hi", max_tokens=2), metadata=[("authorization", f"Bearer {API_KEY}")], timeout=30
        )
        assert ok.usage.completion_tokens == 2
        # A malformed message is judged after the key: without one it is UNAUTHENTICATED, with it INVALID_ARGUMENT.
        for metadata, code in (
            ((), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", f"Bearer {API_KEY}"),), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                raw_grpc_call(channel, "Generate", MALFORMED_MESSAGES[0], metadata=metadata)
            assert exc.value.code() == code


def test_queue_over_limit_gets_429(small_server: ServerProcess) -> None:
    rejected = 'tokenmill_requests_total{endpoint="/v1/completions",status="rejected"}'
    before = small_server.metrics()[rejected]
    body = {"prompt": "flood", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    # 1 running + 1 waiting fit (--max-num-seqs 1 --max-queue 1); the rest must be refused at once.
    with ThreadPoolExecutor(8) as pool:
        started = time.monotonic()
        responses = list(pool.map(lambda _: (completion(small_server, body), time.monotonic() - started), range(8)))
    codes = [r.status_code for r, _ in responses]
    assert 429 in codes and 200 in codes, codes
    assert set(codes) <= {200, 429}, codes
    for r, _ in responses:
        if r.status_code == 429:
            assert_openai_error(r, 429, "queue_full")
            assert r.headers["retry-after"] == "1"
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    assert small_server.metrics()[rejected] - before == codes.count(429)


def test_a_request_that_could_never_be_admitted_is_a_400_not_a_429(small_server: ServerProcess) -> None:
    """More sequences than run at once plus the queue (1 + 1 here): a 429 would be retried for ever."""
    body = {"prompt": "hi", "max_tokens": 2}
    err = assert_openai_error(completion(small_server, {**body, "n": 3}), 400, "too_many_sequences")
    assert err["param"] == "n" and "at most 2" in err["message"]
    err = assert_openai_error(completion(small_server, {**body, "prompt": ["a", "b", "c"]}), 400, "too_many_sequences")
    assert completion(small_server, {**body, "n": 2}).status_code == 200


def test_sigterm_drains_in_flight_stream_then_exits_0(small_server: ServerProcess) -> None:
    result: dict[str, object] = {}
    first_chunk = threading.Event()

    def stream() -> None:
        body = {
            "prompt": "A long answer",
            "max_tokens": 120,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{small_server.base_url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            payloads = []
            for payload in sse_events(r.iter_lines()):
                payloads.append(payload)
                first_chunk.set()
        result["payloads"] = payloads

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(small_server.grpc_target)
    health = health_pb2_grpc.HealthStub(channel)

    def grpc_health(service: str = "") -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    assert grpc_health() == grpc_health("tokenmill.v1.Generation") == health_pb2.HealthCheckResponse.SERVING
    t = threading.Thread(target=stream)
    t.start()
    assert first_chunk.wait(60), "stream did not start"
    small_server.terminate()

    # Draining: readiness fails (so the load balancer stops sending), liveness holds, new work is refused...
    deadline = time.monotonic() + 5
    while httpx.get(f"{small_server.base_url}/health/ready").status_code != 503:
        assert time.monotonic() < deadline, "readiness did not turn 503 on SIGTERM"
        time.sleep(0.05)
    assert httpx.get(f"{small_server.base_url}/health/live").status_code == 200
    assert httpx.get(f"{small_server.base_url}/health").status_code == 503  # vLLM's probe path agrees
    assert_openai_error(completion(small_server, {"prompt": "late", "max_tokens": 2}), 503, "draining")
    # gRPC health agrees with /health/ready: NOT_SERVING for the server and the Generation service.
    assert grpc_health() == grpc_health("tokenmill.v1.Generation") == health_pb2.HealthCheckResponse.NOT_SERVING
    channel.close()
    assert t.is_alive(), "the stream should still be running during the drain"

    # ...while the running stream completes whole, then the process exits cleanly.
    t.join(120)
    payloads = result["payloads"]
    assert payloads[-1] == "[DONE]"
    usage = json.loads(payloads[-2])["usage"]
    assert usage["completion_tokens"] == 120
    assert sum(1 for p in payloads[:-2] if json.loads(p)["choices"][0]["text"] is not None) >= 1
    assert small_server.proc.wait(60) == 0
    assert "server stopped" in small_server.log_tail()
