"""The engine requests behind one HTTP request, client-disconnect detection, and SSE."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from starlette.responses import StreamingResponse

logger = logging.getLogger("quill.server")

DISCONNECTED = object()  # until_disconnect's result when the client went away first


@dataclass
class Job:
    """One engine request: a prompt (ids, and text for logs / echo) under one request id."""

    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None


class RequestGroup:
    """One engine request per prompt, merged into a single stream of (prompt index, output).

    Each engine iterator is pumped by its own task, so that closing the group (client gone,
    error, shutdown) cancels the pumps; the engine aborts a request whose consumer stops.
    aclose() also calls engine.abort for each unfinished request, so that nothing is left
    decoding for nobody even if an engine iterator ignores cancellation.
    """

    def __init__(self, engine, jobs: list[Job], params, fault: str | None = None):
        self.engine = engine
        self.jobs = jobs
        self.params = params
        self.fault = fault  # a quill.engine.faults phase to arm on every request (fault tests only)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = set(range(len(jobs)))
        self._finished: set[int] = set()
        self._closed = False

    def start(self) -> None:
        for index, job in enumerate(self.jobs):
            self._tasks.append(asyncio.create_task(self._pump(index, job), name=f"quill-{job.request_id}"))

    async def _pump(self, index: int, job: Job) -> None:
        stream = None
        try:
            extra = {} if self.fault is None else {"fault": self.fault}
            stream = self.engine.generate(job.prompt_token_ids, self.params, job.request_id, prompt=job.prompt, **extra)
            async for output in stream:
                if output.finished:
                    self._finished.add(index)
                self._queue.put_nowait((index, output, None))
            self._queue.put_nowait((index, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the consumer, which decides the HTTP answer
            self._queue.put_nowait((index, None, exc))
        finally:
            if stream is not None:
                await stream.aclose()

    def fail(self, exc: Exception) -> None:
        """Make the consumer's next (or current) next() raise `exc`, e.g. at the drain deadline."""
        self._queue.put_nowait((-1, None, exc))

    async def next(self):
        """The next (prompt index, RequestOutput); None once every request has ended."""
        while self._open:
            index, output, exc = await self._queue.get()
            if exc is not None:
                self._open.discard(index)
                raise exc
            if output is None:
                self._open.discard(index)
                continue
            return index, output
        return None

    async def aclose(self) -> None:
        """Stop every pump and abort what has not finished; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        unfinished = [job.request_id for i, job in enumerate(self.jobs) if i not in self._finished]
        for task in self._tasks:
            task.cancel()
        # Aborts first: they only post a command, so they happen even if this task is being
        # cancelled itself (uvicorn's shutdown cancels with asyncio, which a shield cannot stop).
        with anyio.CancelScope(shield=True):
            for request_id in unfinished:
                try:
                    await self.engine.abort(request_id)
                except Exception:  # already gone is fine
                    logger.debug("abort(%s) failed", request_id, exc_info=True)
            if unfinished:
                logger.info("aborted %s (client gone or stream closed)", ", ".join(unfinished))
            await asyncio.gather(*self._tasks, return_exceptions=True)


async def wait_for_disconnect(receive) -> None:
    """Return when the ASGI server reports that the client closed the connection."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive, awaitable: Awaitable):
    """Await `awaitable`, or return DISCONNECTED (cancelling it) if the client leaves first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        return DISCONNECTED
    return task.result()


class SSEResponse(StreamingResponse):
    """text/event-stream that stops (and runs `on_close`) as soon as the client disconnects.

    Starlette's own disconnect handling depends on the ASGI spec version and only closes the
    body iterator if it was started; here the watcher always runs and on_close always runs.
    """

    def __init__(self, content, on_close: Callable[[], Awaitable[None]]):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    await wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    await self.stream_response(send)
                except OSError:  # the socket went away mid-write
                    pass
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.body_iterator.aclose()
                finally:
                    await self._on_close()
