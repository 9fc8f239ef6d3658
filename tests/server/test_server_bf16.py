"""`tokenmill serve --dtype bfloat16` under the official openai client: on a CPU without native bf16
that is bf16 weights and KV cache with fp32 arithmetic (tokenmill.engine.precision); the server's
greedy answers, logprobs and streams are those of the same engine in-process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.server import ServerProcess, model_id, openai_client, running_server
from tokenmill import LLM, SamplingParams
from tokenmill.kernels.cpu_caps import detect

PROMPT = "The capital of France is"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, server_log_dir: Path) -> Iterator[ServerProcess]:
    with running_server(tiny_model_dir, server_log_dir, "--dtype", "bfloat16") as proc:
        yield proc


def test_bf16_server_answers_the_openai_client_as_the_engine_does(server: ServerProcess, tiny_model_dir: Path):
    engine = LLM(str(tiny_model_dir), dtype="bfloat16", progress=False, kv_cache_memory="64MiB")
    expected = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2))[0].outputs[
        0
    ]
    client = openai_client(server)
    reply = client.completions.create(
        model=model_id(server), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    assert choice.text == expected.text and reply.usage.completion_tokens == MAX_TOKENS
    assert choice.logprobs.token_logprobs == pytest.approx([chosen for chosen, _ in expected.logprobs], abs=1e-5)
    stream = client.completions.create(
        model=model_id(server), prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected.text
    chat = client.chat.completions.create(
        model=model_id(server), messages=[{"role": "user", "content": "Hi"}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    if not detect().native_bf16:  # the precision it chose, and why, in the server's log
        assert "weights and KV cache in bf16, arithmetic in fp32" in server.log_path.read_text()
