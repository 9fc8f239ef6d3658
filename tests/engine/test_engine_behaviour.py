"""Sampling, stopping, aborting, streaming text and input validation of the engine."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.conftest import mixed_prompts
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), progress=False, kv_cache_memory="64MiB")


def _tokens(llm: LLM, prompt, params: SamplingParams) -> list[int]:
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    prompt = mixed_prompts(1, 20, 20, seed=1)[0]
    a = _tokens(llm, prompt, SamplingParams(temperature=1.0, seed=123, max_tokens=24, ignore_eos=True))
    b = _tokens(llm, prompt, SamplingParams(temperature=1.0, seed=123, max_tokens=24, ignore_eos=True))
    c = _tokens(llm, prompt, SamplingParams(temperature=1.0, seed=321, max_tokens=24, ignore_eos=True))
    assert a == b
    assert a != c


def test_seeded_output_independent_of_batch_neighbours(llm):
    prompt = mixed_prompts(1, 20, 20, seed=2)[0]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    alone = _tokens(llm, prompt, params)
    others = mixed_prompts(5, 5, 50, seed=3)
    batch = llm.generate([prompt] + others, [params] + [SamplingParams(temperature=1.0, max_tokens=16)] * 5)
    assert batch[0].outputs[0].token_ids == alone


def test_top_k_1_equals_greedy(llm):
    prompt = mixed_prompts(1, 30, 30, seed=4)[0]
    greedy = _tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert _tokens(llm, prompt, SamplingParams(temperature=1.3, top_k=1, max_tokens=16)) == greedy


def test_top_p_tiny_equals_greedy_and_n_choices(llm):
    prompt = mixed_prompts(1, 30, 30, seed=5)[0]
    greedy = _tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=12))
    assert _tokens(llm, prompt, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12)) == greedy
    out = llm.generate([prompt], SamplingParams(temperature=1.0, n=3, seed=9, max_tokens=12, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_penalties_change_repetitive_greedy_output(llm):
    prompt = mixed_prompts(1, 10, 10, seed=6)[0]
    plain = _tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    penalised = _tokens(
        llm,
        prompt,
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, repetition_penalty=1.5),
    )
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))


def test_max_tokens_and_finish_reasons(llm):
    out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    eos = sorted(llm.engine.eos_token_ids)[0]
    forced = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=5, logit_bias={eos: 100.0}))[0]
    assert forced.outputs[0].token_ids == [eos] and forced.outputs[0].finish_reason == "stop"


def test_stop_strings_cut_text_exactly(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm.generate(["The weather today"], params)[0].outputs[0].text
    assert len(full) > 10
    stop = full[6:9]
    cut = llm.generate(
        ["The weather today"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    )[0]
    choice = cut.outputs[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == full[: full.find(stop)]
    kept = llm.generate(
        ["The weather today"],
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.outputs[0].text == full[: full.find(stop) + len(stop)]


def test_stop_token_ids(llm):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tokens = llm.generate(["Count with me"], params)[0].outputs[0].token_ids
    stop_at = tokens[3]
    out = llm.generate(
        ["Count with me"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at])
    )[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_detokenizer_never_splits_multibyte_characters(llm):
    from tokenmill.engine.detokenizer import IncrementalDetokenizer

    tok = llm.tokenizer
    text = "Grüße aus Köln: 世界你好 🎉🚀 naïve café — ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids), "some character really spans several tokens"
    prompt = tok.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=[], include_stop=False)
    streamed = []
    for t in ids:
        before = len(detok.text)
        detok.add_token(t)
        streamed.append(detok.text[before:])
    assert all("\ufffd" not in piece for piece in streamed)
    assert "".join(streamed) == tok.decode(ids) == text


def test_streamed_text_equals_final_text(tiny_model_dir):
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="32MiB"), progress=False)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=60, ignore_eos=True, stop=["the end"])

    async def run() -> tuple[list[str], str]:
        deltas: list[str] = []
        async for out in engine.generate("Once upon a time", params):
            deltas.append(out.outputs[0].text_delta)
        return deltas, out.outputs[0].text

    try:
        deltas, final = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(deltas) > 10
    assert "".join(deltas) == final


def test_async_engine_loads_and_steps_the_model_on_its_own_thread(tiny_model_dir, monkeypatch):
    """Only the engine thread opens OpenMP regions: each thread that does gets its own team of
    workers, and more of them than cores made libgomp sleep between regions (the server's model
    steps ran 1.5-2x slower). So the engine is built on the thread that steps it."""
    import threading

    from tokenmill.engine import async_engine
    from tokenmill.engine.config import EngineConfig

    threads: list[str] = []

    class RecordingEngine(async_engine.LLMEngine):
        def __init__(self, *args, **kwargs) -> None:
            threads.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

        def step(self):
            threads.append(threading.current_thread().name)
            return super().step()

    monkeypatch.setattr(async_engine, "LLMEngine", RecordingEngine)
    engine = async_engine.AsyncEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory="32MiB"), progress=False)

    async def run() -> str:
        outputs = [
            out async for out in engine.generate("Once upon a time", SamplingParams(max_tokens=5, ignore_eos=True))
        ]
        return outputs[-1].outputs[0].text

    try:
        assert asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(threads) > 1 and set(threads) == {"tokenmill-engine"}


def test_async_engine_raises_what_building_its_engine_raised(tmp_path):
    import threading

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(tmp_path / "no-such-model"))
    with pytest.raises(Exception) as direct:
        LLMEngine(config, progress=False)
    with pytest.raises(type(direct.value), match=re.escape(str(direct.value))):
        AsyncEngine(config, progress=False)
    for thread in threading.enumerate():  # (the failed engine's thread ends once it has handed over the error)
        if thread.name == "tokenmill-engine":
            thread.join(timeout=10)
            assert not thread.is_alive()


def test_abort_mid_generation_frees_all_blocks(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(mixed_prompts(4, 40, 80, seed=8)):
        engine.add_request(f"abort-{i}", prompt, params)
    for _ in range(5):
        engine.step()
    assert engine.allocator.num_free < engine.allocator.num_blocks
    out = engine.abort("abort-0")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        for out in engine.step():
            if len(out.outputs[0].token_ids) > 10:
                engine.abort(out.request_id)
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1] * 3000, SamplingParams(max_tokens=4), "context length"),
        ("hi", SamplingParams(max_tokens=3000), "context length"),
        ([-1, 5], SamplingParams(), "token ids"),
    ],
)
def test_bad_requests_raise_clear_errors(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.make_request("bad", prompt, params)


@pytest.mark.unit
@pytest.mark.parametrize(
    "fields, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"bogus_field": 1}, "unknown sampling field"),
        ({"n": 1000}, "n must be"),
        ({"stop": ["x"] * 1000}, "stop strings"),
    ],
)
def test_bad_sampling_params(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(fields)


def test_bad_request_does_not_disturb_running_ones(llm, tiny_model_dir):
    from tests.conftest import hf_greedy

    engine = llm.engine
    prompt = mixed_prompts(1, 30, 30, seed=10)[0]
    engine.add_request("good", prompt, SamplingParams(temperature=0.0, max_tokens=16))
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request("bad", [], SamplingParams())
    with pytest.raises(ValueError):
        engine.add_request("bad2", "x", SamplingParams(max_tokens=10**6))
    result = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                result = out.outputs[0].token_ids
    assert result == hf_greedy(tiny_model_dir, prompt, 16)


def test_priority_scheduling_runs_lower_priorities_first(tiny_model_dir):
    """--scheduling-policy priority (vLLM's): with one sequence at a time, requests run in priority
    order, ties in arrival order; the default policy refuses a priority it would ignore."""
    from tokenmill.errors import InvalidRequest

    llm = LLM(
        str(tiny_model_dir), progress=False, kv_cache_memory="16MiB", max_num_seqs=1, scheduling_policy="priority"
    )
    prompts = mixed_prompts(4, 4, 12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts, params, priority=[3, 0, 3, -2])
    started = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert started == [3, 1, 0, 2]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in outs] == alone  # the order changes when, not what
    with pytest.raises(ValueError, match="one priority per prompt"):
        llm.generate(prompts, params, priority=[1])
    fcfs = LLM(str(tiny_model_dir), progress=False, kv_cache_memory="16MiB")
    with pytest.raises(InvalidRequest, match="--scheduling-policy priority"):
        fcfs.generate(prompts[:1], params, priority=[1])
    assert fcfs.generate(prompts[:1], params, priority=[0])[0].outputs[0].token_ids == alone[0]
