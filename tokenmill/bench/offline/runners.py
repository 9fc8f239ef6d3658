"""`bench offline`'s tokenmill runs: the whole workload submitted at once to `LLM.generate` and timed,
in this process or in a fresh one."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.offline.workload import OfflineRequest
from tokenmill.bench.report import LatencyStats
from tokenmill.bench.sampling import GREEDY, Sampling


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


def run_result(
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


def _params(
    output_lens: Sequence[int], structured: dict[str, Any] | None = None, sampling: Sampling = GREEDY
) -> list[Any]:
    from tokenmill import SamplingParams
    from tokenmill.engine.structured_output.params import StructuredOutputsParams

    constraint = StructuredOutputsParams.from_dict(structured) if structured is not None else None
    return [
        SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=sampling.min_p,
            max_tokens=n,
            ignore_eos=True,
            structured_outputs=constraint,
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
    return run_result(
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


def in_fresh_process(fn: Any, *args: Any) -> Any:
    """fn(*args) in a newly spawned interpreter. Heavy runs one after another in one process
    handicap the later ones (HF generate and the engine each run well slower after the other), so
    every compared run gets a process of its own."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


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
            llm.engine.structured_outputs.compiler.compile(StructuredOutputsParams.from_dict(structured)).result()
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
