"""How a request's failure answers over HTTP: OpenAI's error shape, and the one table from a failed
Result's ErrorKind (serving.messages) to its status."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from serving.messages import ErrorKind

RETRY_AFTER_S = 1  # what a 503 (overload, no live worker, stopping) or 429 tells the client to wait


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,
        code: str | None = None,
    ):
        """kind: OpenAI's error type (from the status by default); code: the body's `code` (a failed
        request's ErrorKind, so a client tells a lost worker from a refusal; else from the status)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or (
            "authentication_error"
            if status == 401
            else "invalid_request_error"
            if 400 <= status < 500
            else "service_unavailable"
            if status == 503
            else "server_error"
        )

    def body(self) -> dict:
        codes = {401: "invalid_api_key", 429: "rate_limit_exceeded", 503: "service_unavailable"}
        code = self.code or codes.get(self.status)
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# How each way a request fails answers over HTTP: (status, OpenAI's error type, what the message says)
STATUS: dict[ErrorKind, tuple[int, str, str]] = {
    ErrorKind.BAD_REQUEST: (400, "invalid_request_error", "the request was refused"),
    ErrorKind.REJECTED: (503, "service_unavailable", "the request was refused"),
    ErrorKind.CANCELLED: (
        503,
        "service_unavailable",
        "the request was cancelled before it finished (the server is stopping)",
    ),
    ErrorKind.WORKER_LOST: (503, "service_unavailable", "the request failed"),
    ErrorKind.DEADLINE: (504, "timeout", "the request did not finish in time"),
    ErrorKind.INTERNAL: (500, "server_error", "the request failed"),
}
