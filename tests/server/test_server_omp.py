"""Server processes' OpenMP workers spin a bounded while, then sleep (tokenmill/server/omp.py), set
before torch loads; offline keeps libgomp's defaults; an explicit setting always wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.cli import build_parser
from tokenmill.server.omp import server_omp_settings


@pytest.mark.unit
def test_settings_fill_in_only_when_neither_is_set() -> None:
    assert server_omp_settings({}) == {"GOMP_SPINCOUNT": "100000"}
    assert server_omp_settings({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert server_omp_settings({"GOMP_SPINCOUNT": "1000"}) == {}


@pytest.mark.unit
def test_server_commands_ask_for_them_and_offline_ones_do_not() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).server_omp is True
    assert getattr(parser.parse_args(["bench", "offline"]), "server_omp", False) is False


def test_a_server_process_sets_them_before_torch_loads() -> None:
    """`tokenmill serve` puts them in its environment before torch (and so libgomp) is imported: any
    subcommand's registration importing torch (as `bench` and `export` did) would make them void."""
    code = (
        "import os, sys\n"
        "import tokenmill.cli.serve as commands\n"
        "commands.run_serve = lambda args: print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'),"
        " 'torch' in sys.modules)\n"
        "from tokenmill.cli import main\n"
        "sys.exit(main(['serve']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "100000", "False"]
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # an explicit setting wins
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["ACTIVE", "None", "False"]
