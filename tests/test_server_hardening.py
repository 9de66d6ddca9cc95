"""Issue 13, server side: hostile input, slow clients, failures and shutdown, each through a real
`quill serve` process where the defect needs the real stack, else through the app under uvicorn."""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from fake_engine import FakeEngine, FakeTokenizer
from quill.chat_template import ChatTemplateError, render_chat_template
from quill.server.app import create_app
from server_utils import ServeProcess, ThreadServer, metric_value

MODEL = "quill-test"
HELLO = [{"role": "user", "content": "Name a colour."}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


# ---- a real `quill serve` -----------------------------------------------------------------------


def Serve(log_dir: Path, *flags: str) -> ServeProcess:
    """A real `quill serve` with this file's defaults (a short context and a small KV pool)."""
    return ServeProcess(log_dir, "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--log-level", "info", *flags,
                        model_name=MODEL)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Default connection flags, and --drain-timeout 1 for the last test (which stops it)."""
    proc = Serve(tmp_path_factory.mktemp("serve"), "--drain-timeout", "1")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def post_raw(url: str, path: str, body: bytes, client: httpx.Client | None = None) -> httpx.Response:
    return (client or httpx).post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)


def assert_error(response: httpx.Response, status: int, code: str | None, param: str | None = None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


# defect 1 ---------------------------------------------------------------------------------------


def test_min_tokens_with_guided_choice_beside_two_streams_harms_nobody(server):
    """The issue's exact request (min_tokens 8 with guided_choice) while two long streams run: on
    b7ef9fa all three streams ended with "internal server error: RuntimeError"."""

    def stream(body: dict, out: list) -> None:
        with httpx.Client(timeout=300) as client, client.stream("POST", server.url + CHAT, json={**body, "stream": True}) as r:
            out.append((r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]))

    long = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}], "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}
    results: list[list] = [[], [], []]
    threads = [threading.Thread(target=stream, args=(long, results[0])), threading.Thread(target=stream, args=(long, results[1]))]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stream({"messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 20, "min_tokens": 8,
            "guided_choice": ["yes", "no"]}, results[2])
    for t in threads:
        t.join(timeout=300)
    for (status, lines), which in zip((r[0] for r in results), ("long 1", "long 2", "choice")):
        assert status == 200 and lines[-1] == "[DONE]", which
        chunks = [json.loads(line) for line in lines[:-1]]
        assert not any("error" in c for c in chunks), (which, chunks[-1])
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
        assert finish == (["stop"] if which == "choice" else ["length"]), (which, finish)
    answer = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, results[2][0][1][:-1]) if c.get("choices"))
    assert answer in ("yes", "no")


# defect 3 ---------------------------------------------------------------------------------------

SURROGATE_CASES = [
    ("completion", COMP, b'{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),
    ("completion-stream", COMP, b'{"prompt": "a\\ud800b", "max_tokens": 4, "stream": true}', "prompt"),
    ("completion-list", COMP, b'{"prompt": ["ok", "a\\ud800b"], "max_tokens": 4}', "prompt.1"),
    ("tokenize", "/tokenize", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("chat", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}', "messages.0.content"),
]


@pytest.mark.parametrize("case", SURROGATE_CASES, ids=[c[0] for c in SURROGATE_CASES])
def test_lone_surrogate_is_a_400_naming_field_and_position(server, case):
    _, path, body, param = case
    with httpx.Client(timeout=60) as client:
        error = assert_error(post_raw(server.url, path, body, client), 400, "invalid_request", param, "\\ud800", "character 1")
        assert "template" not in error["message"]  # the chat template is not to blame
        # The same connection still serves: a paired surrogate (an emoji) is valid text.
        ok = post_raw(server.url, "/tokenize", b'{"prompt": "a\\ud83d\\ude00b"}', client)
        assert ok.status_code == 200 and ok.json()["count"] > 0


# defect 6 ---------------------------------------------------------------------------------------


def test_invalid_utf8_and_deep_nesting_are_invalid_json(server):
    bad_utf8 = assert_error(post_raw(server.url, COMP, b'{"prompt": "caf\xe9", "max_tokens": 2}'), 400, "invalid_json")
    assert "UTF-8" in bad_utf8["message"] and "e9" in bad_utf8["message"]
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = assert_error(post_raw(server.url, COMP, deep), 400, "invalid_json")
    assert "nested" in nested["message"]


# defect 7 ---------------------------------------------------------------------------------------


def test_wrong_method_is_405_with_allow(server):
    for method, path, allowed in (("GET", CHAT, "POST"), ("GET", COMP, "POST"), ("GET", "/tokenize", "POST"),
                                  ("POST", "/v1/models", "GET"), ("DELETE", "/health", "GET")):
        r = httpx.request(method, server.url + path, timeout=30)
        error = assert_error(r, 405, "method_not_allowed", None, method, path)
        assert r.headers["Allow"] == allowed, r.headers
        assert allowed in error["message"]
    assert "<html" in httpx.get(server.url + "/", timeout=30).text.lower()  # the playground is still there
    assert httpx.get(server.url + "/no-such-file.js", timeout=30).status_code == 404


def test_models_with_trailing_slash_is_the_list(server):
    listed = httpx.get(server.url + "/v1/models", timeout=30).json()
    slashed = httpx.get(server.url + "/v1/models/", timeout=30).json()
    assert slashed == listed and slashed["object"] == "list" and [m["id"] for m in slashed["data"]] == [MODEL]
    assert httpx.get(server.url + f"/v1/models/{MODEL}", timeout=30).json()["id"] == MODEL


# defect 8 ---------------------------------------------------------------------------------------

LOOSE = [
    ("max-tokens-bool", COMP, {"prompt": "Hi", "max_tokens": True}, "max_tokens", "True"),
    ("max-tokens-string", COMP, {"prompt": "Hi", "max_tokens": "3"}, "max_tokens", "'3'"),
    ("temperature-string", COMP, {"prompt": "Hi", "max_tokens": 2, "temperature": "0"}, "temperature", "'0'"),
    ("n-float", COMP, {"prompt": "Hi", "max_tokens": 2, "n": 2.0}, "n", "2.0"),
    ("chat-max-tokens-bool", CHAT, {"messages": HELLO, "max_tokens": True}, "max_tokens", "True"),
    ("stream-string", CHAT, {"messages": HELLO, "max_tokens": 2, "stream": "true"}, "stream", "'true'"),
    ("include-usage-int", CHAT, {"messages": HELLO, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "1"),
    ("detokenize-bool", "/detokenize", {"tokens": [False]}, "tokens.0", "False"),
]


@pytest.mark.parametrize("case", LOOSE, ids=[c[0] for c in LOOSE])
def test_loose_types_are_refused(server, case):
    _, path, body, param, shown = case
    assert_error(httpx.post(server.url + path, json=body, timeout=60), 400, "invalid_request", param, param, shown)


def test_ints_are_still_valid_floats(server):
    r = httpx.post(server.url + COMP, json={"prompt": "Hi", "max_tokens": 1, "temperature": 1, "top_p": 1}, timeout=120)
    assert r.status_code == 200, r.text


# defect 5 (last: it stops the module's server) ------------------------------------------------


def test_drain_timeout_ends_each_stream_with_an_error_event(server):
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 400, "ignore_eos": True, "stream": True}
    results: dict[int, list] = {}
    started = [threading.Event() for _ in range(3)]

    def stream(i: int) -> None:
        events = []
        try:
            with httpx.stream("POST", server.url + CHAT, json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                        started[i].set()
        except httpx.HTTPError as exc:
            events.append(exc)
        results[i] = events

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(e.wait(timeout=120) for e in started)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    assert server.proc.wait(timeout=60) == 0
    for i in range(3):
        events = results[i]
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["code"] == "shutting_down" and "--drain-timeout 1" in error["message"], error
        reasons = [c.get("finish_reason") for e in events if isinstance(e, dict) for c in e.get("choices", [])]
        assert "length" not in reasons and "stop" not in reasons, reasons  # cut short, not finished
    log = server.output()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert "aborting 3 request(s)" in log


# defect 9: a server with small connection limits ------------------------------------------------


def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything until the server closes, and how long that took (raises socket.timeout)."""
    sock.settimeout(timeout)
    t0, data = time.monotonic(), b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def _status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body) if body else {}


def test_slow_and_oversized_clients(tmp_path):
    proc = Serve(tmp_path, "--header-timeout", "1", "--body-timeout", "1", "--timeout-keep-alive", "1",
                 "--max-headers", "50", "--max-header-bytes", "16KiB")
    try:
        proc.wait_ready()
        addr = ("127.0.0.1", proc.port)
        # A connection that never sends a byte is closed after --header-timeout.
        with socket.create_connection(addr) as idle:
            data, waited = _read_all(idle, timeout=10)
            assert data == b"" and waited < 5
        # Half a request head: 408 naming the flag, then closed.
        with socket.create_connection(addr) as half:
            half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            data, waited = _read_all(half, timeout=10)
            status, body = _status_and_body(data)
            assert status == 408 and "--header-timeout" in body["error"]["message"] and waited < 5
        # A body that declares 1,000 bytes and sends 12: 408 naming --body-timeout, then closed.
        with socket.create_connection(addr) as short:
            short.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
            data, waited = _read_all(short, timeout=10)
            status, body = _status_and_body(data)
            assert status == 408 and body["error"]["code"] == "request_timeout" and "--body-timeout" in body["error"]["message"]
        # A 100 KB header, 5,000 headers, then 60 small ones (under the byte cap, over the count).
        either = ("--max-header-bytes", "--max-headers")  # whichever cap the head reaches first
        for extra, flags in ((b"X-Big: " + b"a" * 100_000 + b"\r\n", ("--max-header-bytes",)),
                             (b"".join(b"X-H%d: v\r\n" % i for i in range(5000)), either),
                             (b"".join(b"X-H%d: v\r\n" % i for i in range(60)), ("--max-headers",))):
            with socket.create_connection(addr) as big:
                try:
                    big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused before it finished sending: the answer is still to be read
                data, _ = _read_all(big, timeout=10)
                status, body = _status_and_body(data)
                assert status == 431 and any(f in body["error"]["message"] for f in flags), (flags, data[:300])
        # After a response, an idle kept-alive connection is closed after --timeout-keep-alive.
        with socket.create_connection(addr) as kept:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data, waited = _read_all(kept, timeout=10)
            assert data.startswith(b"HTTP/1.1 200") and waited < 5
        assert httpx.get(proc.url + "/health", timeout=10).status_code == 200
    finally:
        proc.stop()


# ---- through the app under uvicorn (a real server cannot be made to fail on purpose) ----------


class _BrokenTokenizer(FakeTokenizer):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "BOOM" in text:
            raise RuntimeError("tokenizer bug")
        return super().encode(text, add_special_tokens)


def test_unhandled_exception_is_a_json_500_and_the_client_carries_on():
    engine = FakeEngine()
    engine.tokenizer = _BrokenTokenizer()
    with ThreadServer(create_app(engine, MODEL, static_dir=None)) as live, httpx.Client(timeout=30) as client:
        for _ in range(3):
            r = client.post(live.url + COMP, json={"prompt": "BOOM", "max_tokens": 2})
            ok = client.post(live.url + COMP, json={"prompt": "fine", "max_tokens": 2})  # the same client
            assert ok.status_code == 200, ok.text
            error = assert_error(r, 500, "internal_error", None, "RuntimeError")
            assert error["type"] == "internal_error" and r.headers["Connection"] == "close"
        # On one raw connection: a 500 either says `Connection: close` or leaves the connection usable.
        with socket.create_connection(("127.0.0.1", live.port)) as sock:
            status, headers, body = _exchange(sock, _post_bytes(COMP, {"prompt": "BOOM", "max_tokens": 2}))
            assert status == 500 and json.loads(body)["error"]["code"] == "internal_error"
            if headers.get("connection") != "close":
                status, _, _ = _exchange(sock, _post_bytes(COMP, {"prompt": "fine", "max_tokens": 2}))
                assert status == 200
        metrics = client.get(live.url + "/metrics").text
        assert metric_value(metrics, "quill_request_errors_total", {"code": "internal_error", "status": "500"}) == 4


def _post_bytes(path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


def _exchange(sock: socket.socket, request: bytes) -> tuple[int, dict, bytes]:
    """Send one request on an open connection and read one Content-Length response."""
    sock.settimeout(10)
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without answering (got {data!r})"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(lines[0].split(" ", 2)[1]), headers, body


def test_request_failed_is_a_500_or_an_error_event_and_counted():
    engine = FakeEngine()
    with ThreadServer(create_app(engine, MODEL, static_dir=None)) as live, httpx.Client(timeout=30) as client:
        before = client.get(live.url + "/metrics").text
        assert 'quill_requests_total{finish_reason="error"} 0.0' in before
        body = {"prompt": "FAIL_REQUEST", "max_tokens": 20, "ignore_eos": True, "temperature": 0}
        r = client.post(live.url + COMP, json=body)
        error = assert_error(r, 500, "request_failed", None, "simulated")
        assert error["type"] == "internal_error" and "Connection" not in r.headers  # this connection stays usable
        assert client.post(live.url + COMP, json={"prompt": "fine", "max_tokens": 2}).status_code == 200
        with client.stream("POST", live.url + COMP, json={**body, "stream": True}) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "request_failed"
        # a stream whose request fails before its first output is still a 200 with the error event
        with client.stream("POST", live.url + COMP, json={**body, "prompt": "FAIL_EARLY", "stream": True}) as response:
            assert response.status_code == 200
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "request_failed"
        metrics = client.get(live.url + "/metrics").text
        assert metric_value(metrics, "quill_requests_total", {"finish_reason": "error"}) == 3
        assert metric_value(metrics, "quill_request_errors_total", {"code": "request_failed", "status": "500"}) == 3


def test_fault_header_reaches_the_engine():
    engine = FakeEngine()
    with ThreadServer(create_app(engine, MODEL, static_dir=None)) as live:
        r = httpx.post(live.url + COMP, json={"prompt": "x", "max_tokens": 2}, headers={"X-Quill-Fault": "sample"})
        assert r.status_code == 200
        assert list(engine.received_faults.values()) == ["sample"]
        httpx.post(live.url + COMP, json={"prompt": "x", "max_tokens": 2})
        assert len(engine.received_faults) == 1  # no header, no fault


def test_unknown_field_warning_is_per_app(caplog):
    caplog.set_level(logging.WARNING, logger="quill.server")
    for _ in range(2):
        with ThreadServer(create_app(FakeEngine(), MODEL, static_dir=None)) as live:
            for _ in range(2):
                httpx.post(live.url + COMP, json={"prompt": "x", "max_tokens": 1, "frobnicate": 1})
    warnings = [r for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(warnings) == 2  # once per app, not once per process


# ---- defect 10: chat templates are bounded --------------------------------------------------------

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE_TEMPLATES = [
    ("nested-loops", NESTED_LOOPS, "s"),
    ("nested-loops-output", "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", " s"),
    ("repeat", "{{ 'x' * 500000000 }}", "characters"),
    ("filter-width", "{{ 'x'|center(500000000) }}", "500,000,000"),
    ("method-width", "{{ 'x'.ljust(500000000) }}", "500,000,000"),
    ("doubling", "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "characters"),
    ("macro-doubling", "{% macro d(s, n) %}{{ d(s ~ s, n - 1) if n else s }}{% endmacro %}{{ d('x', 40) }}", "characters"),
    ("power", "{{ 7 ** 100000000 }}", "exponent"),
    ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
]


@pytest.mark.parametrize("case", HOSTILE_TEMPLATES, ids=[c[0] for c in HOSTILE_TEMPLATES])
def test_hostile_chat_template_is_bounded(case):
    _, template, word = case
    from quill.chat_template import ChatTemplateLimitError  # inside: the test file must load without it

    t0 = time.monotonic()
    with pytest.raises(ChatTemplateLimitError) as info:
        render_chat_template(template, [{"role": "user", "content": "hi"}], max_seconds=0.5)
    assert word in str(info.value) and time.monotonic() - t0 < 5


def test_ordinary_templates_still_render():
    template = ("{% for m in messages %}{{ loop.index }}<{{ m.role }}>{{ m.content | trim }}{% if not loop.last %}|{% endif %}"
                "{% endfor %}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                "[{{ ns.n }}]{{ 'ab' * 2 }}{{ [1] + [2] }}{{ 2 ** 10 }}")
    messages = [{"role": "user", "content": " a "}, {"role": "assistant", "content": "b"}]
    assert render_chat_template(template, messages) == "1<user>a|2<assistant>b[2]abab[1, 2]1024"
    with pytest.raises(ChatTemplateError, match="reserves"):
        render_chat_template("{% set _quill_loop_items = 1 %}", messages)


class _TemplateTokenizer(FakeTokenizer):
    template = NESTED_LOOPS

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return render_chat_template(self.template, messages, add_generation_prompt=add_generation_prompt)


def test_hostile_template_is_a_400_and_the_server_stays_responsive():
    engine = FakeEngine()
    engine.tokenizer = _TemplateTokenizer()
    with ThreadServer(create_app(engine, MODEL, static_dir=None)) as live:
        results = {}
        worker = threading.Thread(target=lambda: results.update(r=httpx.post(
            live.url + CHAT, json={"messages": HELLO, "max_tokens": 2}, timeout=15)))
        worker.start()
        time.sleep(0.3)
        t0 = time.monotonic()  # the render runs off the event loop: health answers meanwhile
        assert httpx.get(live.url + "/health", timeout=5).status_code == 200 and time.monotonic() - t0 < 1.0
        worker.join(timeout=20)
        assert_error(results["r"], 400, "invalid_request", "messages", "exceeded the limit of 2 s")
