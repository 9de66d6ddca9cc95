"""Connection limits against slow or hostile clients: the settings, and the h11 protocol that
enforces what uvicorn itself does not (a deadline for the request head)."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("quill.server")


@dataclass(frozen=True)
class HTTPLimits:
    """Per-connection bounds; each maps to one `quill serve` flag.

    timeout_keep_alive  idle seconds between requests on a kept-alive connection (uvicorn)
    header_timeout      seconds from a connection's first byte (or its opening) to a complete
                        request line and headers; an idle new connection is closed after it
    body_timeout        seconds for the whole request body once the headers are in (408 after)
    max_header_bytes    request line + headers, in bytes (431 beyond; h11's incomplete-event cap)
    max_headers         number of header lines (431 beyond)
    limit_concurrency   open connections + running requests before uvicorn answers 503
    """

    timeout_keep_alive: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    limit_concurrency: int | None = 1000

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name in ("max_header_bytes", "max_headers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency!r}")


def head_size(scope) -> int:
    """Bytes of the request line and headers as the client sent them (near enough: CRLFs and ': ')."""
    line = len(scope.get("method", "")) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 12
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))


def h11_protocol(limits: HTTPLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with `limits` bound: uvicorn.Config(http=h11_protocol(limits))."""

    class QuillH11Protocol(_HeadDeadlineProtocol):
        header_timeout = limits.header_timeout
        max_header_bytes = limits.max_header_bytes

    return QuillH11Protocol


class _HeadDeadlineProtocol(H11Protocol):
    """H11Protocol plus a deadline for each request head.

    uvicorn arms its keep-alive timer only after a response; a connection that never sends a
    byte, or sends half a request line, is otherwise held forever. The deadline starts when
    the connection opens and again when the first byte of each later request arrives, and
    ends when h11 has the full head; if it passes first, the client gets a 408 (or, if it
    sent nothing, a plain close).
    """

    header_timeout: float = 10.0
    max_header_bytes: int = 64 * 1024

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiting_for_head = self.conn.their_state is h11.IDLE
        if waiting_for_head:
            self._head_bytes += len(data)
            if self._head_timer is None:
                self._arm_head_timer()
        super().data_received(data)
        if waiting_for_head and self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()
            self._head_bytes = 0

    def on_response_complete(self) -> None:
        self._head_bytes = 0
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        # h11 refuses a head still incomplete past max_incomplete_event_size; say which limit.
        if self._head_bytes > self.max_header_bytes:
            message = f"request line and headers exceed the limit of {self.max_header_bytes:,} bytes (--max-header-bytes)"
            self._reply_and_close(431, message, "request_header_fields_too_large")
        else:
            self._reply_and_close(400, f"malformed HTTP request: {msg}", "invalid_http_request")

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_bytes == 0:
            self.transport.close()  # nothing asked, nothing to answer
            return
        message = f"the request line and headers did not arrive within {self.header_timeout:g} s (--header-timeout)"
        logger.info("closing %s: %s", _peer(self.client), message)
        self._reply_and_close(408, message, "request_timeout")

    def _reply_and_close(self, status: int, message: str, code: str) -> None:
        """Answer outside h11's state machine (there is no request to answer yet) and close."""
        from quill.server.errors import error_body

        body = json.dumps(error_body(status, message, None, code)).encode()
        reason = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
        head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        if not self.transport.is_closing():
            self.transport.write(head + body)
            self.transport.close()
        self._cancel_head_timer()


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "client"
