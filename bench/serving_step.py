"""A serving step's cost: 63 sequences decoding alone, and with one new 256-token prompt's prefill
in the same step (what a 64-stream load runs whenever a request ends and the next arrives).

    python bench/serving_step.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenmill import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    llm = LLM(None, progress=False, dtype=args.dtype, max_num_batched_tokens=2048, max_num_seqs=128)
    engine = llm.engine
    rng = np.random.default_rng(0)

    def prompt(n: int) -> list[int]:
        return rng.integers(100, 40000, size=n).tolist()

    for i in range(63):
        engine.add_request(
            f"decode-{i}",
            prompt(int(rng.integers(128, 385))),
            SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True),
        )
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(5):
        engine.step()

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return (time.perf_counter() - start) * 1e3

    decode = [timed_step() for _ in range(10)]
    mixed = []
    for j in range(8):
        engine.add_request(f"new-{j}", prompt(256), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        mixed.append(timed_step())
        engine.step()
    print(f"63 decodes: {np.median(decode):.1f} ms a step; with a 256-token prefill: {np.median(mixed):.1f} ms")


if __name__ == "__main__":
    main()
