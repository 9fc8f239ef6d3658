"""Flags come from the settings dataclasses: every command's defaults are the dataclass defaults."""

from __future__ import annotations

import pytest

from tokenmill.cli import build_parser
from tokenmill.cli.serve import settings_from_args
from tokenmill.deploy.scale import ScaleOptions
from tokenmill.engine.config import OFFLINE_DEFAULTS, EngineConfig
from tokenmill.options import from_args
from tokenmill.server.settings import ServerSettings


@pytest.mark.parametrize(
    "command", [["serve"], ["serve-ray"], ["generate", "--prompt", "x"], ["bench", "offline"], ["bench", "features"]]
)
def test_engine_flag_defaults_are_the_dataclass_defaults(command):
    args = build_parser().parse_args(command)
    config = EngineConfig.from_cli_args(args)
    expected = EngineConfig(kv_cache_memory="2GiB", **OFFLINE_DEFAULTS) if command[0] == "bench" else EngineConfig()
    assert config == expected


def test_the_offline_api_batches_larger_steps_by_default(monkeypatch):
    """LLM (and the offline benchmarks) default to vLLM's LLM-class step budget on CPU; arguments win."""
    from tokenmill.engine import llm

    monkeypatch.setattr(llm, "LLMEngine", lambda config, progress: config)
    assert llm.LLM("m").engine == EngineConfig(model="m", max_num_batched_tokens=4096, max_num_seqs=256)
    assert llm.LLM("m", max_num_batched_tokens=512).engine.max_num_batched_tokens == 512
    assert EngineConfig().max_num_batched_tokens == 2048  # the server's


def test_server_and_scale_flags(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    assert settings_from_args(build_parser().parse_args(["serve"])) == ServerSettings()
    ray_args = build_parser().parse_args(["serve-ray"])
    assert settings_from_args(ray_args, grpc_port=0) == ServerSettings(grpc_port=0, log_format="text")
    assert from_args(ScaleOptions, ray_args) == ScaleOptions()
    args = build_parser().parse_args(
        [
            "serve",
            "--max-num-seqs",
            "7",
            "--max-body-bytes",
            "2KiB",
            "--no-onednn-linear",
            "-tp",
            "2",
            "--allow-special-tokens-in-messages",
        ]
    )
    settings = settings_from_args(args)
    assert (settings.max_num_seqs, settings.max_body_bytes, settings.allow_special_tokens_in_messages) == (
        7,
        2048,
        True,
    )
    config = EngineConfig.from_cli_args(args)
    assert (config.max_num_seqs, config.packed_linear, config.tensor_parallel_size) == (7, False, 2)
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    assert settings_from_args(build_parser().parse_args(["serve"])).api_key == "from-env"
    assert settings_from_args(build_parser().parse_args(["serve", "--api-key", "k"])).api_key == "k"
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored\n")
    assert settings_from_args(build_parser().parse_args(["serve", "--api-key-file", str(key_file)])).api_key == (
        "from-file"
    )
    for flags, problem in (
        (["--api-key-file", str(tmp_path / "missing")], "cannot read"),
        (["--api-key-file", str(tmp_path)], "cannot read"),
        (["--api-key", "k", "--api-key-file", str(key_file)], "give the API key once"),
    ):
        with pytest.raises(ValueError, match=problem):
            settings_from_args(build_parser().parse_args(["serve", *flags]))
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        settings_from_args(build_parser().parse_args(["serve", "--api-key-file", str(key_file)]))
    scale = from_args(ScaleOptions, build_parser().parse_args(["serve-ray", "--num-cpus-per-replica", "2.5"]))
    assert scale.num_cpus == 2.5


def test_lora_flags(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--max-loras", "3", "--max-lora-rank", "64"]
    )
    config = EngineConfig.from_cli_args(args)
    assert config.lora_modules == ["a=/x", '{"name": "b", "path": "/y"}'] and config.lora_enabled
    assert (config.max_loras, config.max_lora_rank, config.enable_lora) == (3, 64, False)
    assert not settings_from_args(args).enable_lora_runtime_updates
    assert settings_from_args(
        build_parser().parse_args(["serve", "--enable-lora-runtime-updates"])
    ).enable_lora_runtime_updates
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's switch works too
    assert settings_from_args(build_parser().parse_args(["serve"])).enable_lora_runtime_updates
    from tokenmill.lora.registry import LoRAModulePath, parse_lora_module

    assert parse_lora_module("a=/x") == LoRAModulePath("a", "/x")
    assert parse_lora_module('{"name": "b", "path": "/y", "base_model_name": "m"}') == LoRAModulePath("b", "/y", "m")
    for bad in (
        "/just/a/path",
        '{"name": "b"}',
        '{"name": "b", "path": "/y", "extra": 1}',
        "{not json",
        '{"name": "b", "path": "/y", "base_model_name": 5}',
    ):  # (/v1/models would fail on a number)
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
