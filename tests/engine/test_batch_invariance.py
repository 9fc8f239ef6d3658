"""Batch invariance (`--batch-invariant`): a request's greedy tokens and their logprobs are the ones
it gets alone, whatever shares its steps: mixed batches with staggered arrivals, chunked prefill,
preemption and recomputation, prefix-cache hits, and speculative decoding (its verification pass
computes the positions plain decoding computes one at a time). Compared bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import mixed_prompts, run_staggered
from tokenmill import LLM, SamplingParams
from tokenmill.engine.worker.kv_cache import bytes_per_block
from tokenmill.kernels.cpu_caps import detect

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
# (dtype, --quantization): float in fp32 and bf16, and int8 weights under bf16 activations
VARIANTS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "bfloat16-int8": ("bfloat16", "int8")}


def _prompts() -> list[list[int]]:
    """Mixed lengths, a shared 70-token prefix on a third of them (prefix-cache hits), and phrases
    that repeat (n-gram drafts to accept)."""
    shared = mixed_prompts(1, 70, 70, seed=31)[0]
    plain = mixed_prompts(12, 1, 150, seed=32)
    cached = [shared + suffix for suffix in mixed_prompts(6, 1, 30, seed=33)]
    repeats = [phrase * 5 for phrase in mixed_prompts(4, 3, 8, seed=34)]
    return [p for group in zip(plain[:6], cached, plain[6:], repeats + repeats[:2]) for p in group]


def _result(output) -> tuple:
    """What must not depend on the batch: a CompletionOutput's tokens and their logprobs."""
    return output.token_ids, output.logprobs


def _engine(model_dir: Path, variant: str, **kwargs) -> LLM:
    dtype, quantization = VARIANTS[variant]
    settings = {"kv_cache_memory": "64MiB", "quantization": quantization, **kwargs}
    return LLM(str(model_dir), progress=False, dtype=dtype, batch_invariant=True, **settings)


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request) -> str:
    if request.param == "bfloat16-int8" and detect().amx_bf16:
        pytest.skip("int8 weights under bf16 activations take AMX-bf16 tiles from 12 rows on AMX CPUs (refused)")
    return request.param


@pytest.fixture(scope="module")
def alone(sharp_tiny_model_dir, variant) -> list[tuple]:
    """Each prompt alone in its engine's steps: one prefill chunk, then batch-1 decodes."""
    llm = _engine(sharp_tiny_model_dir, variant, enable_prefix_caching=False)
    assert llm.engine.dtype == getattr(torch, VARIANTS[variant][0]) and llm.engine.parts.batch_invariant
    return [_result(llm.generate([p], GREEDY)[0].outputs[0]) for p in _prompts()]


@pytest.mark.slow
def test_staggered_arrivals_and_chunked_prefill(sharp_tiny_model_dir, variant, alone):
    """Three requests join every step and prompts are cut into chunks of a 48-token budget: steps
    of many sizes mixing prefill chunks and decodes, each context split its own way."""
    llm = _engine(sharp_tiny_model_dir, variant, max_num_batched_tokens=48)
    assert run_staggered(llm, _prompts(), GREEDY, per_step=3, pick=_result) == alone
    assert llm.engine.stats().prefix_cache_hit_rate > 0  # (the shared prefix was read from the cache)


@pytest.mark.slow
def test_one_batch_with_preemption(sharp_tiny_model_dir, variant, alone):
    """Everything at once into a KV cache too small for it: sequences are preempted and their
    context recomputed as prefill, where they had decoded it token by token."""
    dtype = getattr(torch, VARIANTS[variant][0])
    block_bytes = bytes_per_block(16, 6, 2, 64, dtype)  # (the tiny Llama's K/V per block)
    llm = _engine(sharp_tiny_model_dir, variant, kv_cache_memory=str(30 * block_bytes), max_model_len=256)
    assert [_result(o.outputs[0]) for o in llm.generate(_prompts(), GREEDY)] == alone
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.slow
def test_speculation_on_equals_off(tiny_model_dir):
    """n-gram speculation in bf16, staggered arrivals: each step verifies up to 4 drafts per sequence
    in one pass; the greedy tokens and logprobs are those of plain decoding alone. (The soft tiny
    model: its outputs copy the prompts' repeated phrases, so drafts are accepted; the sharp one's
    never repeat, and n-grams find nothing to propose.)"""
    prompts = _prompts()[1::2]
    plain = _engine(tiny_model_dir, "bfloat16", enable_prefix_caching=False)
    alone = [_result(plain.generate([p], GREEDY)[0].outputs[0]) for p in prompts]
    llm = _engine(tiny_model_dir, "bfloat16", speculative_method="ngram", num_speculative_tokens=4)
    assert run_staggered(llm, prompts, GREEDY, per_step=3, pick=_result) == alone
    stats = llm.engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_the_default_and_where_the_flag_is_refused():
    """On where tokenmill's CPU kernels run, off on CUDA and with what it cannot hold under; asked
    for there, refused with a message naming the setting, before anything loads."""
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.setup import batch_invariance
    from tokenmill.kernels.ops import cpu_kernels_available

    cpu, cuda, fp32 = torch.device("cpu"), torch.device("cuda"), torch.float32
    assert batch_invariance(EngineConfig(), cpu, fp32) == cpu_kernels_available(cpu)
    assert not batch_invariance(EngineConfig(), cuda, fp32)
    assert batch_invariance(EngineConfig(batch_invariant=True), cuda, fp32)
    assert not batch_invariance(EngineConfig(batch_invariant=False), cpu, fp32)
    for blocker, message in (
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
        ({"compile": True}, "--compile"),
        ({"enable_lora": True}, "LoRA"),
    ):
        assert not batch_invariance(EngineConfig(**blocker), cpu, fp32)
        with pytest.raises(ValueError, match=f"--batch-invariant cannot hold with {message}"):
            EngineConfig(batch_invariant=True, **blocker).check_batch_invariance()
        with pytest.raises(ValueError, match="--batch-invariant cannot hold"):
            LLM(None, progress=False, batch_invariant=True, **blocker)
    if cpu_kernels_available(cpu):
        assert not batch_invariance(EngineConfig(packed_linear=False), cpu, fp32)
        with pytest.raises(ValueError, match="--batch-invariant cannot hold with --no-packed-linear"):
            batch_invariance(EngineConfig(batch_invariant=True, packed_linear=False), cpu, fp32)


def test_chunks_of_any_length_stay_on_the_paged_kernel():
    """Long chunks after cached context attend as two flash-attention calls without batch invariance;
    with it (paged_prefill) they stay on the paged kernel, whose sums do not depend on the split."""
    from tokenmill.engine.worker.model_runner import LONG_CHUNK_QUERIES, Chunk, build_forward

    n = LONG_CHUNK_QUERIES
    table = list(range(-(-2 * n // 16)))
    chunks = [Chunk(list(range(n)), 0, table), Chunk(list(range(n)), n, table)]
    invariant = build_forward(chunks, [], 16, True, paged_prefill=True)
    assert not invariant.meta.prefills and invariant.meta.paged.query_lens.tolist() == [n, n]
    plain = build_forward(chunks, [], 16, True)
    assert [seg.cached_slots is not None for seg in plain.meta.prefills] == [False, True]
