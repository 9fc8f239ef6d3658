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


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_dir"])  # GQA; Qwen2 adds q/k/v biases
def test_tp2_equals_tp1_greedy(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    prompts = mixed_prompts(8, 3, 90, seed=51)  # prompts longer than a block, batched together
    tp1 = _greedy(model_dir, prompts)
    tp2 = _greedy(model_dir, prompts, tensor_parallel_size=2)
    assert tp2 == tp1
    assert all(len(t) == GREEDY.max_tokens for t in tp2)


def test_tp2_with_ngram_speculation_equals_tp1_greedy(tiny_model_dir):
    """Speculative chunks (a token and its drafts) are replayed by the worker like any chunk; the
    soft tiny model repeats itself, so drafts are accepted."""
    prompts = mixed_prompts(4, 3, 40, seed=52)
    tp1 = _greedy(tiny_model_dir, prompts)
    llm = LLM(
        str(tiny_model_dir), progress=False, kv_cache_memory="32MiB", tensor_parallel_size=2, speculative_method="ngram"
    )
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == tp1
        assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.engine.close()
    with pytest.raises(ValueError, match="--speculative-method draft does not run with --tensor-parallel-size"):
        LLM(
            str(tiny_model_dir),
            progress=False,
            tensor_parallel_size=2,
            speculative_method="draft",
            speculative_model=str(tiny_model_dir),
        )


def test_tp_rejects_what_it_cannot_shard(tiny_gpt2_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="Llama family"):
        LLM(str(tiny_gpt2_dir), progress=False, kv_cache_memory="32MiB", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="must divide"):
        LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB", tensor_parallel_size=4)  # 6 heads
    with pytest.raises(ValueError, match=">= 1"):
        LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB", tensor_parallel_size=0)
