"""Loader hygiene: every checkpoint format loads the same model; a broken or mismatched model
directory fails with one line naming the file and the problem (exit code 2 from the CLI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import save_random_model
from tokenmill.errors import ModelLoadError
from tokenmill.models.model_loader.loader import load_model, load_spec

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def small_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return save_random_model(config, default_model_dir, tmp_path_factory.mktemp("small-llama"), seed=5)


@pytest.fixture
def broken_dir(small_llama_dir, tmp_path) -> Path:
    """A private copy of the small model to break."""
    return Path(shutil.copytree(small_llama_dir, tmp_path / "model"))


def _state(model_dir: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(model_dir, torch.float32, CPU, progress=False)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _resave(model_dir: Path, target: Path, **save_args) -> Path:
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, target)
    for f in list(target.glob("*.safetensors")) + list(target.glob("*.index.json")):
        f.unlink()
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).save_pretrained(target, **save_args)
    return target


def test_sharded_safetensors_and_bin_load_the_same_weights(small_llama_dir, tmp_path):
    from safetensors.torch import load_file

    reference = _state(small_llama_dir)
    sharded = _resave(small_llama_dir, tmp_path / "sharded", max_shard_size="2MB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    as_bin = Path(shutil.copytree(small_llama_dir, tmp_path / "bin"))
    torch.save(load_file(as_bin / "model.safetensors"), as_bin / "pytorch_model.bin")  # transformers 5 writes no .bin
    (as_bin / "model.safetensors").unlink()
    for model_dir in (sharded, as_bin):
        state = _state(model_dir)
        assert state.keys() == reference.keys()
        assert all(torch.equal(state[k], reference[k]) for k in reference)


@pytest.mark.unit
def test_eos_list_from_generation_config(broken_dir):
    (broken_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_spec(broken_dir).eos_token_ids == [2, 7, 9]


def test_derived_tensors_of_old_checkpoints_are_ignored(broken_dir):
    """Old Llama checkpoints saved the RoPE inv_freq buffer: derived, documented, skipped."""
    from safetensors.torch import load_file, save_file

    path = broken_dir / "model.safetensors"
    state = load_file(path)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, path, metadata={"format": "pt"})
    load_model(broken_dir, torch.float32, CPU, progress=False)


def test_unused_checkpoint_tensor_is_an_error(broken_dir):
    from safetensors.torch import load_file, save_file

    path = broken_dir / "model.safetensors"
    state = load_file(path)
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)  # a bias the config does not declare
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_model(broken_dir, torch.float32, CPU, progress=False)


def test_missing_weight_and_wrong_shape_are_errors(broken_dir):
    from safetensors.torch import load_file, save_file

    path = broken_dir / "model.safetensors"
    state = load_file(path)
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing.*layers\.1\.mlp\.down_proj\.weight"):
        load_model(broken_dir, torch.float32, CPU, progress=False)
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight has shape \(64, 100\)"):
        load_model(broken_dir, torch.float32, CPU, progress=False)


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _truncate_weights(model_dir: Path) -> str:
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return r"model\.safetensors: unreadable weights file"


def _corrupt_config_json(model_dir: Path) -> str:
    path = model_dir / "config.json"
    path.write_text(path.read_text()[:-40])
    return r"config\.json: invalid JSON"


def _drop_hidden_size(model_dir: Path) -> str:
    _edit_config(model_dir, hidden_size=None)  # LlamaConfig would silently default it to 4096
    return r"config\.json: missing required key 'hidden_size'"


def _unknown_model_type(model_dir: Path) -> str:
    _edit_config(model_dir, model_type="no-such-arch")
    return r"config\.json: unsupported architecture 'no-such-arch'"


def _unknown_activation(model_dir: Path) -> str:
    _edit_config(model_dir, hidden_act="no-such-act")
    return r"config\.json: unsupported activation 'no-such-act'"


BREAKAGES = [_truncate_weights, _corrupt_config_json, _drop_hidden_size, _unknown_model_type, _unknown_activation]


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda f: f.__name__.strip("_"))
def test_broken_model_dir_raises_one_line(broken_dir, breakage):
    pattern = breakage(broken_dir)
    with pytest.raises(ModelLoadError, match=pattern) as info:
        load_model(broken_dir, torch.float32, CPU, progress=False)
    assert "\n" not in str(info.value)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize(
    "breakage", [_truncate_weights, _corrupt_config_json, _drop_hidden_size], ids=lambda f: f.__name__.strip("_")
)
def test_cli_generate_on_broken_model_dir_exits_2_with_one_line(broken_dir, breakage):
    import re

    pattern = breakage(broken_dir)
    result = _cli("generate", "--model", str(broken_dir), "--prompt", "hi", "--max-tokens", "1")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tokenmill generate: error: ") and str(broken_dir) in lines[0]
    assert re.search(pattern, lines[0])
    assert result.stdout == ""


def test_cli_serve_on_broken_model_dir_exits_2_with_one_line(broken_dir):
    import re

    pattern = _drop_hidden_size(broken_dir)
    result = _cli("serve", "--model", str(broken_dir), "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0")
    assert result.returncode == 2, result.stderr
    # The server's own JSON log lines (e.g. "loading model") may come first; the error is one line.
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith('{"ts"')]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tokenmill serve: error: ") and re.search(pattern, lines[0])


@pytest.mark.unit
def test_models_command_lists_every_architecture_with_its_path(capsys):
    from tokenmill.cli import main
    from tokenmill.models.model_loader.registry import architectures

    assert main(["models", "--json"]) == 0
    rows = {row["model_type"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows.keys() == {a.model_type for a in architectures()}
    assert {"llama", "mistral", "qwen2", "gpt2"} <= rows.keys()
    assert rows["llama"]["path"] == "native" and rows["llama"]["architectures"] == ["LlamaForCausalLM"]
