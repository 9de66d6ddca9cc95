"""Run the app under uvicorn: engine loads in the background, SIGTERM drains, then exit."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import uvicorn

from quill.server.app import create_app
from quill.server.limits import HTTPLimits, h11_protocol

logger = logging.getLogger("quill.server")


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM / SIGINT stops admitting (503) and lets in-flight
    requests finish for up to `drain_timeout` seconds before the normal shutdown; a second
    signal shuts down at once."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining or self.should_exit:
            return super().handle_exit(sig, frame)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        logger.info("%s: not admitting new requests; draining %d in flight (up to %.0f s)", name, self.state.in_flight, self.drain_timeout)
        self.state.draining = True
        threading.Thread(target=self._drain, name="quill-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.in_flight > 0:
            logger.warning("drain timeout: aborting %d request(s) still in flight", self.state.in_flight)
            message = (f"the server is shutting down and this request did not finish within "
                       f"--drain-timeout {self.drain_timeout:g} s")
            # Each request ends with an error (an error event and [DONE] for a stream) and its
            # engine requests are aborted, so uvicorn never has to cancel a response half-sent.
            self.state.abort_in_flight_threadsafe(message)
            settle = time.monotonic() + _ABORT_SETTLE_S
            while self._requests_open() and time.monotonic() < settle:
                time.sleep(0.02)
        self.should_exit = True  # uvicorn's main loop polls this every 0.1 s

    def _requests_open(self) -> bool:
        """HTTP requests still answering, or engine requests not yet dropped: the engine must have
        taken the aborts before the event loop closes, or it would deliver to a closed loop."""
        engine = getattr(self, "engine", None)
        return self.state.in_flight > 0 or (engine is not None and getattr(engine, "num_in_flight", 0) > 0)


_ABORT_SETTLE_S = 5.0  # after the drain deadline: how long the aborted requests get to send their error


def _load_engine(state, config, server: DrainingServer) -> None:
    """Import and load the engine (blocking), attach it, log the cold start, print the URL."""
    from quill import coldstart

    before_import = coldstart.process_age_ms() or 0.0  # interpreter start + CLI imports
    t0 = time.perf_counter()
    try:
        torch_ms = coldstart.import_torch()
        from quill.engine.async_engine import AsyncEngine
        from quill.engine.engine import freeze_heap

        import_ms = before_import + (time.perf_counter() - t0) * 1000.0
        engine = AsyncEngine.from_config(config)
        freeze_heap()  # this process is the server's
        engine.start()
    except BaseException as exc:  # noqa: BLE001 - any failure must stop the server, not hang it
        logger.exception("the model failed to load")
        state.load_error = f"{type(exc).__name__}: {exc}"
        server.should_exit = True
        return
    cold = dict(getattr(engine, "cold_start", {}) or {})
    cold_line = coldstart.line(import_ms, cold, coldstart.process_age_ms(), torch_ms)
    logger.info("%s", cold_line)  # before /health turns 200, so whoever waits for it finds the line logged
    if tip := coldstart.hint(cold):
        cold_line += f"\nquill: tip: {tip}"
    state.attach(engine)
    server.engine = engine
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        host = server.config.host
        shown = f"[{host}]" if ":" in host else host
        url = f"http://{shown}:{server.config.port}"
        print(f"quill: {cold_line}\nquill: serving {state.served_model_name!r} at {url}/v1 (health {url}/health, "
              f"metrics {url}/metrics)", flush=True)


def http_limits(args) -> HTTPLimits:
    return HTTPLimits(
        timeout_keep_alive=args.timeout_keep_alive,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_header_bytes=args.max_header_bytes,
        max_headers=args.max_headers,
        limit_concurrency=args.limit_concurrency or None,
    )


def serve(args, config) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean shutdown, 1 if the model or the port failed."""
    limits = http_limits(args)
    app = create_app(None, served_model_name=args.served_model_name, api_key=args.api_key, max_body_bytes=args.max_body_size,
                     limits=limits, reasoning_format=getattr(args, "reasoning_format", None),
                     tool_parser=getattr(args, "tool_parser", None))
    state = app.state.quill
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=True,
        timeout_graceful_shutdown=2,
        http=h11_protocol(limits),  # h11 always (not httptools when installed): the limits are enforced there
        timeout_keep_alive=limits.timeout_keep_alive,
        limit_concurrency=limits.limit_concurrency,
        h11_max_incomplete_event_size=limits.max_header_bytes,
    )
    server = DrainingServer(uv_config, state, args.drain_timeout)
    server.engine = None
    loader = threading.Thread(target=_load_engine, args=(state, config, server), name="quill-load", daemon=True)
    loader.start()
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        if exc.code not in (0, None):
            logger.error("the server could not start (exit %s)", exc.code)
            return 1
    finally:
        engine = server.engine
        if engine is not None:
            engine.shutdown(drain_timeout=0)
    if state.load_error:
        print(f"quill serve: {state.load_error}", file=sys.stderr)
        return 1
    return 0
