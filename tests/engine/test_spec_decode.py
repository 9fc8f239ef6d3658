"""Speculative decoding in the engine: greedy tokens identical to speculation off (n-gram and draft
model, staggered arrivals, chunked prefill, preemption, prefix caching), stops never passed,
requests that cannot speculate sharing the batch, metrics per request and over HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import hf_greedy, mixed_prompts, run_staggered, save_random_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.structured_output.params import StructuredOutputsParams
from tokenmill.engine.worker.kv_cache import bytes_per_block

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
TINY_BLOCK_BYTES = bytes_per_block(16, 6, 2, 64, torch.float32)  # the tiny Llama's K/V per block


@pytest.fixture(scope="module")
def draft_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A smaller random Llama with the tiny model's tokenizer: an unrelated draft (rare acceptance)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    return save_random_model(config, default_model_dir, tmp_path_factory.mktemp("draft-llama"), seed=21)


def prompts() -> list[list[int]]:
    """Mixed lengths, some repeating a phrase."""
    phrases = [p * 4 for p in mixed_prompts(2, 3, 9, seed=41)]
    return [p for pair in zip(mixed_prompts(4, 5, 40, seed=40), phrases + phrases) for p in pair]


def staggered(llm: LLM, prompt_list: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Two arrivals per step, so requests join a batch that is already decoding (and speculating)."""
    tokens = run_staggered(llm, prompt_list, params)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks  # every block, rolled back ones too
    return tokens


def small_engine(model_dir: Path, block_bytes: int = TINY_BLOCK_BYTES, **kwargs) -> LLM:
    """9 usable blocks of 16 tokens for 8 sequences of up to 72 tokens: preemption is forced."""
    return LLM(
        str(model_dir),
        progress=False,
        max_num_batched_tokens=64,
        max_model_len=128,
        kv_cache_memory=str(10 * block_bytes),
        **kwargs,
    )


@pytest.mark.slow
def test_ngram_greedy_equals_speculation_off(tiny_model_dir):
    """The tiny model with HF's soft random init repeats itself, so its n-gram drafts are mostly
    accepted and rejected where the repeated token changes."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    off = staggered(small_engine(tiny_model_dir), prompts(), params)
    llm = small_engine(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=3)
    assert staggered(llm, prompts(), params) == off
    stats = llm.engine.stats()
    assert llm.engine.scheduler.num_preemptions > 0  # KV blocks ran out: sequences were recomputed
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens  # accepted and rejected
    assert stats.spec_decode_accepted_per_position[0] >= stats.spec_decode_accepted_per_position[-1] > 0


@pytest.fixture(scope="module")
def greedy_off(sharp_tiny_model_dir) -> list[list[int]]:
    tokens = staggered(small_engine(sharp_tiny_model_dir), prompts(), GREEDY)
    assert tokens[1][:8] == hf_greedy(sharp_tiny_model_dir, prompts()[1], 8)  # (the reference is right)
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["unrelated", "same-as-target"])
def test_draft_model_greedy_equals_speculation_off(request, sharp_tiny_model_dir, greedy_off, draft):
    """An unrelated draft is nearly always rejected; the target as its own draft nearly always
    accepted (its proposals are the target's argmax, computed one token at a time)."""
    draft_dir = request.getfixturevalue("draft_model_dir") if draft == "unrelated" else sharp_tiny_model_dir
    draft_bytes = bytes_per_block(16, 2, 2, 16, torch.float32) if draft == "unrelated" else TINY_BLOCK_BYTES
    llm = small_engine(
        sharp_tiny_model_dir,
        TINY_BLOCK_BYTES + draft_bytes,
        speculative_method="draft",
        speculative_model=str(draft_dir),
        num_speculative_tokens=4,
    )
    assert staggered(llm, prompts(), GREEDY) == greedy_off
    stats = llm.engine.stats()
    assert llm.engine.scheduler.num_preemptions > 0
    rate = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    assert rate > 0.9 if draft == "same-as-target" else rate < 0.5


def test_a_failing_draft_model_only_costs_speculation(sharp_tiny_model_dir, draft_model_dir, caplog):
    """The draft model raising in two steps: those steps run without drafts (logged), the tokens
    stay those of speculation off. (The draft's K/V of those steps' tokens stay missing: worse
    drafts for those sequences, never wrong tokens.)"""
    prompt_list = mixed_prompts(3, 4, 20, seed=44)
    off = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="32MiB").generate(prompt_list, GREEDY)
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        kv_cache_memory="32MiB",
        speculative_method="draft",
        speculative_model=str(draft_model_dir),
    )
    propose, calls = llm.engine.drafter.propose, [0]

    def flaky(batch, fresh):
        calls[0] += 1
        if calls[0] in (3, 4):
            raise RuntimeError("draft model out of memory")
        return propose(batch, fresh)

    llm.engine.drafter.propose = flaky
    on = llm.generate(prompt_list, GREEDY)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert caplog.text.count("the draft model failed") == 2 and llm.engine.stats().spec_decode_num_drafts > 0
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_stops_inside_accepted_drafts(tiny_model_dir):
    """The soft tiny model repeats a token, so n-gram drafts are accepted in long runs; a stop
    string completed by an accepted draft, max_tokens falling inside a run, and a stop token: the
    output ends exactly where it ends without speculation."""
    prompt = mixed_prompts(1, 20, 20, seed=42)[0]
    off = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB")
    on = LLM(
        str(tiny_model_dir),
        progress=False,
        kv_cache_memory="32MiB",
        speculative_method="ngram",
        num_speculative_tokens=5,
    )
    tokens = (
        off.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].token_ids
    )
    cases = [
        (SamplingParams(temperature=0, max_tokens=30, stop=[off.tokenizer.decode(tokens[:7])], ignore_eos=True), True),
        (SamplingParams(temperature=0, max_tokens=13, ignore_eos=True), True),
        (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tokens[-1]], ignore_eos=True), False),
    ]
    for params, speculates in cases:
        expected, got = off.generate([prompt], params)[0].outputs[0], on.generate([prompt], params)[0]
        assert got.outputs[0].token_ids == expected.token_ids and got.outputs[0].text == expected.text
        assert got.outputs[0].finish_reason == expected.finish_reason
        assert got.metrics.spec_num_accepted_tokens > 0 or not speculates
    assert len(expected.token_ids) < 30  # (the stop token did stop it)


def test_mixed_batch_with_non_speculating_requests(tiny_model_dir):
    """One batch (the soft tiny model, whose repetitions the n-gram lookup finds): plain greedy,
    greedy with logprobs and penalties, a structured output (never
    speculates: its grammar decides each token after the one before), a seeded sampled request with
    two choices, and a prompt-scoring request. Greedy ones equal speculation off, logprobs too."""
    prompt_list = [p * 3 for p in mixed_prompts(5, 4, 10, seed=43)]
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=16, logprobs=3, repetition_penalty=1.2, frequency_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex="[0-9]{5}")),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, n=2, seed=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2),
    ]
    off = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB").generate(prompt_list, params)
    llm = LLM(
        str(tiny_model_dir),
        progress=False,
        kv_cache_memory="32MiB",
        speculative_method="ngram",
        overlap_scheduling=True,
    )
    assert llm.engine._model_thread is None  # overlap scheduling gave way to speculation
    on = llm.generate(prompt_list, params)
    for i in (0, 1, 2):
        assert on[i].outputs[0].token_ids == off[i].outputs[0].token_ids, i
    assert [lp[0] for lp in on[1].outputs[0].logprobs] == pytest.approx(
        [lp[0] for lp in off[1].outputs[0].logprobs], abs=1e-4
    )
    assert [set(lp[1]) for lp in on[1].outputs[0].logprobs] == [set(lp[1]) for lp in off[1].outputs[0].logprobs]
    assert on[0].metrics.spec_num_accepted_tokens > 0 and on[0].metrics.spec_mean_accepted_length > 1
    assert on[2].metrics.spec_num_draft_tokens == 0 and on[2].outputs[0].text.isdigit()
    assert [len(c.token_ids) for c in on[3].outputs] == [16, 16]
    assert [e.keys() for e in on[4].prompt_logprobs[1:]] == [e.keys() for e in off[4].prompt_logprobs[1:]]
    again = llm.generate(prompt_list[3:4], params[3:4])[0]  # seeded: reproducible with speculation too
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in on[3].outputs]


def test_draft_model_must_share_the_vocabulary(tmp_path, default_model_dir, sharp_tiny_model_dir):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=1,
        eos_token_id=2,
    )
    other = save_random_model(config, default_model_dir, tmp_path / "other-vocab", seed=5)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        LLM(
            str(sharp_tiny_model_dir),
            progress=False,
            kv_cache_memory="16MiB",
            speculative_method="draft",
            speculative_model=str(other),
        )
    with pytest.raises(ValueError, match="--speculative-model needs --speculative-method draft"):
        LLM(str(sharp_tiny_model_dir), progress=False, speculative_model=str(other))
    with pytest.raises(ValueError, match="needs --speculative-model"):
        LLM(str(sharp_tiny_model_dir), progress=False, speculative_method="draft")


@pytest.mark.slow
def test_metrics_over_http(tiny_model_dir, tmp_path):
    """`tokenmill serve --speculative-method ngram`: the spec-decode counters on /metrics, read with
    prometheus_client's parser, add up to what a repetitive completion proposed and accepted."""
    from tests.utils.server import ServerProcess, post_json

    server = ServerProcess(tiny_model_dir, tmp_path, "--speculative-method", "ngram", "--num-speculative-tokens", "3")
    try:
        server.wait_ready()
        before = server.metrics()
        r = post_json(
            server,
            "/v1/completions",
            {
                "model": tiny_model_dir.name,
                "prompt": "one two three " * 8,
                "max_tokens": 32,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 32
        m = server.metrics()
        drafts, proposed, accepted = (
            m[key] - before[key]
            for key in (
                "tokenmill_spec_decode_num_drafts_total",
                "tokenmill_spec_decode_num_draft_tokens_total",
                "tokenmill_spec_decode_num_accepted_tokens_total",
            )
        )
        assert 0 < drafts <= proposed <= 3 * drafts and 0 < accepted <= proposed
        assert accepted + drafts <= 32  # every verification step emitted its accepted drafts and one token
        per_position = sum(v for k, v in m.items() if k.startswith("tokenmill_spec_decode_num_accepted_tokens_per_pos"))
        assert per_position == m["tokenmill_spec_decode_num_accepted_tokens_total"]
    finally:
        server.stop()
