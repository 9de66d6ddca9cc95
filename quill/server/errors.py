"""Error bodies (OpenAI's, or Anthropic's on the Messages API paths), and the handlers that turn
every failure into one."""

from __future__ import annotations

import json
import logging
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("quill.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    408: "invalid_request_error",
    431: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error the server answers with; carries status, OpenAI code and param."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})


# Anthropic's error types by status (docs.claude.com/en/api/errors): another 4xx is an
# invalid_request_error, another 5xx an api_error; 503 is overloaded (Anthropic's own is 529).
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"  # and what is under it (/v1/messages/count_tokens)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_for(err: APIError, path: str) -> dict:
    """The one decision of an error's shape: Anthropic's on the Messages API paths, else OpenAI's."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_body(err.status, err.message)
    return error_body(err.status, err.message, err.param, err.code)


def error_response(err: APIError, path: str) -> JSONResponse:
    """`err` as the answer to a request for `path` (which picks the body's shape)."""
    headers = dict(err.headers)
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(round(err.retry_after))))
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body_for(err, path), status_code=err.status, headers=headers)


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, None, code)).encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code or "invalid_request")


def validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's first complaint, with its location as the OpenAI `param`."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        where = f" at character {loc[0]}" if loc and loc[0].isdigit() else ""
        return bad_request(f"request body is not valid JSON: {detail}{where}", code="invalid_json")
    if first.get("type") == "lone_surrogate":
        return bad_request(first["msg"], param=(first.get("ctx") or {}).get("param"))
    # Union members add their type name to the location (e.g. content.str); keep the field path.
    param = ".".join(p for p in loc if not _is_type_tag(p)) or None
    if param == "prompt":
        return bad_request(
            f"prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists (got {_short(first.get('input'))})",
            param="prompt",
        )
    value = first.get("input")
    shown = "" if isinstance(value, dict) or value is None else f" (got {_short(value)})"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    message = f"{param or 'body'}: {first.get('msg', 'invalid value')}{shown}{more}"
    return bad_request(message, param=param)


def _is_type_tag(part: str) -> bool:
    return part in {"str", "int", "float", "bool", "list", "dict", "list[str]", "list[int]", "list[list[int]]"} or (
        part.startswith(("list[", "function-", "nullable[", "union[", "literal["))
    )


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_handlers(app: FastAPI, on_error=None) -> None:
    """Every error, including routing and validation errors, leaves as an error body (error_body_for)."""

    def respond(request: Request, err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(err)
        return error_response(err, request.scope["path"])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return respond(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        parse_error = _body_parse_error(exc)
        if parse_error is not None:
            return respond(request, parse_error)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        headers = dict(exc.headers or {})
        if exc.status_code == 405 and "Allow" in headers:
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
        return respond(request, APIError(exc.status_code, message, code=code, headers=headers))


def _body_parse_error(exc: StarletteHTTPException) -> APIError | None:
    """FastAPI answers a body json.loads could not read (bad UTF-8, nesting past the recursion
    limit) with a bare 400; name what was wrong, with the same code as any other invalid JSON."""
    cause = exc.__cause__
    if exc.status_code != 400 or cause is None:
        return None
    if isinstance(cause, UnicodeDecodeError):
        return bad_request(f"request body is not valid JSON: {invalid_utf8_message(cause)}", code="invalid_json")
    if isinstance(cause, RecursionError):
        limit = sys.getrecursionlimit()
        return bad_request(f"request body is not valid JSON: arrays/objects nested deeper than the parser's limit (about {limit:,} levels)",
                           code="invalid_json")
    return bad_request(f"request body is not valid JSON: {type(cause).__name__}: {cause}", code="invalid_json")


def invalid_utf8_message(exc: UnicodeDecodeError) -> str:
    bad = exc.object[exc.start:exc.end].hex(" ")
    return f"it is not valid UTF-8 (byte {bad} at offset {exc.start:,}: {exc.reason})"


class InternalErrorMiddleware:
    """Outermost guard: an exception no handler took becomes a 500 error body.

    Starlette's own last-resort handler answers and then re-raises, so uvicorn drops the
    keep-alive connection without saying so and the client's next request on it fails. Here
    the exception ends with the answer, which carries `Connection: close`: after a failure
    nobody knows what state the request body is in, so the client is told to reconnect.
    A failure after the response started can only cut the body: the connection is closed.
    """

    def __init__(self, app, on_error=None):
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                return None  # uvicorn closes a connection whose response did not complete
            err = APIError(500, f"internal server error: {type(exc).__name__}: {_short(str(exc), 200)}", code="internal_error",
                           headers={"Connection": "close"})
            if self.on_error is not None:
                self.on_error(err)
            await error_response(err, scope["path"])(scope, receive, send)
