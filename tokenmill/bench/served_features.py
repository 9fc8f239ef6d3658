"""Server-side features in `tokenmill bench features`: the same streamed workload through a real
`tokenmill serve` (127.0.0.1) with a server setting off and on, e.g. request tracing exported over
OTLP to a collector stub in this process (which counts the spans it receives)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

from tokenmill.bench.compare import free_port, real_server_cmd, start_server, stop_server, wait_ready
from tokenmill.bench.serve.report import BenchReport
from tokenmill.bench.serve.runner import run_benchmark
from tokenmill.bench.serve.workload import BenchRequest, warmup_requests

# Stands for the collector stub's address in a Feature's settings.
COLLECTOR_STUB = "collector-stub"
_STARTUP_TIMEOUT_S = 300.0


class CollectorStub:
    """An OTLP/gRPC trace receiver on 127.0.0.1 that accepts every export and counts its spans
    (the exporter's whole cost is paid, nothing is stored)."""

    def __init__(self) -> None:
        self.num_spans = 0
        self._lock = threading.Lock()
        self._server: Any = None
        self.url = ""

    def __enter__(self) -> CollectorStub:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        stub = self

        class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                count = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
                with stub._lock:
                    stub.num_spans += count
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


def engine_cli_args(config: Any) -> list[str]:
    """`tokenmill serve` flags that rebuild an EngineConfig (the fields that differ from the defaults)."""
    defaults = type(config)()
    flags: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "model" or value == getattr(defaults, field.name):
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _server_flags(settings: dict[str, Any], collector: CollectorStub) -> list[str]:
    flags: list[str] = []
    for name, value in settings.items():
        flags += ["--" + name.replace("_", "-"), collector.url if value == COLLECTOR_STUB else str(value)]
    return flags


def served_run(
    args: argparse.Namespace, model_dir: Path, settings: dict[str, Any], requests: list[BenchRequest], name: str
) -> tuple[BenchReport, int]:
    """Serve the model with these server settings, warm it up, stream `requests` at once; the report
    and how many spans the collector stub received (after the server's shutdown flushed them)."""
    from tokenmill.engine.config import EngineConfig

    # The off run must not pick up a collector from this shell's OTEL_* variables.
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    log_dir = Path(tempfile.mkdtemp(prefix="tokenmill-bench-features-"))
    with CollectorStub() as collector:
        port = free_port()
        flags = [
            *engine_cli_args(EngineConfig.from_cli_args(args)),
            "--grpc-port",
            "0",
            *_server_flags(settings, collector),
        ]
        server = start_server(name, real_server_cmd(model_dir, port, flags), port, "/health/ready", log_dir, environ)
        try:
            wait_ready([server], _STARTUP_TIMEOUT_S)
            asyncio.run(run_benchmark(server.url, warmup_requests(requests, 2), progress=False))  # untimed
            report = asyncio.run(run_benchmark(server.url, requests, seed=args.seed, progress=not args.no_progress))
        finally:
            stop_server(server)
    if report.failed:
        print(f"{name}: {report.failed} requests failed: {report.errors} (log {server.log_path})", file=sys.stderr)
    return report, collector.num_spans
