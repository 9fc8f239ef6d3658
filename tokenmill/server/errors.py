"""OpenAI-shaped errors: every failure a client sees is `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from tokenmill.errors import InvalidRequest

# OpenAI's `type` values by status; clients (and the official SDK) key their exception classes off the status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised anywhere in request handling; turned into the OpenAI error body by the app's handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_invalid_request(exc: InvalidRequest, param: str | None = None) -> APIError:
    """The engine's typed input error as a 400, with its param (or the request field it is about)
    and code."""
    return APIError(400, exc.message, param=param or exc.param, code=exc.code)
