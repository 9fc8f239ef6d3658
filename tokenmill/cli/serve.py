"""`tokenmill serve`: the OpenAI-compatible HTTP server (+ gRPC) in front of one engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from tokenmill.cli.vllm_flags import add_vllm_flags, check_always_so
from tokenmill.engine.config import EngineConfig
from tokenmill.options import add_options, from_args
from tokenmill.server.settings import (
    API_KEY_ENV,
    OTLP_ENDPOINT_ENV,
    OTLP_PROTOCOL_ENV,
    RUNTIME_LORA_ENV,
    ServerSettings,
    env_setting,
)

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (and gRPC)",
        description="Serve a model: OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/responses, "
        "Anthropic's /v1/messages, gRPC (tokenmill.v1.Generation), /metrics (Prometheus) and /health/{live,ready}. "
        "SIGTERM drains. vLLM's serve flags mean the same here where tokenmill has the feature; the others are "
        "refused by name (docs/model-sources.md).",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model takes it (`tokenmill serve ORG/NAME`, as `vllm serve` takes it; put it first)",
    )
    EngineConfig.add_cli_args(parser)
    add_server_args(parser)
    add_vllm_flags(parser)
    parser.set_defaults(func=run_serve, server_omp=True)


def add_server_args(
    parser: argparse.ArgumentParser,
    only: tuple[str, ...] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """The server flags (ServerSettings options, `only` these), in their own help group."""
    add_options(parser.add_argument_group("server"), ServerSettings, only=only, overrides=overrides)


def settings_from_args(args: argparse.Namespace, **values: Any) -> ServerSettings:
    """ServerSettings from the parsed flags; the API key comes from --api-key, --api-key-file or
    $TOKENMILL_API_KEY, runtime LoRA updates also from vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    lora_updates = bool(getattr(args, "enable_lora_runtime_updates", False)) or os.environ.get(
        RUNTIME_LORA_ENV, ""
    ).strip().lower() in ("1", "true")
    # Tracing: the standard OpenTelemetry variables unless the flags say otherwise.
    endpoint = getattr(args, "otlp_traces_endpoint", None) or env_setting(OTLP_ENDPOINT_ENV)
    protocol = getattr(args, "otlp_traces_protocol", None) or env_setting(OTLP_PROTOCOL_ENV)
    return from_args(
        ServerSettings,
        args,
        api_key=_api_key(args),
        otlp_traces_endpoint=endpoint,
        otlp_traces_protocol=protocol,
        enable_lora_runtime_updates=lora_updates,
        **values,
    )


def _api_key(args: argparse.Namespace) -> str | None:
    key, key_file = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    if key is not None and key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file")
    if key_file is None:
        return key if key is not None else os.environ.get(API_KEY_ENV)
    try:
        lines = Path(key_file).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file: cannot read {key_file} ({exc.__class__.__name__})") from None
    if not lines or not lines[0].strip():
        raise ValueError(f"--api-key-file: {key_file} holds no key on its first line")
    return lines[0].strip()


def take_model_tag(args: argparse.Namespace) -> None:
    """The positional MODEL as --model (both given: they must agree)."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag


def run_serve(args: argparse.Namespace) -> int:
    from tokenmill.server.logs import configure_logging

    take_model_tag(args)
    check_always_so(args)
    settings = settings_from_args(args)  # ValueError -> the CLI's one-line error
    config = EngineConfig.from_cli_args(args)
    config.check_sources()
    if args.enable_lora_runtime_updates and not config.lora_enabled:
        raise ValueError(
            "--enable-lora-runtime-updates needs --enable-lora (or --lora-modules): without it "
            "the server has no adapter slots to load into"
        )
    configure_logging(settings.log_format)
    return asyncio.run(_serve(config, settings))


async def _serve(config: EngineConfig, settings: ServerSettings) -> int:
    # Imported late: `tokenmill --help` should not pay for torch. The engine is built inside the loop
    # so anything it binds to "the current loop" is the loop the servers run on.
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.server.runtime import serve

    logger.info("loading model", extra={"model": config.model or "default"})
    engine = AsyncEngine(config)
    logger.info("engine ready", extra={"model": engine.model_name, "max_model_len": engine.max_model_len})
    return await serve(engine, settings)
