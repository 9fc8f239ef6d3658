"""Server-side settings (everything `tokenmill serve` adds on top of the engine config)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.config import parse_memory
from tokenmill.options import option

from .tools.parsers import PARSERS

API_KEY_ENV = "TOKENMILL_API_KEY"


@dataclass
class ServerSettings:
    host: str = option("127.0.0.1", "address to bind (use 0.0.0.0 in containers)")
    port: int = option(8000, "HTTP port")
    grpc_port: int = option(50051, "gRPC port; 0 disables gRPC")
    max_queue: int = option(256, "waiting requests beyond which new ones get 429")
    drain_timeout: float = option(30.0, "seconds in-flight requests get to finish after SIGTERM")
    # None = open. The CLI falls back to $TOKENMILL_API_KEY (see server.commands).
    api_key: str | None = option(None, f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV})")
    max_body_bytes: int = option(1 << 20, "largest accepted request body, e.g. 1MiB", type=parse_memory)
    # Slow clients (slowloris): a request head must arrive within header_timeout seconds of the
    # connection opening (or of the previous response), its body within body_timeout of the head;
    # at most max_connections sockets are open at once; idle keep-alive connections close after
    # keep_alive_timeout.
    header_timeout: float = option(
        10.0, "seconds a client gets to send a request's headers, counted from the connection opening (or the "
        "previous response); slower connections are closed (slowloris)")
    body_timeout: float = option(
        30.0, "seconds a client gets to send the whole request body once its headers are in; slower requests "
        "get 408")
    max_connections: int = option(1024, "open HTTP connections at most; connections beyond it are closed at once")
    keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive HTTP connection stays open")
    log_format: str = option("json", "log line format", choices=["json", "text"])
    log_prompts: bool = option(False, "include prompt text in request logs (off: prompts are never logged)")
    # Chat role injection (see tokenmill.engine.input_processor).
    allow_special_tokens_in_messages: bool = option(
        False, "parse special-token strings inside chat message contents (e.g. <|im_start|>) as control tokens; "
        "off by default, where they are plain text so no message can forge a turn. Only for trusted clients")
    escape_special_tokens_in_prompts: bool = option(
        False, "tokenize special-token strings inside /v1/completions and gRPC prompts as plain text (off by "
        "default: a raw prompt is the caller's own template)")
    # How tool_choice "auto" outputs are read as calls. See tokenmill/server/tools.
    tool_call_parser: str = option(
        "auto", "how tool_choice \"auto\" outputs become tool_calls: hermes (<tool_call>{...}</tool_call>: Qwen "
        "2.5/3, Hermes), llama3_json ({\"name\": ..., \"parameters\": ...}: Llama 3.1/3.2); auto picks from the "
        "chat template (hermes if it writes <tool_call>, llama3_json for Llama 3 tool templates, else none); "
        "none: always plain text. tool_choice \"required\" and named functions do not depend on it",
        choices=["auto", "none", *PARSERS])
    # Sequences the engine runs at once (the engine's --max-num-seqs); requests beyond it count as
    # waiting for back-pressure.
    max_num_seqs: int = option(128, "", cli=False)

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError("--max-queue must be >= 0")
        if self.drain_timeout < 0:
            raise ValueError("--drain-timeout must be >= 0")
        if self.max_body_bytes <= 0:
            raise ValueError("--max-body-bytes must be > 0")
        for flag, value in (("--header-timeout", self.header_timeout), ("--body-timeout", self.body_timeout),
                            ("--keep-alive-timeout", self.keep_alive_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds")
        if self.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")
        if self.log_format not in ("json", "text"):
            raise ValueError("--log-format must be json or text")
        if self.tool_call_parser not in ("auto", "none", *PARSERS):
            raise ValueError(f"--tool-call-parser must be auto, none or one of {', '.join(PARSERS)}")
        if self.api_key == "":
            self.api_key = None
