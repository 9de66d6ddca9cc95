"""OpenAI-style error bodies, and the handlers that turn every failure into one."""

from __future__ import annotations

import json
import logging

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
    500: "server_error",
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
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, int(round(err.retry_after))))
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), status_code=err.status, headers=headers)


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
    """Every error, including routing and validation errors, leaves as an OpenAI error body."""

    def respond(err: APIError) -> JSONResponse:
        if on_error is not None:
            on_error(err)
        return error_response(err)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return respond(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        return respond(APIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return respond(APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error"))
