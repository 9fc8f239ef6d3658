"""Where a step's time goes on a GPU machine: per-step wall times, a cProfile and a torch.profiler table.

A GPU runs a small model's step kernels in a few ms, so slow steps there are host time, not GPU
time. This script gathers what is needed to say where it goes:

1. ms per step for overlap scheduling on/off and CUDA graphs on/off (same workload, same process;
   each variant runs once);
2. a cProfile of one pass without overlap (every step on this thread, Python included);
3. a torch.profiler table (CPU + CUDA) of a short run without overlap, and its chrome trace (gzip).

    python bench/gpu_step_profile.py MODEL_DIR OUT_DIR [--dtype float16] [--num-prompts 64]

Runs on the CPU too (for checking the script; the CUDA-only variants are skipped there).
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import random
import shutil
import statistics
import time
from pathlib import Path

import torch

from tokenmill.engine.llm import LLM
from tokenmill.engine.sampling_params import SamplingParams


def workload(num_prompts: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 1000) for _ in range(rng.randrange(4, 200))] for _ in range(num_prompts)]


def run_steps(llm: LLM, prompts: list[list[int]], max_tokens: int, on_step=None) -> list[float]:
    """Submit every prompt, step to the end; the wall time of each step() call."""
    engine = llm.engine
    tag = f"p{time.monotonic_ns()}"
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add(engine.make_request(f"{tag}-{i}", prompt, params))
    times = []
    while engine.has_unfinished():
        if on_step is not None:
            on_step(len(times))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict:
    ms = [t * 1e3 for t in times]
    return {
        "steps": len(ms),
        "total_s": round(sum(times), 3),
        "median_ms": round(statistics.median(ms), 2),
        "first_12_ms": [round(t, 1) for t in ms[:12]],
        "max_ms": round(max(ms), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    prompts = workload(args.num_prompts)
    report: dict = {"torch": torch.__version__, "num_threads": torch.get_num_threads(), "variants": {}}

    def make(overlap: bool, graphs: bool) -> LLM:
        llm = LLM(
            args.model,
            dtype=args.dtype if cuda else "float32",
            overlap_scheduling=overlap,
            cuda_graphs=graphs,
            kv_cache_memory="2GiB",
            progress=False,
        )
        llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        return llm

    variants = [(False, False), (True, False), (True, True)] if cuda else [(False, False)]
    for overlap, graphs in variants:
        llm = make(overlap, graphs)
        name = f"overlap={overlap} graphs={graphs}"
        report["variants"][name] = summary(run_steps(llm, prompts, args.max_tokens))
        print(name, json.dumps(report["variants"][name]), flush=True)
        if overlap or graphs:
            del llm
            continue
        # Without overlap every step runs on this thread: cProfile sees all of its Python.
        profiler = cProfile.Profile()
        profiler.enable()
        run_steps(llm, prompts, args.max_tokens)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        (args.out / "cprofile.txt").write_text(text.getvalue())
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True) as prof:
            run_steps(llm, prompts[:32], 8)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        table_stacks = prof.key_averages(group_by_stack_n=6).table(sort_by="self_cpu_time_total", row_limit=25)
        (args.out / "torch_profile.txt").write_text(table + "\n\n" + table_stacks)
        trace = args.out / "trace.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        print(table[:6000], flush=True)
        del llm
    (args.out / "step_profile.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
