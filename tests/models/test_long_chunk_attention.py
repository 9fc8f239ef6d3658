"""Long prefill chunks after cached context attend as two flash-attention calls (the cached keys, the
chunk's own keys causally) merged by their log-sum-exps: equal to attention over all the keys with a
causal mask, under a sliding window and a softcap too, and greedy engine output equal to HF's."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TEST_WINDOW, hf_greedy, hf_greedy_batch, mixed_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.worker import model_runner
from tokenmill.engine.worker.model_runner import build_forward
from tokenmill.kernels import build
from tokenmill.models.layers.attention import AttentionMetadata, PrefillSegment, _attend, paged_attention


def _reference(q, keys, values, window, softcap, scale):
    """Attention of the chunk's queries (the last of the keys' positions) over every key, masked."""
    n, ctx = q.shape[0], keys.shape[0]
    pos = torch.arange(ctx)
    mask = pos[None, :] <= pos[ctx - n :, None]
    if window is not None:
        mask &= pos[None, :] > pos[ctx - n :, None] - window
    return _attend(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], mask, scale, softcap
    )[0].transpose(0, 1)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (7, None), (None, 20.0), (300, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_after_context_matches_masked_attention(window, softcap, dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, block, cached, n = 6, 2, 32, 16, 77, 40
    ctx = cached + n
    blocks = torch.randperm(12)[: -(-ctx // block)]  # a table that jumps around the cache
    slots = (blocks[torch.arange(ctx) // block] * block + torch.arange(ctx) % block).long()
    keys, values = torch.randn(ctx, kv_heads, dim, dtype=dtype), torch.randn(ctx, kv_heads, dim, dtype=dtype)
    k_cache = torch.full((12 * block, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    k_cache[slots[:cached]], v_cache[slots[:cached]] = keys[:cached], values[:cached]
    q = torch.randn(n, heads, dim, dtype=dtype)
    segment = PrefillSegment(0, n, None, None, cached_slots=slots[:cached])
    meta = AttentionMetadata(slot_mapping=slots[cached:], block_size=block, prefills=[segment], num_prefill_tokens=n)
    out = paged_attention(q, keys[cached:], values[cached:], k_cache, v_cache, meta, 0.2, window, softcap)
    expected = _reference(q.double(), keys.double(), values.double(), window, softcap, 0.2).flatten(1)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.engine
@pytest.mark.skipif(not build.load(), reason="kernels off (no C++ toolchain or TOKENMILL_CPU_KERNELS=0)")
def test_engine_with_long_chunks_after_context_matches_hf(sharp_tiny_model_dir, monkeypatch):
    """Chunked prefill whose later chunks take the two-call path gives HF's greedy tokens."""
    monkeypatch.setattr(model_runner, "LONG_CHUNK_QUERIES", 8)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = mixed_prompts(4, 40, 90, seed=5)
    expected = hf_greedy_batch(sharp_tiny_model_dir, prompts, greedy.max_tokens)
    seen = []

    def recording(*args, **kwargs):
        forward = build_forward(*args, **kwargs)
        seen.append(forward.meta)
        return forward

    monkeypatch.setattr(model_runner, "build_forward", recording)
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="32MiB",
        max_num_batched_tokens=32,
        batch_invariant=False,  # (batch invariance keeps every chunk on the paged kernel)
    )
    outs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert any(seg.cached_slots is not None for m in seen for seg in m.prefills)


@pytest.mark.engine
@pytest.mark.skipif(not build.load(), reason="kernels off (no C++ toolchain or TOKENMILL_CPU_KERNELS=0)")
@pytest.mark.parametrize("fixture", ["tiny_mistral_dir", "tiny_qwen2_window_dir"])
def test_sliding_window_models_with_long_chunks_after_context_match_hf(request, fixture, monkeypatch):
    """Sliding windows (every layer, or some): later chunks on the masked path give HF's tokens."""
    monkeypatch.setattr(model_runner, "LONG_CHUNK_QUERIES", 8)
    model_dir = request.getfixturevalue(fixture)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = mixed_prompts(3, 3 * TEST_WINDOW, 6 * TEST_WINDOW, seed=24)
    llm = LLM(str(model_dir), progress=False, kv_cache_memory="32MiB", max_num_batched_tokens=24)
    outs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model_dir, p, greedy.max_tokens) for p in prompts]
