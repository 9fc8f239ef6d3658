"""Decode step time at a few batch sizes: 8, 16 and 32 sequences (200-token prompts) decoding
together, median ms a step (what a server with that many streams runs between new prompts).

    python bench/decode_batch_steps.py [--dtype bfloat16] [--quantization int8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenmill import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", choices=["int8"], default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32], help="sequences decoding at once")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per batch (tokens per sequence)")
    args = parser.parse_args()
    llm = LLM(
        None,
        progress=False,
        dtype=args.dtype,
        quantization=args.quantization,
        max_num_batched_tokens=2048,
        max_num_seqs=128,
    )
    engine = llm.engine
    rng = np.random.default_rng(0)
    results = []
    for batch in args.batches:
        for i in range(batch):
            engine.add_request(
                f"{batch}-{i}",
                rng.integers(100, 40000, size=200).tolist(),
                SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True),
            )
        while engine.scheduler.waiting:  # the prompts' prefill
            engine.step()
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        results.append(f"{batch} sequences: {np.median(times[2:-2]):.1f} ms a step")
    print(f"dtype {args.dtype}, quantization {args.quantization or 'none'}: " + "; ".join(results))


if __name__ == "__main__":
    main()
