"""--tensor-parallel-size: 2 CPU processes over gloo give the same greedy tokens as one."""

from __future__ import annotations

import pytest

from tests.conftest import mixed_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _greedy(model_dir, prompts, **engine_args) -> list[list[int]]:
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="32MiB", **engine_args)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir"])  # GQA; Qwen2 adds q/k/v biases
def test_tp2_equals_tp1_greedy(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = mixed_prompts(8, 3, 90, seed=51)  # prompts longer than a block, batched together
    tp1 = _greedy(model_dir, prompts)
    tp2 = _greedy(model_dir, prompts, tensor_parallel_size=2)
    assert tp2 == tp1
    assert all(len(t) == GREEDY.max_tokens for t in tp2)


def test_tp_rejects_what_it_cannot_shard(tiny_gpt2_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="Llama family"):
        LLM(str(tiny_gpt2_dir), progress=False, kv_cache_memory="32MiB", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="must divide"):
        LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB", tensor_parallel_size=4)  # 6 heads
    with pytest.raises(ValueError, match=">= 1"):
        LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB", tensor_parallel_size=0)
