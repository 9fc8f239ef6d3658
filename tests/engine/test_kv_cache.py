"""Block allocator and cache hygiene."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy, mixed_prompts
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
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model_dir, prompt, 12)
    assert torch.isfinite(llm.engine.kv_cache.layers[0][0][:bs]).all()
