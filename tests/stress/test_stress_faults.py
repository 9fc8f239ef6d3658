"""Faults: clients vanishing at random points, injected engine failures, SIGTERM under load.

After each, the server must hold no KV blocks and run nothing, and the requests that were not
hit by the fault must complete whole.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.stress.stress_lib import (
    MAX_NUM_SEQS,
    MAX_QUEUE,
    Outcome,
    check_error_body,
    completion_body,
    counts,
    load_request,
    measure_capacity,
    new_client,
    record,
    scrape_once,
    stream_request,
    wait_quiescent,
)
from tests.utils.server import ServerProcess

# ---------------------------------------------------------------------------------------------- disconnects


def _http_request(path: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


async def _vanish(port: int, phase: str, rng: random.Random) -> str:
    """Open a raw connection, start a request and drop it at a point chosen by `phase`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if phase == "mid-body":  # the body never arrives in full
            body = json.dumps(completion_body("half a body", 64)).encode()
            writer.write(_http_request("/v1/completions", body)[: -len(body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 0.3))
        elif phase == "queued":  # the batch is full: leave while waiting for a slot
            writer.write(_http_request("/v1/completions", json.dumps(completion_body("queued", 64)).encode()))
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.05, 0.6))
        elif phase == "prefill":  # a long prompt: leave while it is being prefilled
            ids = [rng.randrange(100, 40000) for _ in range(rng.randint(800, 1500))]
            body = {"prompt": ids, "max_tokens": 16, "ignore_eos": True, "stream": True}
            writer.write(_http_request("/v1/completions", json.dumps(body).encode()))
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 0.15))
        elif phase == "mid-decode":  # read some tokens, then leave
            writer.write(_http_request("/v1/completions", json.dumps(completion_body("decode", 200)).encode()))
            await writer.drain()
            events = rng.randint(1, 20)
            for _ in range(10_000):  # bounded: headers + at most 20 events
                line = await asyncio.wait_for(reader.readline(), 60)
                if not line:
                    break
                if line.startswith(b"data: "):
                    events -= 1
                    if not events:
                        break
        elif phase == "non-streaming":  # a non-streaming request: leave before the answer
            body = {"prompt": "no stream", "max_tokens": 200, "ignore_eos": True}
            writer.write(_http_request("/v1/completions", json.dumps(body).encode()))
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.0, 1.0))
        else:
            raise AssertionError(phase)
    finally:
        writer.transport.abort()  # RST, no goodbye
    return phase


def test_random_disconnects_free_everything(stress_server: ServerProcess, long_mode: bool) -> None:
    rounds = 6 if long_mode else 2
    rng = random.Random(1234)
    port = stress_server.port
    phases = ["mid-body", "queued", "prefill", "mid-decode", "non-streaming"]
    aborted_key = 'tokenmill_requests_total{endpoint="/v1/completions",status="aborted"}'
    error_key = 'tokenmill_requests_total{endpoint="/v1/completions",status="error"}'
    before = scrape_once(stress_server.base_url)
    aborted_before = before[aborted_key]
    tried: dict[str, int] = {}

    async def one_round() -> None:
        # Fill the batch with streams that will be dropped mid-decode, then add a random mix on top
        # (most of which queue behind them) and drop everything at random moments.
        jobs = [_vanish(port, "mid-decode", rng) for _ in range(MAX_NUM_SEQS)]
        jobs += [_vanish(port, rng.choice(phases), rng) for _ in range(MAX_QUEUE)]
        for phase in await asyncio.wait_for(asyncio.gather(*jobs), 120):
            tried[phase] = tried.get(phase, 0) + 1

    for _ in range(rounds):
        asyncio.run(one_round())
        asyncio.run(wait_quiescent(stress_server.base_url, timeout_s=30))
    after = scrape_once(stress_server.base_url)
    assert stress_server.proc.poll() is None
    # Nothing leaked: idle engine, and a normal request still completes whole.
    ok = asyncio.run(_one_stream(stress_server.base_url, 0))
    assert ok.kind == "ok", ok.detail
    record(
        "disconnects",
        tried=sum(tried.values()),
        by_phase=dict(sorted(tried.items())),
        aborted_counted=int(after[aborted_key] - aborted_before),
        kv_after=after["tokenmill_kv_cache_usage_ratio"],
    )
    assert after[aborted_key] > aborted_before
    # A client that leaves is an abort (499), never a server error (500) with a traceback in the log.
    assert after[error_key] == before[error_key]


async def _one_stream(url: str, i: int, headers: dict[str, str] | None = None, max_tokens: int = 8) -> Outcome:
    async with new_client() as client:
        path, body = load_request(i, max_tokens)
        return await stream_request(client, url, path, body, headers=headers)


# ---------------------------------------------------------------------------------------------- injected faults


def test_injected_fault_fails_only_its_request(stress_server: ServerProcess, long_mode: bool) -> None:
    rounds = 10 if long_mode else 3
    url = stress_server.base_url
    injected = survived = normal_ok = 0

    async def fault_plain(client: httpx.AsyncClient, rid: str, body: dict) -> None:
        nonlocal injected, survived
        injected += 1
        r = await client.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
        assert r.status_code == 500, (r.status_code, r.text)
        assert check_error_body(r.text, 500) is None, r.text
        err = r.json()["error"]
        assert "injected fault" in err["message"] and err["type"] == "server_error", err
        assert r.headers["x-request-id"] == rid
        survived += 1

    async def fault_stream(client: httpx.AsyncClient, rid: str, path: str, body: dict) -> None:
        nonlocal injected, survived
        injected += 1
        async with client.stream("POST", url + path, json=body, headers={"X-Request-Id": rid}, timeout=60) as r:
            assert r.status_code == 200
            payloads = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]", payloads
        events = [json.loads(p) for p in payloads[:-1]]
        errors = [e for e in events if "error" in e]
        assert len(errors) == 1 and events[-1] is errors[0], events  # the error is the last event before [DONE]
        err = errors[0]["error"]
        assert "injected fault" in err["message"] and err["type"] == "server_error", err
        survived += 1

    async def one_round(k: int) -> None:
        nonlocal normal_ok
        async with new_client() as client:
            normals = [
                asyncio.ensure_future(stream_request(client, url, *load_request(1000 * k + i, 32))) for i in range(6)
            ]
            await asyncio.sleep(0.3)  # the normal streams are decoding: the faults join their batch
            faults = [
                fault_plain(client, f"fault-inject-{k}-plain", {"prompt": "boom", "max_tokens": 8}),
                fault_plain(client, f"fault-inject-{k}-n2", {"prompt": ["boom", "bang"], "n": 2, "max_tokens": 8}),
                fault_stream(client, f"fault-inject-{k}-stream", *load_request(2 * k, 8)),
                fault_stream(client, f"fault-inject-{k}-chat", *load_request(2 * k + 1, 8)),
            ]
            plain_normal = client.post(
                url + "/v1/completions", timeout=60, json={"prompt": "calm", "max_tokens": 12, "ignore_eos": True}
            )
            results = await asyncio.wait_for(asyncio.gather(*normals, plain_normal, *faults), 120)
        for o in results[: len(normals)]:
            assert o.kind == "ok", (o.kind, o.detail)
            normal_ok += 1
        plain = results[len(normals)]
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 12
        normal_ok += 1

    for k in range(rounds):
        asyncio.run(one_round(k))
    asyncio.run(wait_quiescent(url))
    assert stress_server.proc.poll() is None
    log = stress_server.log_path.read_text(errors="replace")  # whole: the startup warning is at the top
    assert "injected fault" in log and "fault injection is ON" in log
    record("injected_faults", injected=injected, survived=survived, concurrent_normal_ok=normal_ok)
    assert injected == survived == 4 * rounds


# ---------------------------------------------------------------------------------------------- SIGTERM


@pytest.fixture
def drain_server(tiny_model_dir: Path, server_log_dir: Path):
    proc = ServerProcess(
        tiny_model_dir, server_log_dir, "--max-num-seqs", "4", "--max-queue", "8", "--drain-timeout", "60"
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_sigterm_under_load_drains_every_started_stream(drain_server: ServerProcess, long_mode: bool) -> None:
    url = drain_server.base_url
    capacity = asyncio.run(measure_capacity(url, concurrency=4, duration_s=4))
    count = 300 if long_mode else 80
    rate = 2 * capacity
    sigterm_after = count / rate / 3  # a third of the way into the load
    max_tokens = 24
    sent_at: list[tuple[float, Outcome]] = []

    async def load() -> None:
        # No keep-alive: each request gets its own connection, as new clients arriving during a drain do.
        async with new_client(keepalive=False) as client:
            start = time.monotonic()
            tasks = []

            async def one(i: int) -> None:
                sent = time.monotonic() - start
                path, body = load_request(5000 + i, max_tokens)
                sent_at.append((sent, await stream_request(client, url, path, body, timeout=90)))

            for i in range(count):
                await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
                if i and abs(i / rate - sigterm_after) < 0.5 / rate:
                    drain_server.proc.send_signal(signal.SIGTERM)
                tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.gather(*tasks)

    asyncio.run(asyncio.wait_for(load(), 300))
    code = drain_server.proc.wait(60)
    outcomes = [o for _, o in sent_at]
    c = counts(outcomes)
    before_term = [o for t, o in sent_at if t < sigterm_after - 0.05]
    started_but_cut = [o for o in outcomes if o.started and o.kind != "ok"]
    lost = [o for o in outcomes if o.kind == "lost"]
    record(
        "sigterm_drain",
        requests_sent=len(outcomes),
        served=c.get("ok", 0),
        refused_429=c.get("refused", 0),
        refused_503=c.get("draining", 0),
        connection_refused=c.get("unreachable", 0),
        lost=len(lost),
        exit_code=code,
    )
    assert not started_but_cut, [(o.kind, o.detail) for o in started_but_cut[:5]]
    assert not lost, [(o.status, o.detail) for o in lost[:5]]
    assert code == 0
    assert c.get("ok", 0) > 0 and any(o.kind == "ok" for o in before_term)
    assert c.get("draining", 0) + c.get("unreachable", 0) > 0, c  # the drain did refuse new work
    # Refusals after SIGTERM are 503 or refused connections, never 429 or errors.
    after_term = [o for t, o in sent_at if t > sigterm_after + 0.5]
    assert {o.kind for o in after_term} <= {"ok", "draining", "unreachable"}, counts(after_term)
    assert "server stopped" in drain_server.log_tail()


@pytest.mark.unit
def test_fault_hook_is_off_by_default_and_hits_only_marked_requests() -> None:
    from types import SimpleNamespace

    from tokenmill.engine import faults
    from tokenmill.errors import RequestFailed

    engine = SimpleNamespace(runner=SimpleNamespace(before_forward=None))
    assert not faults.install(engine, environ={})
    assert not faults.install(engine, environ={faults.FAULT_ENV: "0"})
    assert engine.runner.before_forward is None
    assert faults.install(engine, environ={faults.FAULT_ENV: "1"})
    hook = engine.runner.before_forward
    seqs = [SimpleNamespace(request_id=r) for r in ("abc.0.0", "fault-inject-7.1.0", "x-fault-inject.2.1")]
    hook(seqs[:1])  # nothing marked: no failure
    with pytest.raises(RequestFailed) as exc:
        hook(seqs)
    assert exc.value.request_ids == {"fault-inject-7.1.0", "x-fault-inject.2.1"}
    assert str(exc.value) == "injected fault"
