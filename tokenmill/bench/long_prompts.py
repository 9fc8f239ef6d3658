"""`tokenmill bench offline --long-prompts 2000,8000`: time to the first token of long prompts.

Each point submits `streams` prompts of one length at once to `LLM.generate`, one output token each
(greedy, ignore_eos), and takes each request's time from arrival to its first token; the point is
repeated `repeats` times on fresh random prompts (so no prefix cache answers any of them) after one
untimed request of that length (first-touch pages, primitive builds for its chunk shapes). With one
stream this is the prefill latency of one long prompt; with several, how chunked prefill shares the
step budget (--max-num-batched-tokens) among them.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class LongPromptPoint:
    prompt_len: int
    streams: int
    repeats: int
    ttft_s: list[float]  # every request's time to first token, all repeats
    cached_prompt_tokens: int  # prompt tokens the prefix cache answered (0 for a fair run)

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(self.ttft_s)

    @property
    def min_ttft_s(self) -> float:
        return min(self.ttft_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_ttft_s": self.mean_ttft_s, "min_ttft_s": self.min_ttft_s}


def _ttfts(llm: Any, prompts: list[list[int]]) -> tuple[list[float], int]:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return ttfts, sum(o.num_cached_tokens for o in outs)


def run_long_prompts(
    llm: Any, lengths: list[int], streams: list[int], repeats: int, vocab_size: int, seed: int = 0
) -> list[LongPromptPoint]:
    """Every (length, streams) point, lengths outer, after an untimed request of each length."""
    import numpy as np

    limit = llm.engine.max_model_len
    if max(lengths) + 1 > limit:
        raise ValueError(f"--long-prompts {max(lengths)} plus one output token exceeds this model's context ({limit})")
    rng = np.random.default_rng(seed)

    def prompts(length: int, count: int) -> list[list[int]]:
        return [rng.integers(100, vocab_size, size=length).tolist() for _ in range(count)]

    points = []
    for length in lengths:
        _ttfts(llm, prompts(length, 1))  # warm-up
        for count in streams:
            ttfts: list[float] = []
            cached = 0
            for _ in range(repeats):
                times, hits = _ttfts(llm, prompts(length, count))
                ttfts.extend(times)
                cached += hits
            points.append(LongPromptPoint(length, count, repeats, ttfts, cached))
    return points


def format_long_prompts(points: list[LongPromptPoint]) -> str:
    lines = [
        "long prompts: time to first token (one output token per request)",
        f"{'prompt len':>10} {'streams':>8} {'repeats':>8} {'mean TTFT s':>12} {'min TTFT s':>11}",
    ]
    for p in points:
        lines.append(f"{p.prompt_len:>10} {p.streams:>8} {p.repeats:>8} {p.mean_ttft_s:>12.3f} {p.min_ttft_s:>11.3f}")
    return "\n".join(lines)
