"""Overlap scheduling and CUDA-graph decode steps must not change any output.

Overlap scheduling launches step N+1 before step N's tokens are known (placeholders), so it is
checked where that matters: greedy exactness with staggered arrivals, preemption and prefix
caching; seeded sampling with penalties (whose history holds a placeholder); stop strings and EOS
found one step late; aborts and injected faults while a later step is already running.

The CUDA-graph path pads decode batches to bucket sizes and runs them over static buffers. Without
a GPU the same path runs eagerly (`DecodeGraphs(capture=False)`), which checks the padding.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import hf_greedy, hf_greedy_batch, mixed_prompts
from tokenmill import LLM, SamplingParams
from tokenmill.engine.worker.cuda_graphs import DecodeGraphs, batch_buckets, width_buckets
from tokenmill.engine.worker.kv_cache import bytes_per_block
from tokenmill.errors import RequestFailed

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _llm(model_dir, overlap: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", "64MiB")
    return LLM(str(model_dir), progress=False, device="cpu", overlap_scheduling=overlap, **kwargs)


def _run_staggered(llm: LLM, prompts, params, per_step: int = 3) -> dict[str, list[int]]:
    """Add `per_step` requests before every step; returns each request's final token ids."""
    engine = llm.engine
    pending = list(enumerate(prompts))
    results: dict[str, list[int]] = {}
    while pending or engine.has_unfinished():
        for _ in range(per_step):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    return results


def _all_blocks_free(llm: LLM) -> bool:
    a = llm.engine.allocator
    return a.num_free == a.num_blocks and not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_overlap_keeps_a_step_in_flight(tiny_model_dir):
    llm = _llm(tiny_model_dir, overlap=True)
    engine = llm.engine
    engine.add_request(
        "a", mixed_prompts(1, 10, 10, seed=1)[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    assert engine.step() == []  # step 1 launched; nothing completed yet
    assert len(engine._inflight) == 1
    out = engine.step()  # step 2 launched, step 1 (the prefill) completed
    assert [o.outputs[0].token_ids for o in out] == [hf_greedy(tiny_model_dir, engine_prompt(engine, "a"), 1)]


def engine_prompt(engine, request_id: str) -> list[int]:
    return engine.output_processor.request(request_id).prompt_token_ids


def test_overlap_greedy_staggered_chunked_equals_hf(tiny_model_dir):
    llm = _llm(tiny_model_dir, overlap=True, kv_cache_memory="128MiB", max_num_batched_tokens=128)
    prompts = mixed_prompts(24, 1, 300, seed=7)
    results = _run_staggered(llm, prompts, GREEDY)
    for i, expected in enumerate(hf_greedy_batch(tiny_model_dir, prompts, 16)):
        assert results[str(i)] == expected, f"prompt {i}"
    assert _all_blocks_free(llm)


def test_overlap_preemption_and_prefix_cache_equal_hf(tiny_model_dir):
    # 40 usable blocks for 12 sequences of up to ~10 blocks each: preemption is forced while a step
    # is in flight; the shared 64-token prefix is served from the prefix cache.
    budget = str(41 * bytes_per_block(16, 6, 2, 64, torch.float32))
    llm = _llm(tiny_model_dir, overlap=True, max_num_batched_tokens=256, max_model_len=256, kv_cache_memory=budget)
    prefix = mixed_prompts(1, 64, 64, seed=4)[0]
    prompts = [prefix + p for p in mixed_prompts(12, 0, 60, seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().prefix_cache_hits_total > 0
    assert outs == hf_greedy_batch(tiny_model_dir, prompts, 32)
    assert _all_blocks_free(llm)


def _sampled_params() -> list[SamplingParams]:
    """Seeded sampling with every history-dependent option, stop strings, logprobs, EOS allowed."""
    return [
        SamplingParams(temperature=0.9, seed=1, max_tokens=20, repetition_penalty=1.3, logprobs=2),
        SamplingParams(
            temperature=1.0,
            top_k=20,
            seed=2,
            max_tokens=24,
            presence_penalty=0.8,
            frequency_penalty=0.5,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=30, stop=["e", "a"]),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=list(range(100, 30000))),
        SamplingParams(temperature=1.0, seed=5, max_tokens=16, n=2),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
    ]


@pytest.mark.slow
def test_overlap_equals_sync_for_seeded_sampling_stops_and_penalties(tiny_model_dir):
    prompts = mixed_prompts(6, 5, 80, seed=21)
    params = _sampled_params()
    results = {}
    for overlap in (False, True):
        llm = _llm(tiny_model_dir, overlap=overlap)
        outs = llm.generate(prompts, params)
        results[overlap] = [
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs
        ]
        assert _all_blocks_free(llm)
    assert results[True] == results[False]
    reasons = {choice[2] for out in results[True] for choice in out}
    assert {"stop", "length"} <= reasons  # stops found a step late were really exercised


def test_overlap_streamed_deltas_add_up(tiny_model_dir):
    llm = _llm(tiny_model_dir, overlap=True)
    engine = llm.engine
    prompts = mixed_prompts(4, 5, 30, seed=22)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.8, seed=i, max_tokens=20, stop=["th"]))
    streamed: dict[str, tuple[list[int], str]] = {str(i): ([], "") for i in range(4)}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            ids, text = streamed[out.request_id]
            c = out.outputs[0]
            assert all(t >= 0 for t in c.token_ids), "a placeholder leaked into an output"
            streamed[out.request_id] = (ids + c.token_ids_delta, text + c.text_delta)
            if out.finished:
                final[out.request_id] = (c.token_ids, c.text)
    assert streamed == final


def test_overlap_abort_while_a_step_is_in_flight(tiny_model_dir):
    llm = _llm(tiny_model_dir, overlap=True)
    engine = llm.engine
    prompts = mixed_prompts(4, 10, 40, seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    results = {}
    aborted = None
    for step in range(200):
        if step == 5:
            assert engine._inflight  # a step is running while the abort arrives
            aborted = engine.abort("1")
            assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
            assert all(t >= 0 for t in aborted.outputs[0].token_ids)
        for out in engine.step():
            assert aborted is None or out.request_id != "1", "output for an aborted request"
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished():
            break
    assert sorted(results) == ["0", "2", "3"]
    expected = hf_greedy_batch(tiny_model_dir, prompts, 20)
    for i in (0, 2, 3):
        assert results[str(i)] == expected[i]
    assert _all_blocks_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_failed_step_fails_one_request_and_the_rest_finish_exactly(tiny_model_dir, overlap):
    """A request failing mid-decode (its 6th step) while the next step is already launched."""
    llm = _llm(tiny_model_dir, overlap=overlap)
    engine = llm.engine
    seen = {"calls": 0}

    def hook(seqs) -> None:
        if any(s.request_id == "victim" for s in seqs):
            seen["calls"] += 1
            if seen["calls"] == 6:
                raise RequestFailed({"victim"}, "injected fault")

    engine.runner.before_forward = hook
    prompts = mixed_prompts(4, 10, 40, seed=24)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=9, max_tokens=20, ignore_eos=True, frequency_penalty=0.5),
    ]
    ids = ["victim", "a", "b", "c"]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params[rid == "b"])
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["victim"].error == "injected fault"
    assert final["victim"].outputs[0].finish_reason == "error"
    assert all(final[r].outputs[0].finish_reason == "length" for r in ("a", "b", "c"))
    expected = hf_greedy_batch(tiny_model_dir, [prompts[1], prompts[3]], 20)
    assert [final[rid].outputs[0].token_ids for rid in ("a", "c")] == expected
    # The seeded sampled request is unaffected by its neighbour's failure.
    alone = _llm(tiny_model_dir, overlap=False).generate([prompts[2]], params[1])[0].outputs[0].token_ids
    assert final["b"].outputs[0].token_ids == alone
    assert _all_blocks_free(llm)


def test_failed_step_frees_blocks_and_the_engine_serves_on(tiny_model_dir):
    llm = _llm(tiny_model_dir, overlap=True)
    engine = llm.engine

    def hook(seqs) -> None:
        raise ValueError("boom")  # every request in the batch fails

    engine.runner.before_forward = hook
    outs = llm.generate(mixed_prompts(3, 5, 20, seed=25), GREEDY)
    assert all(o.outputs[0].finish_reason == "error" and "boom" in o.error for o in outs)
    assert _all_blocks_free(llm)
    engine.runner.before_forward = None
    prompt = mixed_prompts(1, 5, 20, seed=26)[0]
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == hf_greedy(tiny_model_dir, prompt, 16)


# ---------------------------------------------------------------------------------------------- graphs


@pytest.mark.unit
def test_bucket_ladders():
    assert batch_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]
    assert width_buckets(1) == [1]
    assert width_buckets(33) == [1, 2, 4, 8, 16, 32, 64]


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_graph_decode_path_equals_hf(tiny_model_dir, overlap):
    """Decode steps through the padded static-buffer path (eager replay on CPU) stay exact."""
    llm = _llm(tiny_model_dir, overlap=overlap, max_num_seqs=12, max_model_len=512)
    engine = llm.engine
    graphs = DecodeGraphs(
        engine.model, engine.kv_cache, engine.block_size, 12, 512 // engine.block_size, engine.device, capture=False
    )
    engine.runner.graphs = graphs
    prompts = mixed_prompts(11, 1, 70, seed=27)  # up to 11 rows at once: padded to the 12 bucket
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 10 + [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.2)
    ]
    results = _run_staggered(llm, prompts, params, per_step=2)
    for i, expected in enumerate(hf_greedy_batch(tiny_model_dir, prompts[:10], 24)):
        assert results[str(i)] == expected, f"prompt {i}"
    assert len({b for b, _ in graphs.graphs}) >= 3 and len({w for _, w in graphs.graphs}) >= 2, graphs.graphs
    # Padding rows wrote only to the pad slot: the zero block is still zero.
    assert not engine.kv_cache.data[:, 0].any()
    # The penalised request went through the graph path too; it equals the eager engine's output.
    eager = _llm(tiny_model_dir, overlap=False, max_num_seqs=12, max_model_len=512)
    assert results["10"] == eager.generate([prompts[10]], params[10])[0].outputs[0].token_ids
