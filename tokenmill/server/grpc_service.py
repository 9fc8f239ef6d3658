"""gRPC API (tokenmill.v1.Generation) on grpc.aio, sharing the HTTP server's loop, engine and state,
plus the standard health service (grpc.health.v1) and server reflection."""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tokenmill.engine.outputs import RequestOutputKind
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.errors import InvalidRequest
from tokenmill.server.errors import APIError, bad_request, from_invalid_request
from tokenmill.server.generation import Generation, raise_on_failure
from tokenmill.server.proto import tokenmill_pb2 as pb
from tokenmill.server.state import GRPC_GENERATE, GRPC_GENERATE_STREAM, RequestRecord, ServerState, status_of

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # tokenmill.v1.Generation
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class GenerationService:
    """The two RPCs. Requests arrive as raw bytes and are decoded here, after the API-key check: a
    malformed message is then the client's INVALID_ARGUMENT (not grpc's UNKNOWN with a traceback),
    and an unauthenticated client learns nothing about what it sent."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        record = self._record(context, GRPC_GENERATE)
        gen: Generation | None = None
        try:
            gen = await self._start(raw, context, record, stream=False)
            final: Any = None
            async for _, out in gen.outputs():
                raise_on_failure(out)
                final = out
            choice = final.outputs[0]
            self.state.finish(record, "ok")
            return pb.GenerateResponse(
                request_id=record.request_id,
                text=choice.text,
                token_ids=choice.token_ids,
                finish_reason=choice.finish_reason or "",
                usage=_usage(final),
            )
        except APIError as err:
            await self._fail(record, context, err)
            raise  # unreachable: abort() raises
        except asyncio.CancelledError:  # the client cancelled or went away
            self.state.finish(record, "aborted", http_status=499)
            raise
        finally:
            if gen is not None:
                await gen.aclose()

    async def GenerateStream(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        record = self._record(context, GRPC_GENERATE_STREAM)
        gen: Generation | None = None
        try:
            gen = await self._start(raw, context, record, stream=True)
            async for _, out in gen.outputs():
                raise_on_failure(out)
                choice = out.outputs[0]
                if not (choice.text_delta or choice.token_ids_delta or choice.finish_reason):
                    continue
                yield pb.GenerateChunk(
                    request_id=record.request_id,
                    text=choice.text_delta,
                    token_ids=choice.token_ids_delta,
                    finish_reason=choice.finish_reason or "",
                    usage=_usage(out) if out.finished else None,
                )
            self.state.finish(record, "ok")
        except APIError as err:
            await self._fail(record, context, err)
        except (asyncio.CancelledError, GeneratorExit):
            self.state.finish(record, "aborted", http_status=499)
            raise
        finally:
            if gen is not None:
                await gen.aclose()

    # ------------------------------------------------------------------------------------------ helpers

    def _record(self, context: grpc.aio.ServicerContext, endpoint: str) -> RequestRecord:
        sent = _metadata(context).get("x-request-id", "")
        return self.state.begin(sent if _REQUEST_ID_OK.match(sent) else uuid.uuid4().hex, endpoint)

    async def _fail(self, record: RequestRecord, context: grpc.aio.ServicerContext, err: APIError) -> None:
        self.state.finish(record, status_of(err), http_status=err.status, error=err.message)
        await context.abort(
            _STATUS_CODES.get(err.status, grpc.StatusCode.INTERNAL),
            err.message,
            trailing_metadata=(("x-request-id", record.request_id),),
        )

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        key = self.state.settings.api_key
        if key is None:
            return
        scheme, _, token = _metadata(context).get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Invalid or missing API key (metadata `authorization: Bearer <key>`).")

    async def _start(
        self, raw: bytes, context: grpc.aio.ServicerContext, record: RequestRecord, stream: bool
    ) -> Generation:
        """Authorize, decode, validate and admit, then submit: the same order as the HTTP endpoints."""
        self._authorize(context)
        request = _decode(raw, record)
        if _REQUEST_ID_OK.match(request.request_id):
            record.request_id = request.request_id
        await context.send_initial_metadata((("x-request-id", record.request_id),))
        escape = self.state.settings.escape_special_tokens_in_prompts
        adapter = self.state.resolve_model(request.model or None)  # NOT_FOUND for an unknown name
        try:
            params = _sampling_params(request, self.state.engine.generation_defaults)
            prompt = await asyncio.to_thread(
                self.state.engine.input_processor.process,
                _prompt_of(request),
                params,
                escape_special=escape,
                lora=adapter,
            )
        except InvalidRequest as exc:
            raise from_invalid_request(exc) from None
        if self.state.settings.log_prompts:
            record.prompt_text = repr(prompt.prompt if prompt.prompt is not None else prompt.prompt_token_ids)
        record.params, record.response_id = params, record.request_id
        record.stream = record.endpoint == GRPC_GENERATE_STREAM
        self.state.admit(record, params.n)
        gen = Generation(self.state, record)
        await gen.start([prompt], params, RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
        return gen


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def _decode(raw: bytes, record: RequestRecord) -> pb.GenerateRequest:
    try:
        return pb.GenerateRequest.FromString(raw)
    except DecodeError as exc:
        logger.warning(
            "malformed gRPC message on %s (%d bytes): %s",
            record.endpoint,
            len(raw),
            exc,
            extra={"request_id": record.request_id},
        )
        raise bad_request(f"Malformed request message: {exc}") from None


def _prompt_of(request: pb.GenerateRequest) -> str | list[int]:
    if request.prompt and request.prompt_token_ids:
        raise InvalidRequest("set either prompt or prompt_token_ids, not both", param="prompt")
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    if not request.prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    return request.prompt


def _sampling_params(request: pb.GenerateRequest, defaults: dict[str, Any]) -> SamplingParams:
    """The request's settings; the model's generation defaults (--generation-config) for those unset."""
    values: dict[str, Any] = {"max_tokens": 16, **defaults}
    values.update(stop=list(request.stop), ignore_eos=request.ignore_eos)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if request.HasField(name):
            values[name] = getattr(request, name)
    return SamplingParams.from_dict(values)


def _usage(out: Any) -> pb.Usage:
    prompt, completion = len(out.prompt_token_ids), sum(o.num_tokens for o in out.outputs)
    return pb.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _add_generation_service(server: grpc.aio.Server, service: GenerationService) -> None:
    """Like the generated add_GenerationServicer_to_server, but with no request deserializer (see
    GenerationService)."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            service.Generate, response_serializer=pb.GenerateResponse.SerializeToString
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            service.GenerateStream, response_serializer=pb.GenerateChunk.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class GrpcServer:
    """The running gRPC server and its health service: SERVING ("" and the Generation service) from
    start until drain(), then NOT_SERVING for good, so gRPC probes and load balancers stop routing here
    exactly when /health/ready turns 503."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer) -> None:
        self.server = server
        self.health = health_servicer

    async def drain(self) -> None:
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace=grace)


async def start_grpc_server(
    state: ServerState, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> GrpcServer:
    """Bind and start the gRPC server on the running loop (over TLS with `credentials`); raises
    RuntimeError if the port is taken."""
    limit = state.settings.max_body_bytes
    interceptors = state.tracing.grpc_interceptors() if state.tracing is not None else None
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)], interceptors=interceptors
    )
    _add_generation_service(server, GenerationService(state))
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), server)
    if credentials is None:
        server.add_insecure_port(f"{host}:{port}")
    else:
        server.add_secure_port(f"{host}:{port}", credentials)
    await server.start()
    return GrpcServer(server, health_servicer)
