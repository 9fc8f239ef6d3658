"""Per-request OpenTelemetry traces (`--otlp-traces-endpoint`; this module is imported only then).

The server span of each request comes from the OpenTelemetry instrumentations (FastAPI for HTTP,
the grpc.aio server interceptor for gRPC), which also honour a client's W3C `traceparent`. Under it
the finished request adds one generation span with the GenAI semantic-convention attributes
(`gen_ai.request.*`, `gen_ai.usage.*`, `gen_ai.response.*`) and, per prompt, its stages as child
spans with the engine's own timestamps (`RequestMetrics`): tokenize (chat rendering, tokenization,
validation), queue (queued until first scheduled), prefill (until the first token; prefix-cache hit
tokens), decode (the remaining tokens; output tokens, time per output token) and stream (the last
token until the response is complete). Spans are built after the fact from those timestamps, so
tracing adds no work to the engine loop and nothing per token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fastapi import FastAPI
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanProcessor,
)
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import Status, StatusCode

from tokenmill import __version__
from tokenmill.server.settings import ServerSettings
from tokenmill.server.state import GRPC_GENERATE, GRPC_GENERATE_STREAM, RequestRecord

# Probes and scrapes are not requests anyone wants traces of (regexes searched in the URL).
EXCLUDED_URLS = "/health,/metrics,/version"
# GenAI operation names (gen_ai.operation.name) of the generation endpoints.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    GRPC_GENERATE: "text_completion",
    GRPC_GENERATE_STREAM: "text_completion",
}
PROVIDER = "tokenmill"

# tokenmill's own attributes (no GenAI convention covers them).
PROMPT_INDEX = "tokenmill.prompt_index"
PREFIX_CACHE_HIT_TOKENS = "tokenmill.prefix_cache.hit_tokens"
TIME_PER_OUTPUT_TOKEN = "tokenmill.time_per_output_token_s"
REQUEST_ID = "tokenmill.request_id"
STATUS = "tokenmill.status"

# (name, metrics field where it starts, field where it ends); None = when the request finished here.
STAGES = (
    ("tokenize", "tokenize_start_time", "tokenize_end_time"),
    ("queue", "arrival_time", "first_scheduled_time"),
    ("prefill", "first_scheduled_time", "first_token_time"),
    ("decode", "first_token_time", "finished_time"),
    ("stream", "finished_time", None),
)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class _JsonLinesExporter(ConsoleSpanExporter):
    """file:///path: the SDK's console exporter writing one JSON span per line (tests, debugging)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        super().__init__(out=self._file, formatter=lambda span: span.to_json(indent=None) + "\n")

    def shutdown(self) -> None:
        self._file.close()


def _otlp_exporter(endpoint: str, protocol: str) -> SpanExporter:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPSpanExporter

    return HTTPSpanExporter(endpoint=endpoint)


def span_processor(endpoint: str, protocol: str) -> SpanProcessor:
    """A batching OTLP export (spans leave the request path at once), or a synchronous file sink."""
    url = urlparse(endpoint)
    if url.scheme == "file":
        return SimpleSpanProcessor(_JsonLinesExporter(Path(url.path)))
    return BatchSpanProcessor(_otlp_exporter(endpoint, protocol))


def _resource() -> Resource:
    """The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES), named tokenmill unless they name it."""
    detected = Resource.create()
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        return detected.merge(Resource({SERVICE_NAME: "tokenmill"}))
    return detected


ERROR_MESSAGE = "tokenmill.error"


class RequestTracing:
    """The tracer provider of one server, its instrumentations and the spans of finished requests."""

    def __init__(self, settings: ServerSettings, model: str) -> None:
        assert settings.otlp_traces_endpoint
        assert settings.otlp_traces_protocol  # (None becomes the default in ServerSettings.__post_init__)
        self.provider = TracerProvider(resource=_resource())
        self.provider.add_span_processor(span_processor(settings.otlp_traces_endpoint, settings.otlp_traces_protocol))
        self.tracer = self.provider.get_tracer("tokenmill", __version__)
        self.model = model

    def instrument_http(self, app: FastAPI) -> None:
        # One server span per request; none per ASGI message (a stream would get one per chunk).
        FastAPIInstrumentor.instrument_app(
            app, tracer_provider=self.provider, excluded_urls=EXCLUDED_URLS, exclude_spans=["receive", "send"]
        )

    def grpc_interceptors(self) -> list[Any]:
        return [aio_server_interceptor(tracer_provider=self.provider)]

    @staticmethod
    def current_context() -> Any:
        """The caller's trace context (inside a request: its server span)."""
        return otel_context.get_current()

    def shutdown(self) -> None:
        """Export what is still batched, then stop."""
        self.provider.shutdown()

    def record(
        self, record: RequestRecord, status: str, error: str | None, token_counts: Mapping[int, tuple[int, int]]
    ) -> None:
        """The generation span of a finished request and its stage spans; `token_counts` is
        (prompt tokens, output tokens) per prompt index, as the usage reports them."""
        end = time.time()
        span = self.tracer.start_span(
            f"{OPERATIONS.get(record.endpoint, 'generate')} {self.model}",
            context=record.trace_context,
            start_time=_ns(record.started),
            attributes=self._request_attributes(record, status, token_counts),
        )
        parent = trace.set_span_in_context(span)
        for index, out in sorted(record.last_outputs.items()):
            for name, start, stop, attributes in _stages(out, token_counts.get(index, (0, 0)), end):
                stage = self.tracer.start_span(
                    name, context=parent, start_time=_ns(start), attributes={PROMPT_INDEX: index, **attributes}
                )
                stage.end(end_time=_ns(max(start, stop)))
        # Only the server's own failures are span errors; a client's mistake (invalid, unauthorized,
        # rejected, aborted) leaves the status unset, as OTel's HTTP conventions do for 4xx.
        if status == "error":
            span.set_status(Status(StatusCode.ERROR, error))
        elif error:
            span.set_attribute(ERROR_MESSAGE, error)
        span.end(end_time=_ns(end))

    def _request_attributes(
        self, record: RequestRecord, status: str, token_counts: Mapping[int, tuple[int, int]]
    ) -> dict[str, Any]:
        outputs = list(record.last_outputs.values())
        attributes: dict[str, Any] = {
            gen_ai.GEN_AI_OPERATION_NAME: OPERATIONS.get(record.endpoint, "generate"),
            gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
            gen_ai.GEN_AI_REQUEST_MODEL: self.model,
            gen_ai.GEN_AI_RESPONSE_MODEL: self.model,
            gen_ai.GEN_AI_USAGE_INPUT_TOKENS: sum(p for p, _ in token_counts.values()),
            gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: sum(o for _, o in token_counts.values()),
            gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: sum(o.num_cached_tokens for o in outputs),
            gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: sorted(
                {c.finish_reason for o in outputs for c in o.outputs if c.finish_reason}
            ),
            REQUEST_ID: record.request_id,
            STATUS: status,
        }
        if record.response_id is not None:
            attributes[gen_ai.GEN_AI_RESPONSE_ID] = record.response_id
        if record.stream is not None:
            attributes[gen_ai.GEN_AI_REQUEST_STREAM] = record.stream
        params = record.params
        if params is not None:
            attributes.update(
                {
                    gen_ai.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
                    gen_ai.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
                    gen_ai.GEN_AI_REQUEST_TOP_P: params.top_p,
                    gen_ai.GEN_AI_REQUEST_CHOICE_COUNT: params.n,
                }
            )
            if params.top_k > 0:
                attributes[gen_ai.GEN_AI_REQUEST_TOP_K] = params.top_k
            if params.seed is not None:
                attributes[gen_ai.GEN_AI_REQUEST_SEED] = params.seed
        return attributes


def _stages(out: Any, counts: tuple[int, int], end: float) -> Iterator[tuple[str, float, float, dict[str, Any]]]:
    """(name, start, end, attributes) of each stage one engine request went through."""
    m = out.metrics
    prompt_tokens, output_tokens = counts
    attributes: dict[str, dict[str, Any]] = {
        "prefill": {gen_ai.GEN_AI_USAGE_INPUT_TOKENS: prompt_tokens, PREFIX_CACHE_HIT_TOKENS: out.num_cached_tokens},
        "decode": {gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens},
    }
    if output_tokens > 1 and m.first_token_time is not None and m.finished_time is not None:
        attributes["decode"][TIME_PER_OUTPUT_TOKEN] = (m.finished_time - m.first_token_time) / (output_tokens - 1)
    for name, start_field, end_field in STAGES:
        start = getattr(m, start_field)
        if start is None:  # never reached (aborted in the queue, failed before a token, ...)
            continue
        stop = getattr(m, end_field) if end_field else end
        yield name, start, stop if stop is not None else end, attributes.get(name, {})
