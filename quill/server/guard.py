"""ASGI middleware in front of the routes: header limits (431), API key (401), request body
size (413) and the time the body may take to arrive (408)."""

from __future__ import annotations

import asyncio
import hmac

from quill.server.errors import APIError, error_response
from quill.server.limits import head_size

_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_BODY_METHODS = {"POST", "PUT", "PATCH"}


class GuardMiddleware:
    """Checks the headers and the key before anything else and buffers the body up to the limit.

    The body is read here, in full, so that a body over the limit is refused even without a
    Content-Length header; the app then gets the buffered body followed by the client's own
    receive channel, so that it still sees http.disconnect when the client leaves.
    """

    def __init__(self, app, state):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = self.state
        too_big = _header_problem(scope, state.limits)
        if too_big is not None:
            return await self._refuse(scope, receive, send, too_big, body_pending=False)
        if state.api_key and scope["path"].startswith(_PROTECTED_PREFIXES) and not _authorized(scope, state.api_key):
            message = "invalid or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            return await self._refuse(scope, receive, send, APIError(401, message, code="invalid_api_key"))
        if scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        limit = state.max_body_bytes
        declared = declared_length_problem(_header(scope, b"content-length"), limit)
        if declared is not None:
            return await self._refuse(scope, receive, send, declared)
        timeout = state.limits.body_timeout
        try:
            async with asyncio.timeout(timeout):
                body, size, pending = await read_body(receive, limit)
        except TimeoutError:
            message = f"the request body did not arrive within {timeout:g} s (--body-timeout)"
            err = APIError(408, message, code="request_timeout", headers={"Connection": "close"})
            return await self._refuse(scope, receive, send, err, body_pending=False)
        if body is None and size > limit:
            return await self._refuse(scope, receive, send, body_over_limit(size, limit), body_pending=pending)
        if body is None:  # the client left
            return None
        return await self.app(_as_json(scope), _replay(body, receive), send)

    async def _refuse(self, scope, receive, send, err: APIError, body_pending: bool = True):
        self.state.metrics.count_error(err.status, err.code)
        if body_pending:
            # Read (and drop) what the client is still sending: closing a socket with unread
            # data resets it, and the client would see a connection error instead of the answer.
            # A client too slow for --body-timeout gets the answer and a closed connection.
            try:
                async with asyncio.timeout(self.state.limits.body_timeout):
                    await _discard_body(receive, _DISCARD_LIMIT)
            except TimeoutError:
                err.headers["Connection"] = "close"
        await error_response(err, scope["path"])(scope, receive, send)


_DISCARD_LIMIT = 64 * 1024 * 1024


async def read_body(receive, limit: int) -> tuple[bytes | None, int, bool]:
    """(body, bytes seen, more pending); body is None when the client left or it passed `limit`."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, size, False
        chunk = message.get("body", b"")
        size += len(chunk)
        more = message.get("more_body", False)
        if size > limit:
            return None, size, more
        chunks.append(chunk)
        if not more:
            return b"".join(chunks), size, False


async def _discard_body(receive, limit: int) -> None:
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


def _header_problem(scope, limits) -> APIError | None:
    """A 431 (with Connection: close) for too many headers or too many header bytes.

    h11 caps a head that arrives slowly (max_incomplete_event_size); one that arrives in a
    single read is parsed whole, so the total is checked again here."""
    count = len(scope.get("headers", ()))
    close = {"Connection": "close"}
    if count > limits.max_headers:
        return APIError(431, f"the request has {count:,} headers; the limit is {limits.max_headers:,} (--max-headers)",
                        code="request_header_fields_too_large", headers=close)
    size = head_size(scope)
    if size > limits.max_header_bytes:
        return APIError(431, f"the request line and headers are {size:,} bytes; the limit is {limits.max_header_bytes:,} (--max-header-bytes)",
                        code="request_header_fields_too_large", headers=close)
    return None


def _too_large(what: str, limit: int) -> APIError:
    return APIError(413, f"{what} the limit of {limit:,} bytes (--max-body-size)", code="request_too_large")


def declared_length_problem(declared: str | None, limit: int) -> APIError | None:
    """A Content-Length header that is not a number (400) or is over `limit` (413); None when it
    is absent or fine."""
    if declared is None:
        return None
    if not declared.isdigit():
        return APIError(400, f"Content-Length header is not a number: {declared!r}", code="invalid_request")
    if int(declared) > limit:
        return _too_large(f"request body is {int(declared):,} bytes, over", limit)
    return None


def body_over_limit(size: int, limit: int) -> APIError:
    """The 413 for a body that passed `limit` while it was read (read_body stopped at `size` bytes)."""
    return _too_large(f"request body is at least {size:,} bytes, over", limit)


_NOT_JSON_TYPES = ("application/x-www-form-urlencoded", "text/plain", "")


def _as_json(scope):
    """Treat a body sent as form data or plain text (curl -d's default) as the JSON it is."""
    content_type = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
    if content_type not in _NOT_JSON_TYPES:
        return scope
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip()
    return None


def _authorized(scope, api_key: str) -> bool:
    """The key as OpenAI clients send it (Authorization: Bearer) or as Anthropic's do (x-api-key)."""
    expected = api_key.encode()
    auth = _header(scope, b"authorization") or ""
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected):
        return True
    key = _header(scope, b"x-api-key")
    return key is not None and hmac.compare_digest(key.encode(), expected)


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
