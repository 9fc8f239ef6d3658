"""Batch invariance of the CPU kernels: a row's bits do not depend on the other rows of its step.

Attention: a query's output is the same whether it is decoded alone, is one row of a prefill chunk
(any split of the context into chunks, first chunk included) or shares the call with other
sequences. Linear layers: a row's output is the same alone and at any place of a step of any size.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.test_cpu_kernels import _case, _kernel, needs_kernels


def _sequence(c: dict, s: int) -> dict:
    """Sequence s of a case whose queries are every position of its context."""
    first = sum(ctx for ctx, _ in c["seqs"][:s])
    ctx = c["seqs"][s][0]
    return dict(c, seqs=[(ctx, ctx)], tables=[c["tables"][s]], q=c["q"][first : first + ctx])


def _rows(c: dict, calls: list[list[tuple[int, int]]]) -> torch.Tensor:
    """Every position of one sequence's context (c from _sequence) computed by `calls`: each a list
    of query ranges [start, end) attended in one kernel call (the range's end its context)."""
    out = torch.empty_like(c["q"])
    for ranges in calls:
        q = torch.cat([c["q"][a:b] for a, b in ranges])
        got = _kernel(dict(c, seqs=[(b, b - a) for a, b in ranges], tables=c["tables"] * len(ranges), q=q))
        row = 0
        for a, b in ranges:
            out[a:b] = got[row : row + b - a]
            row += b - a
    return out


def _random_split(rng: random.Random, ctx: int) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, ctx), min(ctx - 1, rng.randint(0, 6)))) if ctx > 1 else []
    bounds = [0, *cuts, ctx]
    return list(zip(bounds, bounds[1:]))


@needs_kernels
@pytest.mark.parametrize(
    "q_dtype, cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.int8),
        (torch.bfloat16, torch.int8),
    ],
)
@pytest.mark.parametrize("seed", range(6))
def test_a_query_has_the_same_bits_decoded_alone_in_any_chunk_or_batch(seed, q_dtype, cache_dtype):
    """Each position of a context attended as a decode alone, as a row of the whole context's prefill,
    of a random split into chunks (chunked prefill, speculative verification) and of those chunks
    run in one call with chunks of the context's other positions: bit-identical outputs (random
    head sizes with and without vector tails, GQA, block sizes, sliding windows, softcaps, block
    tables that jump around the cache)."""
    from tokenmill.models.layers.kv_quant import to_cache

    rng = random.Random(seed)
    c = _case(rng, q_dtype, seqs=[(rng.randint(1, 300), 0) for _ in range(2)])
    c["seqs"] = [(ctx, ctx) for ctx, _ in c["seqs"]]
    total = sum(ctx for ctx, _ in c["seqs"])
    heads = c["k_cache"].shape[1] * rng.choice([1, 2, 3])
    c["q"] = (torch.randn(total, heads, c["q"].shape[2], generator=torch.Generator().manual_seed(seed)) * 2).to(q_dtype)
    if cache_dtype != q_dtype:  # (unowned slots stay NaN: a read outside the context poisons the output)
        c["k_cache"], c["v_cache"] = (to_cache(cache.float(), cache_dtype) for cache in (c["k_cache"], c["v_cache"]))
    for s in range(len(c["seqs"])):
        one = _sequence(c, s)
        ctx = one["seqs"][0][0]
        alone = _rows(one, [[(p, p + 1)] for p in range(ctx)])
        assert not alone.isnan().any()
        splits = {
            "the whole context in one chunk": [[(0, ctx)]],
            "chunks one after another": [[r] for r in _random_split(rng, ctx)],
            "chunks in one call": [_random_split(rng, ctx)],
        }
        for name, calls in splits.items():
            assert torch.equal(_rows(one, calls), alone), (name, calls, c["window"], c["softcap"])
