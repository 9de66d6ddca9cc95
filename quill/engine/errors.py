"""Errors a request can meet before it runs; the server maps them to HTTP statuses."""

from __future__ import annotations


class AdmissionError(ValueError):
    """A request that can never run, or is refused now; names the limit and the value."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
