"""Fixtures for server tests: a real `tokenmill serve` subprocess on free 127.0.0.1 ports.

`server` (one shared server for the whole run) and `server_log_dir` are registered by tests/conftest.py:
ask for them, do not import them into a test module (each importing module would start its own). Import
the helpers; `ServerProcess` starts a server with its own flags.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

READY_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tokenmill.cli serve ...` with its log in a file; stops it (SIGKILL fallback) on exit."""

    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        positional_model: bool = False,
        tls_ca: Path | None = None,
    ) -> None:
        """`positional_model`: `serve MODEL ...` (as `vllm serve` takes it) instead of `--model MODEL`;
        `tls_ca`: the server runs HTTPS (--ssl-certfile in `extra`) with a certificate this CA signed."""
        self.port = free_port()
        self.grpc_port = free_port()
        self.base_url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
        self.tls_ca = tls_ca
        # httpx's verify: the CA for https
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else True
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            *([str(model_dir)] if positional_model else ["--model", str(model_dir)]),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--grpc-port",
            str(self.grpc_port),
            "--kv-cache-memory",
            "64MiB",
            *extra,
        ]
        full_env = dict(os.environ)
        full_env.pop("TOKENMILL_API_KEY", None)  # a key in the developer's shell must not change the tests
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health/ready", timeout=1.0, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def log_records(self) -> list[dict]:
        """The JSON log lines written so far."""
        records = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
        return records

    def metrics(self) -> dict[str, float]:
        """Scrape /metrics: {'name{label="v",...}': value} with labels sorted, via the official parser."""
        return parse_metrics(httpx.get(f"{self.base_url}/metrics", timeout=5.0).text)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextmanager
def running_server(model_dir: Path, log_dir: Path, *extra: str) -> Iterator[ServerProcess]:
    """A ready `tokenmill serve` with these flags, stopped on exit (for module fixtures)."""
    proc = ServerProcess(model_dir, log_dir, *extra)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def post_json(server: ServerProcess, path: str, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=timeout)


# Fixtures are registered under their `name=` so that importing them (into tests/conftest.py) does not
# shadow a test's `server` parameter.


@pytest.fixture(scope="session", name="server_log_dir")
def server_log_dir_fixture(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session", name="server")
def server_fixture(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    """The shared server most tests use: small batch so 32 streams queue and batch."""
    with running_server(tiny_model_dir, server_log_dir, "--max-num-seqs", "8", "--max-queue", "256") as proc:
        yield proc


def model_id(server: ServerProcess) -> str:
    """The name the server reports for its model (`GET /v1/models`, the first entry), as a client
    that discovers it would use."""
    args = list(server.proc.args)
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=30, verify=server.verify)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def openai_client(server: ServerProcess, api_key: str = "unused", **kwargs):
    """The official client, pointed at the test server; no retries so 4xx/5xx surface as-is."""
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0, timeout=60.0, **kwargs)


def async_openai_client(server: ServerProcess, api_key: str = "unused"):
    import openai

    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0, timeout=120.0)


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    """The OpenAI error shape: {"error": {"message", "type", "param", "code"}} and nothing leaked."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


MALFORMED_MESSAGES = (b"\x0a\x05ab", b"\x0a\x02\xff\xfe", b"\xff\xff\xff\xff")  # truncated, bad UTF-8, bad tag


def raw_grpc_call(channel: grpc.Channel, method: str, payload: bytes, **kwargs) -> list[bytes]:
    """Send `payload` as the request message bytes (no serializer) and return the raw responses."""
    path = f"/tokenmill.v1.Generation/{method}"
    if method == "Generate":
        return [channel.unary_unary(path)(payload, timeout=30, **kwargs)]
    return list(channel.unary_stream(path)(payload, timeout=30, **kwargs))


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """`data:` payloads of a text/event-stream, up to and including [DONE]."""
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload
            if payload == "[DONE]":
                return


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v",...}': value} with labels sorted, via the official parser."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
