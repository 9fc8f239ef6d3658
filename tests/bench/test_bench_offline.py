"""`tokenmill bench offline`: workload, HF static-batch baseline, offline run, roofline, CLI parsing."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.bench import engine_args
from tokenmill.bench.engine_args import DEFAULT_KV_CACHE
from tokenmill.bench.offline.cli import main as offline_main
from tokenmill.bench.offline.hf_baseline import (
    hf_pad_id,
    load_hf_model,
    padding_accounting,
    run_hf_static,
    static_batches,
)
from tokenmill.bench.offline.report import format_runs, greedy_agreement
from tokenmill.bench.offline.runners import run_tokenmill, warmup
from tokenmill.bench.offline.workload import MIN_PROMPT_TOKEN_ID, STRUCTURED_SCHEMA, OfflineRequest, make_workload
from tokenmill.bench.roofline import (
    RooflineResult,
    copy_bandwidth,
    measure_roofline,
    model_weight_bytes,
)
from tokenmill.bench.sampling import Sampling


def test_workload_deterministic_and_in_range():
    a = make_workload(50, 4, 200, 16, 128, vocab_size=49152, seed=3)
    b = make_workload(50, 4, 200, 16, 128, vocab_size=49152, seed=3)
    c = make_workload(50, 4, 200, 16, 128, vocab_size=49152, seed=4)
    assert a == b
    assert a != c
    assert len(a) == 50
    for r in a:
        assert 4 <= len(r.prompt_token_ids) <= 200
        assert 16 <= r.output_len <= 128
        assert all(MIN_PROMPT_TOKEN_ID <= t < 49152 for t in r.prompt_token_ids)
    # Mixed lengths, not a constant.
    assert len({len(r.prompt_token_ids) for r in a}) > 10
    assert len({r.output_len for r in a}) > 10
    # Inclusive bounds.
    fixed = make_workload(5, 7, 7, 9, 9, vocab_size=1000, seed=0)
    assert all(len(r.prompt_token_ids) == 7 and r.output_len == 9 for r in fixed)
    with pytest.raises(ValueError):
        make_workload(3, 10, 5, 1, 2, vocab_size=1000)


def test_padding_accounting():
    w = [OfflineRequest([1] * 3, n) for n in (5, 10, 2, 8)]
    # Batches of 2: [5, 10] -> 2*10, [2, 8] -> 2*8; useful 25 of 36.
    useful, generated, waste = padding_accounting(w, 2)
    assert (useful, generated) == (25, 36)
    assert waste == pytest.approx(11 / 36)
    assert padding_accounting(w, 1) == (25, 25, 0.0)
    assert static_batches(w, 3) == [[0, 1, 2], [3]]


def test_greedy_agreement():
    agree = greedy_agreement([[1, 2, 3], [4, 5], [6, 7, 8]], [[1, 2, 3, 9], [4, 6], [6, 7, 8]])
    assert agree["requests"] == 3
    assert agree["exact_match_fraction"] == pytest.approx(2 / 3)
    assert agree["mean_matching_prefix_fraction"] == pytest.approx((1 + 0.5 + 1) / 3)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from tokenmill import LLM

    return LLM(str(tiny_model_dir), progress=False, kv_cache_memory="256MiB", max_num_seqs=8)


@pytest.fixture(scope="module")
def small_workload():
    return make_workload(4, 3, 12, 2, 6, vocab_size=49152, seed=1)


@pytest.mark.engine
def test_hf_static_baseline_counts(tiny_model_dir, small_workload):
    model = load_hf_model(tiny_model_dir)
    pad = hf_pad_id(tiny_model_dir)
    run = run_hf_static(model, small_workload, batch_size=2, pad_id=pad, progress=False)
    outs = [r.output_len for r in small_workload]
    assert [len(t) for t in run.token_ids] == outs
    assert run.output_tokens == run.requested_tokens == sum(outs)
    expected_generated = 2 * max(outs[:2]) + 2 * max(outs[2:])
    assert run.generated_tokens == expected_generated
    assert run.padding_waste == pytest.approx(1 - sum(outs) / expected_generated)
    assert run.duration_s > 0 and run.output_throughput > 0


@pytest.mark.engine
def test_warmup_leaves_the_measured_prompts_uncached(tiny_llm):
    """The untimed warm-up must not put the timed prompts in the prefix cache (HF has none)."""
    from tokenmill import SamplingParams

    workload = make_workload(2, 40, 60, 2, 2, vocab_size=49152, seed=7)
    prompts = [r.prompt_token_ids for r in workload]
    warmup(tiny_llm, workload, max_tokens=2)
    first = run_tokenmill(tiny_llm, workload, use_tqdm=False)
    assert first.cached_prompt_tokens == 0  # the report says so too
    again = tiny_llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in again)  # (a hit is visible when there is one)
    repeated = run_tokenmill(tiny_llm, workload, use_tqdm=False)
    assert repeated.cached_prompt_tokens >= 64 and "Prompt tokens from the prefix cache" in format_runs([repeated])


@pytest.mark.engine
def test_offline_run_consistent(tiny_llm, small_workload):
    warmup(tiny_llm, small_workload, max_tokens=2)
    run = run_tokenmill(tiny_llm, small_workload, use_tqdm=False)
    assert run.num_requests == 4
    assert [len(t) for t in run.token_ids] == [r.output_len for r in small_workload]
    assert run.output_tokens == run.requested_tokens == sum(r.output_len for r in small_workload)
    assert run.output_throughput == pytest.approx(run.output_tokens / run.duration_s)
    assert run.request_throughput == pytest.approx(4 / run.duration_s)
    assert 0 < run.ttft.mean_ms <= run.latency.mean_ms
    assert run.latency.p50_ms <= run.latency.p99_ms <= (run.duration_s + 0.5) * 1e3
    data = run.to_dict()
    assert "token_ids" not in data
    json.dumps(data)


@pytest.mark.engine
def test_sampled_workload_in_tokenmill_and_hf(tiny_llm, tiny_model_dir, small_workload):
    """--temperature/--top-p/--top-k/--min-p: both sides sample (the tokens leave the greedy ones) and
    still produce every requested token."""
    sampling = Sampling(temperature=1.5, top_p=0.95, top_k=50, min_p=0.01)
    greedy = run_tokenmill(tiny_llm, small_workload, use_tqdm=False)
    sampled = run_tokenmill(tiny_llm, small_workload, use_tqdm=False, sampling=sampling)
    assert sampled.output_tokens == sampled.requested_tokens
    assert sampled.token_ids != greedy.token_ids
    model = load_hf_model(tiny_model_dir)
    hf = run_hf_static(model, small_workload, batch_size=2, progress=False, sampling=sampling)
    assert hf.output_tokens == hf.requested_tokens
    assert Sampling().greedy and Sampling(temperature=0.7, top_k=1).greedy and not sampling.greedy


@pytest.mark.engine
def test_structured_output_workload_keeps_every_document_open(tiny_llm):
    """`--compare structured-output`'s constrained side: every request produces exactly its token
    count (STRUCTURED_SCHEMA's minItems never lets the document end), and the tokens are JSON."""
    import jiter

    workload = make_workload(4, 3, 12, 40, 60, vocab_size=49152, seed=2)
    structured = {"json": STRUCTURED_SCHEMA}
    warmup(tiny_llm, workload, max_tokens=2, structured=structured)
    run = run_tokenmill(tiny_llm, workload, use_tqdm=False, structured=structured)
    assert run.output_tokens == run.requested_tokens
    for token_ids in run.token_ids:
        text = tiny_llm.tokenizer.decode(token_ids)
        assert text.startswith("{") and "items" in jiter.from_json(text.encode(), partial_mode="trailing-strings"), text


def test_weight_bytes_tied_once():
    emb = torch.nn.Embedding(100, 8)
    head = torch.nn.Linear(8, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "mlp": torch.nn.Linear(8, 8, bias=False)})
    total, streamed = model_weight_bytes(model)
    assert total == streamed == (100 * 8 + 8 * 8) * 4
    untied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(100, 8), "head": torch.nn.Linear(8, 100, bias=False)})
    total, streamed = model_weight_bytes(untied)
    assert (total, streamed) == (2 * 800 * 4, 800 * 4)


@pytest.fixture
def features_in_this_process(monkeypatch):
    """`bench features` with its runs in the test process: each run's fresh interpreter, which keeps
    the benchmark's timings independent, costs seconds of imports and changes no result checked here."""
    from tokenmill.bench import features

    monkeypatch.setattr(features, "in_fresh_process", lambda fn, *args: fn(*args))
    return features


@pytest.mark.slow
@pytest.mark.engine
def test_features_bench_runs_each_flag_off_and_on(tiny_model_dir, monkeypatch, features_in_this_process):
    from tokenmill.cli import build_parser

    features = features_in_this_process
    monkeypatch.setattr(engine_args, "resolve_bench_model", lambda model: tiny_model_dir)
    monkeypatch.setattr(features, "resolve_bench_model", lambda model: tiny_model_dir)
    args = build_parser().parse_args(
        [
            "bench",
            "features",
            "--num-prompts",
            "4",
            "--max-output",
            "16",
            "--only",
            "prefix",
            "result",
            "int8",
            "--kv-cache-memory",
            "64MiB",
            "--no-progress",
        ]
    )
    chosen = [f for f in features.FEATURES if any(k in f.name for k in args.only)]
    rows = features.measure(args, chosen, log=lambda _: None)
    assert [(r.feature, r.setting) for r in rows] == [(f.name, s) for f in chosen for s in ("off", "on")]
    by = {(r.feature, r.setting): r for r in rows}
    prefix, result, int8 = chosen
    assert by[(prefix.name, "on")].greedy_agreement_with_off == 1.0  # caching never changes tokens
    assert by[(result.name, "on")].greedy_agreement_with_off == 1.0
    # The second, timed round of the repeat workload is answered from memory.
    assert by[(result.name, "on")].output_tok_s > 5 * by[(result.name, "off")].output_tok_s
    # The linear layers go int8 (1 byte per weight + a bf16 scale per 32: 0.27x of fp32), the
    # lm_head too where tokenmill's kernels run (the tied embedding then reads it: one copy), else
    # the vocabulary table stays in fp32.
    import torch

    from tokenmill.kernels.ops import cpu_kernels_available

    config = json.loads((tiny_model_dir / "config.json").read_text())
    table_mib = (
        0.0 if cpu_kernels_available(torch.device("cpu")) else config["vocab_size"] * config["hidden_size"] * 4 / 2**20
    )
    off = by[(int8.name, "off")].weight_mib - table_mib
    on = by[(int8.name, "on")].weight_mib - table_mib
    assert 0.2 * off < on < 0.35 * off, (off, on)
    assert all(r.output_tok_s > 0 for r in rows)
    table = features.format_rows(rows)
    assert "speed-up" in table and "prefix caching" in table


@pytest.mark.engine
def test_roofline_counts_the_weights_once_and_derives_the_bound(tiny_llm):
    """What the roofline reports, apart from timings (how the measured step compares with the bound
    is the benchmark's result, `tokenmill bench offline --roofline`, not something a test can assert
    on a loaded machine)."""
    assert copy_bandwidth(16 << 20, reps=2) > 0
    r = measure_roofline(tiny_llm, prompt_len=8, new_tokens=12, copy_bytes=64 << 20, copy_reps=2, decode_reps=1)
    assert isinstance(r, RooflineResult)
    assert r.bandwidth_gbs > 0 and r.weight_bytes > 0 and r.bound_step_s > 0 and r.measured_step_s > 0
    # Tiny model: parameters (norms) plus the packed linear weights, each once: the tied embedding
    # reads the lm_head's packed copy (PanelEmbedding), and that is streamed by the head every step.
    model = tiny_llm.engine.model
    packed = [m.packed_weight for m in model.modules() if hasattr(m, "packed_weight")]
    assert packed, "CPU linears are packed by default"
    assert type(model.embed_tokens).__name__ == "PanelEmbedding"
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert r.param_bytes == params + sum(w.numel() * w.element_size() for w in packed)
    assert r.weight_bytes == r.param_bytes
    assert r.bound_step_s == pytest.approx(r.weight_bytes / (r.bandwidth_gbs * 1e9))
    assert r.ratio == pytest.approx(r.measured_step_s / r.bound_step_s)


def test_cli_parsing():
    from tokenmill.cli import build_parser

    args = build_parser().parse_args(
        [
            "bench",
            "offline",
            "--compare",
            "hf",
            "--sweep",
            "--sweep-values",
            "1,2,8",
            "--model",
            "tiny",
            "--max-num-seqs",
            "32",
            "--json",
            "x.json",
        ]
    )
    assert args.func is offline_main
    assert args.compare == "hf" and args.sweep and args.sweep_values == [1, 2, 8]
    assert args.model == "tiny" and args.max_num_seqs == 32 and args.json == "x.json"
    assert (args.num_prompts, args.min_input, args.max_input, args.min_output, args.max_output) == (64, 4, 200, 16, 128)
    assert args.hf_batch_size == 16 and args.kv_cache_memory == DEFAULT_KV_CACHE
    assert (
        build_parser().parse_args(["bench", "offline", "--compare", "structured-output"]).compare == "structured-output"
    )
    impls = build_parser().parse_args(["bench", "offline", "--compare", "model-impl"])
    assert impls.compare == "model-impl" and impls.model_impl == "auto"
    defaults = build_parser().parse_args(["bench", "offline"])
    assert defaults.compare is None and not defaults.sweep and not defaults.roofline
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (0.0, 1.0, 0, 0.0)
    sampled = build_parser().parse_args(
        ["bench", "offline", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05"]
    )
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.min_p) == (0.8, 0.9, 40, 0.05)
    for bad in (
        ["--sweep-values", "0,4"],
        ["--temperature", "-1"],
        ["--top-p", "0"],
        ["--top-p", "1.5"],
        ["--min-p", "nan"],
        ["--top-k", "-2"],
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "offline", *bad])


@pytest.mark.engine
def test_long_outputs_runs_both_modes(tiny_llm):
    from tokenmill.bench.long_outputs import format_long_outputs, run_long_outputs

    points = run_long_outputs(tiny_llm, [8, 24], streams=2, prompt_len=5, vocab_size=49152)
    assert [(p.output_len, p.mode) for p in points] == [
        (8, "cumulative"),
        (8, "delta"),
        (24, "cumulative"),
        (24, "delta"),
    ]
    assert all(p.output_tokens == 2 * p.output_len for p in points)  # every streamed token counted once
    assert all(0 < p.model_s < p.wall_s and 0 < p.host_ms_per_token < p.total_ms_per_token for p in points)
    assert "host ms/token at 24 / at 8" in format_long_outputs(points)
    with pytest.raises(ValueError, match="context"):
        run_long_outputs(tiny_llm, [10**6], streams=1, prompt_len=5, vocab_size=49152)


@pytest.mark.engine
def test_long_prompts_times_every_request_without_cache_hits(tiny_llm):
    from tokenmill.bench.long_prompts import format_long_prompts, run_long_prompts

    points = run_long_prompts(tiny_llm, [40, 90], streams=[1, 3], repeats=2, vocab_size=49152)
    assert [(p.prompt_len, p.streams) for p in points] == [(40, 1), (40, 3), (90, 1), (90, 3)]
    assert [len(p.ttft_s) for p in points] == [2, 6, 2, 6]  # every request of every repeat
    assert all(t > 0 for p in points for t in p.ttft_s)
    assert all(p.cached_prompt_tokens == 0 for p in points)  # fresh prompts: the prefix cache answers none
    assert "mean TTFT s" in format_long_prompts(points)
    with pytest.raises(ValueError, match="context"):
        run_long_prompts(tiny_llm, [10**6], streams=[1], repeats=1, vocab_size=49152)


@pytest.mark.slow
@pytest.mark.engine
def test_features_bench_multi_lora_row(tiny_model_dir, monkeypatch, features_in_this_process):
    """The multi-LoRA pair: the base model alone, then the same workload spread over 4 random
    adapters in one LoRA engine (their slots show in the weight memory)."""
    from tokenmill.cli import build_parser

    features = features_in_this_process

    monkeypatch.setattr(features, "resolve_bench_model", lambda model: tiny_model_dir)
    args = build_parser().parse_args(
        [
            "bench",
            "features",
            "--num-prompts",
            "4",
            "--max-output",
            "16",
            "--only",
            "LoRA",
            "--kv-cache-memory",
            "64MiB",
            "--no-progress",
        ]
    )
    chosen = [f for f in features.FEATURES if any(k in f.name for k in args.only)]
    assert len(chosen) == 1 and chosen[0].lora_ranks
    off, on = features.measure(args, chosen, log=lambda _: None)
    assert (off.setting, on.setting) == ("off", "on") and off.output_tok_s > 0 and on.output_tok_s > 0
    assert on.weight_mib > off.weight_mib  # 4 slots of rank-16 A/B matrices beside the weights
    assert on.greedy_agreement_with_off is None  # adapters change the tokens by design
