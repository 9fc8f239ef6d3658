"""Output kinds (cumulative / delta / final only), incremental detokenization with stop strings,
and logprob token strings with their exact bytes."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import mixed_prompts
from tests.utils.server import ServerProcess
from tokenmill import LLM, SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer, TokenText
from tokenmill.engine.outputs import RequestOutputKind

IM_START = 1  # SmolLM2's <|im_start|>, a special token
TEXT = "Grüße aus Köln: 世界你好 🎉🚀 naïve café — ok, the end of it"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    # No prefix cache: every run computes the same way, so logprobs agree to the bit.
    return LLM(str(tiny_model_dir), progress=False, kv_cache_memory="32MiB", enable_prefix_caching=False)


def _run(llm: LLM, kind: RequestOutputKind, prompts, params) -> dict[str, list]:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"{kind.value}-{i}", p, params, output_kind=kind)
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id.split("-", 1)[1], []).append(out)
    return outs


def test_output_kinds_agree(llm):
    prompts = mixed_prompts(3, 5, 40, seed=31)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=30, n=2, logprobs=2, stop=["th", "e a"])
    runs = {kind: _run(llm, kind, prompts, params) for kind in RequestOutputKind}
    for i in map(str, range(3)):
        final = runs[RequestOutputKind.CUMULATIVE][i][-1]
        assert final.finished
        (only,) = runs[RequestOutputKind.FINAL_ONLY][i]  # one output, at the end
        assert only.finished
        deltas = runs[RequestOutputKind.DELTA][i]
        assert len(deltas) > 1 and deltas[-1].finished and not any(o.finished for o in deltas[:-1])
        for k in range(2):
            want = final.outputs[k]
            assert want.num_tokens == len(want.token_ids) > 0
            got = only.outputs[k]
            assert (got.text, got.token_ids, got.logprobs, got.finish_reason, got.stop_reason) == (
                want.text,
                want.token_ids,
                want.logprobs,
                want.finish_reason,
                want.stop_reason,
            )
            assert (got.text_delta, got.token_ids_delta, got.logprobs_delta) == (
                want.text,
                want.token_ids,
                want.logprobs,
            )
            streamed = [o.outputs[k] for o in deltas]
            assert all(c.text == "" and c.token_ids == [] and c.logprobs is None for c in streamed)
            assert "".join(c.text_delta for c in streamed) == want.text
            assert [t for c in streamed for t in c.token_ids_delta] == want.token_ids
            assert [lp for c in streamed for lp in c.logprobs_delta] == want.logprobs
            assert [c.num_tokens for c in streamed] == sorted(c.num_tokens for c in streamed)
            assert streamed[-1].num_tokens == want.num_tokens
            assert (streamed[-1].finish_reason, streamed[-1].stop_reason) == (want.finish_reason, want.stop_reason)
    reasons = {
        o.outputs[k].stop_reason
        for outs in runs[RequestOutputKind.CUMULATIVE].values()
        for o in outs[-1:]
        for k in range(2)
    }
    assert reasons & {"th", "e a"}, "a stop string really ended some choice"


def test_detokenizer_streams_with_holdback_and_cuts_at_stop(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    for stop, include in ((["the end"], False), (["the end"], True), (["é —", "zzz"], False)):
        detok = IncrementalDetokenizer(tokenizer, prompt, stop, include)
        streamed, found = [], None
        for t in ids:
            found = detok.add_token(t)
            piece = detok.take_delta(finished=found is not None)
            assert "\ufffd" not in piece
            streamed.append(piece)
            if found:
                break
        cut = TEXT.find(found) + (len(found) if include else 0)
        assert "".join(streamed) == detok.text == TEXT[:cut]
        # Until the end, a partial stop string is never handed out: the holdback covers it.
        assert all(len("".join(streamed[: j + 1])) <= len(TEXT[:cut]) for j in range(len(streamed)))
    plain = IncrementalDetokenizer(tokenizer, prompt, [], False)
    pieces = []
    for t in ids:
        plain.add_token(t)
        pieces.append(plain.take_delta(finished=False))
    assert "".join(pieces) == TEXT  # no stop strings: nothing held back


def test_special_tokens_are_kept_when_asked_except_the_eos(tokenizer):
    """skip_special_tokens=False (vLLM's; the Mistral tool parser's) keeps the special tokens the model
    writes in the text; the EOS that ends the sequence stays out of it either way."""
    marker = tokenizer.convert_ids_to_tokens(IM_START)
    ids = [IM_START, *tokenizer.encode("call", add_special_tokens=False), tokenizer.eos_token_id]
    texts = {}
    for skip in (True, False):
        detok = IncrementalDetokenizer(
            tokenizer, [], [], False, skip_special_tokens=skip, silent_token_ids=[tokenizer.eos_token_id]
        )
        for t in ids:
            detok.add_token(t)
        texts[skip] = detok.text
    assert texts == {True: "call", False: marker + "call"}


def test_token_text_bytes_of_partial_characters(tokenizer):
    names = TokenText(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    entries = [names(t) for t in ids]
    assert b"".join(raw for _, raw in entries) == TEXT.encode("utf-8")
    partial = [(text, raw) for text, raw in entries if "\ufffd" in text]
    assert partial, "some characters really span several tokens"
    assert all(raw and raw != "\ufffd".encode() for _, raw in partial)
    assert names(ids[0]) is names(ids[0])  # decoded once


def test_server_logprob_bytes_of_a_partial_token(server: ServerProcess, tokenizer):
    names = TokenText(tokenizer)
    token = next(t for t in tokenizer.encode("世界", add_special_tokens=False) if "\ufffd" in names(t)[0])
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
        "logit_bias": {str(token): 100},
    }
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    (entry,) = r.json()["choices"][0]["logprobs"]["content"]
    assert bytes(entry["bytes"]) == names(token)[1] and len(entry["bytes"]) < 3
