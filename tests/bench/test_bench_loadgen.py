"""The serving benchmark's load generator against a fake OpenAI streaming server with known delays.

No model is needed: prompts are given directly and datasets use a whitespace tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.bench import compare
from tokenmill.bench.report import LatencyStats, percentiles
from tokenmill.bench.serve.client import RequestResult, completions_url
from tokenmill.bench.serve.report import BenchReport, build_report, format_table, plot_reports
from tokenmill.bench.serve.runner import run_benchmark
from tokenmill.bench.serve.workload import (
    BenchRequest,
    arrival_offsets,
    load_sharegpt,
    synthetic_requests,
    warmup_requests,
)
from tokenmill.cli import bench as commands

FIRST_DELAY_S = 0.2  # before the first content chunk
GAP_S = 0.05  # between later content chunks
EXTRA_CHUNKS = 10  # content chunks after the first
OUTPUT_TOKENS = EXTRA_CHUNKS + 1
EXPECTED_E2E_S = FIRST_DELAY_S + EXTRA_CHUNKS * GAP_S
TOL = 0.4  # relative tolerance: the 2-core CI machine is shared and loaded


# --------------------------------------------------------------------------------------------------
# Fake server: prompt words switch behaviour ("fail" -> HTTP 500, "nousage" -> no usage chunk).


class FakeState:
    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.bodies: list[dict] = []

    def reset(self) -> None:
        self.__init__()


def make_fake_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await request.json()
        state.bodies.append(body)
        prompt: str = body["prompt"]
        if "fail" in prompt:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        with_usage = "nousage" not in prompt and body.get("stream_options", {}).get("include_usage")

        async def events() -> AsyncIterator[str]:
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                await asyncio.sleep(FIRST_DELAY_S)
                for i in range(OUTPUT_TOKENS):
                    if i:
                        await asyncio.sleep(GAP_S)
                    # ("linebreaks": raw U+2028 / U+0085 in the JSON, as servers that do not escape
                    # non-ASCII send them; the SSE line ends only at LF)
                    text = f" t{i}\u2028\x85\r" if "linebreaks" in prompt else f" t{i}"
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]}, ensure_ascii=False)}\n\n"
                # A role-style empty chunk must not count as a token.
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'finish_reason': 'length'}]})}\n\n"
                if with_usage:
                    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": OUTPUT_TOKENS}
                    if "cached" in prompt:  # a server reporting prefix-cache hits (OpenAI's usage field)
                        usage["prompt_tokens_details"] = {"cached_tokens": 2}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_fake_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture()
def fake(fake_server: tuple[str, FakeState]) -> tuple[str, FakeState]:
    fake_server[1].reset()
    # The fake server is a thread of this process: collect the earlier tests' garbage (whole engines
    # and models) now, not in the middle of a timed run holding the GIL (a full run once saw every
    # TTFT of the first timed test at ~660 ms instead of 200).
    gc.collect()
    return fake_server


def near(value_ms: float, expected_s: float) -> bool:
    expected_ms = expected_s * 1000
    return expected_ms * (1 - TOL) <= value_ms <= expected_ms * (1 + TOL)


def bench(url: str, requests: list[BenchRequest], **kwargs: object) -> BenchReport:
    return asyncio.run(run_benchmark(url, requests, progress=False, **kwargs))


def reqs(prompts: Sequence[str]) -> list[BenchRequest]:
    return [BenchRequest(prompt=p, output_len=OUTPUT_TOKENS) for p in prompts]


# --------------------------------------------------------------------------------------------------
# Load generator against the fake server


def test_timings_match_known_delays(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    n = 8
    report = bench(url, reqs([f"prompt number {i} here" for i in range(n)]), seed=0)

    assert (report.completed, report.failed) == (n, 0)
    assert report.model == "fake-model"  # discovered from /v1/models
    assert report.total_output_tokens == n * OUTPUT_TOKENS  # from usage.completion_tokens
    assert report.total_input_tokens == n * 4  # from usage.prompt_tokens
    assert near(report.ttft.mean_ms, FIRST_DELAY_S) and near(report.ttft.p50_ms, FIRST_DELAY_S)
    assert near(report.itl.mean_ms, GAP_S) and near(report.itl.p50_ms, GAP_S)
    assert near(report.tpot.mean_ms, GAP_S) and near(report.tpot.p50_ms, GAP_S)
    assert near(report.e2e.mean_ms, EXPECTED_E2E_S) and near(report.e2e.p50_ms, EXPECTED_E2E_S)
    for stats in (report.ttft, report.tpot, report.itl, report.e2e):
        assert stats.p50_ms <= stats.p90_ms <= stats.p99_ms
    for r in report.results:
        assert r.success and len(r.itl) == EXTRA_CHUNKS  # empty text chunks are not tokens
        assert r.tpot == pytest.approx((r.latency - r.ttft) / (OUTPUT_TOKENS - 1))

    # All at once (rate inf, unbounded): the run lasts about one request.
    assert report.duration_s < EXPECTED_E2E_S * (1 + TOL) + 0.3
    assert report.request_throughput == pytest.approx(n / report.duration_s)
    assert report.output_throughput == pytest.approx(n * OUTPUT_TOKENS / report.duration_s)
    assert report.total_token_throughput == pytest.approx(n * (OUTPUT_TOKENS + 4) / report.duration_s)

    body = state.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["max_tokens"] == OUTPUT_TOKENS and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "fake-model"
    json.dumps(report.to_dict(), allow_nan=False)  # strict JSON: inf/NaN are converted


def test_sampled_requests_carry_their_settings(fake: tuple[str, FakeState]) -> None:
    """--temperature/--top-p/--top-k/--min-p go into every request (top_k and min_p as vLLM's extra
    fields, only when set); greedy requests carry temperature 0 alone."""
    from tokenmill.bench.sampling import Sampling

    url, state = fake
    bench(url, reqs(["a b c d", "e f g h"]), sampling=Sampling(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05))
    for body in state.bodies:
        assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.8, 0.9, 40, 0.05)
    state.reset()
    bench(url, reqs(["a b c d"]), sampling=Sampling(temperature=1.0))
    (body,) = state.bodies
    assert body["temperature"] == 1.0 and not {"top_p", "top_k", "min_p"} & set(body)


def test_line_separators_inside_json_strings_do_not_split_events(fake: tuple[str, FakeState]) -> None:
    """Text with raw U+2028, U+0085 and CR inside its JSON (allowed there) is one event, not a
    broken line: every request succeeds with all its chunks."""
    url, _ = fake
    report = bench(url, reqs(["linebreaks one two", "linebreaks nousage"]))
    assert (report.completed, report.failed) == (2, 0), report.errors
    assert all(r.output_tokens == OUTPUT_TOKENS and len(r.itl) == OUTPUT_TOKENS - 1 for r in report.results)


def test_without_usage_counts_chunks_and_uses_tokenizer_prompt_len(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    requests = [BenchRequest(prompt="nousage please", output_len=OUTPUT_TOKENS, prompt_len=7)] * 2
    report = bench(url, requests, model_name="explicit")
    assert report.completed == 2 and report.model == "explicit"
    assert [r.output_tokens for r in report.results] == [OUTPUT_TOKENS] * 2
    assert report.total_input_tokens == 14


def test_prefix_cache_hits_reported_by_the_server_are_summed(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    report = bench(url, reqs(["cached a b c", "plain d e f", "cached g h i"]))
    assert report.completed == 3 and report.cached_input_tokens == 4
    assert [r.cached_prompt_tokens for r in report.results] == [2, None, 2]
    assert "Input tokens from the server's cache" in format_table({"x": report})
    assert bench(url, reqs(["plain a b c"])).cached_input_tokens is None  # not reported: unknown, not 0


def test_failures_are_counted_not_raised(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    report = bench(url, reqs(["ok a b c", "fail now", "ok d e f", "fail again", "ok g h i", "ok j k l"]))
    assert (report.completed, report.failed) == (4, 2)
    assert any("HTTP 500" in e for e in report.errors)
    assert report.total_output_tokens == 4 * OUTPUT_TOKENS  # failed requests add nothing
    assert [r.success for r in report.results] == [True, False, True, False, True, True]


def test_unreachable_server_fails_every_request() -> None:
    report = bench(f"http://127.0.0.1:{free_port()}", reqs(["a", "b"]))
    assert (report.completed, report.failed) == (0, 2)
    assert math.isnan(report.ttft.p50_ms)
    assert report.to_dict()["ttft"]["p50_ms"] is None


def test_max_concurrency_bounds_in_flight_requests(fake: tuple[str, FakeState]) -> None:
    url, state = fake
    report = bench(url, reqs([f"ok {i} x y" for i in range(4)]), max_concurrency=2)
    assert report.completed == 4
    assert state.max_in_flight == 2
    # Two waves of two; queueing for a slot is not part of TTFT.
    assert report.duration_s >= 2 * EXPECTED_E2E_S * 0.95
    assert near(report.ttft.p90_ms, FIRST_DELAY_S)


def test_poisson_arrivals_are_open_loop(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    rate, seed, n = 8.0, 3, 5
    report = bench(url, reqs([f"ok {i} x y" for i in range(n)]), request_rate=rate, seed=seed)
    expected = arrival_offsets(n, rate, seed)
    starts = [r.start_time for r in report.results]
    # Sent on schedule even though each request takes longer than the gaps between arrivals.
    assert starts == pytest.approx(expected, abs=0.15)
    assert report.completed == n


# --------------------------------------------------------------------------------------------------
# Arrival process and statistics


def test_arrival_offsets_are_poisson_and_deterministic() -> None:
    rate = 5.0
    offsets = np.array(arrival_offsets(20000, rate, seed=42))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # exponential: std == mean
    assert arrival_offsets(50, rate, seed=1) == arrival_offsets(50, rate, seed=1)
    assert arrival_offsets(50, rate, seed=1) != arrival_offsets(50, rate, seed=2)
    assert arrival_offsets(4, math.inf, seed=0) == [0.0] * 4
    assert arrival_offsets(0, rate, seed=0) == []
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)


def test_percentiles_on_known_arrays() -> None:
    p = percentiles(np.arange(1, 101))
    assert p[50] == pytest.approx(50.5) and p[90] == pytest.approx(90.1) and p[99] == pytest.approx(99.01)
    assert percentiles([7.0]) == {50: 7.0, 90: 7.0, 99: 7.0}
    assert all(math.isnan(v) for v in percentiles([]).values())
    stats = LatencyStats.from_seconds([0.1, 0.2, 0.3, 0.4])  # seconds in, ms out
    assert stats.mean_ms == pytest.approx(250) and stats.p50_ms == pytest.approx(250)
    assert stats.p90_ms == pytest.approx(370) and stats.p99_ms == pytest.approx(397)


def _result(ttft: float, latency: float, tokens: int, ok: bool = True) -> RequestResult:
    itl = [(latency - ttft) / (tokens - 1)] * (tokens - 1) if ok and tokens > 1 else []
    return RequestResult(
        success=ok,
        ttft=ttft,
        itl=itl,
        latency=latency,
        output_tokens=tokens if ok else 0,
        prompt_tokens=10,
        error="" if ok else "HTTP 500: x",
    )


def test_build_report_math_and_outputs(tmp_path: Path) -> None:
    results = [_result(0.1, 1.1, 11), _result(0.3, 2.3, 21), _result(0, 0, 0, ok=False), _result(0.2, 0.2, 1)]
    report = build_report(results, duration=4.0, request_rate=math.inf, max_concurrency=None, model="m")
    assert (report.completed, report.failed) == (3, 1)
    assert report.total_output_tokens == 33 and report.total_input_tokens == 30
    assert report.output_throughput == pytest.approx(33 / 4) and report.total_token_throughput == pytest.approx(63 / 4)
    assert report.ttft.mean_ms == pytest.approx(200)
    assert report.tpot.mean_ms == pytest.approx(100)  # single-token request has no TPOT
    assert report.errors == ["HTTP 500: x"]
    assert report.to_dict()["request_rate"] == "inf"

    table = format_table({"a": report, "b": report}, extra_rows=[("Ratio", ["1.00x", ""])])
    assert "Output token throughput (tok/s)" in table and "P99 ITL (ms)" in table and "Ratio" in table
    plot = tmp_path / "plot.png"
    plot_reports({"a": report, "b": report}, plot)
    assert plot.stat().st_size > 10_000


def test_completions_url_forms() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions"):
        assert completions_url(url) == "http://h:1/v1/completions"


# --------------------------------------------------------------------------------------------------
# Datasets, with a whitespace "tokenizer"


class WordTokenizer:
    """Token = word; ids index a fixed vocabulary (id 0 is a special token)."""

    def __init__(self, words: Sequence[str] = ()) -> None:
        self.vocab = ["<s>", *(words or [f"w{i}" for i in range(50)])]
        self.all_special_ids = [0]

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab.index(w) if w in self.vocab else 1 for w in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 0))


def test_synthetic_requests_lengths_and_determinism() -> None:
    tok = WordTokenizer()
    fixed = synthetic_requests(tok, 5, input_len=12, output_len=7, seed=1)
    assert [r.prompt_len for r in fixed] == [12] * 5 and [r.output_len for r in fixed] == [7] * 5
    assert all(len(r.prompt.split()) == 12 and "<s>" not in r.prompt for r in fixed)
    assert fixed == synthetic_requests(tok, 5, input_len=12, output_len=7, seed=1)
    assert fixed != synthetic_requests(tok, 5, input_len=12, output_len=7, seed=2)
    mixed = synthetic_requests(tok, 200, input_len=20, output_len=10, range_ratio=0.5, seed=0)
    assert {r.prompt_len for r in mixed} <= set(range(10, 31)) and len({r.prompt_len for r in mixed}) > 5
    assert {r.output_len for r in mixed} <= set(range(5, 16))


def test_warmup_requests_share_no_prefix_with_the_trace() -> None:
    """bench compare's untimed warm-up must not hand a server's prefix cache the timed prompts."""
    tok = WordTokenizer()
    trace = synthetic_requests(tok, 8, input_len=12, output_len=3, seed=3)
    warm = warmup_requests(trace, 2)
    assert len(warm) == 2 and [w.output_len for w in warm] == [3, 3]
    for w in warm:
        assert all(tok.encode(w.prompt)[:4] != tok.encode(r.prompt)[:4] for r in trace)


def _sharegpt_file(tmp_path: Path) -> Path:
    data = [
        {
            "conversations": [
                {"from": "human", "value": "one two three four five"},
                {"from": "gpt", "value": "a b c d e f"},
            ]
        },
        {
            "conversations": [
                {"from": "gpt", "value": "system greeting here now"},
                {"from": "human", "value": "tell me about tokens please"},
                {"from": "gpt", "value": "tokens are pieces of text ok"},
                {"from": "human", "value": "later turns are ignored entirely"},
            ]
        },
        {"conversations": [{"from": "human", "value": "no answer to this one"}]},
        {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "a b c d e"}]},
        {"id": "no conversations"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_loader(tmp_path: Path) -> None:
    path = _sharegpt_file(tmp_path)
    tok = WordTokenizer()
    requests = load_sharegpt(path, tok, num_prompts=None, seed=0)
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {"one two three four five", "tell me about tokens please"}
    assert by_prompt["one two three four five"].output_len == 6
    assert by_prompt["one two three four five"].prompt_len == 5
    assert by_prompt["tell me about tokens please"].output_len == 6
    assert load_sharegpt(path, tok, num_prompts=None, seed=0) == requests  # deterministic per seed
    assert len(load_sharegpt(path, tok, num_prompts=1, seed=0)) == 1
    assert {r.output_len for r in load_sharegpt(path, tok, num_prompts=None, output_len=32)} == {32}
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError):
        load_sharegpt(empty, tok, num_prompts=None)


# --------------------------------------------------------------------------------------------------
# CLI wiring and compare's process handling


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill")
    commands.register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_serve_sweeps_every_concurrency_and_rate(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    """`bench serve` with several --max-concurrency / --request-rate values: one run per
    combination, each bounded as asked, reported side by side and in the JSON's points."""
    url, state = fake
    out = tmp_path / "sweep.json"
    argv = ["bench", "serve", "--url", url, "--num-prompts", "4", "--input-len", "8", "--output-len", "4"]
    args = _parser().parse_args(
        [*argv, "--max-concurrency", "1", "2", "--request-rate", "inf", "50", "--json", str(out)]
    )
    assert args.func(args) == 0
    points = json.loads(out.read_text())["points"]
    assert [(p["max_concurrency"], p["request_rate"]) for p in points] == [
        (1, math.inf),
        (1, 50),
        (2, math.inf),
        (2, 50),
    ]
    assert all(p["report"]["completed"] == 4 for p in points)
    assert len(state.bodies) == 16 and state.max_in_flight <= 2


def test_bench_commands_parse() -> None:
    args = _parser().parse_args(
        ["bench", "serve", "--request-rate", "inf", "--max-concurrency", "4", "--num-prompts", "3", "--json", "x.json"]
    )
    assert args.request_rate == [math.inf] and args.max_concurrency == [4] and args.num_prompts == 3
    assert args.func is commands._cmd_serve and args.synthetic_output_len == 128
    args = _parser().parse_args(["bench", "compare", "--request-rate", "2.5", "--range-ratio", "0.2"])
    assert args.request_rate == 2.5 and args.range_ratio == 0.2 and args.func is commands._cmd_compare
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "serve", "--request-rate", "-1"])
    args = _parser().parse_args(["bench", "serve", "--temperature", "1", "--top-p", "0.95"])
    assert (args.temperature, args.top_p, args.top_k, args.min_p) == (1.0, 0.95, 0, 0.0)
    assert _parser().parse_args(["bench", "compare"]).temperature == 0.0
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "compare", "--top-p", "2"])


def test_engine_benchmarks_without_the_bench_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without numpy/httpx/matplotlib the CLI still builds; an engine benchmark says which extra it needs."""
    args = _parser().parse_args(["bench", "offline", "--model", "tiny"])
    assert args.bench_command == "offline" and args.model == "tiny"
    for extra in ("numpy", "httpx", "matplotlib"):  # `import numpy` now raises ImportError
        monkeypatch.setitem(sys.modules, extra, None)
    import tokenmill.bench

    for module in [m for m in sys.modules if m.startswith("tokenmill.bench.")]:  # forget them: imported again
        monkeypatch.delitem(sys.modules, module)
        monkeypatch.delattr(tokenmill.bench, module.split(".")[2], raising=False)
    for command in (["bench", "offline"], ["bench", "features"], ["bench", "serve"]):
        args = _parser().parse_args(command)
        with pytest.raises(ValueError, match=r"tokenmill\[bench\]"):
            args.func(args)


def test_wait_ready_reports_a_dead_server(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import sys; print('model failed to load'); sys.exit(3)"]
    server = compare.start_server("dying", cmd, compare.free_port(), "/health/ready", tmp_path)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*model failed to load"):
            compare.wait_ready([server], timeout_s=20, poll_s=0.05)
    finally:
        compare.stop_server(server)


def test_stop_server_terminates_and_ready_times_out(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = compare.start_server("sleepy", cmd, compare.free_port(), "/health/ready", tmp_path)
    try:
        with pytest.raises(TimeoutError, match="sleepy"):
            compare.wait_ready([server], timeout_s=0.3, poll_s=0.05)
    finally:
        compare.stop_server(server, grace_s=5)
    assert server.proc.poll() is not None


def test_wait_ready_accepts_a_live_server(fake: tuple[str, FakeState], tmp_path: Path) -> None:
    url, _ = fake
    port = int(url.rsplit(":", 1)[1])
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]  # stands in for the server process
    server = compare.start_server("fake", cmd, port, "/v1/models", tmp_path)
    try:
        compare.wait_ready([server], timeout_s=10, poll_s=0.05)
    finally:
        compare.stop_server(server)


def test_comparison_ratios() -> None:
    fast = build_report([_result(0.1, 1.1, 11)] * 4, 2.0, math.inf, None, "fast")
    slow = build_report([_result(0.4, 4.4, 11)] * 4, 8.0, math.inf, None, "slow")
    ratios = compare.comparison_ratios(fast, slow)
    assert ratios["output_throughput_ratio"] == pytest.approx(4.0)
    assert ratios["request_throughput_ratio"] == pytest.approx(4.0)
    assert ratios["p50_ttft_ratio"] == pytest.approx(4.0)
