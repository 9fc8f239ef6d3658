"""Stress suite fixtures: `--long` (full sizes) and one shared server with fault injection on."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stress.stress_lib import MAX_NUM_SEQS, MAX_QUEUE, REPORT
from tests.utils.server import ServerProcess


@pytest.fixture(scope="session")
def long_mode(request) -> bool:
    return bool(request.config.getoption("--long"))


@pytest.fixture(scope="session")
def stress_server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    """8 sequences in the batch, 16 more may wait; requests whose id has `fault-inject` fail.

    Overlap scheduling is forced on (on CPU it is off by default): aborts, injected faults and
    overload then hit an engine that always has a step in flight, its hardest case. The soak and
    drain servers run the default."""
    proc = ServerProcess(
        tiny_model_dir,
        server_log_dir,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-queue",
        str(MAX_QUEUE),
        "--overlap-scheduling",
        env={"TOKENMILL_FAULT_INJECTION": "1"},
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not REPORT:
        return
    mode = "long" if config.getoption("--long") else "short"
    terminalreporter.section(f"stress figures ({mode} mode)")
    for section, figures in REPORT.items():
        terminalreporter.write_line(f"{section}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))
    target = os.environ.get("TOKENMILL_STRESS_REPORT")
    if target:
        Path(target).write_text(json.dumps({"mode": mode, **REPORT}, indent=2, default=str) + "\n")
