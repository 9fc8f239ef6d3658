"""The HTTP API: OpenAI-compatible /v1 endpoints, health probes and /metrics on FastAPI."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill import __version__
from tokenmill.engine.protocol import EngineClient
from tokenmill.server import lora_api, openapi, tokenizer_api
from tokenmill.server.anthropic_api import prepare_messages
from tokenmill.server.embeddings import prepare_embedding
from tokenmill.server.errors import APIError, bad_request, error_response
from tokenmill.server.generation import Generation
from tokenmill.server.metrics import CONTENT_TYPE, ServerMetrics
from tokenmill.server.openai_api import Job, prepare_chat, prepare_completion
from tokenmill.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    HealthStatus,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ResponsesRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from tokenmill.server.protocol.anthropic import MessagesRequest
from tokenmill.server.responses_api import delete_response, prepare_responses, stored_response
from tokenmill.server.settings import ServerSettings
from tokenmill.server.state import GENERATION_ENDPOINTS, RequestRecord, ServerState, status_of

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
_LOGGED_PATH_CHARS = 200
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


# ---------------------------------------------------------------------------------------------- plumbing


class RequestIdMiddleware:
    """Gives every request an id (the client's X-Request-Id when it is sane) and echoes it back.

    Pure ASGI rather than BaseHTTPMiddleware: that one buffers through a task and breaks the
    disconnect signal streaming responses rely on.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        # Only ids that are safe to put in logs and headers; anything else gets a fresh one.
        request_id = sent if _REQUEST_ID_OK.match(sent) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always runs `on_close`, even when the client leaves
    before the first byte (a never-started body iterator would otherwise skip its cleanup)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def read_body(request: Request, settings: ServerSettings) -> bytes:
    """The request body, refusing anything over --max-body-bytes (413) without buffering it all, and
    anything that takes longer than --body-timeout to arrive (408: a slow client holds no slot for ever)."""
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body is {declared} bytes; the limit is {limit}.", code="request_too_large")
    body = bytearray()

    async def receive_all() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > limit:
                raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")

    try:
        await asyncio.wait_for(receive_all(), settings.body_timeout)
    except ClientDisconnect:  # the client left mid-body: an abort (499), not a server error with a traceback
        raise ClientDisconnected() from None
    except asyncio.TimeoutError:  # not the builtin on 3.10
        raise APIError(
            408,
            f"The request body did not arrive within {settings.body_timeout:g} s.",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return bytes(body)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client hangs up first (a non-streaming request has no
    other way to notice, and would keep generating for nobody)."""
    task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientDisconnected()


# ---------------------------------------------------------------------------------------------- generation


class _StreamOutcome:
    """How a stream ended, filled in by the body iterator and read by the close callback."""

    def __init__(self) -> None:
        self.status = "aborted"  # unless the iterator gets to the end, the client left
        self.http_status = 499
        self.error: str | None = None


async def _events(job: Job, gen: Generation, outcome: _StreamOutcome) -> AsyncIterator[str]:
    try:
        async for chunk in job.stream_events(gen):
            yield job.sse(chunk)
        outcome.status, outcome.http_status = "ok", 200
    except APIError as err:  # an engine failure after the stream started: report it in-band
        outcome.status, outcome.http_status, outcome.error = status_of(err), err.status, err.message
        yield job.sse_error(err)
    except Exception as exc:
        logger.exception("stream failed")
        outcome.status, outcome.http_status, outcome.error = "error", 500, type(exc).__name__
        yield job.sse_error(APIError(500, "Internal server error", code="internal_error"))
    if job.sse_end:
        yield job.sse_end


async def _serve_generation(
    request: Request, endpoint: str, prepare: Callable[[ServerState, RequestRecord, bytes], Any]
) -> Response:
    """The shared life of a generation request: validate, admit, start, then respond or stream."""
    state: ServerState = request.app.state.server
    record = state.begin(request.state.request_id, endpoint)
    request.state.accounted = True  # the error handlers must not count this request a second time
    gen: Generation | None = None
    streaming = False
    try:
        raw = await read_body(request, state.settings)
        job = prepare(state, record, raw)
        if asyncio.iscoroutine(job):
            job = await job
        record.params, record.response_id, record.stream = job.params, job.response_id, job.stream
        state.admit(record, job.n_seqs)
        gen = Generation(state, record)
        await cancel_on_disconnect(request, gen.start(job.prompts, job.params, job.output_kind))
        if job.stream:
            outcome = _StreamOutcome()
            started = gen

            async def close() -> None:
                await started.aclose()
                state.finish(record, outcome.status, http_status=outcome.http_status, error=outcome.error)

            streaming = True
            return SSEResponse(_events(job, gen, outcome), on_close=close)
        body = await cancel_on_disconnect(request, job.full(gen))
        state.finish(record, "ok")
        return Response(body.model_dump_json(), media_type="application/json")
    except APIError as err:
        state.finish(record, status_of(err), http_status=err.status, error=err.message)
        return error_response(err)
    except ClientDisconnected:
        state.finish(record, "aborted", http_status=499)
        return Response(status_code=499)  # nobody is listening; uvicorn drops it
    except Exception as exc:
        logger.exception("request %s failed", record.request_id)
        state.finish(record, "error", http_status=500, error=type(exc).__name__)
        return error_response(APIError(500, "Internal server error", code="internal_error"))
    finally:
        if gen is not None and not streaming:
            await gen.aclose()


# ---------------------------------------------------------------------------------------------- app


def _require_api_key(request: Request) -> None:
    key = request.app.state.server.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if "authorization" not in request.headers and "x-api-key" in request.headers:  # Anthropic's SDKs send this
        scheme, token = "bearer", request.headers["x-api-key"]
    # compare_digest: the time taken must not reveal how much of the key matched.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(
            401,
            "Invalid or missing API key (send `Authorization: Bearer <key>`).",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def _require_json(request: Request) -> None:
    """Bodies are JSON: another declared media type (text/plain, a form) is a 415, not a guess."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {media_type}.", code="unsupported_media_type")


def build_app(engine: EngineClient, settings: ServerSettings, metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; `app.state.server` is the shared ServerState (also used by gRPC)."""
    metrics = metrics or ServerMetrics(engine, endpoints=GENERATION_ENDPOINTS)
    engine.add_step_listener(metrics.on_step)
    state = ServerState(engine, settings, metrics)
    # The API docs are routes of our own below: with --api-key they need the key like /v1.
    app = FastAPI(
        title="tokenmill",
        summary="OpenAI-compatible LLM inference",
        version=__version__,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = state
    if settings.otlp_traces_endpoint:  # OpenTelemetry is imported only then
        from tokenmill.server.tracing import RequestTracing

        state.tracing = RequestTracing(settings, engine.model_name)
        state.tracing.instrument_http(app)
    app.add_middleware(RequestIdMiddleware)
    if settings.allowed_origins:  # (outermost: it answers browsers' preflight requests itself)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods or ["*"],
            allow_headers=settings.allowed_headers or ["*"],
            allow_credentials=settings.allow_credentials,
        )
    _add_error_handlers(app)

    auth = [Depends(_require_api_key)]
    json_api = [Depends(_require_api_key), Depends(_require_json)]

    @app.post(
        COMPLETIONS,
        dependencies=json_api,
        openapi_extra=openapi.json_body(CompletionRequest),
        responses=openapi.generation_responses(CompletionResponse, CompletionChunk),
    )
    async def completions(request: Request) -> Response:
        return await _serve_generation(request, COMPLETIONS, prepare_completion)

    @app.post(
        CHAT,
        dependencies=json_api,
        openapi_extra=openapi.json_body(ChatCompletionRequest),
        responses=openapi.generation_responses(ChatCompletionResponse, ChatCompletionChunk),
    )
    async def chat_completions(request: Request) -> Response:
        return await _serve_generation(request, CHAT, prepare_chat)

    @app.post(
        EMBEDDINGS,
        dependencies=json_api,
        openapi_extra=openapi.json_body(EmbeddingRequest),
        responses=openapi.json_responses(EmbeddingResponse, "One pooled vector per input"),
    )
    async def embeddings(request: Request) -> Response:
        return await _serve_generation(request, EMBEDDINGS, prepare_embedding)

    @app.post(
        RESPONSES,
        dependencies=json_api,
        openapi_extra=openapi.json_body(ResponsesRequest),
        responses=openapi.described(
            "A Response object; with `stream: true`, server-sent events (`event: response.created` ... "
            "`response.completed`)"
        ),
    )
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API (text, function tools, structured outputs, reasoning items)."""
        return await _serve_generation(request, RESPONSES, prepare_responses)

    @app.get(RESPONSES + "/{response_id}", dependencies=auth, responses=openapi.errors(401, 404))
    async def retrieve_response(response_id: str) -> Response:
        return Response(stored_response(state, response_id), media_type="application/json")

    @app.delete(RESPONSES + "/{response_id}", dependencies=auth, responses=openapi.errors(401, 404))
    async def delete_stored_response(response_id: str) -> JSONResponse:
        return JSONResponse(delete_response(state, response_id))

    @app.post(
        MESSAGES,
        dependencies=json_api,
        openapi_extra=openapi.json_body(MessagesRequest),
        responses=openapi.described(
            "An Anthropic Messages API message; with `stream: true`, server-sent events (`event: message_start` "
            "... `message_stop`)"
        ),
    )
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (text, tools, thinking blocks), for Anthropic-SDK clients."""
        return await _serve_generation(request, MESSAGES, prepare_messages)

    def model_card(adapter: Any = None, name: str | None = None) -> ModelCard:
        if adapter is None:
            return ModelCard(id=name or engine.model_name, created=state.started_at, max_model_len=engine.max_model_len)
        return ModelCard(  # (root is the name, not the adapter's path: server paths stay private)
            id=adapter.name,
            created=state.started_at,
            max_model_len=engine.max_model_len,
            root=adapter.name,
            parent=adapter.base_model_name or engine.model_name,
        )

    @app.get("/v1/models", dependencies=auth, responses=openapi.errors(401))
    async def models() -> ModelList:
        adapters = engine.loras.adapters() if engine.loras is not None else []
        bases = [model_card(name=name) for name in engine.served_model_names]
        return ModelList(data=bases + [model_card(a) for a in adapters])

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=openapi.errors(401, 404))
    async def retrieve_model(model_id: str) -> ModelCard:
        adapter = state.resolve_model(model_id)
        return model_card(adapter, name=model_id if adapter is None else None)

    # Success is vLLM's plain-text line; errors are JSON like everywhere else.
    lora_responses = openapi.text_responses(
        "Success: LoRA adapter '...' added (removed) successfully.", 400, 401, 403, 404, 408, 413, 415
    )

    @app.post(
        "/v1/load_lora_adapter",
        dependencies=json_api,
        response_class=PlainTextResponse,
        openapi_extra=openapi.json_body(LoadLoRAAdapterRequest),
        responses=lora_responses,
    )
    async def load_lora_adapter(request: Request) -> Response:
        return await _serve_text(request, lambda raw: lora_api.load_adapter(state, raw))

    @app.post(
        "/v1/unload_lora_adapter",
        dependencies=json_api,
        response_class=PlainTextResponse,
        openapi_extra=openapi.json_body(UnloadLoRAAdapterRequest),
        responses=lora_responses,
    )
    async def unload_lora_adapter(request: Request) -> Response:
        return await _serve_text(request, lambda raw: lora_api.unload_adapter(state, raw))

    @app.post(
        "/tokenize",
        dependencies=json_api,
        response_model=TokenizeResponse,
        openapi_extra=openapi.json_body(TokenizePromptRequest, TokenizeChatRequest),
        responses=openapi.errors(400, 401, 404, 408, 413, 415),
    )
    async def tokenize(request: Request) -> Response:
        return await _serve_json(request, lambda raw: tokenizer_api.tokenize(state, raw))

    @app.post(
        "/detokenize",
        dependencies=json_api,
        response_model=DetokenizeResponse,
        openapi_extra=openapi.json_body(DetokenizeRequest),
        responses=openapi.errors(400, 401, 404, 408, 413, 415),
    )
    async def detokenize(request: Request) -> Response:
        return await _serve_json(request, lambda raw: tokenizer_api.detokenize(state, raw))

    @app.get("/health/live")
    async def live() -> HealthStatus:
        return HealthStatus(status="ok")

    def readiness() -> JSONResponse:
        if state.ready():
            return JSONResponse({"status": "ready"})
        reason = "draining" if state.draining else "engine not running"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    not_ready: dict[int | str, dict[str, Any]] = {
        503: {"model": HealthStatus, "description": "Draining, or the engine is not running"}
    }

    @app.get("/health/ready", response_model=HealthStatus, responses=not_ready)
    async def ready() -> JSONResponse:
        return readiness()

    @app.get("/health", response_model=HealthStatus, responses=not_ready)
    async def health() -> JSONResponse:
        """vLLM's probe path: 200 when ready to serve, 503 otherwise (the same as /health/ready)."""
        return readiness()

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text exposition format"}},
    )
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # As FastAPI's own routes do: behind a proxy's path prefix (--root-path) the spec names it as its
    # server and the docs pages load the spec under it.
    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    async def openapi_json(request: Request) -> JSONResponse:
        spec = app.openapi()
        root = _root_path(request)
        if root and not any(server.get("url") == root for server in spec.get("servers", [])):
            spec = {**spec, "servers": [{"url": root}, *spec.get("servers", [])]}
        return JSONResponse(spec)

    @app.get("/docs", dependencies=auth, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=f"{_root_path(request)}/openapi.json", title=f"{app.title} - Swagger UI")

    @app.get("/redoc", dependencies=auth, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=f"{_root_path(request)}/openapi.json", title=f"{app.title} - ReDoc")

    openapi.install(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            EmbeddingRequest,
            ResponsesRequest,
            MessagesRequest,
            TokenizePromptRequest,
            TokenizeChatRequest,
            DetokenizeRequest,
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        ],
        [CompletionChunk, ChatCompletionChunk],
    )
    return app


async def _serve_json(request: Request, handle: Callable[[bytes], Awaitable[BaseModel]]) -> Response:
    """A small JSON endpoint that reads its own body (same limits and errors as generation)."""
    try:
        raw = await read_body(request, request.app.state.server.settings)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; uvicorn drops it
    return Response((await handle(raw)).model_dump_json(), media_type="application/json")


async def _serve_text(request: Request, handle: Callable[[bytes], Awaitable[str]]) -> Response:
    """A small endpoint answering plain text (vLLM's LoRA endpoints), with generation's body limits."""
    try:
        raw = await read_body(request, request.app.state.server.settings)
    except ClientDisconnected:
        return Response(status_code=499)
    return PlainTextResponse(await handle(raw))


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, including FastAPI's own (404 route, 405, validation), in the OpenAI shape."""

    def count(request: Request, err: APIError) -> None:
        # Rejections before the handler ran (401 from the auth dependency) still count as requests.
        if request.url.path in (COMPLETIONS, CHAT, EMBEDDINGS, RESPONSES, MESSAGES) and not getattr(
            request.state, "accounted", False
        ):
            state: ServerState = request.app.state.server
            record = state.begin(getattr(request.state, "request_id", "-"), request.url.path)
            state.finish(record, status_of(err), http_status=err.status, error=err.message)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        count(request, err)
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        err = bad_request(f"Invalid request: {first.get('msg', 'validation failed')}", param=param)
        count(request, err)
        return error_response(err)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug: logged with its traceback once, answered in the OpenAI shape like everything else.
        logger.error("request %s failed", getattr(request.state, "request_id", "-"), exc_info=exc)
        return error_response(APIError(500, "Internal server error", code="internal_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "Request failed"
        if exc.status_code == 404:
            message = f"Unknown path {request.url.path}"
            # Clients probing for endpoints tokenmill lacks show up in the log (bounded: paths are client data).
            logger.info(
                "request to an unknown path",
                extra={"method": request.method[:16], "path": request.url.path[:_LOGGED_PATH_CHARS]},
            )
        err = APIError(exc.status_code, message, headers=getattr(exc, "headers", None))
        return error_response(err)


def _root_path(request: Request) -> str:
    """The path prefix a reverse proxy serves the app under (ASGI root_path), without a trailing /."""
    return str(request.scope.get("root_path", "")).rstrip("/")
