"""Errors a request can meet before it runs; the server maps them to HTTP statuses."""

from __future__ import annotations


class AdmissionError(ValueError):
    """A request that can never run, or is refused now; names the limit and the value."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


class RequestFailed(RuntimeError):
    """One request failed inside the engine (its own sampling, grammar, detokenizing or stop
    check raised); the others in its batch carried on. Maps to HTTP 500 / an SSE error event."""

    status = 500

    def __init__(self, message: str, *, phase: str | None = None, code: str = "request_failed"):
        super().__init__(message)
        self.phase = phase
        self.code = code
        self.param = None
