"""Server-wide request bookkeeping shared by HTTP and gRPC: admission (back-pressure), draining,
per-request records, and the one place where a finished request is counted and logged."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.protocol import EngineClient
from tokenmill.server.errors import APIError
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.settings import ServerSettings
from tokenmill.server.tools.plan import resolve_auto_parser

request_log = logging.getLogger("tokenmill.server.requests")

# The `endpoint` label values of tokenmill_requests_total (fixed set: bounded metric cardinality).
GRPC_GENERATE = "/tokenmill.v1.Generation/Generate"
GRPC_GENERATE_STREAM = "/tokenmill.v1.Generation/GenerateStream"
GENERATION_ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    GRPC_GENERATE,
    GRPC_GENERATE_STREAM,
)


@dataclass
class RequestRecord:
    """Everything we know about one API request, from arrival to its single log line."""

    request_id: str  # what the client sees (X-Request-Id)
    endpoint: str
    started: float = field(default_factory=time.time)
    admitted_seqs: int = 0  # sequences counted against capacity; 0 until admitted
    # Latest engine output per prompt index: token counts and stage timestamps are read from it at the end.
    last_outputs: dict[int, Any] = field(default_factory=dict)
    prompt_text: str | None = None  # only kept with --log-prompts
    done: bool = False
    # What traces report of the request (set once it is validated) and, with tracing on, the trace
    # context it arrived in (its server span).
    params: Any = None  # SamplingParams
    response_id: str | None = None
    stream: bool | None = None
    trace_context: Any = None


def status_of(err: APIError) -> str:
    """Metric status of a failed request. Only the server's own failures are `error` (what alerts
    page on); a client cannot raise that count by sending bad input or a wrong key."""
    if err.status in (401, 403):
        return "unauthorized"
    if err.status in (429, 503):  # capacity or availability: the client may retry elsewhere
        return "rejected"
    return "invalid" if err.status < 500 else "error"


class ServerState:
    def __init__(self, engine: EngineClient, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.draining = False
        self.active_requests = 0
        self.active_seqs = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._engine_ids = itertools.count()
        self.started_at = int(time.time())
        # The parser that reads tool_choice "auto" outputs (None: they stay text).
        self.tool_parser = resolve_auto_parser(settings.tool_call_parser, engine.tokenizer)
        if settings.enable_auto_tool_choice and self.tool_parser is None:
            logging.getLogger(__name__).warning(
                '--enable-auto-tool-choice: no tool-call parser, so tool_choice "auto" answers in plain text '
                "(set --tool-call-parser)"
            )
        self.tracing: Any = None  # a tracing.RequestTracing with --otlp-traces-endpoint
        self.responses = ResponseStore(settings.responses_store_memory)  # /v1/responses with store=true

    # ------------------------------------------------------------------ health / admission

    def ready(self) -> bool:
        return not self.draining and self.engine.is_alive()

    def resolve_model(self, model: str | None) -> Any:
        """The LoRA adapter a request's `model` names (None: the base model, also when `model` is
        unset); 404 in OpenAI's shape for a name this server does not serve."""
        if model is None or model in self.engine.served_model_names:
            return None
        loras = self.engine.loras
        adapter = loras.get(model) if loras is not None else None
        if adapter is None:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {self._served_names()}.",
                code="model_not_found",
                param="model",
            )
        return adapter

    def check_model(self, model: str | None) -> None:
        self.resolve_model(model)

    def model_name(self, adapter: Any) -> str:
        """The name responses report: the adapter's, or the base model's."""
        return self.engine.model_name if adapter is None else adapter.name

    def _served_names(self) -> str:
        base = ", ".join(f"`{name}`" for name in self.engine.served_model_names)
        adapters = [a.name for a in self.engine.loras.adapters()] if self.engine.loras is not None else []
        if not adapters:
            return base
        listed = ", ".join(f"`{name}`" for name in adapters[:10]) + (", ..." if len(adapters) > 10 else "")
        return f"{base} and its LoRA adapters {listed}"

    def admit(self, record: RequestRecord, n_seqs: int) -> None:
        """Count the request against capacity, or refuse it now (cheap 429/503 beats a slow timeout)."""
        if self.draining:
            raise APIError(503, "The server is shutting down; retry on another replica.", code="draining")
        if not self.engine.is_alive():
            raise APIError(503, "The inference engine is not running.", code="engine_unavailable")
        most = self.settings.max_num_seqs + self.settings.max_queue
        if n_seqs > most:  # a 429 would be retried for ever
            raise APIError(
                400,
                f"This request needs {n_seqs} sequences (prompts times n); this server runs "
                f"{self.settings.max_num_seqs} at once and queues {self.settings.max_queue} more, so it "
                f"could never be admitted: send at most {most}.",
                code="too_many_sequences",
                param="n",
            )
        engine_waiting = int(self.engine.stats().num_waiting)
        would_wait = max(0, self.active_seqs + n_seqs - self.settings.max_num_seqs)
        if would_wait > self.settings.max_queue or 0 < engine_waiting >= self.settings.max_queue:
            raise APIError(
                429,
                f"Too many requests waiting (limit {self.settings.max_queue}); retry later.",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        record.admitted_seqs = n_seqs
        self.active_requests += 1
        self.active_seqs += n_seqs
        self._idle.clear()

    def engine_request_id(self, record: RequestRecord, index: int) -> str:
        # Client-sent X-Request-Ids need not be unique, engine ids must be: add a process-wide counter.
        return f"{record.request_id}.{next(self._engine_ids)}.{index}"

    async def wait_idle(self, timeout: float) -> bool:
        """True when every admitted request has finished within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:  # not the builtin on 3.10
            return False

    # ------------------------------------------------------------------ per-request accounting

    def begin(self, request_id: str, endpoint: str) -> RequestRecord:
        record = RequestRecord(request_id=request_id, endpoint=endpoint)
        if self.tracing is not None:
            record.trace_context = self.tracing.current_context()
        return record

    def on_output(self, record: RequestRecord, prompt_index: int, out: Any) -> None:
        record.last_outputs[prompt_index] = out
        self.metrics.on_tokens(sum(len(o.token_ids_delta) for o in out.outputs))

    def finish(self, record: RequestRecord, status: str, *, http_status: int = 200, error: str | None = None) -> None:
        """Release capacity, update metrics and write the request's log line; idempotent."""
        if record.done:
            return
        record.done = True
        if record.admitted_seqs:
            self.active_requests -= 1
            self.active_seqs -= record.admitted_seqs
            if self.active_requests == 0:
                self._idle.set()
        self.metrics.on_request_done(record.endpoint, status)
        token_counts: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt tokens, output tokens)
        for index, out in record.last_outputs.items():
            p = len(out.prompt_token_ids)
            lengths = [o.num_tokens for o in out.outputs]
            self.metrics.on_engine_request_done(out.metrics, p, sum(lengths), max(lengths, default=0))
            token_counts[index] = (p, sum(lengths))
        prompt_tokens = sum(p for p, _ in token_counts.values())
        completion_tokens = sum(c for _, c in token_counts.values())
        self._log(record, status, http_status, error, prompt_tokens, completion_tokens)
        if self.tracing is not None:
            self.tracing.record(record, status, error, token_counts)

    def _log(
        self,
        record: RequestRecord,
        status: str,
        http_status: int,
        error: str | None,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        now = time.time()
        fields: dict[str, Any] = {
            "request_id": record.request_id,
            "endpoint": record.endpoint,
            "status": status,
            "http_status": http_status,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_s": round(now - record.started, 6),
        }
        fields.update(_stage_timings(list(record.last_outputs.values()), now))
        reasons = sorted(
            {o.finish_reason for out in record.last_outputs.values() for o in out.outputs if o.finish_reason}
        )
        if reasons:
            fields["finish_reason"] = ",".join(reasons)
        cached = sum(getattr(out, "num_cached_tokens", 0) for out in record.last_outputs.values())
        if cached:
            fields["cached_tokens"] = cached
        if error:
            fields["error"] = error
        if record.prompt_text is not None:
            fields["prompt"] = record.prompt_text
        level = logging.ERROR if http_status >= 500 else logging.INFO
        if level < logging.ERROR and self.settings.disable_log_requests:
            return
        request_log.log(level, "request finished", extra=fields)


def _stage_timings(outputs: list[Any], now: float) -> dict[str, float]:
    """queue (arrival->scheduled), prefill (scheduled->first token), ttft, decode (first->last token);
    the slowest prompt of a batch for each stage."""
    stages: dict[str, float] = {}

    def put(name: str, value: float | None) -> None:
        if value is not None:
            stages[name] = round(max(stages.get(name, 0.0), max(0.0, value)), 6)

    for out in outputs:
        m = out.metrics
        if m is None:
            continue
        put("queue_s", m.queue_time)
        put("ttft_s", m.ttft)
        if m.first_token_time is not None and m.first_scheduled_time is not None:
            put("prefill_s", m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            put("decode_s", (m.finished_time or now) - m.first_token_time)
    return stages
