"""Decode attention alone: 64 decodes (contexts 56-552 keys, SmolLM2's 9 query / 3 kv heads of 64
dims, bf16 caches in 16-token blocks scattered over the cache) through `tokenmill::paged_attention`,
one call per layer over each layer's own caches (30 layers: K/V from DRAM, as in a model step) or
over one layer's (in cache). Best of 7 passes: ms a pass, ns a key, GB/s of K/V read.

    python bench/paged_attention_decode.py [--layers 30] [--sequences 64] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.kernels import build

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30, help="layers' caches read in turn (1: in cache)")
    parser.add_argument("--sequences", type=int, default=64, help="decodes per call")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if not build.load():
        raise SystemExit("tokenmill's CPU kernels are not built here")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    ctx = torch.randint(16, 512, (args.sequences,)) + 40
    blocks_per = (ctx + BLOCK - 1) // BLOCK
    num_blocks = int(blocks_per.sum()) + 1
    caches = [
        (
            torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM).to(dtype),
            torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM).to(dtype),
        )
        for _ in range(args.layers)
    ]
    order = torch.randperm(num_blocks - 1) + 1  # (blocks anywhere in the cache, as a long-running server's)
    tables = torch.zeros(args.sequences, int(blocks_per.max()), dtype=torch.int32)
    used = 0
    for s in range(args.sequences):
        n = int(blocks_per[s])
        tables[s, :n] = order[used : used + n].int()
        used += n
    q = torch.randn(args.sequences, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    starts = torch.arange(args.sequences, dtype=torch.int32)
    lens = torch.ones(args.sequences, dtype=torch.int32)

    def one_pass() -> None:
        for k, v in caches:
            torch.ops.tokenmill.paged_attention(
                q, k, v, out, starts, lens, tables, ctx.int(), BLOCK, HEAD_DIM**-0.5, 0, 0.0
            )

    repeats = max(1, int(2e6 / (int(ctx.sum()) * args.layers)))
    for _ in range(3):
        one_pass()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(repeats):
            one_pass()
        best = min(best, (time.perf_counter() - start) / repeats)
    keys = int(ctx.sum()) * args.layers
    kv_bytes = keys * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
    print(
        f"{args.sequences} decodes x {args.layers} layers, {args.dtype}, {torch.get_num_threads()} threads: "
        f"{best * 1e3:.2f} ms a pass, {best / keys * 1e9:.1f} ns a key, {kv_bytes / best / 1e9:.1f} GB/s of K/V"
    )


if __name__ == "__main__":
    main()
