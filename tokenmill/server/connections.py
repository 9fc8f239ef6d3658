"""HTTP connection limits that uvicorn lacks: a deadline for every request head and a cap on open
connections, so slow or idle clients (slowloris) cannot hold sockets open for ever.

uvicorn arms no timer on a fresh connection, nor while a request head trickles in (its keep-alive
timer only covers the idle time after a response, and the first byte cancels it). This subclass of
its httptools protocol adds one: a request's head must be complete within `header_timeout` seconds
of the connection opening, or of the previous response ending; otherwise the connection is closed.
The body deadline is the app's (`read_body`): it answers 408 in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

_SUMMARY_INTERVAL_S = 10.0  # under attack, one log line per interval rather than one per connection


class _ClosedCount:
    """Connections closed by a limit, logged as one WARNING per interval with the counts."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._last_log = 0.0

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._last_log >= _SUMMARY_INTERVAL_S:
            self._last_log = now
            logger.warning("closed slow or excess HTTP connections", extra={"closed": dict(self.counts)})
            self.counts.clear()


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a request-head deadline and a connection cap."""

    header_timeout: float = 10.0
    max_connections: int = 1024
    closed = _ClosedCount()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self.closed.add("max_connections")
            transport.close()
            return
        self._arm_head_deadline()

    def on_headers_complete(self) -> None:
        self._cancel_head_deadline()  # the request now belongs to the app (body deadline: read_body)
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's head gets its own deadline, unless it is already in (pipelined).
        if not self.pipeline and not self.transport.is_closing():
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.closed.add("header_timeout")
            self.transport.close()


def limited_http_protocol(header_timeout: float, max_connections: int) -> type[LimitedHttpProtocol]:
    """A protocol class for uvicorn.Config(http=...) with these limits."""
    return type(
        "LimitedHttpProtocol",
        (LimitedHttpProtocol,),
        {"header_timeout": header_timeout, "max_connections": max_connections, "closed": _ClosedCount()},
    )
