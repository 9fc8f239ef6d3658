"""`tokenmill bench offline`: the engine in this process, no server, on a mixed-length workload.

A seeded workload goes through the offline API with all requests submitted at once
(`LLM.generate`), each with ignore_eos and its own max_tokens, so every run produces exactly the
requested number of tokens; reported: useful output tokens/s, latency and TTFT. `--model tiny`
uses a random ~28M Llama built once in the cache. Options add, in the same process:

- `--compare hf`: Hugging Face `generate` in padded static batches on the same prompts (the naive
  baseline), its padding waste, the tokenmill/HF throughput ratio and greedy agreement;
- `--compare model-impl`: the workload on the native path and on the generic transformers path
  (`--model-impl native` / `transformers`), each in a fresh process: the generic path's cost;
- `--compare structured-output`: the workload unconstrained and with every request constrained to
  a JSON schema (`STRUCTURED_SCHEMA`), each in a fresh process: the grammar masks' cost;
- `--sweep`: the workload at several concurrency limits (max_num_seqs), latency vs throughput;
- `--roofline`: copy bandwidth, weight bytes and the batch-1 decode bound vs the measured step;
- `--long-outputs`: host time per output token of long streams, cumulative vs delta outputs.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.sampling import GREEDY, Sampling, add_sampling_args, sampling_from_args
from tokenmill.bench.serve import LatencyStats, format_grid, json_safe, write_json

TINY_MODEL = "tiny"
# Token ids for synthetic prompts start here: SmolLM2's special tokens all sit below 100.
MIN_PROMPT_TOKEN_ID = 100
DEFAULT_KV_CACHE = "2GiB"


# --------------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(
    num_prompts: int, min_input: int, max_input: int, min_output: int, max_output: int, vocab_size: int, seed: int = 0
) -> list[OfflineRequest]:
    """Token-id prompts with lengths uniform in [min_input, max_input] and output lengths uniform in
    [min_output, max_output] (inclusive), deterministic for a seed."""
    if not 1 <= min_input <= max_input:
        raise ValueError(f"need 1 <= --min-input <= --max-input, got {min_input}, {max_input}")
    if not 1 <= min_output <= max_output:
        raise ValueError(f"need 1 <= --min-output <= --max-output, got {min_output}, {max_output}")
    low = MIN_PROMPT_TOKEN_ID if vocab_size > 2 * MIN_PROMPT_TOKEN_ID else 0
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(min_input, max_input + 1, size=num_prompts)
    out_lens = rng.integers(min_output, max_output + 1, size=num_prompts)
    return [
        OfflineRequest(rng.integers(low, vocab_size, size=int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


def describe_workload(workload: Sequence[OfflineRequest]) -> str:
    ins = [len(r.prompt_token_ids) for r in workload]
    outs = [r.output_len for r in workload]
    return (
        f"{len(workload)} requests, prompt tokens {min(ins)}-{max(ins)} (sum {sum(ins)}), "
        f"output tokens {min(outs)}-{max(outs)} (sum {sum(outs)})"
    )


# --------------------------------------------------------------------------------------------------
# Results


@dataclass
class RunResult:
    name: str
    num_requests: int
    prompt_tokens: int
    requested_tokens: int  # sum of each request's own output length
    output_tokens: int  # useful tokens produced (== requested_tokens for a correct run)
    duration_s: float
    output_throughput: float  # useful output tokens / s
    request_throughput: float
    latency: LatencyStats
    ttft: LatencyStats
    max_num_seqs: int | None = None
    generated_tokens: int | None = None  # HF: every position decoded, padding included
    padding_waste: float | None = None  # HF: fraction of generated tokens nobody asked for
    weight_bytes: int | None = None  # the engine's model weights, when measured
    grammar_compile_s: float | None = None  # structured output: compiling the schema (untimed in the run)
    cached_prompt_tokens: int | None = None  # tokenmill: prompt tokens its prefix cache answered (0 for a fair run)
    token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("token_ids")
        return data


def _result(
    name: str,
    workload: Sequence[OfflineRequest],
    token_ids: list[list[int]],
    duration: float,
    latencies: Sequence[float],
    ttfts: Sequence[float],
    **extra: Any,
) -> RunResult:
    produced = sum(len(t) for t in token_ids)
    return RunResult(
        name=name,
        num_requests=len(workload),
        prompt_tokens=sum(len(r.prompt_token_ids) for r in workload),
        requested_tokens=sum(r.output_len for r in workload),
        output_tokens=produced,
        duration_s=duration,
        output_throughput=produced / duration if duration > 0 else math.nan,
        request_throughput=len(workload) / duration if duration > 0 else math.nan,
        latency=LatencyStats.from_seconds(latencies),
        ttft=LatencyStats.from_seconds(ttfts),
        token_ids=token_ids,
        **extra,
    )


# --------------------------------------------------------------------------------------------------
# tokenmill


# `--compare structured-output`: records of every kind of JSON value. minItems keeps each document
# open past any --max-output, so the constrained run produces exactly the tokens the free run does.
_RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["book", "film", "song", "game"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "done": {"type": "boolean"},
    },
    "required": ["id", "name", "kind", "score", "tags", "done"],
    "additionalProperties": False,
}
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": _RECORD, "minItems": 256}},
    "required": ["items"],
    "additionalProperties": False,
}


def _params(
    output_lens: Sequence[int], structured: dict[str, Any] | None = None, sampling: Sampling = GREEDY
) -> list[Any]:
    from tokenmill import SamplingParams

    return [
        SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            max_tokens=n,
            ignore_eos=True,
            structured_outputs=structured,
        )
        for n in output_lens
    ]


def warmup(
    llm: Any,
    workload: Sequence[OfflineRequest],
    max_tokens: int = 8,
    structured: dict[str, Any] | None = None,
    sampling: Sampling = GREEDY,
) -> None:
    """A short untimed generate: first-call allocations and kernel selection are not the benchmark.
    Its prompts are the first two reversed, never the measured ones: the prefix cache would answer
    those in the timed run (the HF baseline has none)."""
    prompts = [list(reversed(r.prompt_token_ids)) for r in workload[:2]]
    llm.generate(prompts, _params([max_tokens] * len(prompts), structured, sampling))


def run_tokenmill(
    llm: Any,
    workload: Sequence[OfflineRequest],
    use_tqdm: bool = True,
    name: str = "tokenmill",
    structured: dict[str, Any] | None = None,
    lora_paths: Sequence[str | None] | None = None,
    sampling: Sampling = GREEDY,
) -> RunResult:
    """Submit every request at once and run them to completion; time the whole generate call.
    `structured`: every request's `structured_outputs` (vLLM's dict form). `lora_paths`: each
    request's LoRA adapter directory (None: the base model)."""
    prompts = [r.prompt_token_ids for r in workload]
    params = _params([r.output_len for r in workload], structured, sampling)
    loras = _lora_requests(lora_paths) if lora_paths is not None else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=loras)
    duration = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    latencies, ttfts = [], []
    for o in outs:
        m = o.metrics
        if m.finished_time is not None:
            latencies.append(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            ttfts.append(m.first_token_time - m.arrival_time)
    return _result(
        name,
        workload,
        token_ids,
        duration,
        latencies,
        ttfts,
        max_num_seqs=getattr(getattr(llm.engine, "config", None), "max_num_seqs", None),
        cached_prompt_tokens=sum(o.num_cached_tokens for o in outs),
    )


def _lora_requests(paths: Sequence[str | None]) -> list[Any]:
    """One LoRARequest per adapter directory (named after it), None for the base model."""
    from tokenmill import LoRARequest

    ids = {path: i + 1 for i, path in enumerate(dict.fromkeys(p for p in paths if p is not None))}
    return [None if p is None else LoRARequest(Path(p).name, ids[p], p) for p in paths]


# --------------------------------------------------------------------------------------------------
# Hugging Face static batches


def static_batches(workload: Sequence[OfflineRequest], batch_size: int) -> list[list[int]]:
    """Indices of consecutive requests, `batch_size` at a time (arrival order, like a naive server)."""
    return [list(range(i, min(i + batch_size, len(workload)))) for i in range(0, len(workload), batch_size)]


def padding_accounting(workload: Sequence[OfflineRequest], batch_size: int) -> tuple[int, int, float]:
    """(useful tokens, generated tokens, waste fraction) of static batches that each decode to their
    longest request's output length."""
    useful = sum(r.output_len for r in workload)
    generated = sum(len(b) * max(workload[i].output_len for i in b) for b in static_batches(workload, batch_size))
    return useful, generated, (1.0 - useful / generated) if generated else 0.0


def load_hf_model(model_dir: str | Path, device: str = "cpu", dtype: Any = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    return model.to(device).eval()


def _hf_generate(
    model: Any, prompts: Sequence[list[int]], new_tokens: int, pad_id: int, sampling: Sampling = GREEDY
) -> list[list[int]]:
    """`generate` (greedy, or sampled as `sampling` says) on one left-padded batch that decodes
    exactly `new_tokens` for every row."""
    import copy

    import torch

    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    # ignore_eos semantics: no EOS id at all, so nothing stops early and no logit is suppressed
    # (min_new_tokens with an EOS id would mask EOS and change greedy picks vs tokenmill).
    gen_config = copy.deepcopy(model.generation_config)
    gen_config.eos_token_id = None
    gen_config.pad_token_id = pad_id
    gen_config.do_sample = not sampling.greedy
    gen_config.max_new_tokens = new_tokens
    gen_config.min_new_tokens = new_tokens
    for name in ("temperature", "top_p", "top_k", "min_p"):  # greedy: no warning about unused sampling flags
        setattr(gen_config, name, None if sampling.greedy else getattr(sampling, name))
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_config)
    gen = out[:, width:].tolist()
    if any(len(g) != new_tokens for g in gen):
        raise RuntimeError(f"HF generate returned {len(gen[0])} tokens, expected {new_tokens}")
    return gen


def hf_pad_id(model_dir: str | Path) -> int:
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        for value in (tok.pad_token_id, tok.eos_token_id):
            if value is not None:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def run_hf_static(
    model: Any,
    workload: Sequence[OfflineRequest],
    batch_size: int = 16,
    pad_id: int = 0,
    progress: bool = True,
    sampling: Sampling = GREEDY,
) -> RunResult:
    """The naive baseline: consecutive static batches, each decoding to its longest output length.

    Useful tokens are each request's own output length (the rest of its row is waste); a request's
    latency is when its batch ends, since all arrive at t=0. TTFT is not observable through
    `generate` (nothing streams out), so it is left NaN.
    """
    from tqdm.auto import tqdm

    token_ids: list[list[int]] = [[] for _ in workload]
    latencies = [0.0] * len(workload)
    batches = static_batches(workload, batch_size)
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc="HF static batches", unit="batch", disable=not progress):
        longest = max(workload[i].output_len for i in batch)
        gen = _hf_generate(model, [workload[i].prompt_token_ids for i in batch], longest, pad_id, sampling)
        end = time.perf_counter() - t0
        for row, i in enumerate(batch):
            token_ids[i] = gen[row][: workload[i].output_len]
            latencies[i] = end
    duration = time.perf_counter() - t0
    _, generated, waste = padding_accounting(workload, batch_size)
    return _result(
        f"hf-static-bs{batch_size}",
        workload,
        token_ids,
        duration,
        latencies,
        [],
        max_num_seqs=batch_size,
        generated_tokens=generated,
        padding_waste=waste,
    )


def greedy_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, float]:
    """Per request, compare the first min(len) tokens: the fraction of requests that match exactly,
    and the mean fraction of tokens before the first difference."""
    exact, prefix = 0, []
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        same = next((k for k in range(n) if x[k] != y[k]), n)
        exact += same == n
        prefix.append(same / n if n else 1.0)
    count = len(prefix)
    return {
        "requests": count,
        "exact_match_fraction": exact / count if count else math.nan,
        "mean_matching_prefix_fraction": float(np.mean(prefix)) if count else math.nan,
    }


# --------------------------------------------------------------------------------------------------
# Runs in fresh processes


def in_fresh_process(fn: Any, *args: Any) -> Any:
    """fn(*args) in a newly spawned interpreter. Heavy runs one after another in one process
    handicap the later ones (measured: HF generate 68 s alone, 95 s after an engine run; the engine
    14 s alone, 22 s after HF generate), so every compared run gets a process of its own."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def hf_baseline_run(
    model_dir: Path,
    workload: Sequence[OfflineRequest],
    batch_size: int,
    dtype: str,
    device: str,
    progress: bool,
    sampling: Sampling = GREEDY,
) -> RunResult:
    """Load the HF model, warm it up untimed and run the static-batch baseline."""
    import torch

    hf = load_hf_model(model_dir, device=device, dtype=getattr(torch, dtype))
    pad = hf_pad_id(model_dir)
    _hf_generate(hf, [workload[0].prompt_token_ids], 4, pad, sampling)  # untimed warmup
    return run_hf_static(hf, workload, batch_size, pad, progress=progress, sampling=sampling)


def tokenmill_run(
    kwargs: dict[str, Any],
    workload: Sequence[OfflineRequest],
    name: str,
    progress: bool,
    warm: Sequence[OfflineRequest] | None = None,
    repeat: bool = False,
    structured: dict[str, Any] | None = None,
    lora_paths: Sequence[str | None] | None = None,
    sampling: Sampling = GREEDY,
) -> RunResult:
    """Build an engine from `engine_kwargs`, warm it up untimed (on `warm`, default the workload's
    first prompts) and time the workload; with `repeat`, time only a second identical round.
    `structured`: constrain every request (its grammar is compiled, and timed, before the warmup).
    `lora_paths`: each request's LoRA adapter (loaded, and used by the warmup, before timing)."""
    from tokenmill import LLM
    from tokenmill.bench.roofline import model_weight_bytes
    from tokenmill.engine.structured_output.params import StructuredOutputsParams

    kwargs = dict(kwargs)
    llm = LLM(kwargs.pop("model"), progress=progress, **kwargs)
    try:
        compile_s = None
        if structured is not None:
            start = time.perf_counter()
            llm.engine.grammars.compile(StructuredOutputsParams.from_dict(structured)).result()
            compile_s = time.perf_counter() - start
        warmup(llm, warm if warm is not None else workload, structured=structured, sampling=sampling)
        if lora_paths is not None:  # every adapter loaded and run once, untimed
            adapters = list(dict.fromkeys(p for p in lora_paths if p is not None))
            first = (warm or workload)[0].prompt_token_ids
            run_tokenmill(llm, [OfflineRequest(first, 4)] * len(adapters), use_tqdm=False, lora_paths=adapters)
        if repeat:
            run_tokenmill(
                llm, workload, use_tqdm=False, structured=structured, lora_paths=lora_paths, sampling=sampling
            )
        run = run_tokenmill(
            llm, workload, use_tqdm=progress, name=name, structured=structured, lora_paths=lora_paths, sampling=sampling
        )
        run.weight_bytes = model_weight_bytes(llm.engine.model)[0]
        run.grammar_compile_s = compile_s
        return run
    finally:
        llm.engine.close()


# --------------------------------------------------------------------------------------------------
# Model / engine construction


def resolve_bench_model(model: str | None) -> Path:
    """--model: None = the default model, 'tiny' = the random tiny Llama in the cache (built once)."""
    from tokenmill.models.model_loader.hub import make_tiny_model, resolve_model
    from tokenmill.paths import cache_root

    if model != TINY_MODEL:
        return resolve_model(model)
    target = cache_root() / "models" / "tiny-llama"
    if not ((target / "config.json").exists() and any(target.glob("*.safetensors"))):
        import shutil

        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        print(f"building the tiny model in {target} (once)", file=sys.stderr)
        make_tiny_model(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    return target


def engine_kwargs(args: argparse.Namespace, model_dir: Path, **overrides: Any) -> dict[str, Any]:
    from tokenmill.engine.config import EngineConfig

    kwargs = vars(EngineConfig.from_cli_args(args))
    kwargs.update(model=str(model_dir), **overrides)
    return kwargs


def make_llm(args: argparse.Namespace, model_dir: Path, **overrides: Any) -> Any:
    from tokenmill import LLM

    kwargs = engine_kwargs(args, model_dir, **overrides)
    model = kwargs.pop("model")
    return LLM(model, progress=not args.no_progress, **kwargs)


# --------------------------------------------------------------------------------------------------
# Output


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_runs(runs: Sequence[RunResult]) -> str:
    rows: list[tuple[str, str, Any]] = [
        ("Requests", "d", lambda r: r.num_requests),
        ("Prompt tokens", "d", lambda r: r.prompt_tokens),
        ("Prompt tokens from the prefix cache", "d", lambda r: r.cached_prompt_tokens),
        ("Useful output tokens", "d", lambda r: r.output_tokens),
        (
            "Generated tokens (incl. padding)",
            "d",
            lambda r: r.generated_tokens if r.generated_tokens is not None else r.output_tokens,
        ),
        ("Padding waste (%)", ".1f", lambda r: None if r.padding_waste is None else r.padding_waste * 100),
        ("Total time (s)", ".2f", lambda r: r.duration_s),
        ("Useful output tok/s", ".1f", lambda r: r.output_throughput),
        ("Requests/s", ".3f", lambda r: r.request_throughput),
        ("Mean latency (s)", ".2f", lambda r: r.latency.mean_ms / 1e3),
        ("P50 latency (s)", ".2f", lambda r: r.latency.p50_ms / 1e3),
        ("P99 latency (s)", ".2f", lambda r: r.latency.p99_ms / 1e3),
        ("Mean TTFT (s)", ".3f", lambda r: r.ttft.mean_ms / 1e3),
        ("P50 TTFT (s)", ".3f", lambda r: r.ttft.p50_ms / 1e3),
        ("P99 TTFT (s)", ".3f", lambda r: r.ttft.p99_ms / 1e3),
    ]
    table = [["Metric", *(r.name for r in runs)]]
    table += [[label, *(_fmt(get(r), spec) for r in runs)] for label, spec, get in rows]
    return format_grid(table)


def format_sweep(runs: Sequence[RunResult]) -> str:
    table = [["concurrency", "mean latency (s)", "p99 latency (s)", "mean TTFT (s)", "p99 TTFT (s)", "output tok/s"]]
    for r in runs:
        table.append(
            [
                str(r.max_num_seqs),
                _fmt(r.latency.mean_ms / 1e3, ".2f"),
                _fmt(r.latency.p99_ms / 1e3, ".2f"),
                _fmt(r.ttft.mean_ms / 1e3, ".3f"),
                _fmt(r.ttft.p99_ms / 1e3, ".3f"),
                _fmt(r.output_throughput, ".1f"),
            ]
        )
    return format_grid(table, title="Concurrency sweep (max_num_seqs)")


def plot_sweep(runs: Sequence[RunResult], path: str | Path, title: str = "tokenmill bench offline --sweep") -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    conc = [r.max_num_seqs for r in runs]
    fig = Figure(figsize=(11, 4.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax_tp, ax_lat = fig.subplots(1, 2)
    ax_tp.plot(conc, [r.output_throughput for r in runs], "o-")
    ax_tp.set(title="Output tokens/s vs concurrency", xlabel="max_num_seqs", ylabel="output tok/s", xscale="log")
    ax_lat.plot(conc, [r.latency.mean_ms / 1e3 for r in runs], "o-", label="mean latency")
    ax_lat.plot(conc, [r.latency.p99_ms / 1e3 for r in runs], "s--", label="p99 latency")
    ax_lat.plot(conc, [r.ttft.mean_ms / 1e3 for r in runs], "^:", label="mean TTFT")
    ax_lat.set(title="Latency vs concurrency", xlabel="max_num_seqs", ylabel="seconds", xscale="log")
    ax_lat.legend()
    for ax in (ax_tp, ax_lat):
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def environment() -> dict[str, Any]:
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover
        tf_version = None
    return {
        "command": " ".join(shlex.quote(a) for a in ["tokenmill", *sys.argv[1:]]) if sys.argv else None,
        "argv": list(sys.argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "transformers_version": tf_version,
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def print_report(args: argparse.Namespace, table: str | None, data: dict[str, Any]) -> int:
    """How every engine benchmark ends: print its table, write `data` and the environment as JSON
    to --json (which `tokenmill bench` gives every engine benchmark) when given; returns the exit code."""
    if table is not None:
        print(table)
    if args.json:
        write_json(args.json, json_safe({"environment": environment(), **data}))
    return 0


# --------------------------------------------------------------------------------------------------
# Command


def compare_model_impls(
    args: argparse.Namespace, model_dir: Path, workload: Sequence[OfflineRequest], progress: bool
) -> dict[str, Any]:
    """The workload on the native path, then on the generic transformers path, each in a fresh
    process; prints both and returns them with the throughput ratio and greedy agreement."""
    runs = [
        in_fresh_process(
            tokenmill_run,
            engine_kwargs(args, model_dir, model_impl=impl),
            workload,
            f"tokenmill --model-impl {impl}",
            progress,
        )
        for impl in ("native", "transformers")
    ]
    native, generic = runs
    ratio = generic.output_throughput / native.output_throughput
    agreement = greedy_agreement(native.token_ids, generic.token_ids)
    print(format_runs(runs))
    print(f"generic (transformers) / native useful tok/s: {ratio:.2f}x")
    print(
        f"greedy agreement: {agreement['exact_match_fraction'] * 100:.1f}% of {agreement['requests']} requests "
        f"match exactly; mean matching prefix {agreement['mean_matching_prefix_fraction'] * 100:.1f}%"
    )
    return {
        "native": native.to_dict(),
        "transformers": generic.to_dict(),
        "throughput_ratio_transformers_over_native": ratio,
        "greedy_agreement": agreement,
    }


def compare_structured_output(
    args: argparse.Namespace, model_dir: Path, workload: Sequence[OfflineRequest], progress: bool
) -> dict[str, Any]:
    """The workload unconstrained, then with every request constrained to STRUCTURED_SCHEMA, each in
    a fresh process (same prompts, greedy, same token counts); prints both and the throughput ratio."""
    kwargs = engine_kwargs(args, model_dir)
    free = in_fresh_process(tokenmill_run, kwargs, workload, "unconstrained", progress)
    constrained = in_fresh_process(
        tokenmill_run, kwargs, workload, "json_schema", progress, None, False, {"json": STRUCTURED_SCHEMA}
    )
    ratio = constrained.output_throughput / free.output_throughput
    print(format_runs([free, constrained]))
    print(
        f"json_schema / unconstrained useful tok/s: {ratio:.3f}x ({(1 - ratio) * 100:+.1f}% slower); "
        f"schema compiled in {constrained.grammar_compile_s:.2f} s (once, before the timed run)"
    )
    if constrained.output_tokens != free.output_tokens:
        print(
            f"warning: the constrained run produced {constrained.output_tokens} tokens, the free run "
            f"{free.output_tokens}",
            file=sys.stderr,
        )
    return {
        "unconstrained": free.to_dict(),
        "json_schema": constrained.to_dict(),
        "schema": STRUCTURED_SCHEMA,
        "throughput_ratio_json_schema_over_unconstrained": ratio,
    }


def parse_values(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def main(args: argparse.Namespace) -> int:
    import torch

    from tokenmill.engine.precision import resolve_dtype
    from tokenmill.engine.setup import resolve_device
    from tokenmill.models.model_loader.loader import load_spec

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    progress = not args.no_progress
    model_dir = resolve_bench_model(args.model)
    report: dict[str, Any] = {"model_dir": str(model_dir), "engine": engine_kwargs(args, model_dir)}
    print(f"model: {model_dir}", file=sys.stderr)
    device = resolve_device(args.device)
    workload = make_workload(
        args.num_prompts,
        args.min_input,
        args.max_input,
        args.min_output,
        args.max_output,
        load_spec(model_dir).vocab_size,
        args.seed,
    )
    report["workload"] = {
        "num_prompts": args.num_prompts,
        "min_input": args.min_input,
        "max_input": args.max_input,
        "min_output": args.min_output,
        "max_output": args.max_output,
        "seed": args.seed,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
        "requested_output_tokens": sum(r.output_len for r in workload),
    }
    sampling = sampling_from_args(args)
    report["workload"]["sampling"] = asdict(sampling)
    print(f"{describe_workload(workload)}; {sampling.describe()}", file=sys.stderr)

    # The engine of this process serves the main run, the roofline and the long outputs; sweep
    # points and the model-impl and structured-output comparisons build their own.
    main_here = not args.skip_main and args.compare not in ("model-impl", "structured-output")
    llm = make_llm(args, model_dir) if main_here or args.roofline or args.long_outputs else None
    runs: list[RunResult] = []
    if args.compare == "model-impl":
        report["model_impl"] = compare_model_impls(args, model_dir, workload, progress)
    if args.compare == "structured-output":
        report["structured_output"] = compare_structured_output(args, model_dir, workload, progress)
    if main_here:  # first, in this process: no other heavy run has gone before it
        warmup(llm, workload, sampling=sampling)
        main_run = run_tokenmill(llm, workload, use_tqdm=progress, sampling=sampling)
        runs.append(main_run)
        report["tokenmill"] = main_run.to_dict()
        if main_run.output_tokens != main_run.requested_tokens:
            print(
                f"warning: tokenmill produced {main_run.output_tokens} tokens, {main_run.requested_tokens} "
                "were requested",
                file=sys.stderr,
            )
    if args.compare == "hf":
        hf_run = in_fresh_process(
            hf_baseline_run,
            model_dir,
            workload,
            args.hf_batch_size,
            str(resolve_dtype(args.dtype, device, model_dir)).removeprefix("torch."),
            str(device),
            progress,
            sampling,
        )
        runs.append(hf_run)
        report["hf"] = hf_run.to_dict()
        if runs[0] is not hf_run:
            ratio = runs[0].output_throughput / hf_run.output_throughput
            agreement = greedy_agreement(runs[0].token_ids, hf_run.token_ids) if sampling.greedy else None
            report["comparison"] = {"throughput_ratio_tokenmill_over_hf": ratio, "greedy_agreement": agreement}

    if runs:
        print(format_runs(runs))
        if "comparison" in report:
            c = report["comparison"]
            a = c["greedy_agreement"]
            print(f"tokenmill / HF useful tok/s: {c['throughput_ratio_tokenmill_over_hf']:.2f}x")
            if a is not None:
                print(
                    f"greedy agreement vs HF (first min(len) tokens): {a['exact_match_fraction'] * 100:.1f}% of "
                    f"{a['requests']} requests match exactly; mean matching prefix "
                    f"{a['mean_matching_prefix_fraction'] * 100:.1f}% (left padding shifts HF numerics slightly)"
                )

    if args.sweep:
        sweep_workload = workload[: args.sweep_prompts] if args.sweep_prompts else workload
        print(f"sweep: {describe_workload(sweep_workload)}", file=sys.stderr)
        sweep_runs = []
        for value in args.sweep_values:
            run = in_fresh_process(
                functools.partial(tokenmill_run, sampling=sampling),
                engine_kwargs(args, model_dir, max_num_seqs=value),
                sweep_workload,
                f"concurrency {value}",
                progress,
            )
            run.max_num_seqs = value
            sweep_runs.append(run)
            print(
                f"  concurrency {value}: {run.output_throughput:.1f} tok/s, "
                f"mean latency {run.latency.mean_ms / 1e3:.2f} s",
                file=sys.stderr,
            )
        print(format_sweep(sweep_runs))
        report["sweep"] = [r.to_dict() for r in sweep_runs]
        if args.plot:
            plot_sweep(sweep_runs, args.plot, title=f"tokenmill bench offline --sweep ({model_dir.name})")
            print(f"wrote {args.plot}", file=sys.stderr)

    if args.long_outputs:
        from tokenmill.bench.long_outputs import format_long_outputs, run_long_outputs

        points = run_long_outputs(
            llm, args.long_outputs, args.long_streams, args.long_prompt_len, load_spec(model_dir).vocab_size, args.seed
        )
        print(format_long_outputs(points))
        report["long_outputs"] = [p.to_dict() for p in points]

    if args.roofline:
        from tokenmill.bench.roofline import format_roofline, measure_roofline

        result = measure_roofline(llm, prompt_len=32, new_tokens=128, copy_bytes=args.roofline_copy_bytes)
        print(format_roofline(result))
        report["roofline"] = result.to_dict()

    return print_report(args, None, report)


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-prompts", type=positive_int, default=64, metavar="N", help="requests (default: 64)")
    group.add_argument(
        "--min-input", type=positive_int, default=4, metavar="TOKENS", help="shortest prompt (default: 4)"
    )
    group.add_argument(
        "--max-input", type=positive_int, default=200, metavar="TOKENS", help="longest prompt (default: 200)"
    )
    group.add_argument(
        "--min-output", type=positive_int, default=16, metavar="TOKENS", help="shortest output (default: 16)"
    )
    group.add_argument(
        "--max-output", type=positive_int, default=128, metavar="TOKENS", help="longest output (default: 128)"
    )
    add_sampling_args(
        group, note=", here and in the HF baseline (the --compare model-impl and structured-output runs stay greedy)"
    )
    bench = parser.add_argument_group("benchmark")
    bench.add_argument(
        "--compare",
        choices=["hf", "model-impl", "structured-output"],
        default=None,
        help="hf: also run Hugging Face generate in static left-padded batches on the same "
        "prompts; model-impl: run the workload with --model-impl native and with "
        "--model-impl transformers (the generic path), each in a fresh process, instead "
        "of the main run; structured-output: run the workload unconstrained and with "
        "every request constrained to a JSON schema (greedy, same token counts), each "
        "in a fresh process, instead of the main run",
    )
    bench.add_argument(
        "--hf-batch-size",
        type=positive_int,
        default=16,
        metavar="N",
        help="static batch size of the HF baseline (default: 16)",
    )
    bench.add_argument("--sweep", action="store_true", help="rerun the workload at each --sweep-values max_num_seqs")
    bench.add_argument(
        "--sweep-values",
        type=parse_values,
        default=[1, 4, 16, 64],
        metavar="LIST",
        help="comma-separated concurrency limits (default: 1,4,16,64)",
    )
    bench.add_argument(
        "--sweep-prompts",
        type=positive_int,
        default=None,
        metavar="N",
        help="use only the first N prompts in the sweep (default: all)",
    )
    bench.add_argument(
        "--plot", metavar="PATH", default=None, help="with --sweep: PNG of tok/s and latency vs concurrency"
    )
    bench.add_argument(
        "--roofline",
        action="store_true",
        help="measure copy bandwidth, weight bytes and batch-1 decode step vs its bandwidth bound",
    )
    bench.add_argument(
        "--roofline-copy-bytes",
        type=positive_int,
        default=1 << 30,
        metavar="BYTES",
        help="size of the fp32 tensor copied to measure bandwidth (default: 1 GiB)",
    )
    bench.add_argument(
        "--long-outputs",
        type=parse_values,
        default=None,
        metavar="LIST",
        help="also stream --long-streams requests of each of these output lengths (e.g. 256,1024,4096) "
        "with cumulative outputs (before) and delta outputs (after), reporting engine host time "
        "per output token",
    )
    bench.add_argument(
        "--long-streams",
        type=positive_int,
        default=8,
        metavar="N",
        help="concurrent streams of --long-outputs (default: 8)",
    )
    bench.add_argument(
        "--long-prompt-len",
        type=positive_int,
        default=32,
        metavar="TOKENS",
        help="prompt length of --long-outputs requests (default: 32)",
    )
    bench.add_argument(
        "--skip-main", action="store_true", help="skip the main tokenmill run (e.g. only --sweep or --roofline)"
    )
    add_bench_engine_args(parser)


def add_bench_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags of the offline benchmarks: --model also takes 'tiny', a bench KV budget;
    --no-progress."""
    from tokenmill.engine.config import OFFLINE_DEFAULTS, EngineConfig
    from tokenmill.options import option_help

    offline = {
        name: {
            "default": value,
            "help": f"{option_help(EngineConfig, name)} (default here: {value}, the offline API's)",
        }
        for name, value in OFFLINE_DEFAULTS.items()
    }
    EngineConfig.add_cli_args(
        parser,
        **offline,
        model={
            "help": "model directory, 'tiny' for the random tiny Llama (built once in the cache), or default",
        },
        kv_cache_memory={
            "default": DEFAULT_KV_CACHE,
            "help": f"KV cache budget (default here: {DEFAULT_KV_CACHE})",
        },
        seed={
            "help": "seed of the prompts and of the engine's unseeded sampling (default: 0)",
        },
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
