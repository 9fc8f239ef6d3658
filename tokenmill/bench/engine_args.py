"""The engine flags and engine construction the in-process (engine) benchmarks share: `--model` also
takes 'tiny', a benchmark KV cache budget, `--no-progress`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

TINY_MODEL = "tiny"
DEFAULT_KV_CACHE = "2GiB"


def resolve_bench_model(model: str | None) -> Path:
    """--model: None = the default model, 'tiny' = the random tiny Llama in the cache (built once)."""
    from tokenmill.models.model_loader.hub import make_tiny_model, resolve_model
    from tokenmill.paths import cache_root

    if model != TINY_MODEL:
        return resolve_model(model)
    target = cache_root() / "models" / "tiny-llama"
    if not ((target / "config.json").exists() and any(target.glob("*.safetensors"))):
        import shutil

        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        print(f"building the tiny model in {target} (once)", file=sys.stderr)
        make_tiny_model(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    return target


def engine_kwargs(args: argparse.Namespace, model_dir: Path, **overrides: Any) -> dict[str, Any]:
    from tokenmill.engine.config import EngineConfig

    kwargs = vars(EngineConfig.from_cli_args(args))
    kwargs.update(model=str(model_dir), **overrides)
    return kwargs


def make_llm(args: argparse.Namespace, model_dir: Path, **overrides: Any) -> Any:
    from tokenmill import LLM

    kwargs = engine_kwargs(args, model_dir, **overrides)
    model = kwargs.pop("model")
    return LLM(model, progress=not args.no_progress, **kwargs)


def add_bench_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags of the offline benchmarks: --model also takes 'tiny', a bench KV budget;
    --no-progress."""
    from tokenmill.engine.config import OFFLINE_DEFAULTS, EngineConfig
    from tokenmill.options import option_help

    offline = {
        name: {
            "default": value,
            "help": f"{option_help(EngineConfig, name)} (default here: {value}, the offline API's)",
        }
        for name, value in OFFLINE_DEFAULTS.items()
    }
    EngineConfig.add_cli_args(
        parser,
        **offline,
        model={
            "help": "model directory, 'tiny' for the random tiny Llama (built once in the cache), or default",
        },
        kv_cache_memory={
            "default": DEFAULT_KV_CACHE,
            "help": f"KV cache budget (default here: {DEFAULT_KV_CACHE})",
        },
        seed={
            "help": "seed of the prompts and of the engine's unseeded sampling (default: 0)",
        },
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
