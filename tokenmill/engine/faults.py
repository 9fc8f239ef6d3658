"""Fault injection for reliability tests (off unless TOKENMILL_FAULT_INJECTION=1 at engine start).

With it on, every engine request whose id contains `fault-inject` fails in the model step with
"injected fault", exactly as a real per-request failure would (LLMEngine fails those requests with
finish_reason "error"; the rest of the batch runs on the next step). The server derives engine
request ids from the client's X-Request-Id (`<x-request-id>.<counter>.<prompt index>`), so a client
triggers a fault with e.g. `X-Request-Id: fault-inject-42`. Never enable it in production.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.errors import RequestFailed

logger = logging.getLogger(__name__)

FAULT_ENV = "TOKENMILL_FAULT_INJECTION"
FAULT_MARKER = "fault-inject"
FAULT_MESSAGE = "injected fault"


def enabled(environ: dict[str, str] | None = None) -> bool:
    return (environ if environ is not None else os.environ).get(FAULT_ENV) == "1"


def make_hook(
    previous: Callable[[list[Any]], None] | None = None, marker: str = FAULT_MARKER
) -> Callable[[Sequence[Any]], None]:
    """A `ModelRunner.before_forward` hook failing the marked requests (after any `previous` hook)."""

    def before_forward(seqs: Sequence[Any]) -> None:
        if previous is not None:
            previous(list(seqs))
        marked = {s.request_id for s in seqs if marker in s.request_id}
        if marked:
            raise RequestFailed(marked, FAULT_MESSAGE)

    return before_forward


def install(engine: Any, environ: dict[str, str] | None = None) -> bool:
    """Install the hook on `engine.runner` when the env var asks for it; True if installed."""
    if not enabled(environ):
        return False
    engine.runner.before_forward = make_hook(engine.runner.before_forward)
    logger.warning("fault injection is ON (%s=1): requests whose id contains %r fail", FAULT_ENV, FAULT_MARKER)
    return True
