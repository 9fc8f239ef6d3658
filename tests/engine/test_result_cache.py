"""Result cache (--result-cache-size): identical deterministic requests skip the engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import mixed_prompts
from tests.utils.server import ServerProcess
from tokenmill import LLM, SamplingParams
from tokenmill.engine.outputs import CompletionOutput
from tokenmill.engine.result_cache import ResultCache


def _llm(model_dir: Path, size: int) -> LLM:
    return LLM(str(model_dir), progress=False, kv_cache_memory="32MiB", result_cache_size=size)


def test_hit_returns_identical_output_without_a_model_step(tiny_model_dir):
    llm = _llm(tiny_model_dir, 8)
    prompt = mixed_prompts(1, 20, 21, seed=41)[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
    first = llm.generate([prompt], params)[0]
    steps = llm.engine.num_steps
    again = llm.generate([prompt], params)[0]
    assert llm.engine.num_steps == steps  # answered without scheduling anything
    a, b = first.outputs[0], again.outputs[0]
    assert (b.token_ids, b.text, b.finish_reason, b.logprobs) == (a.token_ids, a.text, a.finish_reason, a.logprobs)
    # A cached answer is a complete, final output: all of it is new to its caller.
    assert b.text_delta == b.text and b.token_ids_delta == b.token_ids and again.finished
    stats = llm.engine.stats()
    assert (stats.result_cache_hits_total, stats.result_cache_misses_total, stats.result_cache_entries) == (1, 1, 1)


def test_seeded_sampling_is_cached_and_unseeded_is_not(tiny_model_dir):
    llm = _llm(tiny_model_dir, 8)
    prompt = mixed_prompts(1, 12, 13, seed=42)[0]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8)
    assert (
        llm.generate([prompt], seeded)[0].outputs[0].token_ids == llm.generate([prompt], seeded)[0].outputs[0].token_ids
    )
    assert llm.engine.stats().result_cache_hits_total == 1
    unseeded = SamplingParams(temperature=1.0, max_tokens=8)
    steps = llm.engine.num_steps
    draws = {tuple(llm.generate([prompt], unseeded)[0].outputs[0].token_ids) for _ in range(3)}
    assert llm.engine.num_steps > steps  # every unseeded call ran the model
    assert len(draws) > 1  # and drew anew
    stats = llm.engine.stats()
    assert (stats.result_cache_hits_total, stats.result_cache_misses_total) == (1, 1)  # unseeded: never looked up


def test_different_params_or_prompt_miss(tiny_model_dir):
    llm = _llm(tiny_model_dir, 8)
    prompt = mixed_prompts(1, 12, 13, seed=43)[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=7))
    llm.generate([prompt[:-1]], SamplingParams(temperature=0.0, max_tokens=6))
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, stop=["zz"]))
    stats = llm.engine.stats()
    assert (stats.result_cache_hits_total, stats.result_cache_misses_total) == (0, 4)


def test_off_by_default(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB")
    prompt = mixed_prompts(1, 9, 10, seed=44)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate([prompt], params)
    steps = llm.engine.num_steps
    llm.generate([prompt], params)
    assert llm.engine.num_steps > steps
    assert llm.engine.stats().result_cache_misses_total == 0


@pytest.mark.unit
def test_lru_eviction_and_only_normal_finishes_are_stored():
    cache = ResultCache(2)
    params = SamplingParams(temperature=0.0)
    keys = [cache.key([i], params) for i in range(3)]
    done = [CompletionOutput(0, "x", [5], finish_reason="length")]
    for key in keys[:2]:
        assert cache.put(key, done)
    assert cache.get(keys[0]) is not None  # 0 is now the most recent; 1 is evicted next
    cache.put(keys[2], done)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and cache.get(keys[2]) is not None
    assert not cache.put(cache.key([9], params), [CompletionOutput(0, "x", [5], finish_reason="abort")])
    assert cache.stats().entries == 2
    assert ResultCache(0).key([1], params) is None
    with pytest.raises(ValueError):
        ResultCache(-1)


@pytest.fixture(scope="module")
def cached_server(tiny_model_dir: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("result-cache-logs"), "--result-cache-size", "16")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_server_serves_repeats_from_the_cache_and_counts_them(cached_server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "The result cache", "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=cached_server.base_url, timeout=30.0) as client:
        body["model"] = client.get("/v1/models").json()["data"][0]["id"]
        first = client.post("/v1/completions", json=body).json()
        second = client.post("/v1/completions", json=body).json()
        streamed = client.post("/v1/completions", json={**body, "stream": True}).text
        sampled = client.post("/v1/completions", json={**body, "temperature": 1.0}).json()
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    # A repeat is answered without touching the model: the same counts, and its whole prompt is cached.
    usage_without_cache = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}
    assert usage_without_cache(second["usage"]) == usage_without_cache(first["usage"])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"]
    assert streamed.rstrip().endswith("data: [DONE]")
    assert len(sampled["choices"][0]["text"]) > 0
    metrics = cached_server.metrics()
    # The streamed request differs (stream is not a sampling parameter, so it is a hit too).
    assert metrics["tokenmill_result_cache_hits_total"] == 2
    assert metrics["tokenmill_result_cache_misses_total"] == 1
    assert metrics["tokenmill_result_cache_entries"] == 1
