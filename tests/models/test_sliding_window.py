"""Sliding-window attention (Mistral, Qwen2 use_sliding_window): prompts and generations longer
than the window give HF's greedy tokens, also with chunked prefill and prefix caching."""

from __future__ import annotations

import pytest

from tests.conftest import TEST_WINDOW, hf_greedy, mixed_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.models.model_loader.loader import load_spec

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
FIXTURES = ["tiny_mistral_dir", "tiny_qwen2_window_dir"]


def test_windows_per_layer_follow_hf(tiny_mistral_dir, tiny_qwen2_window_dir):
    assert load_spec(tiny_mistral_dir).layer_windows == (TEST_WINDOW,) * 2
    assert load_spec(tiny_qwen2_window_dir).layer_windows == (None, TEST_WINDOW, TEST_WINDOW)  # max_window_layers=1
    assert load_spec(tiny_mistral_dir).max_position == 512  # the window no longer caps the context


def _check(llm: LLM, model_dir, prompts) -> None:
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, GREEDY.max_tokens), (
            f"{len(prompt)}-token prompt"
        )


@pytest.mark.parametrize("fixture", FIXTURES)
def test_long_prompts_batched_and_chunked(request, fixture):
    """Mixed-length prompts up to 7x the window, prefilled in 24-token chunks next to decodes."""
    model_dir = request.getfixturevalue(fixture)
    prompts = mixed_prompts(6, 1, 7 * TEST_WINDOW, seed=21)
    assert max(map(len, prompts)) > 3 * TEST_WINDOW
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="32MiB", max_num_batched_tokens=24)
    _check(llm, model_dir, prompts)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_prefix_cached_prompts_longer_than_the_window(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    shared = mixed_prompts(1, 5 * TEST_WINDOW, 5 * TEST_WINDOW, seed=22)[0]
    prompts = [shared + suffix for suffix in mixed_prompts(4, 1, 20, seed=23)]
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="32MiB", enable_prefix_caching=True)
    _check(llm, model_dir, prompts[:1])  # fills the cache with the shared prefix
    _check(llm, model_dir, prompts[1:])
    assert llm.engine.stats().prefix_cache_hit_rate > 0.5
