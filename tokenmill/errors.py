"""Typed errors: bad input (raised by the input processor and SamplingParams), and failed requests.

Each front end maps them to its own answer (HTTP 400 in OpenAI's shape, gRPC INVALID_ARGUMENT, a
one-line CLI message) from their type, `param` and `code`, never from the message text. They are
ValueErrors, so code that only knows "bad input" still catches them.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """Input the caller must fix. `param` names the offending request field (OpenAI's `param`),
    `code` is a machine-readable reason (OpenAI's `code`), both optional."""

    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or the prompt plus max_tokens, does not fit the model's context."""

    code = "context_length_exceeded"


class RequestFailed(Exception):
    """Raised inside a model step (e.g. by the fault-injection hook) to fail specific requests while
    the rest of the batch goes on."""

    def __init__(self, request_ids: set[str], message: str) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message is one line naming the file."""
