"""Security checks: constant-time API key comparison, body size limit, per-request limits,
no prompt text in logs unless --log-prompts, non-root container image."""

from __future__ import annotations

import inspect
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stress.stress_lib import record
from tests.utils.server import ServerProcess, assert_openai_error
from tokenmill.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
)

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-stress-" + "7" * 24
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def locked_server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tiny_model_dir,
        server_log_dir,
        "--api-key",
        KEY,
        "--max-body-bytes",
        str(BODY_LIMIT),
        "--log-prompts",
        "--max-num-seqs",
        "4",
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _post(
    server: ServerProcess, body: dict | bytes, path: str = "/v1/completions", key: str | None = KEY, **kw
) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    content = body if isinstance(body, (bytes, type(x for x in ()))) else httpx.Request("POST", "/", json=body).content
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=60, **kw)


def test_api_key_is_compared_in_constant_time(locked_server: ServerProcess) -> None:
    from tokenmill.server import app, grpc_service

    for source in (inspect.getsource(app._require_api_key), inspect.getsource(grpc_service)):
        assert "hmac.compare_digest" in source
        assert not re.search(r"(token|key)\s*[!=]=\s*(key|token)", source), "plain == on the API key"
    for wrong in ("x", KEY[:-1], KEY + "x", KEY[:1], "x" * len(KEY), KEY.upper()):
        assert_openai_error(_post(locked_server, {"prompt": "hi", "max_tokens": 1}, key=wrong), 401, "invalid_api_key")
    assert_openai_error(_post(locked_server, {"prompt": "hi", "max_tokens": 1}, key=None), 401, "invalid_api_key")
    r = httpx.post(
        locked_server.base_url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"Authorization": f"Basic {KEY}"},
        timeout=30,
    )
    assert_openai_error(r, 401)
    assert _post(locked_server, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_max_body_bytes_is_enforced(locked_server: ServerProcess) -> None:
    pad = "a" * (BODY_LIMIT + 100)
    assert_openai_error(_post(locked_server, {"prompt": pad, "max_tokens": 1}), 413, "request_too_large")

    # Chunked upload (no Content-Length): the limit holds while streaming the body in.
    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"a" * 1024
        yield b'", "max_tokens": 1}'

    assert_openai_error(_post(locked_server, body()), 413, "request_too_large")
    ok = _post(locked_server, {"prompt": "a" * (BODY_LIMIT - 200), "max_tokens": 1})
    assert ok.status_code != 413, ok.text


@pytest.mark.parametrize(
    "field,over,at_limit",
    [
        ("n", MAX_N + 1, MAX_N),
        ("max_tokens", (1 << 20) + 1, None),
        ("stop", ["s"] * (MAX_STOP_STRINGS + 1), ["s"] * MAX_STOP_STRINGS),
        ("stop", ["s" * (MAX_STOP_STRING_CHARS + 1)], ["s" * MAX_STOP_STRING_CHARS]),
        ("logit_bias", {str(i): 0.5 for i in range(MAX_LOGIT_BIAS + 1)}, {str(i): 0.5 for i in range(MAX_LOGIT_BIAS)}),
        ("logprobs", MAX_TOP_LOGPROBS + 1, MAX_TOP_LOGPROBS),
    ],
)
def test_request_limits_are_400(stress_server: ServerProcess, field: str, over: object, at_limit: object) -> None:
    r = httpx.post(
        stress_server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, field: over}, timeout=60
    )
    err = assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error"
    if at_limit is not None:
        r = httpx.post(
            stress_server.base_url + "/v1/completions",
            json={"prompt": "x", "max_tokens": 1, field: at_limit},
            timeout=60,
        )
        assert r.status_code == 200, r.text


def test_prompts_stay_out_of_logs_unless_log_prompts(
    stress_server: ServerProcess, locked_server: ServerProcess
) -> None:
    marker = f"secret-{uuid.uuid4().hex}"
    bodies = [
        ("/v1/completions", {"prompt": f"{marker} ok", "max_tokens": 2}),
        ("/v1/completions", {"prompt": f"{marker} bad", "max_tokens": 2, "temperature": -1}),  # a 400
        ("/v1/completions", {"prompt": f"{marker} " * 3000, "max_tokens": 2}),  # too long: a 400
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": marker}], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": marker}], "max_tokens": 2, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": marker}], "user": marker, "max_tokens": 2}),
    ]
    for path, body in bodies:
        httpx.post(stress_server.base_url + path, json=body, timeout=60)
    # Positive control: the same request with --log-prompts does log it (so the grep below can see it).
    assert _post(locked_server, {"prompt": f"{marker} logged", "max_tokens": 1}).status_code == 200
    deadline = time.monotonic() + 10
    while marker not in locked_server.log_tail(1 << 20) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker in locked_server.log_tail(1 << 20)
    assert marker not in stress_server.log_path.read_text(errors="replace")
    record("security", prompt_marker_requests=len(bodies), prompt_leaks=0)


def test_container_runs_as_non_root() -> None:
    for name in ("Dockerfile", "Dockerfile.cuda"):
        path = REPO / "deploy" / name
        if not path.exists():
            continue
        text = path.read_text()
        last_stage = text.split("\nFROM ")[-1]
        users = re.findall(r"^USER\s+(\S+)", last_stage, flags=re.MULTILINE)
        assert users, f"{name}: no USER in the final stage (would run as root)"
        user = users[-1].split(":")[0]
        assert user not in ("root", "0"), f"{name}: final USER is {users[-1]}"
    entry = (REPO / "deploy" / "docker-entrypoint.sh").read_text()
    assert not re.search(r"\b(sudo|su|gosu|su-exec)\b", entry), "entrypoint must not switch users"
