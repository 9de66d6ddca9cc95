"""FastAPI app: OpenAI-compatible routes, Anthropic's Messages API, health, metrics, tokenizer
endpoints, static page."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match, Mount

from quill.server import anthropic, handlers
from quill.server.errors import APIError, InternalErrorMiddleware, bad_request, install_handlers
from quill.server.guard import GuardMiddleware
from quill.server.limits import HTTPLimits
from quill.server.metrics import CONTENT_TYPE, ServerMetrics
from quill.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

logger = logging.getLogger("quill.server")

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class ServerState:
    """What the routes share: the engine (None while loading), names, limits, drain state."""

    def __init__(self, engine, served_model_name, api_key, max_body_bytes, retry_after, limits: HTTPLimits,
                 reasoning_format: str | None = None, tool_parser: str | None = None):
        self.engine = None
        self.reasoning_format = reasoning_format  # --reasoning-format; None: from the chat template
        self.tool_parser = tool_parser  # --tool-parser; None: from the chat template (quill.tools.detect_parser)
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.retry_after = retry_after
        self.limits = limits
        self.draining = False
        self.load_error: str | None = None
        self.started_at = time.time()
        self.warned_fields: set[str] = set()  # unknown request fields already logged once
        self._groups: set = set()  # the RequestGroups of requests in flight
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics = ServerMetrics(self.engine_stats)
        if engine is not None:
            self.attach(engine)

    def attach(self, engine) -> None:
        if self.served_model_name is None:
            self.served_model_name = engine.model_name
        hooks = getattr(engine, "on_request_finished", None)
        if hooks is not None:
            hooks.append(self.metrics.on_request_finished)
        self.engine = engine

    @property
    def model_names(self) -> list[str]:
        names = [self.served_model_name]
        if self.engine is not None and self.engine.model_name not in names:
            names.append(self.engine.model_name)
        return [n for n in names if n]

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self.load_error is None

    def require_engine(self):
        if self.draining:
            raise APIError(503, "the server is shutting down and not accepting requests", code="server_shutting_down", retry_after=self.retry_after)
        if self.engine is None:
            detail = f"the model failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, detail, code="model_loading", retry_after=5)
        return self.engine

    def engine_stats(self) -> dict | None:
        return None if self.engine is None else self.engine.stats()

    @property
    def in_flight(self) -> int:
        return len(self._groups)

    def begin(self, group) -> None:
        self._loop = asyncio.get_running_loop()
        self._groups.add(group)

    def end(self, group) -> None:
        self._groups.discard(group)

    def abort_in_flight(self, message: str) -> int:
        """End every request in flight with a 503 `shutting_down` error (an error event, then
        [DONE], for a stream); closing each group aborts its engine requests. Call on the loop."""
        for group in list(self._groups):
            group.fail(APIError(503, message, code="shutting_down"))
        return len(self._groups)

    def abort_in_flight_threadsafe(self, message: str) -> None:
        if self._loop is not None and self._groups:
            self._loop.call_soon_threadsafe(self.abort_in_flight, message)

    def log_extra_fields(self, body) -> None:
        for name in body.model_extra or {}:
            if name not in self.warned_fields:
                self.warned_fields.add(name)
                logger.warning("ignoring unknown request field %r", name)

    def param_names(self, body) -> dict:
        """SamplingParams field -> the request's own field name, for engine-side errors."""
        from quill.server.protocol import requested_max_tokens, structured_fields

        names = {"max_tokens": requested_max_tokens(body)[1]}
        if isinstance(body, ChatCompletionRequest):
            names["logprobs"] = "top_logprobs"
            names["prompt"] = "messages"
        try:
            names.update(structured_fields(body)[1])
        except APIError:
            pass
        return names


def create_app(
    engine=None,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    retry_after: float = 1.0,
    static_dir: Path | None = STATIC_DIR,
    limits: HTTPLimits | None = None,
    reasoning_format: str | None = None,
    tool_parser: str | None = None,
) -> FastAPI:
    """The server app. `engine` may be None and attached later (attach_engine) so that
    /health can answer 503 while the model loads. `reasoning_format` ("none" | "deepseek"; None:
    decided from the model's chat template) is the default for chat requests that name none.
    `tool_parser` (a quill.tools.PARSER_NAMES name; None or "auto": decided from the chat template)
    reads tool calls out of chat outputs."""
    from quill import __version__

    app = FastAPI(title="quill", version=__version__, description="OpenAI-compatible API for the quill inference engine")
    if reasoning_format is not None:
        from quill.reasoning import check_reasoning_format

        check_reasoning_format(reasoning_format)
    if tool_parser == "auto":
        tool_parser = None
    if tool_parser is not None:
        from quill.tools import parser_class

        parser_class(tool_parser)  # an unknown name fails here, listing the names
    state = ServerState(engine, served_model_name, api_key, max_body_bytes, retry_after, limits or HTTPLimits(), reasoning_format,
                        tool_parser)
    app.state.quill = state

    def count_error(err: APIError) -> None:
        state.metrics.count_error(err.status, err.code)

    install_handlers(app, on_error=count_error)
    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(InternalErrorMiddleware, on_error=count_error)  # added last: outermost
    _add_routes(app, state)
    if static_dir is not None and (Path(static_dir) / "index.html").is_file():
        api_routes = list(app.router.routes)
        app.router.routes.append(_PlaygroundMount(api_routes, StaticFiles(directory=static_dir, html=True)))
    return app


class _PlaygroundMount(Mount):
    """The playground's files at "/", behind every API route.

    A Mount at "/" matches every path, so a GET on a POST-only route would reach the static
    files (a 404) instead of the route's 405; this one steps aside for any path an API route
    knows, whatever the method.
    """

    def __init__(self, api_routes: list, app):
        super().__init__("/", app=app, name="static")
        self._api_routes = api_routes

    def matches(self, scope):
        if scope["type"] == "http" and any(route.matches(scope)[0] != Match.NONE for route in self._api_routes):
            return Match.NONE, {}
        return super().matches(scope)


def attach_engine(app: FastAPI, engine) -> None:
    app.state.quill.attach(engine)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        state.log_extra_fields(body)
        return await handlers.chat_completions(request, body, state)

    @app.post("/v1/completions", tags=["openai"])
    async def completions(request: Request, body: CompletionRequest):
        state.log_extra_fields(body)
        return await handlers.completions(request, body, state)

    @app.post("/v1/messages", tags=["anthropic"])
    async def messages(request: Request, body: anthropic.MessagesRequest):
        state.log_extra_fields(body)
        return await anthropic.messages(request, body, state)

    @app.post("/v1/messages/count_tokens", tags=["anthropic"])
    async def count_tokens(body: anthropic.CountTokensRequest):
        state.log_extra_fields(body)
        return await anthropic.count_tokens(body, state)

    @app.get("/v1/models", tags=["openai"])
    async def list_models():
        return {"object": "list", "data": [_model_card(state, name) for name in _listed_models(state)]}

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def get_model(model_id: str):
        if not model_id:  # "/v1/models/": the list, as "/v1/models" (a card with id "" helps nobody)
            return await list_models()
        handlers.check_model(state, model_id)
        return _model_card(state, model_id)

    @app.get("/health", tags=["server"])
    async def health():
        if state.ready:
            return {"status": "ok"}
        status = "shutting_down" if state.draining else ("failed" if state.load_error else "loading")
        return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics", tags=["server"])
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/stats", tags=["server"])
    async def stats():
        engine_stats = state.engine_stats() or {}
        return {
            "model": state.served_model_name,
            "ready": state.ready,
            "draining": state.draining,
            "in_flight": state.in_flight,
            "uptime_s": round(time.time() - state.started_at, 3),
            "max_model_len": getattr(state.engine, "max_model_len", None),
            "engine": engine_stats,
        }

    @app.post("/tokenize", tags=["tokenizer"])
    async def tokenize(body: TokenizeRequest):
        engine = state.require_engine()
        handlers.check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            kwargs = handlers.template_kwargs(body)
            if not body.add_generation_prompt:  # the default (True) is the tokenizer's own default too
                kwargs["add_generation_prompt"] = False
            ids = await run_in_threadpool(handlers.encode_chat, engine, handlers.template_messages(body.messages), kwargs)
        else:
            ids = handlers.encode_text(engine, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        result = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = [engine.tokenizer.id_to_piece(t) for t in ids]
        return result

    @app.post("/detokenize", tags=["tokenizer"])
    async def detokenize(body: DetokenizeRequest):
        engine = state.require_engine()
        handlers.check_model(state, body.model)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}


def _listed_models(state: ServerState) -> list[str]:
    return [state.served_model_name] if state.served_model_name else []


def _model_card(state: ServerState, name: str) -> dict:
    engine = state.engine
    return {
        "id": name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "quill",
        "root": getattr(engine, "model_name", name),
        "max_model_len": getattr(engine, "max_model_len", None),
    }
