"""Process lifecycle: run HTTP (uvicorn) and gRPC on one event loop, drain on SIGTERM, then exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import prometheus_client
import uvicorn

from tokenmill.engine.protocol import EngineClient
from tokenmill.server.app import build_app
from tokenmill.server.connections import limited_http_protocol
from tokenmill.server.settings import ServerSettings
from tokenmill.server.state import ServerState

if TYPE_CHECKING:
    from tokenmill.server.grpc_service import GrpcServer

logger = logging.getLogger(__name__)

_ENGINE_WATCH_INTERVAL_S = 1.0


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server without its own signal handling: SIGTERM must start a drain, not an exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Lifecycle:
    """Owns the servers and the shutdown sequence: drain -> stop HTTP/gRPC -> stop the engine."""

    def __init__(self, state: ServerState, http: _Uvicorn, grpc_server: GrpcServer | None) -> None:
        self.state = state
        self.http = http
        self.grpc = grpc_server
        self.exit_code = 0
        self._drain_task: asyncio.Task[None] | None = None

    def on_signal(self, sig: signal.Signals) -> None:
        if self._drain_task is None:
            logger.info("received %s: draining (up to %gs)", sig.name, self.state.settings.drain_timeout)
            self._drain_task = asyncio.get_running_loop().create_task(self.drain())
        else:  # a second signal: the operator wants out now
            logger.warning("received %s again: stopping without waiting", sig.name)
            self.http.force_exit = True
            self.http.should_exit = True

    async def stop_accepting(self) -> None:
        """Readiness turns 503 and gRPC health NOT_SERVING, so load balancers stop routing here."""
        self.state.draining = True
        if self.grpc is not None:
            await self.grpc.drain()

    async def drain(self) -> None:
        # In-flight requests finish; new ones get 503.
        await self.stop_accepting()
        if not await self.state.wait_idle(self.state.settings.drain_timeout):
            logger.warning("drain timeout: %d request(s) still running are cut off", self.state.active_requests)
        self.http.should_exit = True

    async def watch_engine(self) -> None:
        """A dead engine never recovers in-process: exit non-zero so the supervisor restarts us."""
        while not self.http.should_exit:
            await asyncio.sleep(_ENGINE_WATCH_INTERVAL_S)
            if not self.state.engine.is_alive() and not self.state.draining:
                logger.error("the engine loop died; shutting down")
                self.exit_code = 1
                await self.stop_accepting()
                self.http.should_exit = True


def grpc_tls(settings: ServerSettings) -> Any:
    """gRPC's server credentials from --ssl-certfile/--ssl-keyfile (client certificates as --ssl-cert-reqs
    asks, against --ssl-ca-certs); None: plaintext."""
    if not settings.tls:
        return None
    import grpc

    assert settings.ssl_certfile is not None and settings.ssl_keyfile is not None
    pair = (Path(settings.ssl_keyfile).read_bytes(), Path(settings.ssl_certfile).read_bytes())
    roots = Path(settings.ssl_ca_certs).read_bytes() if settings.ssl_ca_certs and settings.ssl_cert_reqs else None
    return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=settings.ssl_cert_reqs == 2)


async def serve(engine: EngineClient, settings: ServerSettings) -> int:
    """Serve until SIGTERM/SIGINT (after draining) or engine death; returns the process exit code."""
    # `_created` series double the exposition and no dashboard reads them (process-wide switch,
    # which is why it is flipped here, in the server process, and not in ServerMetrics).
    prometheus_client.disable_created_metrics()
    app = build_app(engine, settings)
    state: ServerState = app.state.server
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        http=limited_http_protocol(settings.header_timeout, settings.max_connections),
        # After the drain, anything still open gets this long before uvicorn cancels it.
        timeout_graceful_shutdown=5,
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]  # (declared int; any seconds work)
        lifespan="off",
        log_level=settings.uvicorn_log_level,
        root_path=settings.root_path or "",
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_ca_certs=settings.ssl_ca_certs,
        ssl_cert_reqs=settings.ssl_cert_reqs,
    )
    http = _Uvicorn(config)
    grpc_server = None
    if settings.grpc_port:
        from tokenmill.server.grpc_service import start_grpc_server  # grpc is only imported when served

        try:
            grpc_server = await start_grpc_server(state, settings.host, settings.grpc_port, grpc_tls(settings))
        except RuntimeError as exc:
            logger.error("cannot serve gRPC on %s:%d: %s", settings.host, settings.grpc_port, exc)
            engine.shutdown()
            return 1
        logger.info("gRPC listening on %s:%d%s", settings.host, settings.grpc_port, " (TLS)" if settings.tls else "")

    life = Lifecycle(state, http, grpc_server)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, life.on_signal, sig)
    watcher = loop.create_task(life.watch_engine())
    try:
        await http.serve()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        logger.error("HTTP server failed to start on %s:%d", settings.host, settings.port)
        life.exit_code = int(exc.code or 1)
    finally:
        watcher.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)
        await asyncio.to_thread(engine.shutdown)
        if state.tracing is not None:
            state.tracing.shutdown()  # export the spans still batched
    if not http.started and life.exit_code == 0:
        life.exit_code = 1
    logger.info("server stopped", extra={"exit_code": life.exit_code})
    return life.exit_code
