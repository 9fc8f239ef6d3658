"""Greedy output must be token-for-token identical to transformers' generate()."""

from __future__ import annotations

import pytest

from tests.conftest import agree_up_to_near_ties, hf_greedy, hf_greedy_batch, hf_greedy_padded, mixed_prompts
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _engine_outputs(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    "fixture",
    [
        pytest.param("sharp_tiny_model_dir", marks=pytest.mark.smoke),
        "tiny_gpt2_dir",
        "tiny_qwen2_dir",
        "tiny_llama_bias_dir",
        "tiny_gpt2_unscaled_dir",
    ],
)
def test_greedy_matches_hf_random_models(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="64MiB")
    prompts = mixed_prompts(6, 1, 60, seed=len(fixture))
    assert _engine_outputs(llm, prompts) == hf_greedy_batch(model_dir, prompts, 16)


def test_padded_hf_reference_is_the_one_prompt_at_a_time_reference(sharp_tiny_model_dir):
    """The batched reference (`hf_greedy_batch`, left-padded generate) gives each prompt the tokens
    generate() gives it alone, unpadded: what lets the exactness tests batch their references."""
    prompts = mixed_prompts(5, 1, 200, seed=21) + [[1234]]
    assert hf_greedy_padded(sharp_tiny_model_dir, prompts, 12) == [
        hf_greedy(sharp_tiny_model_dir, prompt, 12) for prompt in prompts
    ]


@pytest.mark.slow
def test_greedy_matches_hf_default_model(default_model_dir, default_model_chat_answers):
    prompts, answers = default_model_chat_answers
    assert [answer.token_ids for answer in answers] == hf_greedy_batch(default_model_dir, prompts, 24)
    assert "Paris" in answers[0].text


@pytest.mark.slow
def test_32_mixed_prompts_staggered_arrival(sharp_tiny_model_dir):
    """Requests join the running batch at different steps; chunked prefill splits the long ones."""
    llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="128MiB", max_num_batched_tokens=128)
    engine = llm.engine
    prompts = mixed_prompts(32, 1, 300, seed=7)
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {}
    max_batch = 0
    while pending or engine.has_unfinished():
        for _ in range(3):  # three new arrivals per step
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, GREEDY)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        max_batch = max(max_batch, len(engine.scheduler.running))
    assert max_batch > 4  # it really batched
    for i, (p, expected) in enumerate(zip(prompts, hf_greedy_batch(sharp_tiny_model_dir, prompts, 16))):
        assert results[str(i)] == expected, f"prompt {i} ({len(p)} tokens)"
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.slow
def test_preemption_under_tiny_kv_budget(sharp_tiny_model_dir):
    # 40 usable blocks of 16 tokens for 12 sequences that need up to ~10 blocks each: preemption is forced.
    import torch

    from tokenmill.engine.worker.kv_cache import bytes_per_block

    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        max_num_batched_tokens=256,
        max_model_len=256,
        kv_cache_memory=str(41 * bytes_per_block(16, 6, 2, 64, torch.float32)),
    )
    prompts = mixed_prompts(12, 60, 120, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = _engine_outputs(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for got, expected in zip(outs, hf_greedy_batch(sharp_tiny_model_dir, prompts, 32)):
        assert got == expected[: len(got)]
        assert len(got) == 32
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


@pytest.mark.slow
def test_prefix_caching_gives_identical_outputs(sharp_tiny_model_dir):
    """A prompt whose prefix is cached runs its suffix as a chunk over cached context (the paged
    kernel) where the plain engine prefills it whole (SDPA): the same arithmetic in another order, so
    the tokens agree except where two candidates tie to fp32 rounding (seen once in 20 on an Intel
    AVX-512 CPU: two logits 1e-5 apart; see agree_up_to_near_ties)."""
    system = mixed_prompts(1, 200, 200, seed=11)[0]
    prompts = [system + suffix for suffix in mixed_prompts(20, 3, 12, seed=12)]
    cached = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="128MiB", enable_prefix_caching=True)
    plain = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="128MiB", enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    first = [o.outputs[0] for o in cached.generate(prompts[:1], params)]  # warm the cache with the shared prefix
    rest = [o.outputs[0] for o in cached.generate(prompts[1:], params)]
    parted = agree_up_to_near_ties(first + rest, [o.outputs[0] for o in plain.generate(prompts, params)])
    assert parted <= 2, f"{parted} of 20 sequences parted at near-ties"
    assert cached.engine.stats().prefix_cache_hit_rate > 0.8
    assert [got.token_ids for got in (first + rest)[:3]] == hf_greedy_batch(sharp_tiny_model_dir, prompts[:3], 16)


@pytest.mark.slow
def test_prefix_cache_eviction_stays_correct(sharp_tiny_model_dir):
    import torch

    from tokenmill.engine.worker.kv_cache import bytes_per_block

    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        max_model_len=256,
        kv_cache_memory=str(30 * bytes_per_block(16, 6, 2, 64, torch.float32)),
    )
    prompts = mixed_prompts(10, 100, 150, seed=5)
    for round_ in range(2):  # second round: some blocks were evicted, some revived
        assert _engine_outputs(llm, prompts) == hf_greedy_batch(sharp_tiny_model_dir, prompts, 16), f"round {round_}"
