"""ASGI middleware in front of the routes: API key (401) and request body size (413)."""

from __future__ import annotations

import hmac

from quill.server.errors import APIError, error_response

_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_BODY_METHODS = {"POST", "PUT", "PATCH"}


class GuardMiddleware:
    """Checks the key before anything else and buffers the body up to the limit.

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
        if state.api_key and scope["path"].startswith(_PROTECTED_PREFIXES) and not _authorized(scope, state.api_key):
            return await self._refuse(scope, receive, send, APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"))
        if scope["method"] not in _BODY_METHODS:
            return await self.app(scope, receive, send)
        limit = state.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await self._refuse(scope, receive, send, APIError(400, f"Content-Length header is not a number: {declared!r}", code="invalid_request"))
            if int(declared) > limit:
                return await self._refuse(scope, receive, send, _too_large(f"request body is {int(declared):,} bytes, over", limit))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return await self._refuse(scope, receive, send, _too_large(f"request body is at least {size:,} bytes, over", limit), body_pending=message.get("more_body", False))
            chunks.append(body)
            if not message.get("more_body", False):
                break
        return await self.app(_as_json(scope), _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope, receive, send, err: APIError, body_pending: bool = True):
        self.state.metrics.count_error(err.status, err.code)
        if body_pending:
            # Read (and drop) what the client is still sending: closing a socket with unread
            # data resets it, and the client would see a connection error instead of the answer.
            await _discard_body(receive, _DISCARD_LIMIT)
        await error_response(err)(scope, receive, send)


_DISCARD_LIMIT = 64 * 1024 * 1024


async def _discard_body(receive, limit: int) -> None:
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


def _too_large(what: str, limit: int) -> APIError:
    return APIError(413, f"{what} the limit of {limit:,} bytes (--max-body-size)", code="request_too_large")


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
    auth = _header(scope, b"authorization") or ""
    scheme, _, token = auth.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
