"""Models named by hub repository id (tokenmill/models/model_loader/hf_hub.py), against a local
stand-in for the Hugging Face hub (tests/utils/fake_hub.py, HF_ENDPOINT pointed at it): download of
only the files the engine reads, progress output, resume of a cut transfer, revision pinning,
401/403/404, no network, a second start from the cache with the hub stopped, HF_HUB_OFFLINE, the
tokenizer, draft model and LoRA adapters by repo id, and ModelScope.

Every start runs `tokenmill` (or a short Python program) in its own process: huggingface_hub reads
HF_ENDPOINT and HF_HUB_OFFLINE when it is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import hf_greedy
from tests.utils.fake_hub import FakeHub, Repo
from tests.utils.lora import make_peft_adapter

ROOT = Path(__file__).resolve().parents[2]
REPO = "tiny-org/tiny-llama"
PROMPT = [1, 3000, 500, 42, 7, 900]
# The shard holding the embedding is ~12.6 MB; huggingface_hub writes 10 MB chunks, so a transfer cut
# after 11 MB resumes from 10 MB with a byte range.
CUT_AT = 11 << 20
# Files a repository also holds that the engine never reads: none may be fetched.
NEVER_FETCHED = {"pytorch_model.bin": b"\0" * 64, "original/consolidated.00.pth": b"\0" * 64, "model.onnx": b"\0" * 8}


def _tiny_llama(target: Path, tokenizer_dir: Path, seed: int, layers: int = 2) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(target, max_shard_size="4MB")  # sharded, with an index
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("hub-models")
    main = _tiny_llama(base / "main", default_model_dir, seed=0)
    pinned = _tiny_llama(base / "v1", default_model_dir, seed=1, layers=3)
    adapter = make_peft_adapter(main, base / "adapter", seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return {"main": main, "v1": pinned, "adapter": adapter}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture
def hub(model_dirs) -> FakeHub:
    hub = FakeHub()
    repo = Repo.from_directory(model_dirs["main"], extra=NEVER_FETCHED)
    repo.add_revision("v1", _files(model_dirs["v1"]))
    hub.repos[REPO] = repo
    hub.repos["tiny-org/private"] = Repo.from_directory(model_dirs["main"], token="hf_secret")
    hub.repos["tiny-org/gated"] = Repo.from_directory(model_dirs["main"], token="hf_secret", gated=True)
    hub.repos["tiny-org/adapter"] = Repo.from_directory(model_dirs["adapter"])
    yield hub
    hub.stop()


def _env(hub_url: str, cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TOKENMILL_USE_", "VLLM_USE_"))}
    env.update(HF_ENDPOINT=hub_url, HF_HUB_CACHE=str(cache), HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def _generate(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tokenmill.cli", "generate", "--prompt", "x", "--json", "--max-tokens", "4"]
    return subprocess.run(
        [*command, "--kv-cache-memory", "16MiB", *flags], env=env, capture_output=True, text=True, timeout=600
    )


def _resolve(env: dict[str, str], model: str, *args: str) -> subprocess.CompletedProcess:
    """`resolve_model` in a fresh process (prints the directory), with HubOptions(*args)."""
    program = (
        "import sys\n"
        "from tokenmill.models.model_loader.hub import HubOptions, resolve_model\n"
        "print(resolve_model(sys.argv[1], HubOptions(*[a or None for a in sys.argv[2:]])))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", program, model, *args], env=env, capture_output=True, text=True, timeout=300
    )


def _fetched(hub: FakeHub) -> set[str]:
    return {path.split("/resolve/", 1)[1].split("/", 1)[1] for path in hub.paths("GET") if "/resolve/" in path}


def test_download_resume_then_a_start_from_the_cache_with_the_hub_gone(hub, model_dirs, tmp_path):
    """A repo id downloads the engine's files only (config, generation config, tokenizer, chat
    template, the index and its safetensors shards; no .bin, no original/ or ONNX), shows progress,
    resumes a transfer cut halfway with a byte range, and generates the model's greedy tokens; with
    the hub stopped, the next start runs from the cache, and so does one with HF_HUB_OFFLINE=1."""
    index = json.loads((model_dirs["main"] / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    big = max(shards, key=lambda s: (model_dirs["main"] / s).stat().st_size)
    assert (model_dirs["main"] / big).stat().st_size > CUT_AT
    hub.cut_once[big] = CUT_AT
    env = _env(hub.url, tmp_path / "hf-cache")
    done = _generate(env, "--model", REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    expected_files = {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
        *shards,
    }
    assert _fetched(hub) == expected_files & set(_files(model_dirs["main"]))
    ranges = [h.get("range") for m, p, h in hub.requests if m == "GET" and p.endswith(big)]
    assert ranges[0] is None and ranges[-1] == "bytes=10485760-", ranges  # cut, then resumed
    assert "Fetching" in done.stderr and "100%" in done.stderr  # huggingface_hub's progress bar
    snapshot = next((tmp_path / "hf-cache").glob("models--tiny-org--tiny-llama/snapshots/*"))
    assert (snapshot / big).read_bytes() == (model_dirs["main"] / big).read_bytes()
    first = [json.loads(line) for line in done.stdout.splitlines()]

    hub.stop()  # no network now
    again = _generate(env, "--model", REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [json.loads(line) for line in again.stdout.splitlines()] == first
    offline = _generate({**env, "HF_HUB_OFFLINE": "1"}, "--model", REPO)
    assert offline.returncode == 0, offline.stderr[-3000:]
    ids = first[0]["prompt_token_ids"]
    assert first[0]["token_ids"] == hf_greedy(model_dirs["main"], ids, 4)


def test_revision_pinning(hub, model_dirs, tmp_path):
    """--revision (a tag, or a commit) gets that revision's files; the branch stays separate."""
    env = _env(hub.url, tmp_path / "hf-cache")
    repo = hub.repos[REPO]
    for revision in ("v1", repo.refs["v1"]):
        done = _resolve(env, REPO, revision)
        assert done.returncode == 0, done.stderr[-3000:]
        path = Path(done.stdout.strip())
        assert path.name == repo.refs["v1"]
        assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    main = Path(_resolve(env, REPO).stdout.strip())
    assert main.name == repo.refs["main"] and json.loads((main / "config.json").read_text())["num_hidden_layers"] == 2
    missing = _generate(env, "--model", REPO, "--revision", "v9")
    assert missing.returncode == 2 and "has no revision 'v9'" in missing.stderr


@pytest.mark.parametrize(
    ("repo", "env_token", "flag_token", "message"),
    [
        ("tiny-org/private", None, None, "or it is private or gated (HTTP 401)"),
        ("tiny-org/does-not-exist", "hf_secret", None, "was not found on http://127.0.0.1"),
        ("tiny-org/gated", None, "hf_secret", "is gated: accept its conditions"),
    ],
)
def test_hub_refusals_are_one_line_errors(hub, tmp_path, repo, env_token, flag_token, message):
    env = _env(hub.url, tmp_path / "hf-cache", **({"HF_TOKEN": env_token} if env_token else {}))
    done = _generate(env, "--model", repo, *(["--hf-token", flag_token] if flag_token else []))
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and repo in done.stderr and "Traceback" not in done.stderr
    if "401" in message:
        assert "--hf-token" in done.stderr


def test_a_token_opens_a_private_repo(hub, tmp_path):
    """--hf-token or HF_TOKEN: sent as a bearer token, the private repo downloads (into --download-dir
    when given, else HF_HUB_CACHE)."""
    for env, flags, cache in (
        (_env(hub.url, tmp_path / "a"), ["", str(tmp_path / "download-dir"), "hf_secret"], tmp_path / "download-dir"),
        (_env(hub.url, tmp_path / "b", HF_TOKEN="hf_secret"), [], tmp_path / "b"),
    ):
        done = _resolve(env, "tiny-org/private", *flags)
        assert done.returncode == 0, done.stderr[-2000:]
        path = Path(done.stdout.strip())
        assert (path / "config.json").exists() and path.is_relative_to(cache)
    tokens = {h.get("authorization") for _, p, h in hub.requests if "tiny-org/private" in p}
    assert tokens == {"Bearer hf_secret"}


def test_no_network_and_offline_mode_fail_naming_the_repo_and_the_way_out(tmp_path):
    """An uncached repo with the hub unreachable, or with HF_HUB_OFFLINE=1: exit 2 with one line
    naming the repo and what to do."""
    unreachable = FakeHub()
    unreachable.stop()  # (its port is closed now)
    done = _generate(_env(unreachable.url, tmp_path / "c"), "--model", REPO)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot reach {unreachable.url}" in done.stderr and REPO in done.stderr
    assert "hf download" in done.stderr and "Traceback" not in done.stderr
    offline = _generate(_env(unreachable.url, tmp_path / "c", HF_HUB_OFFLINE="1"), "--model", REPO)
    assert offline.returncode == 2 and "HF_HUB_OFFLINE=1 forbids downloading it" in offline.stderr


def test_tokenizer_draft_model_and_lora_adapter_by_repo_id(hub, model_dirs, tmp_path):
    """--tokenizer fetches tokenizer files only; --speculative-model and --lora-modules NAME=ORG/NAME
    resolve through the hub like --model."""
    env = _env(hub.url, tmp_path / "hf-cache")
    program = (
        "from tokenmill import LLM, SamplingParams\n"
        f"llm = LLM({REPO!r}, progress=False, kv_cache_memory='16MiB', tokenizer={REPO!r}, tokenizer_revision='v1',\n"
        f"          speculative_method='draft', speculative_model={REPO!r}, enable_lora=True, max_lora_rank=8,\n"
        "          lora_modules=['ad=tiny-org/adapter'])\n"
        "print(llm.engine.loras.get('ad').name, llm.engine.tokenizer.name_or_path)\n"
        "print(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    name, tokenizer_path = done.stdout.splitlines()[0].split()
    assert name == "ad" and Path(tokenizer_path).name == hub.repos[REPO].refs["v1"]
    v1 = hub.repos[REPO].refs["v1"]
    at_v1 = {p.split(f"/resolve/{v1}/", 1)[1] for p in hub.paths("GET") if f"/resolve/{v1}/" in p}
    assert at_v1 and not any(f.endswith(".safetensors") for f in at_v1)  # the tokenizer: no weights
    adapter = {p.rsplit("/", 1)[1] for p in hub.paths("GET") if "tiny-org/adapter/resolve" in p}
    assert adapter == {"adapter_config.json", "adapter_model.safetensors"}


MODELSCOPE_STUB = """
import json, os, shutil
def snapshot_download(model_id, revision=None, cache_dir=None, allow_patterns=None):
    with open(os.environ["STUB_LOG"], "a") as log:
        log.write(json.dumps([model_id, revision, cache_dir]) + "\\n")
    target = os.path.join(cache_dir or os.environ["STUB_CACHE"], model_id.replace("/", "--"))
    shutil.copytree(os.environ["STUB_SOURCE"], target, dirs_exist_ok=True)
    return target
"""


@pytest.mark.parametrize("switch", ["TOKENMILL_USE_MODELSCOPE", "VLLM_USE_MODELSCOPE"])
def test_modelscope_resolves_the_same_ids(model_dirs, tmp_path, switch):
    """With TOKENMILL_USE_MODELSCOPE=1 (or vLLM's VLLM_USE_MODELSCOPE=true) a repo id goes to
    ModelScope's snapshot_download (a stand-in module here), with --revision and --download-dir;
    without the modelscope package, the error says how to install it."""
    stub = tmp_path / "stub"
    (stub / "modelscope").mkdir(parents=True)
    (stub / "modelscope" / "__init__.py").write_text(MODELSCOPE_STUB)
    log = tmp_path / "calls.jsonl"
    env = _env("http://127.0.0.1:9", tmp_path / "hf", **{switch: "true" if switch.startswith("VLLM") else "1"})
    env.update(
        STUB_LOG=str(log), STUB_SOURCE=str(model_dirs["main"]), PYTHONPATH=f"{stub}{os.pathsep}{env['PYTHONPATH']}"
    )
    done = _resolve(env, REPO, "v1.0", str(tmp_path / "ms-cache"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()) == tmp_path / "ms-cache" / "tiny-org--tiny-llama"
    assert json.loads(log.read_text().splitlines()[0]) == [REPO, "v1.0", str(tmp_path / "ms-cache")]
    env["PYTHONPATH"] = str(ROOT)
    missing = _generate(env, "--model", REPO)
    assert missing.returncode == 2 and "pip install modelscope" in missing.stderr
