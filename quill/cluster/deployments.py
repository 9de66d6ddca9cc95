"""The Ray Serve application: an ingress that routes, and replicas that are quill servers.

    HTTP client -> Ray Serve proxy -> QuillIngress --(DeploymentHandle, chosen by the request
    router)--> QuillReplica (AsyncEngine + quill's FastAPI app, quill.cluster.bridge)

- QuillIngress reads the request, computes its prefix key (quill.cluster.routing) with the
  model's tokenizer only (no weights), forwards it, and streams the replica's answer back. If
  the replica dies, a request that has not started answering gets a 503, and a stream gets an
  error event and [DONE]. GET /metrics merges every replica's metrics with a `replica` label.
- QuillReplica is `quill serve` without uvicorn: the same flags build the same engine and app.
  It reports the block hashes in its prefix cache as routing stats, and pushes its /metrics text
  to a MetricsHub actor each second.

`build_app(ClusterOptions)` returns the application; `app_builder` is the `serve run` entry
(`serve run quill.cluster.deployments:app_builder replicas=2 args="--threads 1"`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import time
from dataclasses import dataclass, field

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from quill.cluster.bridge import ResponseStart, respond
from quill.cluster.metrics import MetricsBoard, merge_replica_metrics
from quill.cluster.routing import DEFAULT_IMBALANCE, PREFIX_ROUTED_PATHS, ROUTERS, QuillCall, routing_key

logger = logging.getLogger("quill.cluster")

APP_NAME = "quill"
METRICS_PUSH_S = 1.0  # how often a replica sends its /metrics text to the hub
ROUTING_STATS_S = 2.0  # how often Ray Serve asks a replica for its cached block hashes
MAX_REPORTED_HASHES = 1 << 17  # 2 MiB of 16-byte digests at most per report
REPLICA_HEADER = b"x-quill-replica"
# Ray's own prefix router, by its module path: the public alias (ray.serve.llm.request_router) refuses
# to import without vLLM or SGLang; this one needs only pyarrow. Kept for comparison (docs/SCALING.md).
RAY_PREFIX_ROUTER = "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """`quill serve`'s flags (engine and server) as a replica reads them."""
    from quill.server.serve_cmd import add_arguments

    parser = argparse.ArgumentParser(prog="quill serve --ray (replica flags)")
    add_arguments(parser)
    return parser.parse_args(argv)


@dataclass
class ClusterOptions:
    """What `quill serve --ray` deploys. `serve_args` are the parsed `quill serve` flags every
    replica runs with (parse_serve_args)."""

    serve_args: argparse.Namespace = field(default_factory=lambda: parse_serve_args([]))
    replicas: int = 1
    max_replicas: int | None = None  # above `replicas`: Ray Serve autoscales between the two
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = 128
    router: str = "prefix"
    imbalance_threshold: int = DEFAULT_IMBALANCE
    replica_cpus: float = 1.0  # Ray's CPU reservation per replica (its --threads)
    app_name: str = APP_NAME

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= replicas ({self.replicas})")
        if not 0 < self.target_ongoing_requests <= self.max_ongoing_requests:
            raise ValueError(f"target_ongoing_requests must be in (0, max_ongoing_requests={self.max_ongoing_requests}], "
                             f"got {self.target_ongoing_requests}")
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.replicas


# ---- the metrics hub ------------------------------------------------------------------------------
@ray.remote(num_cpus=0)
class MetricsHub:
    """The latest /metrics text of each replica (quill.cluster.metrics.MetricsBoard)."""

    def __init__(self):
        self.board = MetricsBoard(stale_s=5 * METRICS_PUSH_S)

    def push(self, replica: str, text: str) -> None:
        self.board.push(replica, text)

    def remove(self, replica: str) -> None:
        self.board.remove(replica)

    def texts(self) -> dict[str, str]:
        return self.board.texts()


def metrics_hub(app_name: str):
    """The app's hub, created by whoever asks first (it lives as long as its creator)."""
    return MetricsHub.options(name=f"quill-metrics-{app_name}", namespace="quill", get_if_exists=True).remote()


# ---- replicas ------------------------------------------------------------------------------------
class QuillReplica:
    """One quill engine and its FastAPI app; answers QuillCalls forwarded by the ingress."""

    def __init__(self, args: argparse.Namespace, app_name: str = APP_NAME):
        from quill.engine.async_engine import AsyncEngine
        from quill.engine.engine import freeze_heap
        from quill.server.app import attach_engine, create_app
        from quill.server.serve_cmd import engine_config

        self.app = create_app(None, served_model_name=args.served_model_name, api_key=args.api_key,
                              max_body_bytes=args.max_body_size, reasoning_format=args.reasoning_format,
                              tool_parser=args.tool_parser)
        self.engine = AsyncEngine.from_config(engine_config(args))
        freeze_heap()  # a replica's process is quill's, as `quill serve`'s is
        self.engine.start()
        attach_engine(self.app, self.engine)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app_name = app_name
        self._pusher: asyncio.Task | None = None
        logger.info("replica %s ready: %s", self.replica_id, self.engine.model_name)

    async def handle(self, call: QuillCall):
        """The app's answer to `call`: a ResponseStart, then body bytes."""
        self._start_pusher()
        async for piece in respond(self.app, call, self.replica_id):
            yield piece

    async def record_routing_stats(self) -> dict:
        """Ray Serve's routing stats: the digests of the blocks in this replica's prefix cache."""
        self._start_pusher()
        return {"at": time.time(), "prefix_hashes": self.engine.cached_block_hashes()[:MAX_REPORTED_HASHES]}

    def check_health(self) -> None:
        """Ray Serve's health check: the engine loop must be alive (else Ray replaces the replica)."""
        if not self.engine.is_running:
            raise RuntimeError("the engine loop has stopped")

    def _start_pusher(self) -> None:
        if self._pusher is None or self._pusher.done():
            self._pusher = asyncio.ensure_future(self._push_metrics())

    async def _push_metrics(self) -> None:
        hub = None
        state = self.app.state.quill
        while True:
            try:
                hub = hub or metrics_hub(self.app_name)
                await hub.push.remote(self.replica_id, state.metrics.render().decode())
            except Exception:  # noqa: BLE001 - the hub died with its creator: make it again next time
                hub = None
            await asyncio.sleep(METRICS_PUSH_S)

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(drain_timeout=0)


# ---- the ingress ---------------------------------------------------------------------------------
def _stream_error(path: str, message: str) -> bytes:
    """The end of a stream whose replica died, in the route's own shape."""
    from quill.server.anthropic_adapter import AnthropicAdapter
    from quill.server.errors import ANTHROPIC_PATH, anthropic_error_body, error_body
    from quill.server.responses import OPENAI

    if path == ANTHROPIC_PATH:
        return AnthropicAdapter().error(anthropic_error_body(503, message))
    return OPENAI.error(error_body(503, message, None, "replica_failed"))


class QuillIngress:
    """Takes every HTTP request from Ray Serve's proxy and forwards it to a replica."""

    def __init__(self, replica, args: argparse.Namespace, app_name: str = APP_NAME):
        from quill.models.loader import load_tokenizer

        self.replica = replica
        self.app_name = app_name
        self.block_size = args.block_size
        self.max_body_bytes = args.max_body_size
        self.tokenizer = load_tokenizer(args.model)
        self.hub = metrics_hub(app_name)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return await self._metrics()
        body = await self._body_within_limit(request)
        if isinstance(body, Response):
            return body
        hashes, prompt = (), ""
        if request.method == "POST" and path in PREFIX_ROUTED_PATHS:
            hashes, prompt = await asyncio.to_thread(routing_key, self.tokenizer, self.block_size, path, body)
        client = (request.client.host, request.client.port) if request.client else None
        # A text-matching router (Ray's PrefixCacheAffinityRouter) divides by the text's length:
        # a request without a prompt (/health, /v1/models) offers its method and path instead.
        call = QuillCall(request.method, path, request.scope.get("query_string", b""), tuple(request.headers.raw), body,
                         client, hashes, prompt or f"{request.method} {path}")
        stream = self.replica.options(stream=True).handle.remote(call)
        try:
            start = await stream.__anext__()
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the replica died or failed before answering
            return self._replica_failed(path, exc)
        if not isinstance(start, ResponseStart):
            return self._replica_failed(path, TypeError(f"expected a ResponseStart, got {type(start).__name__}"))
        headers = [(k, v) for k, v in start.headers] + [(REPLICA_HEADER, start.replica.encode())]
        is_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
        response = StreamingResponse(self._body(stream, path, is_stream, start.replica), status_code=start.status)
        response.raw_headers = headers
        return response

    async def _body_within_limit(self, request: Request) -> bytes | Response:
        """The request body, read here only up to --max-body-size (the 413 or 400 quill serve's guard
        answers, from the same checks): the ingress must not hold an unbounded body in memory before a
        replica refuses it."""
        from quill.server.errors import APIError, error_response
        from quill.server.guard import body_over_limit, declared_length_problem, read_body

        limit = self.max_body_bytes
        declared = declared_length_problem(request.headers.get("content-length"), limit)
        if declared is not None:
            return error_response(declared, request.url.path)
        body, size, _ = await read_body(request.receive, limit)
        if body is None and size > limit:
            return error_response(body_over_limit(size, limit), request.url.path)
        if body is None:
            return error_response(APIError(400, "the client disconnected before sending the whole body",
                                           code="invalid_request"), request.url.path)
        return body

    async def _body(self, stream, path: str, is_stream: bool, replica: str):
        """The replica's body pieces. When the client goes away, Ray Serve cancels this; the
        replica's call is cancelled here too, explicitly: Ray's own propagation to calls a request
        made does not always reach one whose caller has already returned its response (measured:
        a disconnected stream ran to its max_tokens on the replica)."""
        finished = False
        try:
            async for piece in stream:
                yield piece
            finished = True
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - the replica died mid-answer
            finished = True
            logger.warning("replica %s failed during %s: %s: %s", replica, path, type(exc).__name__, exc)
            if is_stream:
                yield _stream_error(path, f"the replica serving this request failed ({type(exc).__name__}); "
                                          "retry: another replica will take it")
        finally:
            if not finished:
                stream.cancel()

    def _replica_failed(self, path: str, exc: BaseException) -> Response:
        from quill.server.errors import APIError, error_response

        logger.warning("no replica answered %s: %s: %s", path, type(exc).__name__, exc)
        return error_response(APIError(503, f"the replica chosen for this request failed before answering "
                                            f"({type(exc).__name__}); retry: another replica will take it",
                                       code="replica_failed", retry_after=1), path)

    async def _metrics(self) -> Response:
        from quill.server.metrics import CONTENT_TYPE

        try:
            texts = await self.hub.texts.remote()
        except Exception:  # noqa: BLE001 - the hub died with the replica that made it; a new one fills in a second
            self.hub = metrics_hub(self.app_name)
            texts = {}
        return Response(merge_replica_metrics(texts), media_type=CONTENT_TYPE)


# ---- the application -----------------------------------------------------------------------------
def router_config(options: ClusterOptions) -> RequestRouterConfig | None:
    if options.router == "pow2":
        return None  # Ray Serve's default PowerOfTwoChoicesRequestRouter
    if options.router == "round-robin":
        from quill.cluster.ray_router import RoundRobinRouter

        return RequestRouterConfig(request_router_class=RoundRobinRouter)
    if options.router == "ray-prefix":
        return RequestRouterConfig(request_router_class=RAY_PREFIX_ROUTER,
                                   request_router_kwargs={"imbalanced_threshold": options.imbalance_threshold})
    from quill.cluster.ray_router import QuillPrefixRouter

    return RequestRouterConfig(request_router_class=QuillPrefixRouter, request_routing_stats_period_s=ROUTING_STATS_S,
                               request_router_kwargs={"imbalance_threshold": options.imbalance_threshold})


def replica_deployment_options(options: ClusterOptions) -> dict:
    """QuillReplica's Serve deployment options: resources, concurrency, scaling, router."""
    replica_options: dict = {
        "name": "QuillReplica",
        "ray_actor_options": {"num_cpus": options.replica_cpus},
        "max_ongoing_requests": options.max_ongoing_requests,
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": 5,
    }
    if options.autoscaling:
        replica_options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=options.replicas, initial_replicas=options.replicas, max_replicas=options.max_replicas,
            target_ongoing_requests=options.target_ongoing_requests)
    else:
        replica_options["num_replicas"] = options.replicas
    routing = router_config(options)
    if routing is not None:
        replica_options["request_router_config"] = routing
    return replica_options


def build_app(options: ClusterOptions):
    """The Serve application `options` describe (pass it to serve.run)."""
    replica = serve.deployment(QuillReplica).options(**replica_deployment_options(options))
    ingress = serve.deployment(QuillIngress).options(
        name="QuillIngress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    args = options.serve_args
    return ingress.bind(replica.bind(args, options.app_name), args, options.app_name)


def app_builder(args: dict):
    """`serve run quill.cluster.deployments:app_builder replicas=2 router=prefix args="--threads 1"`
    (or the same keys under `args:` in a Serve config file)."""
    known = {"args", "replicas", "max_replicas", "target_ongoing_requests", "max_ongoing_requests", "router",
             "imbalance_threshold", "replica_cpus"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown quill app argument(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    numbers = {"replicas": int, "max_replicas": int, "target_ongoing_requests": float, "max_ongoing_requests": int,
               "imbalance_threshold": int, "replica_cpus": float}
    kwargs = {key: numbers[key](value) for key, value in args.items() if key in numbers}
    argv = shlex.split(args["args"]) if isinstance(args.get("args"), str) else [str(a) for a in args.get("args") or []]
    return build_app(ClusterOptions(serve_args=parse_serve_args(argv), router=args.get("router", "prefix"), **kwargs))
