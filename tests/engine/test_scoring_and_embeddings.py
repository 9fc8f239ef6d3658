"""Prompt logprobs (scoring) and embeddings in the engine: equal to an HF forward pass in fp32, through
chunked prefill, prefix caching, preemption and overlap scheduling, batched with generation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import hf_forward, hf_greedy, hf_greedy_batch, mixed_prompts
from tokenmill import LLM, PoolingParams, SamplingParams
from tokenmill.engine.worker.kv_cache import bytes_per_block

TOL = 1e-4


def assert_prompt_logprobs_match_hf(model_dir: Path, prompt: list[int], entries, num_top: int) -> None:
    logp, _ = hf_forward(model_dir, prompt)
    assert entries is not None and len(entries) == len(prompt), (None if entries is None else len(entries), len(prompt))
    assert entries[0] is None
    for i in range(1, len(prompt)):
        entry, expected, token = entries[i], logp[i - 1], prompt[i]
        assert next(iter(entry)) == token  # the prompt's own token comes first
        for t, lp in entry.items():
            assert abs(lp.logprob - expected[t].item()) < TOL, (i, t, lp, expected[t].item())
        # Ranks: as HF's logits order them, up to near-ties within the tolerance.
        value = expected[token].item()
        assert int((expected > value + TOL).sum()) + 1 <= entry[token].rank <= int((expected > value - TOL).sum()) + 1
        top = {t: lp for t, lp in entry.items() if lp.rank <= num_top}
        assert sorted(lp.rank for lp in top.values()) == list(range(1, num_top + 1))
        assert set(entry) == set(top) | {token}
        if num_top:
            ours = torch.tensor(sorted((lp.logprob for lp in top.values()), reverse=True))
            assert (ours - expected.topk(num_top).values).abs().max().item() < TOL


def run_collecting(llm: LLM, requests: list[tuple[str, list[int], object]]) -> dict[str, list]:
    """Every output of every request, in order (to see what each output carried)."""
    engine = llm.engine
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list] = {request_id: [] for request_id, _, _ in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert engine.allocator.num_free == engine.allocator.num_blocks  # every block came back
    return outputs


def prompt_logprobs_of(outputs: list) -> list:
    """The one output that carries prompt logprobs (asserting there is exactly one)."""
    carrying = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(carrying) == 1, f"prompt logprobs delivered {len(carrying)} times"
    return carrying[0]


# ---------------------------------------------------------------------------------------------- prompt logprobs


@pytest.mark.slow
def test_prompt_logprobs_equal_hf_across_chunks_with_generation_alongside(sharp_tiny_model_dir):
    """Scoring requests (max_tokens 0) and scoring + generating ones, batched with plain generation;
    prompts longer than the step budget are prefilled in chunks that accumulate."""
    llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="64MiB", max_num_batched_tokens=40)
    prompts = mixed_prompts(6, 2, 110, seed=11)
    score = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    score_and_generate = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=3)
    generate = SamplingParams(temperature=0.0, max_tokens=6)
    plan = [score, score_and_generate, generate, score, score_and_generate, generate]
    outputs = run_collecting(llm, [(str(i), p, params) for i, (p, params) in enumerate(zip(prompts, plan))])
    assert max(len(p) for p in prompts) > 40  # at least one prompt was chunked
    for i, (prompt, params) in enumerate(zip(prompts, plan)):
        outs = outputs[str(i)]
        final = outs[-1].outputs[0]
        if params.prompt_logprobs is None:
            assert all(o.prompt_logprobs is None for o in outs)
        else:
            assert_prompt_logprobs_match_hf(
                sharp_tiny_model_dir, prompt, prompt_logprobs_of(outs), params.prompt_logprobs
            )
        if params.max_tokens == 0:
            assert (final.token_ids, final.text, final.finish_reason) == ([], "", "length")
        else:
            assert final.token_ids == hf_greedy(sharp_tiny_model_dir, prompt, params.max_tokens)


def test_prompt_logprobs_recompute_a_cached_prefix(sharp_tiny_model_dir):
    """A cached prefix has no logits: a scoring request does not take it from the prefix cache (and
    fills the cache for later requests itself)."""
    llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="64MiB")
    shared = mixed_prompts(1, 70, 70, seed=12)[0]
    first = run_collecting(llm, [("warm", shared + [101, 102], SamplingParams(temperature=0.0, max_tokens=2))])
    assert first["warm"][-1].num_cached_tokens == 0
    prompt = shared + [103, 104, 105]
    scored = run_collecting(llm, [("score", prompt, SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1))])
    assert scored["score"][-1].num_cached_tokens == 0  # the cached 64 tokens were recomputed
    assert_prompt_logprobs_match_hf(sharp_tiny_model_dir, prompt, prompt_logprobs_of(scored["score"]), 1)
    again = run_collecting(llm, [("again", prompt + [106], SamplingParams(temperature=0.0, max_tokens=2))])
    assert again["again"][-1].num_cached_tokens == 64


def test_prompt_logprobs_with_n_choices_are_reported_once(sharp_tiny_model_dir):
    llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="64MiB")
    prompt = mixed_prompts(1, 30, 30, seed=13)[0]
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    outs = run_collecting(llm, [("n", prompt, params)])["n"]
    assert_prompt_logprobs_match_hf(sharp_tiny_model_dir, prompt, prompt_logprobs_of(outs), 2)
    assert [len(c.token_ids) for c in outs[-1].outputs] == [4, 4, 4]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_prompt_logprobs_and_embeddings_survive_preemption(sharp_tiny_model_dir, overlap):
    """A KV budget far too small for the batch: sequences are preempted mid-prompt and mid-generation
    and recomputed. Prompt logprobs are neither lost nor duplicated, embeddings not summed twice."""
    llm = LLM(
        str(sharp_tiny_model_dir),
        progress=False,
        max_num_batched_tokens=32,
        max_model_len=200,
        overlap_scheduling=overlap,
        kv_cache_memory=str(20 * bytes_per_block(16, 6, 2, 64, torch.float32)),
    )
    scheduler = llm.engine.scheduler
    victims: list[tuple[str, bool]] = []  # (request id, preempted before its prompt was computed)
    preempt = scheduler._preempt

    def recording_preempt(seq):
        victims.append((seq.request_id, seq.num_computed_tokens < len(seq.prompt_token_ids)))
        preempt(seq)

    scheduler._preempt = recording_preempt
    generate = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    score_and_generate = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    score = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=0)
    mean, last = PoolingParams("mean"), PoolingParams("last")
    # (an order that preempts each kind in both modes, with this seed and budget)
    plans = [
        generate,
        score_and_generate,
        generate,
        last,
        generate,
        score_and_generate,
        score,
        generate,
        mean,
        generate,
        mean,
        last,
        score,
        mean,
    ]
    requests = [
        (str(i), p, params) for i, (p, params) in enumerate(zip(mixed_prompts(len(plans), 60, 120, seed=14), plans))
    ]
    outputs = run_collecting(llm, requests)
    kinds = {rid: params for rid, _, params in requests}
    preempted = {
        (kinds[rid] is score, isinstance(kinds[rid], PoolingParams), mid_prompt) for rid, mid_prompt in victims
    }
    assert (True, False, True) in preempted, victims  # scoring only, mid-prompt
    assert (False, False, False) in preempted and any(kinds[rid] is score_and_generate for rid, _ in victims), victims
    assert (False, True, True) in preempted, victims  # an embedding, mid-prompt
    generating = [prompt for _, prompt, params in requests if params is generate or params is score_and_generate]
    expected = iter(hf_greedy_batch(sharp_tiny_model_dir, generating, 40))
    for rid, prompt, params in requests:
        outs = outputs[rid]
        if isinstance(params, PoolingParams):
            assert_embedding_matches_hf(sharp_tiny_model_dir, prompt, outs[-1].embedding, params)
            continue
        if params.prompt_logprobs is not None:
            assert_prompt_logprobs_match_hf(
                sharp_tiny_model_dir, prompt, prompt_logprobs_of(outs), params.prompt_logprobs
            )
        if params.max_tokens:
            assert outs[-1].outputs[0].token_ids == next(expected)


@pytest.mark.unit
def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0, prompt_logprobs=-1)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0


def test_logprobs_beyond_max_logprobs_are_refused_by_the_engine():
    """--max-logprobs (20 by default, as vLLM's) caps logprobs and prompt_logprobs per request; -1
    lifts the cap (the parameters themselves take any count)."""
    from tokenmill.engine.input_processor import InputProcessor
    from tokenmill.errors import InvalidRequest

    capped = InputProcessor(None, vocab_size=1000, max_model_len=64)
    for params, name in (
        (SamplingParams(max_tokens=1, logprobs=21), "logprobs"),
        (SamplingParams(max_tokens=0, prompt_logprobs=21), "prompt_logprobs"),
    ):
        with pytest.raises(InvalidRequest, match="--max-logprobs") as refused:
            capped.process([1, 2, 3], params)
        assert refused.value.param == name
    capped.process([1, 2, 3], SamplingParams(max_tokens=1, logprobs=20))
    InputProcessor(None, vocab_size=1000, max_model_len=64, max_logprobs=-1).process(
        [1, 2, 3], SamplingParams(max_tokens=1, logprobs=50)
    )


# ---------------------------------------------------------------------------------------------- embeddings


def assert_embedding_matches_hf(model_dir: Path, prompt: list[int], embedding, params: PoolingParams) -> None:
    _, hidden = hf_forward(model_dir, prompt)
    expected = hidden.mean(0) if params.pooling == "mean" else hidden[-1]
    if params.normalize:
        expected = torch.nn.functional.normalize(expected, dim=-1)
    assert embedding is not None and len(embedding) == expected.shape[0]
    assert (torch.tensor(embedding) - expected).abs().max().item() < TOL


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_hf_pooling_batched_with_generation(sharp_tiny_model_dir, pooling):
    llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="64MiB", max_num_batched_tokens=40)
    prompts = mixed_prompts(6, 1, 90, seed=15)
    embed = [PoolingParams(pooling), PoolingParams(pooling, normalize=False)]
    generate = SamplingParams(temperature=0.0, max_tokens=5)
    requests = [(str(i), p, embed[i % 2] if i % 3 else generate) for i, p in enumerate(prompts)]
    outputs = run_collecting(llm, requests)
    for rid, prompt, params in requests:
        final = outputs[rid][-1]
        if isinstance(params, PoolingParams):
            assert_embedding_matches_hf(sharp_tiny_model_dir, prompt, final.embedding, params)
            assert final.outputs[0].token_ids == [] and final.outputs[0].finish_reason == "length"
            assert all(o.embedding is None for o in outputs[rid][:-1])
        else:
            assert final.embedding is None
            assert final.outputs[0].token_ids == hf_greedy(sharp_tiny_model_dir, prompt, 5)
    offline = llm.embed(prompts[:2], PoolingParams(pooling))  # the offline API, vLLM's LLM.embed
    for prompt, embedding in zip(prompts[:2], offline):
        assert_embedding_matches_hf(sharp_tiny_model_dir, prompt, embedding, PoolingParams(pooling))


def test_embeddings_and_the_prefix_cache(sharp_tiny_model_dir):
    """Last-token pooling may take a cached prefix (only the last position's state is pooled); mean
    pooling recomputes it (every position's state is)."""
    llm = LLM(str(sharp_tiny_model_dir), progress=False, kv_cache_memory="64MiB")
    shared = mixed_prompts(1, 40, 40, seed=16)[0]
    run_collecting(llm, [("warm", shared + [201], SamplingParams(temperature=0.0, max_tokens=1))])
    prompt = shared + [202, 203]
    for params, cached in [(PoolingParams("last"), 32), (PoolingParams("mean"), 0)]:
        final = run_collecting(llm, [(params.pooling, prompt, params)])[params.pooling][-1]
        assert final.num_cached_tokens == cached
        assert_embedding_matches_hf(sharp_tiny_model_dir, prompt, final.embedding, params)


@pytest.mark.unit
def test_bad_pooling():
    with pytest.raises(ValueError, match="pooling must be one of"):
        PoolingParams("max")
