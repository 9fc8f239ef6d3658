"""Speed features keep outputs correct: torch.compile, int8 weights."""

from __future__ import annotations

import pytest

from tests.conftest import mixed_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.slow
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
    # Every linear layer is int8, the lm_head too (tokenmill's CPU kernels), and the embedding tied to
    # it reads its rows from the int8 head: one copy, the head's dequantized rows, in fp32.
    from tokenmill.kernels.ops import cpu_kernels_available
    from tokenmill.models.layers.quantization.int8 import Int8Embedding

    modules = dict(q.engine.model.named_modules())
    assert not any(type(m) is torch.nn.Linear for m in modules.values())
    assert all(m.quant_method.name == "int8" for n, m in modules.items() if n.endswith("_proj"))
    head, embedding = modules["lm_head"], modules["embed_tokens"]
    if cpu_kernels_available(torch.device("cpu")):
        assert head.quant_method.name == "int8" and isinstance(embedding, Int8Embedding)
        assert not any(isinstance(m, torch.nn.Embedding) for m in modules.values())
        ids = torch.tensor([0, 1, 5])
        assert torch.equal(embedding(ids), head.dequantized(torch.float32)[ids])
    else:  # (the head stays in the model dtype: int8 weights would be widened on every call)
        assert head.quant_method.name != "int8"
    first_token_agreement = sum(a[0] == b[0] for a, b in zip(fp32, int8)) / len(prompts)
    assert first_token_agreement >= 0.75, first_token_agreement


@pytest.mark.slow
def test_int8_default_model_follows_fp32_greedy(default_model_chat_answers):
    """The bundled SmolLM2 in int8 (once 49% teacher-forced agreement, off fp32 from the 2nd token)
    follows fp32's greedy answers to the chat prompts of the exactness test: fed fp32's answer, int8's
    top-1 is fp32's token wherever fp32's own top two lie more than 0.25 nats apart (closer ones are
    near-ties any rounding may flip: "What is the capital of France?" opens with "The" only 0.08
    nats ahead of "L"), and each answer token's log-probability stays within 0.25 nats of fp32's."""
    prompts, answers = default_model_chat_answers
    int8 = LLM(None, progress=False, kv_cache_memory="64MiB", dtype="float32", quantization="int8")
    scored = int8.generate(
        [p + a.token_ids for p, a in zip(prompts, answers)],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
    )
    clear = 0
    for prompt, answer, out in zip(prompts, answers, scored):
        for token, (logprob, top), ranked in zip(answer.token_ids, answer.logprobs, out.prompt_logprobs[len(prompt) :]):
            assert abs(ranked[token].logprob - logprob) < 0.25, (answer.text, token)
            first, second = sorted(top.values(), reverse=True)[:2]
            if first - second > 0.25:
                clear += 1
                assert ranked[token].rank == 1, (answer.text, token)
    assert clear >= 36  # (44 of the 72 answer tokens are clear choices: the rank check has teeth)
