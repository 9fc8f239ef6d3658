"""Server-side settings (everything `tokenmill serve` adds on top of the engine config)."""

from __future__ import annotations

from dataclasses import dataclass

from .tools.parsers import PARSERS


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051  # 0 disables gRPC
    max_queue: int = 256  # waiting requests beyond which new ones get 429
    drain_timeout: float = 30.0  # seconds to let in-flight requests finish after SIGTERM
    api_key: str | None = None  # Bearer token for /v1/* (and gRPC); None = open
    max_body_bytes: int = 1 << 20
    # Slow clients (slowloris): a request head must arrive within header_timeout seconds of the
    # connection opening (or of the previous response), its body within body_timeout of the head;
    # at most max_connections sockets are open at once; idle keep-alive connections close after
    # keep_alive_timeout.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 1024
    keep_alive_timeout: float = 5.0
    log_format: str = "json"  # json | text
    log_prompts: bool = False  # prompt text is never logged unless this is set
    # Chat role injection: special-token strings inside message contents are plain text unless this
    # is set (trusted clients only: it lets a message forge system/assistant turns).
    allow_special_tokens_in_messages: bool = False
    # Raw /v1/completions prompts are the caller's own template: special-token strings in them are
    # control tokens unless this is set.
    escape_special_tokens_in_prompts: bool = False
    # Sequences the engine runs at once; requests beyond it count as waiting for back-pressure.
    max_num_seqs: int = 128
    # How tool_choice "auto" outputs are read as calls: a parser name, "auto" (picked from the
    # chat template) or "none" (always text). See tokenmill/server/tools.
    tool_call_parser: str = "auto"

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
