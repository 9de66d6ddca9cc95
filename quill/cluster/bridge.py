"""Run one forwarded request (a QuillCall) through quill's own FastAPI app inside a replica, and
hand its response back piece by piece: the same routes, errors, SSE bytes and `timings` as
`quill serve`, because it is the same app.

The ingress is cancelled when its client disconnects, Ray Serve cancels the replica's call, and
the cancellation reaches `respond` below, which gives the app the `http.disconnect` it would get
from uvicorn: the app aborts the engine requests and their KV blocks free on the next step.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from quill.cluster.routing import QuillCall

logger = logging.getLogger("quill.cluster")

DISCONNECT_SETTLE_S = 5.0  # after a disconnect: how long the app gets to abort and return


@dataclass(frozen=True)
class ResponseStart:
    """The status line and headers; a replica yields it first, then the body as bytes."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str = ""


def asgi_scope(call: QuillCall) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "root_path": "",
        "query_string": call.query_string,
        "headers": [(bytes(k), bytes(v)) for k, v in call.headers],
        "client": call.client,
        "server": None,
    }


async def respond(app, call: QuillCall, replica: str = "") -> AsyncIterator[ResponseStart | bytes]:
    """Run `app` on `call`: yields a ResponseStart, then each non-empty body chunk."""
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    messages: asyncio.Queue = asyncio.Queue()

    async def send(message: dict) -> None:
        if disconnected.is_set():
            raise OSError("the client disconnected")  # what uvicorn raises for a send after a disconnect
        await messages.put(message)

    task = asyncio.ensure_future(app(asgi_scope(call), receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(messages.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                if messages.empty():
                    task.result()  # raises what the app raised
                    raise RuntimeError(f"{call.method} {call.path}: the app returned without a complete response")
                continue
            message = getter.result()
            if message["type"] == "http.response.start":
                headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
                yield ResponseStart(message["status"], headers, replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        await task
    finally:
        if not task.done():
            disconnected.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_SETTLE_S)
            except BaseException:  # noqa: BLE001 - the app's own end after a disconnect is not the caller's business
                if not task.done():
                    task.cancel()
                    logger.warning("%s %s: the app did not end within %.0f s of the disconnect", call.method,
                                   call.path, DISCONNECT_SETTLE_S)
