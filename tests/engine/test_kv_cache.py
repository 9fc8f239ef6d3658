"""Block allocator and cache hygiene."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy, hf_greedy_batch, mixed_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.core.block_manager import BlockAllocator


@pytest.mark.unit
def test_allocator_reserves_zero_block_and_recycles_lru():
    a = BlockAllocator(5, 16, enable_prefix_caching=True)
    assert a.num_blocks == 4 and a.num_free == 4
    blocks = [a.allocate() for _ in range(4)]
    assert 0 not in blocks and a.usage == 1.0
    a.register(blocks[0], 1234)
    for b in blocks:
        a.release(b)
    assert a.usage == 0.0
    assert a.lookup(1234) == blocks[0]  # revived from the free list
    assert a.num_free == 3
    a.release(blocks[0])
    for _ in range(4):  # reusing every block evicts the cached hash
        a.allocate()
    assert a.lookup(1234) is None


# Two 16-token blocks with the same CPython tuple hash, the prefix cache's old block hash (found in
# seconds by solving the hash's invertible rounds for the first four tokens, birthday-style).
COLLIDING_BLOCKS = ([26606, 11074, 23489, 0, *range(100, 112)], [29863, 2686, 11795, 43611, *range(100, 112)])


def test_blocks_whose_weak_hashes_collide_never_share_kv(tiny_model_dir):
    a, b = COLLIDING_BLOCKS
    assert hash(tuple(a)) == hash(tuple(b))
    llm = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB")
    assert llm.engine.block_size == len(a) and llm.engine.allocator.enable_prefix_caching
    tail = [5, 6, 7, 8]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([a + tail], params)  # block a is now cached
    out = llm.generate([b + tail], params)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == hf_greedy(tiny_model_dir, b + tail, 8)
    assert llm.generate([a + tail[:2]], params)[0].num_cached_tokens == len(a)  # a itself still hits


@pytest.mark.slow
def test_uninitialised_cache_memory_never_leaks_into_outputs(tiny_model_dir):
    """Fill the whole cache with NaN: every read must hit written slots or the zero block."""
    llm = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB")
    bs = llm.engine.block_size
    for k, v in llm.engine.kv_cache.layers:
        k[bs:].fill_(float("nan"))
        v[bs:].fill_(float("nan"))
    prompts = mixed_prompts(6, 5, 70, seed=21)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [out.outputs[0].token_ids for out in outs] == hf_greedy_batch(tiny_model_dir, prompts, 12)
    assert torch.isfinite(llm.engine.kv_cache.layers[0][0][:bs]).all()
