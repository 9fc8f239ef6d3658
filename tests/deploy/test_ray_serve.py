"""Ray Serve scale-out (`tokenmill serve-ray`, tokenmill/deploy/ray_serve.py) on a local Ray instance.

Two CPU replicas of the tiny model (one CPU and one torch thread each) behind Ray Serve's proxy on
127.0.0.1: both replicas serve requests (seen in `X-Tokenmill-Replica`), the endpoint is
OpenAI-compatible (official client, streaming too), and after one replica's actor is killed the
endpoint keeps answering (clients retry a failed request a bounded number of times) while Ray
brings up a replacement. The CLI itself is run end to end once, with one replica.

Needs `pip install -e '.[test,ray]'` (ray[serve] pinned in pyproject.toml); a missing Ray is a
failure, not a skip.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.utils.server import free_port

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves this machine

try:
    import ray
    from ray import serve
except ImportError as exc:  # pragma: no cover - CI installs the [ray] extra
    pytest.fail(f"ray[serve] is not installed ({exc}): pip install -e '.[test,ray]'", pytrace=False)

from tokenmill.deploy import ray_serve
from tokenmill.engine.config import EngineConfig
from tokenmill.server.settings import ServerSettings

HEADER = ray_serve.REPLICA_HEADER
RETRIES = 8  # attempts per request while a replica is being replaced
RETRY_SLEEP_S = 0.5


def engine_config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory="64MiB", max_num_seqs=8)


def completion(base_url: str, model: str, prompt: str = "Hello there", max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions",
        timeout=60.0,
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )


def completion_with_retry(base_url: str, model: str, prompt: str = "Hello there") -> tuple[httpx.Response, int]:
    """A client's small bounded retry: transport errors and 5xx (a replica that just died) are
    retried up to RETRIES times; returns the response and how many attempts failed."""
    for attempt in range(RETRIES):  # `attempt` attempts have failed so far
        try:
            r = completion(base_url, model, prompt)
            if r.status_code < 500:
                return r, attempt
        except httpx.TransportError:
            pass
        time.sleep(RETRY_SLEEP_S * (attempt + 1))
    pytest.fail(f"no answer after {RETRIES} attempts")


# ---------------------------------------------------------------------------------------------- pure


def test_deployment_options_cpu():
    scale = ray_serve.ScaleOptions(num_replicas=2, num_cpus=1)
    opts = ray_serve.deployment_options(EngineConfig(model="m", device="cpu", max_num_seqs=8), scale)
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"]["num_cpus"] == 1
    assert "num_gpus" not in opts["ray_actor_options"]
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"
    assert opts["max_ongoing_requests"] == 8
    assert ray_serve.replica_engine_config(EngineConfig(model="m", device="cpu"), scale).num_threads == 1
    # An explicit --num-threads wins.
    assert ray_serve.replica_engine_config(EngineConfig(model="m", device="cpu", num_threads=3), scale).num_threads == 3


def test_deployment_options_cuda_autoscaling():
    scale = ray_serve.ScaleOptions(num_replicas=2, min_replicas=1, max_replicas=4, target_ongoing_requests=16)
    opts = ray_serve.deployment_options(EngineConfig(model="m", device="cuda"), scale)
    assert opts["ray_actor_options"]["num_gpus"] == 1
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"] == {
        "min_replicas": 1,
        "initial_replicas": 2,
        "max_replicas": 4,
        "target_ongoing_requests": 16,
    }
    assert ray_serve.replica_engine_config(EngineConfig(model="m", device="cuda"), scale).num_threads is None


def test_scale_options_validate():
    with pytest.raises(ValueError):
        ray_serve.ScaleOptions(num_replicas=0)
    with pytest.raises(ValueError):
        ray_serve.ScaleOptions(min_replicas=3, max_replicas=2)


def test_cli_registered():
    from tokenmill.cli import build_parser

    args = build_parser().parse_args(["serve-ray", "--model", "m", "--num-replicas", "3", "--port", "9000"])
    assert (args.command, args.num_replicas, args.port, args.host) == ("serve-ray", 3, 9000, "127.0.0.1")


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.mark.slow
@pytest.mark.server
def test_serve_ray_cli_end_to_end(tiny_model_dir: Path, tmp_path: Path):
    """`tokenmill serve-ray` starts its own local Ray, serves, and exits 0 on SIGTERM.

    Runs before the in-process cluster below exists (file order), so the two never overlap."""
    port = free_port()
    log = tmp_path / "serve-ray.log"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill.cli",
        "serve-ray",
        "--model",
        str(tiny_model_dir),
        "--device",
        "cpu",
        "--kv-cache-memory",
        "64MiB",
        "--max-num-seqs",
        "4",
        "--num-replicas",
        "1",
        "--ray-num-cpus",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("TOKENMILL_API_KEY", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None, f"serve-ray exited {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"serve-ray not ready:\n{log.read_text()[-4000:]}"
            try:
                if httpx.get(f"{base}/health/ready", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        model = httpx.get(f"{base}/v1/models", timeout=10.0).json()["data"][0]["id"]
        r = completion(base, model)
        assert r.status_code == 200, r.text
        assert r.headers.get(HEADER)
        assert r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------- two replicas


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path):
    """A local Ray instance (2 CPUs, loopback only) running 2 CPU replicas of the tiny model."""
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", namespace="tokenmill-test")
    port = free_port()
    try:
        ray_serve.start(
            engine_config(tiny_model_dir),
            ServerSettings(host="127.0.0.1", port=port),
            ray_serve.ScaleOptions(num_replicas=2, num_cpus=1),
        )
        base = f"http://127.0.0.1:{port}"
        model = httpx.get(f"{base}/v1/models", timeout=10.0).json()["data"][0]["id"]
        yield base, model
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def replica_states() -> dict[str, int]:
    status = serve.status().applications[ray_serve.APP_NAME].deployments[ray_serve.DEPLOYMENT_NAME]
    return dict(status.replica_states)


@pytest.mark.server
def test_openai_client_through_ray(cluster):
    import openai

    base, model = cluster
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60.0)
    out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert out.usage.completion_tokens == 6 and out.choices[0].text
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert any(c.choices and c.choices[0].finish_reason for c in chunks), "the stream never finished"


@pytest.mark.server
def test_streaming_is_tagged_with_replica(cluster):
    base, model = cluster
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60.0) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers.get(HEADER)
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


@pytest.mark.server
def test_errors_and_metrics_per_replica(cluster):
    base, _ = cluster
    r = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30.0)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    m = httpx.get(f"{base}/metrics", timeout=10.0)
    assert m.status_code == 200 and "tokenmill_requests_total" in m.text and m.headers.get(HEADER)


def answers_by_replica(base: str, model: str, label: str) -> dict[str, int]:
    """Up to 6 waves of 8 concurrent completions (every one answered 200), stopping once both
    replicas answered: how many each replica answered. Concurrent, because one request at a time to
    idle replicas, Ray's router once sent all of 40 to the same one."""
    seen: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for wave in range(6):
            for r in pool.map(lambda i, wave=wave: completion(base, model, f"{label} {wave} {i}"), range(8)):
                assert r.status_code == 200, r.text
                seen[r.headers[HEADER]] = seen.get(r.headers[HEADER], 0) + 1
            if len(seen) >= 2:
                break
    return seen


@pytest.mark.server
def test_both_replicas_serve(cluster):
    base, model = cluster
    seen = answers_by_replica(base, model, "prompt")
    assert len(seen) == 2, f"requests were not spread over both replicas: {seen}"
    assert replica_states() == {"RUNNING": 2}


@pytest.mark.server
def test_killed_replica_is_replaced_and_requests_keep_flowing(cluster):
    base, model = cluster
    before = set(answers_by_replica(base, model, "warm"))
    assert len(before) == 2, before
    victim = min(before)
    ray.kill(ray.get_actor(ray_serve.replica_actor_name(victim), namespace="serve"), no_restart=True)

    served, failed_attempts = set(), 0
    deadline = time.monotonic() + 120
    replaced = False
    i = 0
    while time.monotonic() < deadline:
        r, failed = completion_with_retry(base, model, f"after kill {i}")
        i += 1
        failed_attempts += failed
        assert r.status_code == 200, r.text
        served.add(r.headers[HEADER])
        new = served - before
        if new and replica_states() == {"RUNNING": 2}:
            replaced = True
            break
        time.sleep(0.1)
    assert victim not in served, "a killed replica cannot answer"
    assert replaced, f"no replacement replica served within 120s (served by {served}, states {replica_states()})"
    assert i >= 1
    # Give the report a number to look at: how often the client had to retry during the gap.
    print(f"requests after kill: {i}, failed attempts retried: {failed_attempts}, replicas seen: {sorted(served)}")


def test_serve_config_file_builds():
    """deploy/ray/serve-config.yaml: its import_path and args build the application (no cluster)."""
    import importlib

    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve-config.yaml").read_text())
    (app_cfg,) = config["applications"]
    module, _, attr = app_cfg["import_path"].partition(":")
    builder = getattr(importlib.import_module(module), attr)
    app = builder(app_cfg["args"])
    assert isinstance(app, serve.Application)
    scale = ray_serve.ScaleOptions(**app_cfg["args"]["scale"])
    opts = ray_serve.deployment_options(EngineConfig(**app_cfg["args"]["engine"]), scale)
    assert opts["ray_actor_options"]["num_gpus"] == 1
    assert opts["autoscaling_config"]["max_replicas"] == 8
    with pytest.raises(ValueError):
        builder({"bogus": {}})
