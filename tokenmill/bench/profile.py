"""`tokenmill bench profile`: where a step's time goes (attention, GEMMs, elementwise, sampler, host).

Three workloads, each on one engine in this process: batch-1 decode, batch-64 decode (contexts of
16-512 tokens) and the first steps of a mixed workload (64 requests submitted at once: chunked
prefills next to decodes). Each is first timed without the profiler (ms per step), then run again
under torch.profiler, where every op's self time goes to one category:

- attention: everything under `paged_attention` (K/V writes, gathers, masks, the attention kernel);
- gemm: matrix products (linear layers, the lm_head, int8 GEMMs) outside attention;
- sampler: everything under the sampler;
- elementwise: every other op (norms, RoPE, activations, embedding lookups, copies);
- host: the profiled step's wall time not spent in any op: Python, scheduling, input preparation.

The profiler adds a few microseconds to every op, so shares are of the profiled step; the
unprofiled ms/step is the speed figure.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tokenmill.bench.arg_types import positive_int
from tokenmill.bench.engine_args import add_bench_engine_args, make_llm, resolve_bench_model
from tokenmill.bench.offline.workload import MIN_PROMPT_TOKEN_ID
from tokenmill.bench.report import format_grid, print_report

CATEGORIES = ("attention", "gemm", "elementwise", "sampler", "host")
_SCOPES = {"tokenmill::attention": "attention", "tokenmill::sampler": "sampler"}
# Op names (or name prefixes) that are matrix products.
_GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
    "aten::linear",
    "aten::_weight_int8pack_mm",
    "mkldnn::",
    "quantized::",
    "aten::_grouped_mm",
    "aten::baddbmm",
    "tokenmill::packed_int8_linear",
    "tokenmill::lora_delta",
    "tokenmill::packed_linear",
    "tokenmill::amx_linear",
)


@dataclass
class WorkloadProfile:
    name: str
    steps: int
    ms_per_step: float  # unprofiled
    tokens_per_step: float  # tokens the model processed per step (prefill + decode)
    profiled_ms_per_step: float
    shares: dict[str, float]  # category -> fraction of the profiled step time
    top_ops: list[tuple[str, float]] = field(default_factory=list)  # (op, ms per step), self time


def _category(event: Any) -> str:
    """The category of a profiler event's self time: its nearest tokenmill scope, else by op name."""
    node = event
    while node is not None:
        if node.name in _SCOPES:
            return _SCOPES[node.name]
        node = node.cpu_parent
    node = event
    while node is not None:
        if node.name.startswith(_GEMM_OPS):
            return "gemm"
        node = node.cpu_parent
    return "elementwise"


@contextmanager
def _scoped(owner: Any, attribute: str, scope: str) -> Iterator[None]:
    """Wrap owner.attribute (a function or method) in a profiler scope while the block runs."""
    import torch

    original = getattr(owner, attribute)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(scope):
            return original(*args, **kwargs)

    setattr(owner, attribute, wrapped)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


@contextmanager
def profiler_scopes() -> Iterator[None]:
    """Scope paged_attention in every model module that calls it, and the sampler."""
    import importlib

    from tokenmill.engine.sample.sampler import Sampler

    owners = [
        importlib.import_module(f"tokenmill.models.{m}")
        for m in ("families.llama", "families.gpt2", "model_loader.transformers_backend")
    ]
    with _scoped(Sampler, "__call__", "tokenmill::sampler"):
        stack = [_scoped(m, "paged_attention", "tokenmill::attention") for m in owners if hasattr(m, "paged_attention")]
        for cm in stack:
            cm.__enter__()
        try:
            yield
        finally:
            for cm in reversed(stack):
                cm.__exit__(None, None, None)


def summarize(events: Any, wall_s: float, steps: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Shares of the profiled wall time per category, and the top ops by self time (ms per step)."""
    totals: dict[str, float] = defaultdict(float)
    per_op: dict[str, float] = defaultdict(float)
    for event in events:
        if event.name in _SCOPES or event.name.startswith("ProfilerStep"):
            continue
        self_us = event.self_cpu_time_total
        totals[_category(event)] += self_us
        per_op[event.name] += self_us
    wall_us = wall_s * 1e6
    totals["host"] = max(0.0, wall_us - sum(totals.values()))
    shares = {c: totals.get(c, 0.0) / wall_us for c in CATEGORIES}
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:12]
    return shares, [(name, us / 1e3 / steps) for name, us in top]


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    low = MIN_PROMPT_TOKEN_ID if vocab > 2 * MIN_PROMPT_TOKEN_ID else 0
    return rng.integers(low, vocab, size=length).tolist()


def _add(engine: Any, prompts: list[list[int]], max_tokens: int) -> None:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{time.monotonic_ns()}-{i}", prompt, params)


def _drain(engine: Any) -> None:
    """End every request now (aborted: the rest of a long workload is not profiled)."""
    for request_id in engine.output_processor.request_ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()


def _steps_until_decode_only(engine: Any, limit: int = 10_000) -> None:
    """Step until no sequence is waiting or prefilling: every later step is decode-only."""
    for _ in range(limit):
        sched = engine.scheduler
        if not sched.waiting and all(s.num_computed_tokens >= s.num_tokens - 1 for s in sched.running):
            return
        engine.step()
    raise RuntimeError("prefills did not finish")


def _measure(engine: Any, steps: int, counter: Callable[[], int]) -> tuple[float, float]:
    """(seconds per step, tokens per step) over `steps` steps."""
    before = counter()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps, (counter() - before) / steps


def profile_workload(llm: Any, name: str, setup: Callable[[], None], steps: int) -> WorkloadProfile:
    """Set up the workload twice: time `steps` steps, then profile `steps` steps."""
    import torch

    engine = llm.engine
    processed = [0]
    listener = lambda stats: processed.__setitem__(0, processed[0] + stats.num_prefill_tokens + stats.num_decode_tokens)
    engine.step_listeners.append(listener)
    try:
        setup()
        step_s, tokens = _measure(engine, steps, lambda: processed[0])
        _drain(engine)
        setup()
        with profiler_scopes(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - t0
        _drain(engine)
    finally:
        engine.step_listeners.remove(listener)
    shares, top = summarize(prof.events(), wall, steps)
    return WorkloadProfile(name, steps, step_s * 1e3, tokens, wall / steps * 1e3, shares, top)


def run_profiles(llm: Any, args: argparse.Namespace) -> list[WorkloadProfile]:
    engine = llm.engine
    vocab = engine.spec.vocab_size
    results = []
    todo = set(args.workloads)
    # Untimed warmup: first calls allocate and pick kernels.
    _add(engine, [_prompt(32, vocab, 0)], 8)
    _drain(engine)
    if "decode-bs1" in todo:

        def bs1() -> None:
            _add(engine, [_prompt(args.context, vocab, 1)], args.steps + 4)
            _steps_until_decode_only(engine)

        results.append(profile_workload(llm, "decode-bs1", bs1, args.steps))
    if "decode-bs64" in todo:
        rng = np.random.default_rng(2)
        lengths = rng.integers(16, 513, size=64)

        # Long enough that no request ends while later ones still prefill.
        budget = engine.config.max_num_batched_tokens
        max_tokens = args.steps + 4 + -(-int(lengths.sum()) // budget)

        def bs64() -> None:
            _add(engine, [_prompt(int(n), vocab, 3 + i) for i, n in enumerate(lengths)], max_tokens)
            _steps_until_decode_only(engine)

        results.append(profile_workload(llm, "decode-bs64", bs64, args.steps))
    if "mixed" in todo:
        rng = np.random.default_rng(4)
        lengths, outputs = rng.integers(16, 513, size=64), rng.integers(32, 257, size=64)

        def mixed() -> None:
            from tokenmill import SamplingParams

            for i, (n, out) in enumerate(zip(lengths, outputs)):
                engine.add_request(
                    f"profile-mixed-{time.monotonic_ns()}-{i}",
                    _prompt(int(n), vocab, 100 + i),
                    SamplingParams(temperature=0.0, max_tokens=int(out), ignore_eos=True),
                )

        results.append(profile_workload(llm, "mixed", mixed, args.steps))
    return results


def format_profiles(results: list[WorkloadProfile]) -> str:
    header = ["workload", "ms/step", "tok/step", *(f"{c} %" for c in CATEGORIES)]
    rows = [
        [r.name, f"{r.ms_per_step:.2f}", f"{r.tokens_per_step:.1f}", *(f"{100 * r.shares[c]:.1f}" for c in CATEGORIES)]
        for r in results
    ]
    parts = [format_grid([header, *rows], "Step profile (shares of the profiled step)")]
    for r in results:
        parts.append(
            format_grid(
                [["op (self time)", "ms/step"], *([op, f"{ms:.3f}"] for op, ms in r.top_ops)], f"{r.name}: top ops"
            )
        )
    return "\n\n".join(parts)


def main(args: argparse.Namespace) -> int:
    import torch

    model_dir = resolve_bench_model(args.model)
    llm = make_llm(args, model_dir)
    try:
        results = run_profiles(llm, args)
    finally:
        llm.engine.close()
    attention = "fused CPU kernel" if llm.engine.runner.fused_attention else "gather + SDPA"
    print(
        f"dtype {llm.engine.precision.describe()}, {torch.get_num_threads()} threads, "
        f"attention: {attention} (TOKENMILL_CPU_KERNELS=0 for gather + SDPA)"
    )
    return print_report(
        args,
        format_profiles(results),
        {
            "dtype": llm.engine.precision.describe(),
            "num_threads": torch.get_num_threads(),
            "attention": attention,
            "profiles": [asdict(r) for r in results],
        },
    )


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=["decode-bs1", "decode-bs64", "mixed"],
        default=["decode-bs1", "decode-bs64", "mixed"],
        help="which workloads (default: all three)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=32,
        metavar="N",
        help="steps timed, then profiled, per workload (default: 32)",
    )
    parser.add_argument(
        "--context",
        type=positive_int,
        default=256,
        metavar="TOKENS",
        help="prompt length of the batch-1 decode (default: 256)",
    )
    add_bench_engine_args(parser)
