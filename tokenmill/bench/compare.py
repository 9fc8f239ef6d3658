"""`tokenmill bench compare`: tokenmill vs the naive Hugging Face baseline on one request trace.

Both servers run as subprocesses on 127.0.0.1 (own process groups, so their children go too), are
polled until ready, warmed up, and benchmarked one after the other with the identical trace (same
prompts, same seeded arrival times). They are always terminated, even on errors or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenmill.bench.report import environment, json_safe, write_json
from tokenmill.bench.sampling import sampling_from_args
from tokenmill.bench.serve.report import BenchReport, format_table, plot_reports
from tokenmill.bench.serve.runner import run_benchmark
from tokenmill.bench.serve.workload import (
    BenchRequest,
    describe_trace,
    load_tokenizer,
    requests_from_args,
    warmup_requests,
)
from tokenmill.server.omp import server_omp_settings

REAL_NAME = "tokenmill"
NAIVE_NAME = "naive-hf"


@dataclass
class ServerProcess:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    ready_path: str
    log_path: Path


def free_port() -> int:
    """A port that is free right now (the small race before the server binds it is acceptable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def real_server_cmd(model_dir: Path, port: int, extra: Sequence[str] = ()) -> list[str]:
    # `python -m tokenmill.cli` is the `tokenmill` entry point without depending on PATH.
    return [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


def naive_server_cmd(model_dir: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tokenmill.bench.naive_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def start_server(
    name: str, cmd: list[str], port: int, ready_path: str, log_dir: Path, environ: dict[str, str] | None = None
) -> ServerProcess:
    """`cmd` in its own session, logging to a file; `environ` replaces this process's environment."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        # A new session makes the server a process-group leader, so stopping it reaches its children.
        # Both servers get the same OpenMP wait settings as `tokenmill serve` sets for itself.
        base = os.environ if environ is None else environ
        env = {**base, **server_omp_settings(base)}
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    return ServerProcess(name, proc, f"http://127.0.0.1:{port}", ready_path, log_path)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _is_ready(client: httpx.Client, server: ServerProcess) -> bool:
    try:
        return client.get(server.url + server.ready_path).status_code == 200
    except httpx.HTTPError:
        return False  # not listening yet


def wait_ready(servers: Sequence[ServerProcess], timeout_s: float, poll_s: float = 0.5) -> None:
    """Block until every server answers 200 on its readiness path; fail fast if one exits."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while pending:
            for server in list(pending):
                rc = server.proc.poll()
                if rc is not None:
                    raise RuntimeError(
                        f"{server.name} server exited with code {rc} before becoming ready "
                        f"(log {server.log_path}):\n{log_tail(server.log_path)}"
                    )
                if _is_ready(client, server):
                    print(f"{server.name} ready at {server.url}", file=sys.stderr)
                    pending.remove(server)
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise TimeoutError(f"{names} not ready after {timeout_s:.0f} s (logs in {pending[0].log_path.parent})")
            if pending:
                time.sleep(poll_s)


def stop_server(server: ServerProcess, grace_s: float = 15.0) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left after `grace_s`."""
    if server.proc.poll() is not None:
        return
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    except ProcessLookupError:
        pass  # already gone


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("nan")


def comparison_ratios(real: BenchReport, naive: BenchReport) -> dict[str, float]:
    """Both ratios read as "times better for tokenmill": > 1 means tokenmill wins."""
    return {
        "output_throughput_ratio": _ratio(real.output_throughput, naive.output_throughput),
        "request_throughput_ratio": _ratio(real.request_throughput, naive.request_throughput),
        "p50_ttft_ratio": _ratio(naive.ttft.p50_ms, real.ttft.p50_ms),
    }


def _ratio_rows(ratios: dict[str, float]) -> list[tuple[str, list[str]]]:
    labels = {
        "output_throughput_ratio": "Output throughput ratio (tokenmill/naive)",
        "request_throughput_ratio": "Request throughput ratio (tokenmill/naive)",
        "p50_ttft_ratio": "P50 TTFT ratio (naive/tokenmill)",
    }
    return [(labels[k], [f"{v:.2f}x", ""]) for k, v in ratios.items()]


async def _bench_both(
    servers: Sequence[ServerProcess], requests: list[BenchRequest], args: argparse.Namespace
) -> dict[str, BenchReport]:
    reports: dict[str, BenchReport] = {}
    sampling = sampling_from_args(args)
    for server in servers:  # one after the other: they share the machine's cores
        if args.warmup > 0:  # first requests pay lazy init / allocator warmup; keep it out of the numbers
            await run_benchmark(
                server.url, warmup_requests(requests, args.warmup), seed=args.seed, progress=False, sampling=sampling
            )
        print(f"benchmarking {server.name} ...", file=sys.stderr)
        reports[server.name] = await run_benchmark(
            server.url,
            requests,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            sampling=sampling,
        )
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} server died during the benchmark:\n{log_tail(server.log_path)}")
    return reports


def _config(args: argparse.Namespace, model_dir: Path, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    return {
        "model": str(model_dir),
        "num_prompts": len(requests),
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "dataset": args.dataset,
        "input_len": None if args.dataset else args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "sampling": asdict(sampling_from_args(args)),
    }


def main(args: argparse.Namespace) -> int:
    """Run the comparison described by the `bench compare` flags; returns a process exit code."""
    from tokenmill.models.model_loader.hub import resolve_model

    model_dir = resolve_model(args.model)  # convert the default model once, before two servers race for it
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    requests = requests_from_args(args, tokenizer)
    print(describe_trace(requests, args.request_rate, args.max_concurrency), file=sys.stderr)
    log_dir = Path(tempfile.mkdtemp(prefix="tokenmill-bench-compare-"))
    print(f"server logs: {log_dir}", file=sys.stderr)
    real_port, naive_port = args.port or free_port(), args.naive_port or free_port()
    servers: list[ServerProcess] = []
    try:
        servers.append(
            start_server(
                REAL_NAME,
                real_server_cmd(model_dir, real_port, shlex.split(args.serve_args)),
                real_port,
                "/health/ready",
                log_dir,
            )
        )
        servers.append(
            start_server(NAIVE_NAME, naive_server_cmd(model_dir, naive_port), naive_port, "/health/live", log_dir)
        )
        wait_ready(servers, args.startup_timeout)
        reports = asyncio.run(_bench_both(servers, requests, args))
    finally:
        for server in servers:
            stop_server(server)
    ratios = comparison_ratios(reports[REAL_NAME], reports[NAIVE_NAME])
    print(format_table(reports, extra_rows=_ratio_rows(ratios)))
    if args.json:
        write_json(
            args.json,
            json_safe(
                {
                    "environment": environment(),
                    "config": _config(args, model_dir, requests),
                    "ratios": ratios,
                    "reports": {name: rep.to_dict() for name, rep in reports.items()},
                }
            ),
        )
    if args.plot:
        title = (
            f"tokenmill vs naive HF: output throughput ratio {ratios['output_throughput_ratio']:.2f}x, "
            f"p50 TTFT ratio {ratios['p50_ttft_ratio']:.2f}x (>1: tokenmill better)\n"
            f"{len(requests)} requests, rate {args.request_rate} req/s, "
            f"max concurrency {args.max_concurrency or 'unbounded'}"
        )
        plot_reports(reports, args.plot, title=title)
        print(f"wrote {args.plot}", file=sys.stderr)
    failed = sum(rep.failed for rep in reports.values())
    return 0 if failed == 0 else 1
