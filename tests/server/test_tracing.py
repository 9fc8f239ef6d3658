"""OpenTelemetry traces of real requests: a `tokenmill serve` subprocess whose spans go to a file
(`--otlp-traces-endpoint file://...`, the SDK's span JSON, one per line), read back here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import grpc
import httpx
import pytest

from tests.utils.server import ServerProcess, sse_events

# A client's trace context (W3C traceparent: version, trace id, parent span id, flags).
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
STAGES = ("tokenize", "queue", "prefill", "decode", "stream")
OUTPUT_TOKENS = 64
TRANSPORT_S = 0.010
OTEL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in OTEL_ENV}
    return {**env, **extra}


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _duration(span: dict) -> float:
    return _seconds(span["end_time"]) - _seconds(span["start_time"])


class SpanFile:
    def __init__(self, path: Path) -> None:
        self.path = path

    def spans(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def trace(self, trace_id: str, expected: int, timeout: float = 20.0) -> list[dict]:
        """The spans of one trace, once `expected` of them were written (the server span ends last)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = [s for s in self.spans() if s["context"]["trace_id"] == "0x" + trace_id]
            if len(spans) >= expected or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


def _traceparent(trace_id: str, span_id: str = CLIENT_SPAN_ID) -> str:
    return f"00-{trace_id}-{span_id}-01"


def _trace_id(n: int) -> str:
    return f"{n:032x}"


@pytest.fixture(scope="module")
def traced(tiny_model_dir: Path, server_log_dir: Path, tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    # PYTHONPROFILEIMPORTTIME: the server logs every module it imports (the control for the "off" test).
    proc = ServerProcess(
        tiny_model_dir,
        server_log_dir,
        "--otlp-traces-endpoint",
        f"file://{path}",
        env=_clean_env(PYTHONPROFILEIMPORTTIME="1"),
    )
    try:
        proc.wait_ready()
        yield proc, SpanFile(path)
    finally:
        proc.stop()


def _stream_chat(
    client: httpx.Client, server: ServerProcess, trace_id: str, max_tokens: int
) -> tuple[list[dict], float]:
    body = {
        "messages": [{"role": "user", "content": "Tell me a story about a mill."}],
        "max_tokens": max_tokens,
        "temperature": 0.5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    with client.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, headers={"traceparent": _traceparent(trace_id)}
    ) as response:
        assert response.status_code == 200, response.read()
        chunks = [json.loads(e) for e in sse_events(response.iter_lines()) if e != "[DONE]"]
    return chunks, time.perf_counter() - start


def _by_name(spans: list[dict]) -> dict[str, list[dict]]:
    named: dict[str, list[dict]] = {}
    for span in spans:
        named.setdefault(span["name"], []).append(span)
    return named


def test_streamed_request_is_one_trace_whose_stages_add_up(traced):
    server, span_file = traced
    with httpx.Client(timeout=60.0) as client:
        _stream_chat(client, server, _trace_id(1), 4)  # warm-up: first-request costs are not a stage
        chunks, e2e = _stream_chat(client, server, _trace_id(2), OUTPUT_TOKENS)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == OUTPUT_TOKENS
    spans = span_file.trace(_trace_id(2), expected=2 + len(STAGES))
    named = _by_name(spans)
    server_spans = [s for s in spans if s["kind"] == "SpanKind.SERVER"]
    assert len(server_spans) == 1 and server_spans[0]["name"] == "POST /v1/chat/completions", named.keys()
    server_span = server_spans[0]
    assert all(s["resource"]["attributes"]["service.name"] == "tokenmill" for s in spans)
    generation = next(s for s in spans if s["name"].startswith("chat "))
    assert generation["parent_id"] == server_span["context"]["span_id"]
    for stage in STAGES:
        assert len(named[stage]) == 1, (stage, named.keys())
        assert named[stage][0]["parent_id"] == generation["context"]["span_id"], stage
    assert len(spans) == 2 + len(STAGES), sorted(named)

    # The stages tile the request: together they are its end-to-end latency, as the client measured
    # it and as the server span shows it (within 5%). Outside the server span there is only the
    # transport (the client's request and HTTP framing), a few ms that a busy 2-core machine can
    # stretch: it gets TRANSPORT_S of its own.
    stage_total = sum(_duration(named[stage][0]) for stage in STAGES)
    assert stage_total <= e2e
    assert stage_total >= 0.95 * e2e - TRANSPORT_S, (stage_total, e2e, {s: _duration(named[s][0]) for s in STAGES})
    assert abs(stage_total - _duration(server_span)) <= 0.05 * _duration(server_span)
    for earlier, later in zip(STAGES, STAGES[1:]):  # in order, each starting where the last ended (or after)
        assert named[later][0]["start_time"] >= named[earlier][0]["end_time"], (earlier, later)

    attributes = generation["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "tokenmill"
    assert attributes["gen_ai.request.model"] == chunks[0]["model"] == attributes["gen_ai.response.model"]
    assert attributes["gen_ai.request.max_tokens"] == OUTPUT_TOKENS
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert attributes["gen_ai.response.id"] == chunks[0]["id"]
    prefill, decode = named["prefill"][0]["attributes"], named["decode"][0]["attributes"]
    assert prefill["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    # The warm-up sent the same prompt: its full blocks come from the prefix cache this time.
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert prefill["tokenmill.prefix_cache.hit_tokens"] == cached > 0
    assert decode["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    per_token = decode["tokenmill.time_per_output_token_s"]
    assert per_token == pytest.approx(_duration(named["decode"][0]) / (OUTPUT_TOKENS - 1), rel=1e-3)


def test_traceparent_links_the_server_span_to_the_clients_trace(traced):
    server, span_file = traced
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=60.0,
        headers={"traceparent": _traceparent(CLIENT_TRACE_ID)},
        json={"prompt": "The mill", "max_tokens": 3},
    )
    assert response.status_code == 200
    spans = span_file.trace(CLIENT_TRACE_ID, expected=2 + len(STAGES))
    server_span = next(s for s in spans if s["kind"] == "SpanKind.SERVER")
    assert server_span["context"]["trace_id"] == "0x" + CLIENT_TRACE_ID
    assert server_span["parent_id"] == "0x" + CLIENT_SPAN_ID
    generation = next(s for s in spans if s["name"].startswith("text_completion "))
    assert generation["attributes"]["gen_ai.usage.output_tokens"] == response.json()["usage"]["completion_tokens"]
    # A request without a traceparent starts a trace of its own.
    before = {s["context"]["trace_id"] for s in span_file.spans()}
    assert (
        httpx.post(
            f"{server.base_url}/v1/completions", timeout=60.0, json={"prompt": "The mill", "max_tokens": 3}
        ).status_code
        == 200
    )
    time.sleep(0.5)
    new = [s for s in span_file.spans() if s["context"]["trace_id"] not in before]
    assert [s["parent_id"] for s in new if s["kind"] == "SpanKind.SERVER"] == [None]


def test_rejected_request_is_traced_without_stages(traced):
    server, span_file = traced
    trace_id = _trace_id(5)
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        timeout=60.0,
        headers={"traceparent": _traceparent(trace_id)},
        json={"prompt": "The mill", "max_tokens": 3, "temperature": -1},
    )
    assert response.status_code == 400
    spans = span_file.trace(trace_id, expected=2)
    assert len(spans) == 2, [s["name"] for s in spans]  # no stage ran
    generation = next(s for s in spans if s["name"].startswith("text_completion "))
    assert generation["attributes"]["tokenmill.status"] == "invalid"
    assert generation["status"]["status_code"] == "UNSET"  # a client's mistake is not a server error
    server_span = next(s for s in spans if s["kind"] == "SpanKind.SERVER")
    assert server_span["attributes"]["http.status_code"] == 400


def test_grpc_stream_is_traced_under_the_grpc_server_span(traced):
    from tokenmill.server.proto import tokenmill_pb2 as pb
    from tokenmill.server.proto import tokenmill_pb2_grpc as pb_grpc

    server, span_file = traced
    trace_id = _trace_id(3)
    with grpc.insecure_channel(server.grpc_target) as channel:
        chunks = list(
            pb_grpc.GenerationStub(channel).GenerateStream(
                pb.GenerateRequest(prompt="The mill", max_tokens=5, ignore_eos=True),
                timeout=60,
                metadata=(("traceparent", _traceparent(trace_id)),),
            )
        )
    usage = chunks[-1].usage
    spans = span_file.trace(trace_id, expected=2 + len(STAGES))
    server_span = next(s for s in spans if s["kind"] == "SpanKind.SERVER")
    assert server_span["name"] == "/tokenmill.v1.Generation/GenerateStream"
    assert server_span["parent_id"] == "0x" + CLIENT_SPAN_ID
    generation = next(s for s in spans if s["name"].startswith("text_completion "))
    assert generation["parent_id"] == server_span["context"]["span_id"]
    assert generation["attributes"]["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert generation["attributes"]["gen_ai.usage.output_tokens"] == usage.completion_tokens == 5
    assert {s["name"] for s in spans} >= set(STAGES)


@pytest.mark.slow
def test_tracing_off_creates_no_span_and_imports_no_sdk(traced, tiny_model_dir, server_log_dir):
    # The control: the traced server imported the SDK (-X importtime lines name every module).
    assert "opentelemetry.sdk.trace" in traced[0].log_tail(10**8)
    proc = ServerProcess(tiny_model_dir, server_log_dir, env=_clean_env(PYTHONPROFILEIMPORTTIME="1"))
    try:
        proc.wait_ready()
        response = httpx.post(
            f"{proc.base_url}/v1/completions",
            timeout=60.0,
            headers={"traceparent": _traceparent(_trace_id(4))},
            json={"prompt": "The mill", "max_tokens": 3, "stream": True},
        )
        assert response.status_code == 200
        log = proc.log_tail(10**8)
    finally:
        proc.stop()
    # The import log is there and names none of the tracing packages. (FastAPI itself imports the
    # OpenTelemetry *API*, a no-op without an SDK: its native telemetry stays off without a provider.)
    assert "import time:" in log
    for package in ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation"):
        assert package not in log, package
    assert not any(s["context"]["trace_id"] == "0x" + _trace_id(4) for s in traced[1].spans())


@pytest.mark.unit
def test_endpoint_from_the_standard_environment_variables(monkeypatch):
    from tokenmill.cli import build_parser
    from tokenmill.cli.serve import settings_from_args

    def settings(*flags: str):
        return settings_from_args(build_parser().parse_args(["serve", *flags]))

    for name in OTEL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    assert settings().otlp_traces_endpoint is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert settings().otlp_traces_endpoint == "http://collector:4317"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    s = settings()
    assert (s.otlp_traces_endpoint, s.otlp_traces_protocol) == ("http://collector:4318/v1/traces", "http/protobuf")
    s = settings("--otlp-traces-endpoint", "http://127.0.0.1:4317", "--otlp-traces-protocol", "grpc")
    assert (s.otlp_traces_endpoint, s.otlp_traces_protocol) == ("http://127.0.0.1:4317", "grpc")


def test_missing_opentelemetry_is_a_one_line_error(tmp_path, tiny_model_dir):
    # A regular package named `opentelemetry` first on the path hides the installed one.
    shadow = tmp_path / "opentelemetry"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--otlp-traces-endpoint",
            "http://127.0.0.1:4317",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'tokenmill[otel]'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_bench_features_measures_tracing_off_and_on(tiny_model_dir, monkeypatch):
    from tokenmill.bench import features
    from tokenmill.cli import build_parser

    monkeypatch.setattr(features, "resolve_bench_model", lambda model: tiny_model_dir)
    args = build_parser().parse_args(
        [
            "bench",
            "features",
            "--num-prompts",
            "3",
            "--max-output",
            "16",
            "--only",
            "tracing",
            "--kv-cache-memory",
            "64MiB",
            "--no-progress",
        ]
    )
    (tracing,) = [f for f in features.FEATURES if any(k in f.name for k in args.only)]
    lines: list[str] = []
    rows = features.measure(args, [tracing], log=lines.append)
    assert [(r.setting, r.workload) for r in rows] == [("off", "serve"), ("on", "serve")]
    assert all(r.output_tok_s > 0 for r in rows)
    # Off exports nothing; on, the collector stub got every request's spans (3 timed + 2 warm-up).
    assert lines[0].endswith("0 failed, 0 spans exported"), lines
    exported = int(lines[1].split(", ")[-1].split()[0])
    assert exported >= 5 * (2 + len(STAGES)), lines


@pytest.mark.unit
def test_engine_flags_rebuild_the_engine_config():
    from tokenmill.bench.served_features import engine_cli_args
    from tokenmill.cli import build_parser
    from tokenmill.engine.config import EngineConfig

    config = EngineConfig(
        model="m",
        dtype="bfloat16",
        kv_cache_memory="64MiB",
        enable_prefix_caching=False,
        packed_linear=False,
        compile=True,
        overlap_scheduling=True,
        max_num_seqs=7,
    )
    args = build_parser().parse_args(["serve", "--model", "m", *engine_cli_args(config)])
    assert EngineConfig.from_cli_args(args) == config
