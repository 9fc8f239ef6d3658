"""Speed features keep outputs correct: torch.compile, int8 weights."""

from __future__ import annotations

from tests.conftest import mixed_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def test_compile_equals_eager_greedy(tiny_model_dir):
    prompts = mixed_prompts(6, 3, 70, seed=31)
    eager = _tokens(LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB"), prompts)
    compiled = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB", compile=True)
    assert _tokens(compiled, prompts) == eager
    assert _tokens(compiled, prompts[::-1]) == eager[::-1]  # other batch shapes reuse the dynamic graph


def test_int8_weights_agree_with_fp32_mostly(tiny_model_dir):
    import torch

    prompts = mixed_prompts(16, 5, 40, seed=32)
    fp32 = _tokens(LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB"), prompts)
    q = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB", quantization="int8")
    int8 = _tokens(q, prompts)
    assert not any(isinstance(m, torch.nn.Linear) and type(m) is torch.nn.Linear for m in q.engine.model.modules())
    first_token_agreement = sum(a[0] == b[0] for a, b in zip(fp32, int8)) / len(prompts)
    assert first_token_agreement >= 0.75, first_token_agreement
