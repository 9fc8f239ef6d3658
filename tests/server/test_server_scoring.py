"""Scoring and embeddings against a real `tokenmill serve`, through the official `openai` client:
lm-eval's loglikelihood requests (echo + logprobs + max_tokens 0), echo with generation and
streaming, vLLM's prompt_logprobs extra, and /v1/embeddings; every number equal to an HF forward
pass in fp32 (1e-4)."""

from __future__ import annotations

import base64
import concurrent.futures
from operator import itemgetter
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.conftest import hf_forward, hf_greedy, mixed_prompts
from tests.utils.server import ServerProcess, assert_openai_error, openai_client

TOL = 1e-4
BUDGET = 32  # --max-num-batched-tokens: longer prompts are prefilled in chunks


@pytest.fixture(scope="module")
def scoring_server(sharp_tiny_model_dir: Path, server_log_dir: Path):
    # Mean pooling by flag, so one server covers the flag and the per-request `pooling` override.
    proc = ServerProcess(
        sharp_tiny_model_dir, server_log_dir, "--max-num-batched-tokens", str(BUDGET), "--embedding-pooling", "mean"
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def tokenizer(sharp_tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(sharp_tiny_model_dir)


def model_of(server: ServerProcess) -> str:
    return server.proc.args[server.proc.args.index("--model") + 1].rstrip("/").split("/")[-1]


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120.0)


def loglikelihood(choice: dict, ctxlen: int, drop_last: bool) -> tuple[float, bool]:
    """lm-eval's `local-completions` parse_logprobs: the continuation's summed logprob and whether
    it is the greedy continuation ([ctxlen:-1] with max_tokens=1, as lm-eval sends it now;
    [ctxlen:] with max_tokens=0, as older versions and other harnesses do)."""
    end = -1 if drop_last else None
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:end]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:end]
    is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs))
    return sum(token_logprobs), is_greedy


def assert_echoed_prompt_matches_hf(model_dir: Path, prompt_ids: list[int], logprobs: dict) -> None:
    """The echoed prompt's logprobs: null first, then each token's log-softmax from HF."""
    logp, _ = hf_forward(model_dir, prompt_ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = torch.tensor(logprobs["token_logprobs"][1 : len(prompt_ids)])
    expected = logp[torch.arange(len(prompt_ids) - 1), torch.tensor(prompt_ids[1:])]
    assert (got - expected).abs().max().item() < TOL


# ---------------------------------------------------------------------------------------------- lm-eval scoring


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_lm_eval_loglikelihood_requests_equal_hf(scoring_server, sharp_tiny_model_dir, max_tokens):
    """A batch of token-id prompts (context + continuation) as lm-eval sends them: one shares a prefix
    cached by an earlier request, one is longer than the step budget."""
    client = openai_client(scoring_server)
    shared = mixed_prompts(1, 40, 40, seed=21)[0]
    client.completions.create(
        model=model_of(scoring_server), prompt=shared + [300, 301], max_tokens=2, temperature=0
    )  # caches 32 tokens
    contexts = [shared + [302], *mixed_prompts(3, 3, 20, seed=22), mixed_prompts(1, 90, 90, seed=23)[0]]
    continuations = mixed_prompts(len(contexts), 1, 6, seed=24)
    resp = client.completions.create(
        model=model_of(scoring_server),
        prompt=[c + k for c, k in zip(contexts, continuations)],
        echo=True,
        max_tokens=max_tokens,
        logprobs=1,
        temperature=0,
        seed=1234,
    ).model_dump()
    choices = sorted(resp["choices"], key=itemgetter("index"))
    assert len(choices) == len(contexts)
    assert resp["usage"]["prompt_tokens"] == sum(len(c) + len(k) for c, k in zip(contexts, continuations))
    assert resp["usage"]["completion_tokens"] == max_tokens * len(contexts)
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # scored positions are recomputed
    for choice, context, continuation in zip(choices, contexts, continuations):
        prompt = context + continuation
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + max_tokens
        assert choice["finish_reason"] == "length"
        assert_echoed_prompt_matches_hf(sharp_tiny_model_dir, prompt, lp)
        logp, _ = hf_forward(sharp_tiny_model_dir, prompt)
        rows = torch.arange(len(context) - 1, len(prompt) - 1)
        expected = logp[rows, torch.tensor(continuation)]
        total, is_greedy = loglikelihood(choice, len(context), drop_last=max_tokens == 1)
        assert abs(total - expected.sum().item()) < TOL * len(continuation)
        assert is_greedy == bool((logp[rows].argmax(-1) == torch.tensor(continuation)).all())
    greedy_case = contexts[1] + hf_greedy(sharp_tiny_model_dir, contexts[1], 3)  # an is_greedy=True case too
    choice = client.completions.create(
        model=model_of(scoring_server), prompt=greedy_case, echo=True, max_tokens=0, logprobs=1, temperature=0
    ).model_dump()["choices"][0]
    assert loglikelihood(choice, len(contexts[1]), drop_last=False)[1] is True


def test_text_prompt_echo_scores_and_offsets(scoring_server, sharp_tiny_model_dir, tokenizer):
    """A text prompt: the echoed text is the prompt, its tokens are the tokenizer's, text_offset
    points at each token in the text, and the logprobs equal HF's on the same tokens."""
    client = openai_client(scoring_server)
    prompt = "The quick brown fox jumps over the lazy dog because it wants to see what is there"
    choice = client.completions.create(
        model=model_of(scoring_server), prompt=prompt, echo=True, max_tokens=0, logprobs=3, temperature=0
    ).choices[0]
    ids = tokenizer(prompt)["input_ids"]
    lp = choice.logprobs
    assert choice.text == prompt and choice.finish_reason == "length"
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert [choice.text[o : o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    assert_echoed_prompt_matches_hf(sharp_tiny_model_dir, ids, lp.model_dump())
    assert all(len(top) in (3, 4) for top in lp.top_logprobs[1:])  # top 3, and the prompt token if not among them


def test_echo_with_generation_streamed_equals_full(scoring_server, sharp_tiny_model_dir, tokenizer):
    """echo + logprobs + generated tokens: the prompt's entries, then the completion's; streaming puts
    the prompt in the first chunk and the chunks add up to the full response."""
    client = openai_client(scoring_server)
    prompts = ["Once upon a time there was", "A long prompt " * 12]
    kwargs = dict(
        model=model_of(scoring_server), prompt=prompts, echo=True, max_tokens=5, logprobs=2, temperature=0, n=2
    )
    full = client.completions.create(**kwargs)
    for choice in full.choices:
        prompt = prompts[choice.index // 2]
        ids = tokenizer(prompt)["input_ids"]
        generated = hf_greedy(sharp_tiny_model_dir, ids, 5)
        assert choice.text == prompt + tokenizer.decode(generated)
        assert len(choice.logprobs.tokens) == len(ids) + 5
        assert_echoed_prompt_matches_hf(sharp_tiny_model_dir, ids, choice.logprobs.model_dump())
        assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    pieces: dict[int, dict] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            piece = pieces.setdefault(c.index, {"text": [], "tokens": [], "token_logprobs": [], "text_offset": []})
            if not piece["text"]:
                assert c.text.startswith(prompts[c.index // 2])  # the echo comes first
            piece["text"].append(c.text)
            for key in ("tokens", "token_logprobs", "text_offset"):
                piece[key].extend(getattr(c.logprobs, key) if c.logprobs else [])
    for choice in full.choices:
        piece = pieces[choice.index]
        assert "".join(piece["text"]) == choice.text
        assert piece["tokens"] == choice.logprobs.tokens and piece["text_offset"] == choice.logprobs.text_offset
        # (the same numbers up to float noise: the two requests ran in different batches)
        assert piece["token_logprobs"][0] is None
        assert piece["token_logprobs"][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=TOL)


def test_echo_without_logprobs_and_max_tokens_rules(scoring_server):
    client = openai_client(scoring_server)
    echoed = client.completions.create(
        model=model_of(scoring_server), prompt=[[5000, 5001, 5002]], echo=True, max_tokens=0
    )
    assert echoed.choices[0].text and echoed.choices[0].logprobs is None
    assert echoed.usage.completion_tokens == 0 and echoed.usage.prompt_tokens == 3
    cases = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ]
    for path, body, param in cases:
        assert assert_openai_error(post(scoring_server, path, body), 400)["param"] == param, body


def test_vllm_prompt_logprobs_extra(scoring_server, sharp_tiny_model_dir, tokenizer):
    """vLLM's prompt_logprobs extra: per prompt token null or {id: {logprob, rank, decoded_token}} with
    the prompt's own token and the top alternatives; on completions' choices and chat's response."""
    prompt = mixed_prompts(1, 12, 12, seed=25)[0]
    body = post(
        scoring_server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    ).json()
    entries = body["choices"][0]["prompt_logprobs"]
    logp, _ = hf_forward(sharp_tiny_model_dir, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        assert str(prompt[i]) in entry and len(entry) in (2, 3)
        for token, item in entry.items():
            assert abs(item["logprob"] - logp[i - 1, int(token)].item()) < TOL
            assert item["decoded_token"] == tokenizer.decode([int(token)])
        assert sorted(item["rank"] for token, item in entry.items() if item["rank"] <= 2) == [1, 2]
    assert body["choices"][0]["logprobs"] is None  # `logprobs` was not asked for
    chat = post(
        scoring_server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "prompt_logprobs": 0},
    ).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


# ---------------------------------------------------------------------------------------------- embeddings


def hf_embedding(model_dir: Path, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    _, hidden = hf_forward(model_dir, ids)
    vector = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def test_embeddings_equal_hf_pooling(scoring_server, sharp_tiny_model_dir, tokenizer):
    """Both poolings (the server's --embedding-pooling mean, a request's `pooling: last`), both
    encodings (the client asks for base64 unless told), every input shape, normalize off; batched with
    concurrent generation requests."""
    client = openai_client(scoring_server)
    texts = ["The capital of France is Paris.", "A long sentence about many things " * 8]
    ids = mixed_prompts(2, 5, 70, seed=26)
    greedy_prompts = mixed_prompts(4, 10, 40, seed=27)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        generations = [
            pool.submit(
                client.completions.create, model=model_of(scoring_server), prompt=p, max_tokens=12, temperature=0
            )
            for p in greedy_prompts
        ]
        cases = [
            (dict(input=texts), "mean", [tokenizer(t)["input_ids"] for t in texts]),
            (
                dict(input=texts[0], encoding_format="float", extra_body={"pooling": "last"}),
                "last",
                [tokenizer(texts[0])["input_ids"]],
            ),
            (dict(input=ids, encoding_format="float"), "mean", ids),
            (dict(input=ids[1], extra_body={"pooling": "last"}), "last", [ids[1]]),
        ]
        for kwargs, pooling, inputs in cases:
            resp = client.embeddings.create(model=model_of(scoring_server), **kwargs)
            assert [d.index for d in resp.data] == list(range(len(inputs)))
            assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(i) for i in inputs)
            for data, input_ids in zip(resp.data, inputs):
                got = torch.tensor(data.embedding)
                assert (got - hf_embedding(sharp_tiny_model_dir, input_ids, pooling)).abs().max().item() < TOL, kwargs
        raw = post(scoring_server, "/v1/embeddings", {"input": ids[0], "normalize": False, "encoding_format": "base64"})
        vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
        expected = hf_embedding(sharp_tiny_model_dir, ids[0], "mean", normalize=False)
        assert (torch.from_numpy(vector.copy()) - expected).abs().max().item() < TOL
        for future, prompt in zip(generations, greedy_prompts):
            assert future.result().choices[0].text == tokenizer.decode(hf_greedy(sharp_tiny_model_dir, prompt, 12))


def test_embedding_request_errors(scoring_server):
    client = openai_client(scoring_server)
    size = len(
        client.embeddings.create(model=model_of(scoring_server), input="hi", encoding_format="float").data[0].embedding
    )
    assert post(scoring_server, "/v1/embeddings", {"input": "hi", "dimensions": size}).status_code == 200
    err = assert_openai_error(post(scoring_server, "/v1/embeddings", {"input": "hi", "dimensions": size - 1}), 400)
    assert err["param"] == "dimensions" and str(size) in err["message"]
    for body, param in [
        ({"input": []}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": [10**9]}, "input"),
        ({"input": "hi", "pooling": "max"}, "pooling"),
        ({"input": [1] * 100_000}, "input"),
    ]:
        assert assert_openai_error(post(scoring_server, "/v1/embeddings", body), 400)["param"] == param, body
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
