"""`tokenmill serve`: the OpenAI-compatible HTTP server (+ gRPC) in front of one engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from tokenmill.engine.config import EngineConfig, parse_memory

from .settings import ServerSettings
from .tools.parsers import PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "TOKENMILL_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (and gRPC)",
        description="Serve a model: OpenAI-compatible /v1/completions and /v1/chat/completions, gRPC "
        "(tokenmill.v1.Generation), /metrics (Prometheus) and /health/{live,ready}. SIGTERM drains.",
    )
    EngineConfig.add_cli_args(parser)
    add_server_args(parser)
    parser.set_defaults(func=run_serve, passive_omp=True)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (use 0.0.0.0 in containers)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port")
    g.add_argument("--grpc-port", type=int, default=50051, help="gRPC port; 0 disables gRPC")
    g.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond which new ones get 429")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV})")
    g.add_argument("--max-body-bytes", type=parse_memory, default=1 << 20, help="largest accepted request body, e.g. 1MiB")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client gets to send a request's headers, counted from the connection opening "
                   "(or the previous response); slower connections are closed (slowloris)")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client gets to send the whole request body once its headers are in; slower "
                   "requests get 408")
    g.add_argument("--max-connections", type=int, default=1024,
                   help="open HTTP connections at most; connections beyond it are closed at once")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive HTTP connection stays open")
    g.add_argument("--log-format", choices=["json", "text"], default="json", help="log line format")
    g.add_argument("--log-prompts", action="store_true", help="include prompt text in request logs (off: prompts are never logged)")
    add_special_token_args(g)
    add_tool_call_args(g)


def add_tool_call_args(g: argparse._ArgumentGroup) -> None:
    """How tool calls are read from outputs, shared with serve-ray."""
    g.add_argument("--tool-call-parser", choices=["auto", "none", *PARSERS], default="auto",
                   help="how tool_choice \"auto\" outputs become tool_calls: hermes (<tool_call>{...}</tool_call>: "
                        "Qwen 2.5/3, Hermes), llama3_json ({\"name\": ..., \"parameters\": ...}: Llama 3.1/3.2); "
                        "auto picks from the chat template (hermes if it writes <tool_call>, llama3_json for Llama 3 "
                        "tool templates, else none); none: always plain text. tool_choice \"required\" and named "
                        "functions do not depend on it")


def add_special_token_args(g: argparse._ArgumentGroup) -> None:
    """Chat role-injection defence (see tokenmill.engine.input_processor), shared with serve-ray."""
    g.add_argument("--allow-special-tokens-in-messages", action="store_true",
                   help="parse special-token strings inside chat message contents (e.g. <|im_start|>) as control "
                        "tokens; off by default, where they are plain text so no message can forge a turn. Only "
                        "for trusted clients")
    g.add_argument("--escape-special-tokens-in-prompts", action="store_true",
                   help="tokenize special-token strings inside /v1/completions and gRPC prompts as plain text "
                        "(off by default: a raw prompt is the caller's own template)")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        max_queue=args.max_queue,
        drain_timeout=args.drain_timeout,
        api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV),
        max_body_bytes=args.max_body_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        keep_alive_timeout=args.keep_alive_timeout,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
        escape_special_tokens_in_prompts=args.escape_special_tokens_in_prompts,
        tool_call_parser=args.tool_call_parser,
        max_num_seqs=args.max_num_seqs,
    )


def run_serve(args: argparse.Namespace) -> int:
    from .logs import configure_logging

    settings = settings_from_args(args)  # ValueError -> the CLI's one-line error
    configure_logging(settings.log_format)
    return asyncio.run(_serve(EngineConfig.from_cli_args(args), settings))


async def _serve(config: EngineConfig, settings: ServerSettings) -> int:
    # Imported late: `tokenmill --help` should not pay for torch. The engine is built inside the loop
    # so anything it binds to "the current loop" is the loop the servers run on.
    from tokenmill.engine.async_engine import AsyncEngine

    from .runtime import serve

    logger.info("loading model", extra={"model": config.model or "default"})
    engine = AsyncEngine(config)
    logger.info("engine ready", extra={"model": engine.model_name, "max_model_len": engine.max_model_len})
    return await serve(engine, settings)
