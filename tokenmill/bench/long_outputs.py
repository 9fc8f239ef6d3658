"""`tokenmill bench offline --long-outputs 256,1024,4096`: engine time per output token while
streaming long outputs, with cumulative outputs (every step copies each request's whole text,
tokens and logprobs: how the engine worked before delta outputs) and with delta outputs.

Each point runs `--long-streams` greedy requests (ignore_eos, `max_tokens` = the point) through
`LLMEngine.step()` and reads every output's deltas, as a streaming server does. Host time is the
wall time of the steps minus the model thread's time (the forward pass and sampling, which grows
with the context for reasons that have nothing to do with outputs): scheduling, input preparation,
landing tokens, detokenization and building outputs. With delta outputs it stays flat as outputs
grow; with cumulative ones it grows with the output length (O(n^2) per request).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.engine.outputs import RequestOutputKind

MODES = {"cumulative": RequestOutputKind.CUMULATIVE, "delta": RequestOutputKind.DELTA}


@dataclass
class LongOutputPoint:
    mode: str  # "cumulative" (before) | "delta" (after)
    output_len: int
    streams: int
    output_tokens: int
    wall_s: float  # sum of LLMEngine.step() wall times
    model_s: float  # model-thread time of those steps
    host_ms_per_token: float
    total_ms_per_token: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_point(llm: Any, prompts: list[list[int]], output_len: int, mode: str) -> LongOutputPoint:
    from tokenmill import SamplingParams

    engine = llm.engine
    model_seconds: list[float] = []
    listener = lambda stats: model_seconds.append(stats.step_time_s)
    engine.step_listeners.append(listener)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=1)
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"long-{mode}-{output_len}-{i}", prompt, params, output_kind=MODES[mode])
        tokens = chars = 0
        wall = 0.0
        while engine.has_unfinished():
            start = time.perf_counter()
            outputs = engine.step()
            wall += time.perf_counter() - start
            for out in outputs:  # what a streaming server reads
                for choice in out.outputs:
                    tokens += len(choice.token_ids_delta)
                    chars += len(choice.text_delta)
    finally:
        engine.step_listeners.remove(listener)
    model = sum(model_seconds)
    return LongOutputPoint(
        mode,
        output_len,
        len(prompts),
        tokens,
        wall,
        model,
        1000 * (wall - model) / max(tokens, 1),
        1000 * wall / max(tokens, 1),
    )


def run_long_outputs(
    llm: Any, lengths: list[int], streams: int, prompt_len: int, vocab_size: int, seed: int = 0
) -> list[LongOutputPoint]:
    """Every length in both modes, alternating, after an untimed warm-up."""
    import numpy as np

    limit = llm.engine.max_model_len
    if prompt_len + max(lengths) > limit:
        raise ValueError(
            f"--long-outputs {max(lengths)} plus a {prompt_len}-token prompt exceeds this model's "
            f"context ({limit}): pick a model with a longer context or shorter outputs"
        )
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab_size, size=prompt_len).tolist() for _ in range(streams)]
    run_point(llm, prompts, min(lengths), "delta")  # warm-up (allocations, first-touch pages)
    points = []
    for length in lengths:
        for mode in MODES:
            points.append(run_point(llm, prompts, length, mode))
    return points


def format_long_outputs(points: list[LongOutputPoint]) -> str:
    lines = [
        "long outputs: engine time per output token (host = step wall time - model thread)",
        f"{'output len':>10} {'outputs':>11} {'tokens':>8} {'host ms/tok':>12} {'total ms/tok':>13}",
    ]
    for p in points:
        lines.append(
            f"{p.output_len:>10} {p.mode:>11} {p.output_tokens:>8} {p.host_ms_per_token:>12.3f} "
            f"{p.total_ms_per_token:>13.3f}"
        )
    for mode in MODES:
        mine = [p for p in points if p.mode == mode]
        if len(mine) > 1:
            lines.append(
                f"{mode}: host ms/token at {mine[-1].output_len} / at {mine[0].output_len} = "
                f"{mine[-1].host_ms_per_token / mine[0].host_ms_per_token:.2f}x"
            )
    return "\n".join(lines)
