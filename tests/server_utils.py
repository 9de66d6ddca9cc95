"""Helpers for server tests: a uvicorn server in a thread, raw-socket clients, /metrics parsing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

import quill


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """Runs an ASGI app under uvicorn on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def post_then_close(port: int, path: str, body: dict, *, read_bytes: int = 0, wait_s: float = 0.3, headers: dict | None = None,
                    until: threading.Event | None = None) -> bytes:
    """POST over a raw socket; read `read_bytes` of the answer (0: none), wait (`wait_s`, or
    until `until` is set), then hang up."""
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n{extra}\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(head + payload)
        received = b""
        sock.settimeout(30)
        while len(received) < read_bytes:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        if until is not None:
            until.wait(timeout=600)
        else:
            time.sleep(wait_s)
        return received
    finally:
        sock.close()


def read_sse_then_close(url: str, body: dict, num_chunks: int, headers: dict | None = None) -> list[dict]:
    """Stream a request, keep the first `num_chunks` data events, then drop the connection."""
    events: list[dict] = []
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url, json=body, headers=headers or {}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) >= num_chunks:
                        break
    return events


def metric_value(text: str, name: str, labels: dict | None = None) -> float:
    """The value of one sample in Prometheus text format (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in (labels or {}).items())
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        sample, _, label_text = key.partition("{")
        if sample == name and label_text.rstrip("}") == want:
            return float(value)
    return 0.0


def wait_until(predicate, timeout: float = 2.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class ServeProcess:
    """`python -m quill.cli serve` on a free port, importing the same quill as the tests (so a test
    run from another checkout drives that checkout's server); records /health while it starts.
    The test that starts one stops it, by its PID (stop())."""

    def __init__(self, log_dir: Path, *flags: str, model_name: str = "quill-test"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        self.log = open(self.log_path, "w")
        root = Path(quill.__file__).parents[1]
        cmd = [sys.executable, "-m", "quill.cli", "serve", "--port", str(self.port), "--served-model-name", model_name, *flags]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=root)
        self.health_seen: list[int] = []
        self.headers: dict = {}  # sent to /v1/stats (behind --api-key when set)

    def wait_ready(self, timeout: float = 300.0) -> "ServeProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"quill serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
                self.health_seen.append(status)
                if status == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"quill serve not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@contextlib.contextmanager
def serving(log_dir: Path, *flags: str, client_timeout: float = 300.0, **kwargs):
    """A ready ServeProcess with `.client`, the official openai client on it; stopped on exit."""
    import openai

    proc = ServeProcess(log_dir, *flags, **kwargs)
    try:
        proc.wait_ready()
        proc.client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0, timeout=client_timeout)
        yield proc
    finally:
        proc.stop()
