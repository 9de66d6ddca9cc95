"""A client that hangs up is aborted in the engine: while queued, during prefill, mid-stream."""

from __future__ import annotations

import threading

import httpx
import pytest

from fake_engine import FakeEngine
from quill.server.app import create_app
from server_utils import ThreadServer, metric_value, post_then_close, read_sse_then_close, wait_until

MODEL = "fake-model"
CHAT = "/v1/chat/completions"
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "ignore_eos": True}


@pytest.fixture()
def live():
    # One running slot, so a second request queues; 2 ms of "prefill" per prompt token.
    engine = FakeEngine(max_num_seqs=1, token_delay=0.01, prefill_delay_per_token=0.002)
    with ThreadServer(create_app(engine, MODEL, static_dir=None)) as server:
        server.engine = engine
        yield server


def aborts(server) -> float:
    return metric_value(httpx.get(server.url + "/metrics").text, "quill_requests_total", {"finish_reason": "abort"})


def idle(engine) -> bool:
    return not engine.requests and engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_after_three_chunks_or_mid_decode(live, stream):
    engine = live.engine
    if stream:
        events = read_sse_then_close(live.url + CHAT, {**LONG, "stream": True}, 3)
        assert len(events) == 3
    else:
        post_then_close(live.port, CHAT, LONG, wait_s=0.3)
    assert wait_until(lambda: len(engine.aborted) == 1, timeout=2.0)
    assert list(engine.aborted.values()) == ["decode"]
    assert wait_until(lambda: idle(engine), timeout=2.0)
    assert wait_until(lambda: aborts(live) == 1, timeout=2.0)


def test_disconnect_during_prefill(live):
    engine = live.engine
    body = {**LONG, "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 50, "stream": True}  # ~0.8 s prefill
    post_then_close(live.port, CHAT, body, wait_s=0.2)
    assert wait_until(lambda: len(engine.aborted) == 1, timeout=2.0)
    assert list(engine.aborted.values()) == ["prefill"]
    assert wait_until(lambda: idle(engine), timeout=2.0)
    assert aborts(live) == 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_queued(live, stream):
    engine = live.engine
    holder = threading.Thread(target=read_sse_then_close, args=(live.url + CHAT, {**LONG, "max_tokens": 120, "stream": True}, 10_000))
    holder.start()
    assert wait_until(lambda: engine.stats()["running"] == 1)
    post_then_close(live.port, CHAT, {**LONG, "stream": stream}, wait_s=0.3)
    assert wait_until(lambda: len(engine.aborted) == 1, timeout=2.0)
    assert list(engine.aborted.values()) == ["queued"]
    assert engine.stats()["waiting"] == 0
    holder.join(timeout=10)
    assert wait_until(lambda: idle(engine), timeout=2.0)
    assert aborts(live) == 1
    assert len(engine.finished) == 2  # the holder finished normally


def test_finished_requests_are_not_aborted(live):
    r = httpx.post(live.url + CHAT, json={**LONG, "max_tokens": 3})
    assert r.status_code == 200
    read_sse_then_close(live.url + CHAT, {**LONG, "max_tokens": 3, "stream": True}, 10_000)
    assert wait_until(lambda: idle(live.engine))
    assert live.engine.aborted == {} and aborts(live) == 0
    assert httpx.get(live.url + "/v1/stats").json()["in_flight"] == 0


def _draining_server(engine, drain_timeout):
    import signal as _signal

    import uvicorn

    from quill.server.runner import DrainingServer
    from server_utils import free_port

    app = create_app(engine, MODEL, static_dir=None)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    server = DrainingServer(config, app.state.quill, drain_timeout)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=10)
    return server, thread, f"http://127.0.0.1:{port}", lambda: server.handle_exit(_signal.SIGTERM, None)


def test_sigterm_drains_in_flight_then_exits():
    engine = FakeEngine(token_delay=0.01)
    server, thread, url, sigterm = _draining_server(engine, drain_timeout=30)
    result = {}
    body = {**LONG, "max_tokens": 60, "stream": True}
    worker = threading.Thread(target=lambda: result.update(events=read_sse_then_close(url + CHAT, body, 10_000)))
    worker.start()
    assert wait_until(lambda: engine.stats()["running"] == 1)
    sigterm()
    assert httpx.get(url + "/health").status_code == 503
    refused = httpx.post(url + CHAT, json={**LONG, "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    worker.join(timeout=10)
    assert result["events"][-1]["choices"][0]["finish_reason"] == "length"  # it finished, not cut off
    thread.join(timeout=10)
    assert not thread.is_alive() and engine.aborted == {}


def test_drain_timeout_aborts_what_is_left():
    engine = FakeEngine(token_delay=0.01)
    server, thread, url, sigterm = _draining_server(engine, drain_timeout=0.3)
    hang_up = threading.Event()
    worker = threading.Thread(target=post_then_close, args=(int(url.rsplit(":", 1)[1]), CHAT, {**LONG, "stream": True}),
                              kwargs={"until": hang_up}, daemon=True)
    worker.start()
    assert wait_until(lambda: engine.stats()["running"] == 1)
    sigterm()
    thread.join(timeout=10)
    hang_up.set()
    assert not thread.is_alive()
    # The server closed the request itself (the fake engine's loop is gone with the server's, so
    # the abort call is what shows; the real engine runs it on its own thread).
    assert len(engine.abort_calls) >= 1 and server.state.in_flight == 0
