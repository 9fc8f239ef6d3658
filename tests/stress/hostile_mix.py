"""The hostile mix: user-supplied programs (schemas, regexes, grammars, choice lists, tool schemas)
built to cost the server as much as possible, sent while a well-behaved client streams.

Used by `test_stress_hostile_inputs.py`, and runnable against any server to measure it:

    python -m tests.stress.hostile_mix --url http://127.0.0.1:8000 --pid SERVER_PID [--json out.json]

Every request has a client timeout, so a server that stalls shows up as slow figures, never as a
hung run. What each case stands for is in its name: `deep-schema-text` a JSON schema sent as text
and nested 400 levels deep; `slow-regex` a 15-byte regex that takes seconds to compile;
`slow-regex-left` the same, with the client gone after a second; `endless-grammar` a 2 KB grammar
whose compile would run far past the deadline; `big-choices` 200 KB choice lists; `huge-choices` a 1 MB
one; `ambiguous-grammar` a grammar whose matcher state grows with every token; `any-of-1000-n16` a
1,000-branch anyOf sampled 16 times; `huge-tool-schema` an 830 KB tool parameters schema;
`tool-schema-loop` two clients sending 60 KB tool schemas back to back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

HOSTILE_TIMEOUT_S = 180.0
WELL_BEHAVED_TOKENS = 48
SLOW_REGEX = "[^x]{0,100000}"
AMBIGUOUS_GRAMMAR = 'root ::= b* "y"\nb ::= "x"* "x"* "x"* "x"* "x"*'


@dataclass
class Outcome:
    case: str
    status: int | None = None  # HTTP status (None: no answer: timed out, or the client left on purpose)
    code: str | None = None  # the error's code, in the body or in a stream's error event
    seconds: float = 0.0
    detail: str = ""


@dataclass
class StreamFigures:
    ttft_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)  # between consecutive token events
    whole: int = 0
    broken: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- requests


def _nested_schema_text(depth: int, leaf: str) -> str:
    return '{"type": "array", "items": ' * depth + json.dumps({"type": leaf}) + "}" * depth


def _choices(count: int, length: int, tag: str) -> list[str]:
    return [f"{tag}{i:05d}" + "abcdefghij"[i % 10] * (length - len(tag) - 5) for i in range(count)]


def _tool(name: str, properties: int, description: int) -> dict[str, Any]:
    props = {f"p{i}": {"type": "string", "description": "d" * description} for i in range(properties)}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


def hostile_requests(copies: int = 1) -> list[tuple[str, str, dict[str, Any], float | None]]:
    """(case, path, body, seconds after which the client leaves (None: it waits)); `copies` distinct
    requests of each case."""
    completion = {"prompt": "Answer:", "max_tokens": 8}
    chat = {"messages": [{"role": "user", "content": "Call a tool."}], "max_tokens": 1}
    any_of = {
        "anyOf": [
            {
                "type": "object",
                "properties": {f"k{i}": {"type": "integer"}, "v": {"type": "string"}},
                "required": [f"k{i}"],
            }
            for i in range(1000)
        ]
    }
    ambiguous = {
        "prompt": "x",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
        "guided_grammar": AMBIGUOUS_GRAMMAR,
        "logit_bias": {"104": 100},  # "x" in SmolLM2's vocabulary: it writes x after x
    }
    sampled_16 = {"prompt": "{", "max_tokens": 64, "n": 16, "stream": True, "guided_json": any_of, "temperature": 1.0}
    out: list[tuple[str, str, dict[str, Any], float | None]] = []
    for i in range(copies):
        leaf = ("integer", "string", "boolean", "number")[i % 4]
        # 24 rules of distinct long repetitions, each slow to compile: together far past the deadline.
        endless = "root ::= " + " | ".join(f"r{k}" for k in range(24)) + "\n"
        endless += "".join(f'r{k} ::= [^x]{{0,{100000 + k}}} "{i}"\n' for k in range(24))
        out += [
            (
                "deep-schema-text",
                "/v1/completions",
                {**completion, "guided_json": _nested_schema_text(400, leaf)},
                None,
            ),
            ("slow-regex", "/v1/completions", {**completion, "guided_regex": f"{SLOW_REGEX}{i}"}, None),
            ("slow-regex-left", "/v1/completions", {**completion, "guided_regex": f"{SLOW_REGEX}-{i}"}, 1.0),
            ("endless-grammar", "/v1/completions", {**completion, "guided_grammar": endless}, None),
            ("big-choices", "/v1/completions", {**completion, "guided_choice": _choices(200, 1000, f"c{i}")}, None),
            ("huge-choices", "/v1/completions", {**completion, "guided_choice": _choices(1000, 1000, f"h{i}")}, None),
            ("ambiguous-grammar", "/v1/completions", {**ambiguous, "seed": i}, None),
            ("any-of-1000-n16", "/v1/completions", {**sampled_16, "seed": i}, None),
            ("huge-tool-schema", "/v1/chat/completions", {**chat, "tools": [_tool(f"h{i}", 4200, 160)]}, None),
        ]
    return out


async def _send(
    client: httpx.AsyncClient, url: str, case: str, path: str, body: dict, leave_after: float | None
) -> Outcome:
    out = Outcome(case)
    start = time.monotonic()

    async def go() -> None:
        async with client.stream("POST", url + path, json=body, timeout=HOSTILE_TIMEOUT_S) as r:
            out.status = r.status_code
            text = (await r.aread()).decode(errors="replace")
            if r.status_code != 200:
                out.code = _error_code(text)
                out.detail = text[:200]
            else:  # a stream may end with an in-band error event
                events = [line for line in text.splitlines() if line.startswith("data: ")]
                out.detail = events[-2][:200] if len(events) > 1 else text[:200]
                for line in events:
                    if line.startswith("data: {") and '"error"' in line[:20]:
                        out.code = _error_code(line[6:])

    try:
        if leave_after is not None:
            await asyncio.wait_for(go(), leave_after)
        else:
            await go()
    except (asyncio.TimeoutError, httpx.TimeoutException):
        out.detail = "left" if leave_after is not None else f"no answer within {HOSTILE_TIMEOUT_S:g} s"
    except httpx.HTTPError as exc:
        out.detail = f"{type(exc).__name__}: {exc}"
    out.seconds = time.monotonic() - start
    return out


def _error_code(text: str) -> str | None:
    try:
        return json.loads(text)["error"].get("code") or json.loads(text)["error"].get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def tool_schema_loop(client: httpx.AsyncClient, url: str, until: float) -> list[Outcome]:
    """Back-to-back chat requests with a 60 KB (valid) tool schema, until `until`."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [_tool("t", 300, 160)]}
    outcomes = []
    while time.monotonic() < until:
        outcomes.append(await _send(client, url, "tool-schema-loop", "/v1/chat/completions", body, None))
    return outcomes


# ---------------------------------------------------------------------------------------------- the well-behaved


async def well_behaved_stream(client: httpx.AsyncClient, url: str, figures: StreamFigures, seed: int) -> None:
    """One streaming completion of WELL_BEHAVED_TOKENS tokens: its TTFT and inter-token gaps."""
    body = {
        "prompt": "Tell me about the river mill",
        "max_tokens": WELL_BEHAVED_TOKENS,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.monotonic()
    last = None
    tokens, tokens_reported = 0, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=HOSTILE_TIMEOUT_S) as r:
            if r.status_code != 200:
                figures.broken.append(f"HTTP {r.status_code}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    usage = chunk.get("usage") or {}
                    tokens_reported = usage.get("completion_tokens")
                    continue
                now = time.monotonic()
                if last is None:
                    figures.ttft_s.append(now - start)
                else:
                    figures.gaps_s.append(now - last)
                last = now
                tokens += 1
    except httpx.HTTPError as exc:
        figures.broken.append(f"{type(exc).__name__}: {exc}")
        return
    if tokens_reported == WELL_BEHAVED_TOKENS:
        figures.whole += 1
    else:
        figures.broken.append(f"{tokens} chunks, usage {tokens_reported}")


async def well_behaved(url: str, until: float, min_streams: int) -> StreamFigures:
    """Streams back to back until `until` (and at least `min_streams`)."""
    figures = StreamFigures()
    async with httpx.AsyncClient() as client:
        n = 0
        while n < min_streams or time.monotonic() < until:
            await well_behaved_stream(client, url, figures, seed=n)
            n += 1
    return figures


async def health_probe(url: str, until: float) -> list[float]:
    latencies = []
    async with httpx.AsyncClient() as client:
        while time.monotonic() < until:
            start = time.monotonic()
            try:
                await client.get(url + "/health", timeout=60)
            except httpx.HTTPError:
                pass
            latencies.append(time.monotonic() - start)
            await asyncio.sleep(0.2)
    return latencies


# ---------------------------------------------------------------------------------------------- a run


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def children_rss_mb(pid: int) -> float:
    return sum(c.memory_info().rss for c in psutil.Process(pid).children(recursive=True)) / 2**20


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 4),
        "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
        "max": round(ordered[-1], 4),
        "n": len(ordered),
    }


async def solo_phase(url: str, streams: int) -> dict[str, Any]:
    until = time.monotonic()
    figures, health = await asyncio.gather(well_behaved(url, until, streams), health_probe(url, time.monotonic() + 3))
    return {
        "ttft": summary(figures.ttft_s),
        "gap": summary(figures.gaps_s),
        "health": summary(health),
        "figures": figures,
    }


async def hostile_phase(
    url: str, min_streams: int, tool_loop_s: float, copies: int, cases: frozenset[str] | None = None
) -> dict[str, Any]:
    """The hostile mix at once (plus two tool-schema loops) while the well-behaved client streams for
    at least `tool_loop_s`; `cases`: only these (by name, `tool-schema-loop` included)."""
    start = time.monotonic()
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    requests = [req for req in hostile_requests(copies) if cases is None or req[0] in cases]
    loopers = 2 if cases is None or "tool-schema-loop" in cases else 0
    async with httpx.AsyncClient(limits=limits) as client:
        hostile = asyncio.gather(*(_send(client, url, *req) for req in requests))
        loops = asyncio.gather(*(tool_schema_loop(client, url, start + tool_loop_s) for _ in range(loopers)))
        streams = asyncio.ensure_future(well_behaved(url, start + tool_loop_s, min_streams))
        health = asyncio.ensure_future(health_probe(url, start + tool_loop_s))
        outcomes = list(await hostile)
        for batch in await loops:
            outcomes += batch
        figures = await streams
        health_latencies = await health
    return {
        "ttft": summary(figures.ttft_s),
        "gap": summary(figures.gaps_s),
        "health": summary(health_latencies),
        "figures": figures,
        "outcomes": outcomes,
        "seconds": round(time.monotonic() - start, 1),
    }


def outcome_table(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        row = table.setdefault(o.case, {"n": 0, "answers": {}, "max_s": 0.0})
        row["n"] += 1
        answer = f"{o.status}:{o.code}" if o.status is not None else o.detail
        row["answers"][answer] = row["answers"].get(answer, 0) + 1
        row["max_s"] = round(max(row["max_s"], o.seconds), 2)
    return table


async def wait_idle(url: str, timeout_s: float = 120.0) -> None:
    """Until /metrics shows nothing running, waiting or holding KV blocks."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            text = (await client.get(url + "/metrics", timeout=10)).text
            values = {
                line.split()[0]: float(line.split()[1])
                for line in text.splitlines()
                if line and not line.startswith("#") and len(line.split()) == 2
            }
            if all(
                values.get(name, 0) == 0
                for name in (
                    "tokenmill_kv_cache_usage_ratio",
                    "tokenmill_num_requests_running",
                    "tokenmill_num_requests_waiting",
                )
            ):
                return
            await asyncio.sleep(0.5)


async def run(
    url: str,
    pid: int,
    streams: int = 4,
    tool_loop_s: float = 40.0,
    copies: int = 2,
    cases: frozenset[str] | None = None,
) -> dict[str, Any]:
    """Warm-up, the well-behaved client solo, then the hostile mix (or only `cases` of it) next to
    it; figures of both and the server's memory before and after."""
    async with httpx.AsyncClient() as client:  # warm-up: the first stream and the first compile
        await well_behaved_stream(client, url, StreamFigures(), seed=-1)
        await _send(
            client, url, "warm-up", "/v1/completions", {"prompt": "a", "max_tokens": 2, "guided_regex": "[ab]+"}, None
        )
    solo = await solo_phase(url, streams)
    rss_before = rss_mb(pid)
    hostile = await hostile_phase(url, streams, tool_loop_s, copies, cases)
    await wait_idle(url)
    await asyncio.sleep(3)  # (an idle server hands freed memory back within a couple of seconds)
    return {
        "solo": solo,
        "hostile": hostile,
        "rss_before_mb": round(rss_before, 1),
        "rss_after_mb": round(rss_mb(pid), 1),
        "children_rss_mb": round(children_rss_mb(pid), 1),
        "alive": psutil.pid_exists(pid),
    }


def printable(result: dict[str, Any]) -> dict[str, Any]:
    return {
        "solo": {k: result["solo"][k] for k in ("ttft", "gap", "health")},
        "hostile": {
            **{k: result["hostile"][k] for k in ("ttft", "gap", "health", "seconds")},
            "well_behaved_whole": result["hostile"]["figures"].whole,
            "well_behaved_broken": result["hostile"]["figures"].broken,
            "cases": outcome_table(result["hostile"]["outcomes"]),
        },
        **{k: result[k] for k in ("rss_before_mb", "rss_after_mb", "children_rss_mb", "alive")},
    }


# The hardening findings the mix reproduces, each measured on its own (`--items`): the cases that
# stand for it, sent next to the well-behaved client for at least ITEM_PHASE_S.
ITEMS: dict[str, tuple[str, ...]] = {
    "schema given as text, nested deep": ("deep-schema-text",),
    "grammar compiles: slow, endless, abandoned, 200 KB and 1 MB choice lists": (
        "slow-regex",
        "slow-regex-left",
        "endless-grammar",
        "big-choices",
        "huge-choices",
    ),
    "per-token matcher work: an ambiguous grammar": ("ambiguous-grammar",),
    "per-token matcher work: a 1,000-branch anyOf sampled 16 times": ("any-of-1000-n16",),
    "tool schemas: one of 830 KB, two clients looping 60 KB ones": ("huge-tool-schema", "tool-schema-loop"),
}
ITEM_PHASE_S = 20.0


async def run_items(url: str, pid: int, items: list[str]) -> dict[str, Any]:
    """Each of `items` (of ITEMS) in turn on one server: the well-behaved client solo, then next to
    that item's cases; the server's memory before and after each."""
    out = {}
    for item in items:
        cases = ITEMS[item]
        result = await run(url, pid, streams=4, tool_loop_s=ITEM_PHASE_S, copies=1, cases=frozenset(cases))
        out[item] = printable(result)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--pid", type=int, required=True, help="the server's process id (for its memory)")
    parser.add_argument("--items", action="store_true", help="each finding's cases on their own (ITEMS), in turn")
    parser.add_argument("--item", action="append", choices=list(ITEMS), help="with --items: only this one (repeatable)")
    parser.add_argument("--label", default="", help="what the server is (e.g. the commit it runs), kept in --json")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    url = args.url.rstrip("/")
    if args.items:
        result = asyncio.run(run_items(url, args.pid, args.item or list(ITEMS)))
    else:
        result = printable(asyncio.run(run(url, args.pid)))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        write_record(args.json, args.label, result if args.items else {"the whole mix": result})


def write_record(path: str, label: str, items: dict[str, Any]) -> None:
    """The figures with their provenance, as bench/results/ keeps them (bench/render_results.py)."""
    import shlex
    import sys

    from tokenmill.bench import provenance

    environment = {
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", "tests.stress.hostile_mix", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "machine": provenance.machine(),
        "commit": provenance.commit(),
    }
    with open(path, "w") as f:
        f.write(json.dumps({"environment": environment, "server": label, "items": items}, indent=2) + "\n")


if __name__ == "__main__":
    main()
