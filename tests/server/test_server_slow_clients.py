"""Slow and excess clients against a real `tokenmill serve`: slowloris heads, trickled bodies and
silent sockets are closed on time (--header-timeout, --body-timeout), connections beyond
--max-connections are refused, and normal requests stay fast meanwhile.

Bounded: 140 attacking sockets, 2-3 s deadlines, every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.utils.server import ServerProcess

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 200
SLACK_S = 1.5  # timer granularity + a loaded 2-core machine
SLOW_HEADS, SILENT, SLOW_BODIES = 100, 20, 20
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def guarded_server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tiny_model_dir,
        server_log_dir,
        "--grpc-port",
        "0",
        "--header-timeout",
        str(HEADER_TIMEOUT_S),
        "--body-timeout",
        str(BODY_TIMEOUT_S),
        "--max-connections",
        str(MAX_CONNECTIONS),
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


class Attacker:
    """One raw socket that sends `opening` and then one more byte every `interval` seconds; records
    when the server closed it and what (if anything) it answered."""

    def __init__(self, port: int, opening: bytes, trickle: bytes | None) -> None:
        self.port, self.opening, self.trickle = port, opening, trickle
        self.opened = 0.0
        self.closed_after: float | None = None
        self.response = b""

    async def run(self, interval: float = 0.5, give_up_s: float = 30.0) -> None:
        reader, writer = await asyncio.open_connection(HOST, self.port)
        self.opened = time.monotonic()
        reading = asyncio.ensure_future(self._read_until_eof(reader))
        try:
            writer.write(self.opening)
            while not reading.done() and time.monotonic() - self.opened < give_up_s:
                if self.trickle:
                    writer.write(self.trickle)
                    await writer.drain()
                await asyncio.wait({reading}, timeout=interval)
        except (ConnectionResetError, BrokenPipeError):
            pass  # the server closed it while we wrote; the reader sees that too
        await asyncio.wait({reading}, timeout=2.0)
        reading.cancel()
        writer.close()

    async def _read_until_eof(self, reader: asyncio.StreamReader) -> None:
        try:
            while chunk := await reader.read(65536):
                self.response += chunk
        except ConnectionResetError:
            pass
        self.closed_after = time.monotonic() - self.opened


async def timed_completions(base_url: str, count: int) -> list[float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        times = []
        for i in range(count):
            start = time.monotonic()
            r = await client.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            times.append(time.monotonic() - start)
        return times


def test_slow_clients_are_closed_while_normal_requests_stay_fast(guarded_server: ServerProcess) -> None:
    port = guarded_server.port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    body_head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": "'
    )

    async def scenario() -> tuple[list[float], list[float], list[Attacker], list[Attacker], list[Attacker]]:
        baseline = await timed_completions(guarded_server.base_url, 8)
        heads = [Attacker(port, head, b"a") for _ in range(SLOW_HEADS)]  # never finishes its headers
        silent = [Attacker(port, b"", None) for _ in range(SILENT)]  # connects and says nothing
        bodies = [Attacker(port, body_head, b"a") for _ in range(SLOW_BODIES)]  # 1000-byte body, 2 bytes/s
        attack = asyncio.gather(*(a.run() for a in heads + silent + bodies))
        await asyncio.sleep(0.5)  # all connected and trickling
        during = await timed_completions(guarded_server.base_url, 8)
        await asyncio.wait_for(attack, 60)
        return baseline, during, heads, silent, bodies

    baseline, during, heads, silent, bodies = asyncio.run(scenario())

    for attacker in heads + silent:
        assert attacker.closed_after is not None, "a slow connection was never closed"
        # Closed by the head deadline (trickling does not reset it), not earlier and not much later.
        assert HEADER_TIMEOUT_S - 0.5 <= attacker.closed_after <= HEADER_TIMEOUT_S + SLACK_S, attacker.closed_after
        assert attacker.response == b""
    for attacker in bodies:
        assert attacker.closed_after is not None
        assert BODY_TIMEOUT_S - 0.5 <= attacker.closed_after <= BODY_TIMEOUT_S + SLACK_S, attacker.closed_after
        status_line, _, rest = attacker.response.partition(b"\r\n")
        assert status_line == b"HTTP/1.1 408 Request Timeout", attacker.response[:200]
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"

    # Normal requests on the same server were not slowed down by 140 hostile sockets.
    p50_before, p50_during = statistics.median(baseline), statistics.median(during)
    assert p50_during <= max(2.0 * p50_before, p50_before + 0.25), (baseline, during)
    closed = [a.closed_after for a in heads + silent]
    print(
        f"\nslow clients: {len(closed)} closed after {min(closed):.2f}-{max(closed):.2f} s "
        f"(header timeout {HEADER_TIMEOUT_S} s), {len(bodies)} slow bodies 408 after "
        f"{max(a.closed_after for a in bodies):.2f} s (body timeout {BODY_TIMEOUT_S} s); "
        f"normal p50 {p50_before * 1000:.0f} ms before, {p50_during * 1000:.0f} ms during"
    )
    assert guarded_server.proc.poll() is None


def test_long_response_outlives_the_header_deadline(guarded_server: ServerProcess) -> None:
    """The head deadline stops once the headers are in: a stream read slowly for longer than
    --header-timeout still completes whole, and the kept-alive connection serves the next request."""
    body = {"prompt": "A long answer", "max_tokens": 32, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(base_url=guarded_server.base_url, timeout=60.0) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            time.sleep(HEADER_TIMEOUT_S + 1.0)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        tokens = sum(1 for line in [first, *rest[:-1]] if json.loads(line[6:])["choices"][0]["text"])
        assert tokens >= 30
        assert client.post("/v1/completions", json={"prompt": "again", "max_tokens": 2}).status_code == 200


def test_connections_beyond_the_cap_are_closed_at_once(guarded_server: ServerProcess) -> None:
    extra = 10

    async def refused_at_once(reader: asyncio.StreamReader) -> bool:
        """EOF within 0.5 s: refused. Still open then (well inside the head deadline): held."""
        try:
            return await asyncio.wait_for(reader.read(1), 0.5) == b""
        except asyncio.TimeoutError:
            return False
        except ConnectionResetError:
            return True

    async def scenario() -> tuple[list[bool], float]:
        start = time.monotonic()
        conns = await asyncio.gather(
            *(asyncio.open_connection(HOST, guarded_server.port) for _ in range(MAX_CONNECTIONS + extra))
        )
        try:
            refused = await asyncio.gather(*(refused_at_once(reader) for reader, _ in conns))
            return refused, time.monotonic() - start
        finally:
            for _, writer in conns:
                writer.close()

    # Earlier tests' keep-alive connections must be gone (--keep-alive-timeout 5).
    time.sleep(5.5)
    refused, elapsed = asyncio.run(scenario())
    assert elapsed < HEADER_TIMEOUT_S, "too slow to tell the cap from the head deadline"
    assert extra <= sum(refused) <= extra + 2, (sum(refused), elapsed)  # +2: a stray keep-alive connection
    # The held ones were cut by the head deadline (or closed by us): the server serves again.
    deadline = time.monotonic() + HEADER_TIMEOUT_S + 10
    while True:
        try:
            r = httpx.post(
                f"{guarded_server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10
            )
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "server did not accept connections again"
            time.sleep(0.2)
    assert r.status_code == 200
    warnings = [
        rec for rec in guarded_server.log_records() if rec.get("msg") == "closed slow or excess HTTP connections"
    ]
    assert warnings and all(rec["level"] == "warning" for rec in warnings)
    assert "Traceback" not in guarded_server.log_tail(50000)
