"""Multi-LoRA over real HTTP and gRPC against a `tokenmill serve` subprocess: adapters from
--lora-modules and loaded at run time, selected by `model` (openai client), listed by /v1/models,
unloaded; unknown names are 404s and bad adapters 400s in OpenAI's error shape."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import httpx
import pytest

from tests.utils.lora import make_peft_adapter, peft_greedy
from tests.utils.server import ServerProcess, assert_openai_error, model_id, openai_client, post_json, running_server
from tokenmill.server.proto import tokenmill_pb2 as pb
from tokenmill.server.proto import tokenmill_pb2_grpc as pb_grpc

pytest.importorskip("peft")

PROMPT = [1, 504, 3459, 314, 260, 1345, 30, 2200, 4572, 2113, 1072, 28, 357, 1790]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, sharp_tiny_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "sql": make_peft_adapter(
            sharp_tiny_model_dir,
            root / "sql",
            seed=21,
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        "chat": make_peft_adapter(
            sharp_tiny_model_dir,
            root / "chat",
            seed=22,
            r=4,
            lora_alpha=4,
            target_modules=["q_proj", "v_proj", "down_proj"],
        ),
    }


@pytest.fixture(scope="module")
def lora_server(sharp_tiny_model_dir, server_log_dir, adapters):
    with running_server(
        sharp_tiny_model_dir,
        server_log_dir,
        "--dtype",
        "float32",
        "--lora-modules",
        f"sql={adapters['sql']}",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--max-cpu-loras",
        "2",
        "--enable-lora-runtime-updates",
    ) as proc:
        yield proc


def _text(server: ServerProcess, model: str, max_tokens: int) -> str:
    import openai  # noqa: F401 - the official client, as users select adapters

    out = openai_client(server).completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert out.model == model
    return out.choices[0].text


def _expected_text(model_dir: Path, adapter: Path | None, max_tokens: int) -> str:
    from transformers import AutoTokenizer

    ids = peft_greedy(model_dir, adapter, PROMPT, max_tokens)
    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


def test_openai_client_selects_adapter_by_model(lora_server, sharp_tiny_model_dir, adapters):
    base = _text(lora_server, model_id(lora_server), 10)
    assert base == _expected_text(sharp_tiny_model_dir, None, 10)
    adapted = _text(lora_server, "sql", 10)
    assert adapted == _expected_text(sharp_tiny_model_dir, adapters["sql"], 10)
    assert adapted != base  # the adapter really changes the output
    chat = openai_client(lora_server).chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "sql" and chat.choices[0].finish_reason == "length"


def test_models_lists_adapters_with_their_base(lora_server, adapters):
    client = openai_client(lora_server)
    base = model_id(lora_server)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {base, "sql"}
    assert cards["sql"].parent == base and cards["sql"].root == "sql"  # the name: server paths stay private
    assert str(adapters["sql"]) not in httpx.get(f"{lora_server.base_url}/v1/models").text
    assert client.models.retrieve("sql").parent == base


def test_unknown_adapter_is_404(lora_server):
    import openai

    client = openai_client(lora_server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    err = assert_openai_error(
        post_json(
            lora_server,
            "/v1/chat/completions",
            {"model": "no-such-adapter", "messages": [{"role": "user", "content": "hi"}]},
        ),
        404,
        "model_not_found",
    )
    assert err["param"] == "model" and "`sql`" in err["message"]


def test_load_use_and_unload_at_run_time(lora_server, sharp_tiny_model_dir, adapters):
    import openai

    client = openai_client(lora_server)
    response = post_json(
        lora_server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    )
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'chat' added successfully."
    assert "chat" in {m.id for m in client.models.list().data}
    assert _text(lora_server, "chat", 8) == _expected_text(sharp_tiny_model_dir, adapters["chat"], 8)
    assert_openai_error(
        post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(adapters["chat"])}),
        400,
        "invalid_lora_adapter",
    )
    response = post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'chat' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="chat", prompt="hi", max_tokens=2)
    assert_openai_error(post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "chat"}), 404, "lora_not_found")
    assert "chat" not in {m.id for m in client.models.list().data}


def test_bad_adapter_at_run_time_is_400(lora_server, adapters, tmp_path):
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "adapter_config.json").write_text('{"r": 64, "lora_alpha": 16}')
    (tmp_path / "a-file").write_text("x")
    # Whether the path is missing, a file, an empty directory or an adapter without weights: one
    # answer, so the API tells nobody which paths exist on the server (the log has the reason).
    answers = set()
    for path in ("nothing", "a-file", ".", "config-only"):
        body = {"lora_name": "bad", "lora_path": str(tmp_path / path)}
        err = assert_openai_error(post_json(lora_server, "/v1/load_lora_adapter", body), 400, "invalid_lora_adapter")
        assert err["param"] == "lora_path"
        answers.add(err["message"].replace(str(tmp_path / path), "PATH"))
    assert answers == {"lora_path 'PATH' is not a PEFT adapter directory this server can read"}
    assert "adapter_model.safetensors" in lora_server.log_tail()
    assert_openai_error(post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": "x"}), 400)
    for name in ("a" * 129, "two words", "tab\there"):
        err = assert_openai_error(
            post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters["chat"])}),
            400,
        )
        assert err["param"] == "lora_name" and "1 to 128 characters" in err["message"]
    # The base model's name cannot be taken by an adapter.
    assert_openai_error(
        post_json(
            lora_server,
            "/v1/load_lora_adapter",
            {"lora_name": model_id(lora_server), "lora_path": str(adapters["chat"])},
        ),
        400,
    )
    assert _text(lora_server, "sql", 2)  # the server still serves


def test_loaded_adapters_are_bounded(lora_server, adapters):
    """--max-cpu-loras 2: `sql` from the command line and one more; a third is refused until one goes."""
    load = {"lora_name": "chat", "lora_path": str(adapters["chat"])}
    assert post_json(lora_server, "/v1/load_lora_adapter", load).status_code == 200
    try:
        err = assert_openai_error(
            post_json(lora_server, "/v1/load_lora_adapter", {**load, "lora_name": "chat2"}), 400, "lora_limit_reached"
        )
        assert "--max-cpu-loras" in err["message"]
    finally:
        assert post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "chat"}).status_code == 200
    assert post_json(lora_server, "/v1/load_lora_adapter", {**load, "lora_name": "chat2"}).status_code == 200
    assert post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "chat2"}).status_code == 200


def test_runtime_updates_are_off_by_default(server):
    """The shared server was started without --enable-lora-runtime-updates (nor --enable-lora)."""
    for path, body in (
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}),
        ("/v1/unload_lora_adapter", {"lora_name": "a"}),
    ):
        err = assert_openai_error(post_json(server, path, body), 403, "lora_runtime_updates_disabled")
        assert "--enable-lora-runtime-updates" in err["message"]


def test_grpc_selects_adapter_by_model(lora_server, sharp_tiny_model_dir, adapters):
    with grpc.insecure_channel(lora_server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reply = stub.Generate(
            pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=6, temperature=0, model="sql"), timeout=60
        )
        assert list(reply.token_ids) == peft_greedy(sharp_tiny_model_dir, adapters["sql"], PROMPT, 6)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, model="nope"), timeout=60)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_metrics_name_the_running_adapters(lora_server):
    """/metrics (parsed by prometheus_client) carries vLLM's lora_requests_info: while a stream on
    the `sql` adapter runs, it is listed as running, with the slot count; afterwards nothing runs."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def lora_info() -> dict[str, str]:
        text = httpx.get(f"{lora_server.base_url}/metrics", timeout=5.0).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        (sample,) = families["tokenmill_lora_requests_info"].samples
        assert sample.value > 1e9  # the scrape time, as vLLM's
        return sample.labels

    stream = openai_client(lora_server).completions.create(
        model="sql", prompt=PROMPT, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the request is running
    running = lora_info()
    stream.close()
    assert running["running_lora_adapters"] == "sql" and running["max_lora"] == "2", running
    for _ in range(100):  # the engine notices the closed stream within a few steps
        if lora_info()["running_lora_adapters"] == "":
            break
        time.sleep(0.05)
    assert lora_info() == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "2"}
