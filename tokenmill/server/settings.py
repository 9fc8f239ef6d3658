"""Server-side settings (everything `tokenmill serve` adds on top of the engine config)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from tokenmill.engine.config import parse_memory
from tokenmill.engine.pooling_params import POOLING_TYPES, PoolingType
from tokenmill.options import option
from tokenmill.server.reasoning import REASONING_PARSERS
from tokenmill.server.tools.catalog import PARSERS

API_KEY_ENV = "TOKENMILL_API_KEY"
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the runtime LoRA endpoints
# The standard OpenTelemetry variables that turn tracing on when --otlp-traces-endpoint is not given.
OTLP_ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
OTLP_PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
# What tracing imports: the SDK, both OTLP exporters and the FastAPI and gRPC instrumentations (the `otel` extra).
TRACING_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.instrumentation.fastapi",
    "opentelemetry.instrumentation.grpc",
)


def json_list(text: str) -> list[str]:
    """A flag value given as a JSON list of strings (vLLM's form for --allowed-origins and friends)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def env_setting(names: tuple[str, ...]) -> str | None:
    """The first of these environment variables that is set and not empty."""
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def check_tracing_installed() -> None:
    """A one-line error naming the extra to install when a tracing package is missing."""
    import importlib.util

    for name in TRACING_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package is missing (or broken)
            found = False
        if not found:
            raise ValueError(
                f"--otlp-traces-endpoint needs the OpenTelemetry packages ({name} is not installed): "
                "pip install 'tokenmill[otel]'"
            )


@dataclass
class ServerSettings:
    host: str = option("127.0.0.1", "address to bind (use 0.0.0.0 in containers)")
    port: int = option(8000, "HTTP port")
    grpc_port: int = option(50051, "gRPC port; 0 disables gRPC")
    max_queue: int = option(256, "waiting requests beyond which new ones get 429")
    drain_timeout: float = option(30.0, "seconds in-flight requests get to finish after SIGTERM")
    # None = open. The CLI falls back to --api-key-file, then $TOKENMILL_API_KEY (see cli.serve).
    api_key: str | None = option(
        None,
        "require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize and the API docs (/openapi.json, "
        f"/docs, /redoc). A flag shows in the process list: prefer --api-key-file or ${API_KEY_ENV}",
    )
    api_key_file: str | None = option(
        None, "read the API key from this file (its first line), so it stays out of the process list", metavar="PATH"
    )
    max_body_bytes: int = option(1 << 20, "largest accepted request body, e.g. 1MiB", type=parse_memory)
    # Slow clients (slowloris): a request head must arrive within header_timeout seconds of the
    # connection opening (or of the previous response), its body within body_timeout of the head;
    # at most max_connections sockets are open at once; idle keep-alive connections close after
    # keep_alive_timeout.
    header_timeout: float = option(
        10.0,
        "seconds a client gets to send a request's headers, counted from the connection opening (or the "
        "previous response); slower connections are closed (slowloris)",
    )
    body_timeout: float = option(
        30.0, "seconds a client gets to send the whole request body once its headers are in; slower requests get 408"
    )
    max_connections: int = option(1024, "open HTTP connections at most; connections beyond it are closed at once")
    keep_alive_timeout: float = option(5.0, "seconds an idle keep-alive HTTP connection stays open")
    log_format: str = option("json", "log line format", choices=["json", "text"])
    log_prompts: bool = option(False, "include prompt text in request logs (off: prompts are never logged)")
    disable_log_requests: bool = option(
        False, "no log line per finished request (failed ones with a server error are still logged)"
    )
    uvicorn_log_level: str = option(
        "info", "level of uvicorn's own log (the HTTP server's)", choices=list(UVICORN_LOG_LEVELS)
    )
    # TLS for HTTP and gRPC (off while ssl_certfile is None).
    ssl_certfile: str | None = option(None, "serve HTTPS (and gRPC over TLS) with this PEM certificate", metavar="FILE")
    ssl_keyfile: str | None = option(None, "the private key of --ssl-certfile (PEM)", metavar="FILE")
    ssl_ca_certs: str | None = option(
        None, "CA certificates (PEM) to verify client certificates with (see --ssl-cert-reqs)", metavar="FILE"
    )
    ssl_cert_reqs: int = option(
        0, "client certificates over HTTPS: 0 = not asked for, 1 = optional, 2 = required (Python's ssl.CERT_*)"
    )
    # CORS (off while allowed_origins is None: no cross-origin headers are sent).
    allowed_origins: list[str] | None = option(
        None,
        "origins browsers may call the API from, as a JSON list (e.g. '[\"https://app.example\"]' or '[\"*\"]'); "
        "default: none (vLLM's default is every origin)",
        type=json_list,
        metavar="JSON",
    )
    allowed_methods: list[str] | None = option(
        None,
        "with --allowed-origins: the methods allowed, as a JSON list (default: all)",
        type=json_list,
        metavar="JSON",
    )
    allowed_headers: list[str] | None = option(
        None,
        "with --allowed-origins: the request headers allowed, as a JSON list (default: all)",
        type=json_list,
        metavar="JSON",
    )
    allow_credentials: bool = option(False, "with --allowed-origins: allow credentials (cookies, HTTP auth)")
    root_path: str | None = option(
        None, "the path prefix a reverse proxy serves the API under (ASGI root_path: links, /docs)", metavar="PATH"
    )
    # Chat role injection (see tokenmill.engine.input_processor).
    allow_special_tokens_in_messages: bool = option(
        False,
        "parse special-token strings inside chat message contents (e.g. <|im_start|>) as control tokens; "
        "off by default, where they are plain text so no message can forge a turn. Only for trusted clients",
    )
    escape_special_tokens_in_prompts: bool = option(
        False,
        "tokenize special-token strings inside /v1/completions and gRPC prompts as plain text (off by "
        "default: a raw prompt is the caller's own template)",
    )
    # How tool_choice "auto" outputs are read as calls. See tokenmill/server/tools.
    tool_call_parser: str = option(
        "auto",
        'how tool_choice "auto" outputs become tool_calls: hermes (<tool_call>{...}</tool_call>: Qwen '
        '2.5/3, Hermes), llama3_json ({"name": ..., "parameters": ...}: Llama 3.1/3.2), mistral '
        "([TOOL_CALLS]...), pythonic ([f(x=1), g()]: Llama 3.2/4, Gemma 3), qwen3_coder (<function=...> XML), "
        "phi4_mini_json (functools[...]); auto picks from the chat template (qwen3_coder, mistral, pythonic "
        "or hermes when it writes their markup, llama3_json for Llama 3 tool templates, else none); none: "
        'always plain text. tool_choice "required" and named functions do not depend on it',
        choices=["auto", "none", *PARSERS],
    )
    enable_auto_tool_choice: bool = option(
        False,
        'accepted for vLLM command lines: tool_choice "auto" is on whenever a tool-call parser is set or '
        "picked (--tool-call-parser); with this flag, startup warns when none is",
    )
    reasoning_parser: str | None = option(
        None,
        "split a thinking model's <think>...</think> section from its answer: message.reasoning_content "
        "(and reasoning) in chat, reasoning deltas when streamed, reasoning items in /v1/responses and "
        "thinking blocks in /v1/messages; structured outputs and tool calls apply after it. deepseek_r1: "
        "output without <think> is reasoning up to </think>; qwen3: such output is the answer",
        choices=list(REASONING_PARSERS),
    )
    responses_store_memory: int = option(
        64 << 20,
        "/v1/responses with store=true: memory for stored responses (previous_response_id, GET and DELETE "
        "/v1/responses/{id}), e.g. 64MiB; the least recently used go first; 0 stores nothing",
        type=parse_memory,
    )
    # OpenTelemetry traces, one per request (tokenmill.server.tracing): off while the endpoint is None.
    # The CLI falls back to the standard OTEL_EXPORTER_OTLP_* variables (see server.commands).
    otlp_traces_endpoint: str | None = option(
        None,
        "export one OpenTelemetry trace per request (HTTP/gRPC server span, GenAI attributes, tokenize/"
        "queue/prefill/decode/stream stages) to this OTLP collector, e.g. http://127.0.0.1:4317 (grpc) or "
        "http://127.0.0.1:4318/v1/traces (http/protobuf); file:///path writes the spans as JSON lines. Default: "
        f"${OTLP_ENDPOINT_ENV[0]} or ${OTLP_ENDPOINT_ENV[1]}; unset = tracing off (nothing imported, no cost). "
        "Needs pip install 'tokenmill[otel]'",
        metavar="URL",
    )
    otlp_traces_protocol: str | None = option(
        None,
        f"OTLP transport (default: ${OTLP_PROTOCOL_ENV[0]}, ${OTLP_PROTOCOL_ENV[1]}, else grpc)",
        choices=list(OTLP_PROTOCOLS),
    )
    embedding_pooling: PoolingType = option(
        "last",
        "/v1/embeddings: pool the final hidden states of the last token (default, as vLLM does for decoder "
        "LMs) or the mean over all tokens; a request may choose with `pooling`",
        choices=list(POOLING_TYPES),
    )
    enable_lora_runtime_updates: bool = option(
        False,
        "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; they read adapter "
        "directories from this machine's disk, so they are off by default; default: vLLM's "
        "$VLLM_ALLOW_RUNTIME_LORA_UPDATING). Needs --enable-lora",
    )
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
        for flag, value in (
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
            ("--keep-alive-timeout", self.keep_alive_timeout),
        ):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds")
        if self.max_connections < 1:
            raise ValueError("--max-connections must be >= 1")
        if self.embedding_pooling not in POOLING_TYPES:
            raise ValueError(f"--embedding-pooling must be one of {', '.join(POOLING_TYPES)}")
        if self.log_format not in ("json", "text"):
            raise ValueError("--log-format must be json or text")
        if self.tool_call_parser not in ("auto", "none", *PARSERS):
            raise ValueError(f"--tool-call-parser must be auto, none or one of {', '.join(PARSERS)}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}")
        if self.responses_store_memory < 0:
            raise ValueError("--responses-store-memory must be >= 0")
        if self.api_key == "":
            self.api_key = None
        self.otlp_traces_protocol = self.otlp_traces_protocol or "grpc"
        if self.otlp_traces_protocol not in OTLP_PROTOCOLS:
            raise ValueError(
                f"--otlp-traces-protocol must be one of {', '.join(OTLP_PROTOCOLS)}, got {self.otlp_traces_protocol!r}"
            )
        if self.otlp_traces_endpoint:
            check_tracing_installed()
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}")
        self._check_tls()

    def _check_tls(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together: HTTPS needs both")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        if self.ssl_cert_reqs and (self.ssl_ca_certs is None or self.ssl_certfile is None):
            raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-certfile/--ssl-keyfile and --ssl-ca-certs")
        for flag, path in (
            ("--ssl-certfile", self.ssl_certfile),
            ("--ssl-keyfile", self.ssl_keyfile),
            ("--ssl-ca-certs", self.ssl_ca_certs),
        ):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None
