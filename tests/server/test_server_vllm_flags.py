"""vLLM's serve command line on `tokenmill serve` (docs/model-sources.md): the model as a positional
argument, several --served-model-name, --max-logprobs, --generation-config, --chat-template,
--disable-log-requests, --uvicorn-log-level, TLS (HTTPS and gRPC), CORS, --root-path; and the
vLLM flags tokenmill cannot honour, refused by name."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.utils.server import ServerProcess, assert_openai_error, server_log_dir_fixture  # noqa: F401
from tokenmill.cli import build_parser
from tokenmill.cli.serve import take_model_tag
from tokenmill.engine.config import EngineConfig

ORIGIN = "https://app.example"
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1 (openssl)."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return key, cert


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tiny_model_dir, server_log_dir):
    """`tokenmill serve MODEL` with the vLLM flags under test; the model's generation config says
    max_new_tokens 3 (the default length of requests that set none)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl to make a certificate")
    base = tmp_path_factory.mktemp("vllm-flags")
    model = Path(shutil.copytree(tiny_model_dir, base / "model"))
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "max_new_tokens": 3}))
    key, cert = _self_signed(base)
    proc = ServerProcess(
        model,
        server_log_dir,
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--max-logprobs",
        "3",
        "--chat-template",
        TEMPLATE,
        "--disable-log-requests",
        "--uvicorn-log-level",
        "warning",
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--root-path",
        "/proxied",
        "--enable-auto-tool-choice",
        positional_model=True,
        tls_ca=cert,
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def _post(server: ServerProcess, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, verify=server.verify, timeout=120, **kwargs)


def test_served_names_logprobs_and_generation_defaults(vllm_server):
    """Every --served-model-name is listed and accepted, responses report the first; --max-logprobs
    caps logprobs (completions) and top_logprobs (chat); a request without max_tokens gets the
    generation config's max_new_tokens."""
    models = httpx.get(vllm_server.base_url + "/v1/models", verify=vllm_server.verify).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    done = _post(vllm_server, "/v1/completions", {"model": "tiny-alias", "prompt": "hello", "ignore_eos": True})
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["model"] == "tiny" and body["usage"]["completion_tokens"] == 3
    assert _post(vllm_server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 3}).status_code == 200
    err = assert_openai_error(
        _post(vllm_server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "logprobs": 4}), 400
    )
    assert err["param"] == "logprobs" and "--max-logprobs" in err["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 4}
    assert assert_openai_error(_post(vllm_server, "/v1/chat/completions", chat), 400)["param"] == "top_logprobs"
    unknown = _post(vllm_server, "/v1/completions", {"model": "other", "prompt": "x", "max_tokens": 1})
    assert "`tiny`, `tiny-alias`" in assert_openai_error(unknown, 404)["message"]


def test_chat_template_flag_replaces_the_models(vllm_server, tokenizer):
    done = _post(vllm_server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert done.status_code == 200, done.text
    assert tokenizer.decode(done.json()["tokens"]) == "<<hi>>"


def test_tls_cors_root_path_and_quiet_request_log(vllm_server):
    """HTTPS only (plain HTTP gets no answer), gRPC over TLS with the same certificate; CORS answers
    the allowed origin's preflight and nothing else; the root path is the API's published prefix;
    --disable-log-requests writes no line per request."""
    with pytest.raises(httpx.HTTPError):
        httpx.get(vllm_server.base_url.replace("https", "http") + "/health", timeout=5)
    credentials = grpc.ssl_channel_credentials(vllm_server.tls_ca.read_bytes())
    with grpc.secure_channel(vllm_server.grpc_target, credentials) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = httpx.options(
        vllm_server.base_url + "/v1/completions", headers={"Origin": ORIGIN, **preflight}, verify=vllm_server.verify
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        vllm_server.base_url + "/v1/completions",
        headers={"Origin": "https://evil.example", **preflight},
        verify=vllm_server.verify,
    )
    assert "access-control-allow-origin" not in other.headers
    simple = _post(vllm_server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    spec = httpx.get(vllm_server.base_url + "/openapi.json", verify=vllm_server.verify).json()
    assert spec["servers"] == [{"url": "/proxied"}]
    docs = httpx.get(vllm_server.base_url + "/docs", verify=vllm_server.verify).text
    assert "'/proxied/openapi.json'" in docs  # (the page fetches the spec under the proxy's prefix)
    records = vllm_server.log_records()
    assert records and not [r for r in records if r.get("msg") == "request finished"]


# ------------------------------------------------------------------------------------------ command line


def _parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_positional_model_is_the_model():
    args = _parse("ORG/NAME", "--port", "8001")
    take_model_tag(args)
    assert args.model == "ORG/NAME" and EngineConfig.from_cli_args(args).model == "ORG/NAME"
    both = _parse("ORG/NAME", "--model", "ORG/OTHER")
    with pytest.raises(ValueError, match="given twice"):
        take_model_tag(both)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization: a vLLM flag tokenmill does not support"),
        (["-pp", "2"], "-pp: a vLLM flag tokenmill does not support: pipeline parallelism"),
        (["--load-format", "pt"], "--load-format: a vLLM flag tokenmill does not support"),
        (["--not-a-flag"], "unrecognized arguments: --not-a-flag"),
    ],
)
def test_vllm_flags_tokenmill_cannot_honour_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_vllm_switches_tokenmill_always_honours_are_accepted():
    from tokenmill.cli.vllm_flags import check_always_so

    args = _parse("--enable-auto-tool-choice", "--enable-chunked-prefill", "--disable-log-stats", "--enforce-eager")
    check_always_so(args)
    with pytest.raises(ValueError, match="--enforce-eager contradicts"):
        check_always_so(_parse("--enforce-eager", "--cuda-graphs"))


def test_trust_remote_code_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match="never runs code from a model repository"):
        EngineConfig.from_cli_args(_parse("ORG/NAME", "--trust-remote-code")).check_sources()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssl-certfile", "/nonexistent.pem"], "go together"),
        (["--allowed-origins", "*"], "expected a JSON list of strings"),
    ],
)
def test_bad_server_flags_are_refused(capsys, argv, message):
    from tokenmill.cli.serve import settings_from_args

    try:
        args = _parse(*argv)
    except SystemExit:
        assert message in capsys.readouterr().err
        return
    with pytest.raises(ValueError, match=message):
        settings_from_args(args)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
