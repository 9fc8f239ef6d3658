"""The API tested from its own spec: schemathesis against the served /openapi.json finds no server
error and no response that violates the documented schemas (status codes, content types, JSON
bodies, and every server-sent event of a stream, whose `data` must be a documented chunk or error).

Short mode (part of `make test`): the examples, fuzzing and stateful phases, 10 cases per operation,
fixed seed. `--long`: the coverage phase too (every field's boundary and negative values), 100
cases per operation, random seed. The server runs with --max-model-len 64 so that whatever
schemathesis asks for is generated quickly.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stress.stress_lib import record
from tests.utils.server import ServerProcess

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
    "response_headers_conformance"
)


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, server_log_dir, "--grpc-port", "0", "--max-model-len", "64")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_successful_responses_match_the_spec(spec_server: ServerProcess) -> None:
    """Every shape of success (JSON and streams, logprobs, n, usage chunks, tokenizer endpoints)
    validated against the spec: random fuzzing rarely builds a request that succeeds."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{spec_server.base_url}/openapi.json")
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 3, "logprobs": 2, "n": 2}),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 3, "stream": True, "logprobs": 1, "stream_options": {"include_usage": True}},
        ),
        ("/v1/chat/completions", {"messages": user, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}),
        (
            "/v1/chat/completions",
            {
                "messages": user,
                "max_tokens": 3,
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                "logprobs": True,
            },
        ),
        ("/v1/chat/completions", {"messages": user, "max_tokens": 3, "store": True, "metadata": {"a": "b"}}),
        ("/tokenize", {"prompt": "hi", "return_token_strs": True}),
        ("/tokenize", {"messages": user, "add_generation_prompt": False}),
        ("/detokenize", {"tokens": [1, 2, 3]}),
    ]
    for path, body in cases:
        case = schema[path]["POST"].Case(body=body, media_type="application/json")
        response = case.call_and_validate()
        assert response.status_code == 200, (path, body)
    for path in ("/v1/models", "/health", "/health/ready", "/health/live", "/version", "/metrics"):
        assert schema[path]["GET"].Case().call_and_validate().status_code == 200, path


def test_schemathesis_finds_no_server_errors_or_schema_violations(
    spec_server: ServerProcess, long_mode: bool, tmp_path: Path
) -> None:
    phases = "examples,coverage,fuzzing,stateful" if long_mode else "examples,fuzzing,stateful"
    cmd = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{spec_server.base_url}/openapi.json",
        "--checks",
        CHECKS,
        "--phases",
        phases,
        "--max-examples",
        "100" if long_mode else "10",
        "--request-timeout",
        "60",
        "--workers",
        "1",
        "--report-dir",
        str(tmp_path),
        "--no-color",
    ]
    if not long_mode:
        cmd += ["--seed", "1"]  # CI stays deterministic
    # cwd: schemathesis keeps a .schemathesis/ cache in its working directory, not in the repository.
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=3000 if long_mode else 600, cwd=tmp_path)
    out = result.stdout + result.stderr
    summary = re.search(r"(\d+) generated, (\d+) passed", out)
    record(
        "schemathesis",
        phases=phases,
        exit_code=result.returncode,
        generated=int(summary.group(1)) if summary else None,
        passed=int(summary.group(2)) if summary else None,
    )
    assert result.returncode == 0, out[-6000:]
    assert summary and summary.group(1) == summary.group(2), out[-3000:]
    assert int(summary.group(1)) >= 50
    assert spec_server.proc.poll() is None
    assert "Traceback" not in spec_server.log_tail(200_000)
