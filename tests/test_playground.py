"""Browser tests of the web playground at `/`: headless Debian chromium against a real `quill serve`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"]
REPO = Path(__file__).resolve().parent.parent

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the Python package) is not installed")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real `quill serve` subprocess; yields its base URL."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    # One engine thread: the browser needs a core too, and spin-waiting engine threads slow
    # down badly when the machine is oversubscribed.
    cmd = [sys.executable, "-m", "quill.cli", "serve", "--port", str(port), "--kv-cache-memory", "256MiB",
           "--max-model-len", "512", "--threads", "1"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"quill serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"quill serve not healthy after 180 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def browser():
    pw = sync_api.sync_playwright().start()
    try:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
    except Exception as exc:
        pw.stop()
        pytest.skip(f"chromium did not start: {exc}")
    yield chromium
    chromium.close()
    pw.stop()


@pytest.fixture(scope="module")
def shot_dir(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("QUILL_SCREENSHOT_DIR") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


class Page:
    """A fresh browser context (empty localStorage) on the playground, collecting page errors."""

    def __init__(self, browser, url, width=1280, height=800):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.url = url

    def open(self):
        self.page.goto(self.url + "/")
        self.page.wait_for_selector("#model-name:has-text('SmolLM2')")
        return self.page

    def close(self):
        self.context.close()
        assert self.errors == [], f"JavaScript errors on the page: {self.errors}"


@pytest.fixture
def desk(browser, server):
    p = Page(browser, server)
    yield p
    p.close()


@pytest.fixture
def phone(browser, server):
    p = Page(browser, server, 375, 740)
    yield p
    p.close()


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/stats", timeout=10).json()["engine"]


def set_setting(page, name: str, value: str) -> None:
    page.fill(f"#settings [name={name}]", value)


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_idle(page, timeout_ms=60_000) -> None:
    # Selectors, not wait_for_function: the page's CSP forbids the eval that the latter needs.
    page.wait_for_selector("body[data-streaming='0']", state="attached", timeout=timeout_ms)


def gauge(page, scope: str, name: str) -> float:
    value = page.get_attribute(f"{scope} [data-gauge={name}]", "data-value")
    return float(value) if value else float("nan")


WATCH_TEXT = """() => {
  window.__lengths = [];
  new MutationObserver(() => {
    const bodies = document.querySelectorAll('#messages .msg.assistant .body');
    const last = bodies[bodies.length - 1];
    if (last) window.__lengths.push(last.textContent.length);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""


def test_chat_streams_with_gauges_timeline_and_persists(desk, server, shot_dir):
    page = desk.open()
    set_setting(page, "max_tokens", "24")
    set_setting(page, "seed", "7")
    before = stats(server)["generation_tokens"]
    page.evaluate(WATCH_TEXT)
    send(page, "Tell me a story about a cat who learns to sail.")
    page.wait_for_selector("#stop", state="visible")
    wait_idle(page)

    lengths = [n for n in page.evaluate("window.__lengths") if n > 0]
    assert len(set(lengths)) >= 3, f"answer text did not grow while streaming: {lengths}"
    assert lengths == sorted(lengths), f"answer text shrank while streaming: {lengths}"

    answer = "#messages .msg.assistant"
    assert page.inner_text(answer + " .body").strip()
    for name in ("ttft", "tps", "tpot", "prompt", "output"):
        assert gauge(page, answer, name) > 0, f"gauge {name} is not > 0"
    assert page.get_attribute(answer + " .answer-gauges", "data-source") == "server"
    assert gauge(page, "#server-gauges", "running") >= 0
    assert "/" in page.inner_text("#server-gauges [data-gauge=kv]")

    cells = page.locator("#timeline .tl-cell").count()
    generated = stats(server)["generation_tokens"] - before
    assert cells == gauge(page, answer, "output") == generated, (cells, gauge(page, answer, "output"), generated)
    assert page.locator("#timeline .tl-prefill").count() == 1
    assert "= %d generated tokens" % cells in page.inner_text("#timeline")
    page.hover("#timeline .tl-cell:nth-child(3)")  # the second generated token
    assert page.inner_text("#timeline .tl-readout").startswith("#2 ")
    page.screenshot(path=str(shot_dir / "playground-desktop.png"))

    page.reload()
    page.wait_for_selector(answer)
    assert page.locator("#timeline .tl-cell").count() == cells, "the conversation did not survive a reload"
    page.click("#new-chat")
    assert page.locator("#messages .msg").count() == 0
    assert page.locator("#chat-list li").count() == 2


def test_stop_aborts_the_request_on_the_server(desk, server):
    page = desk.open()
    set_setting(page, "max_tokens", "400")
    set_setting(page, "temperature", "0")  # greedy counts for ~190 tokens; sampling may stop at once
    aborted_before = stats(server)["num_requests_finished"].get("abort", 0)
    send(page, "Count from 1 to 300, one number per line.")
    page.wait_for_selector("#timeline .tl-cell:nth-child(4)", timeout=60_000)  # prefill block, then 3 cells
    page.wait_for_selector("#server-gauges [data-gauge=running]:not([data-value='0']):not([data-value=''])")
    page.click("#stop")
    wait_idle(page, 10_000)
    assert "stopped" in page.inner_text("#messages .msg.assistant .foot")
    assert page.inner_text("#timeline .tl-end") == "stopped"
    assert page.is_visible("#send") and not page.is_visible("#stop")
    deadline = time.monotonic() + 15
    while stats(server)["num_requests_finished"].get("abort", 0) <= aborted_before:
        assert time.monotonic() < deadline, "the server did not count the request as aborted"
        time.sleep(0.2)


def test_too_long_prompt_shows_the_error(desk):
    page = desk.open()
    send(page, "hello " * 600)
    page.wait_for_selector("#messages .msg.error")
    text = page.inner_text("#messages .msg.error")
    assert "HTTP 400" in text and "this model's context is 512 tokens" in text, text
    assert page.is_visible("#send")


def sse(*chunks: dict) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def token_chunk(text: str | None, finish: str | None = None) -> dict:
    logprobs = {"content": [{"token": text or "", "logprob": -0.1, "bytes": None, "top_logprobs": []}]}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": finish}]}


HOSTILE = ["Look: ", "<script>window.__pwned=1</script>", " <img src=x onerror=\"window.__pwned=2\">",
           " **bold** `code` [bad](javascript:window.__pwned=3) [ok](https://example.com)\n\n",
           "```html\n<script>window.__pwned=4</script>\n```\n", "- one\n- two"]
CANNED = sse(
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    *[token_chunk(t) for t in HOSTILE],
    token_chunk(None, "stop"),
    {"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": len(HOSTILE) + 1, "total_tokens": 27},
     "timings": {"prompt_n": 20, "cache_n": 0, "prompt_ms": 5.0, "ttft_ms": 6.0, "tpot_ms": 2.0, "predicted_per_second": 500.0}},
)


def route_canned(page, bodies: list, status=200, body=CANNED, headers=None):
    def handle(route):
        bodies.append({**route.request.post_data_json, "_auth": route.request.headers.get("authorization")})
        content_type = "text/event-stream" if status == 200 else "application/json"
        route.fulfill(status=status, headers={"content-type": content_type, **(headers or {})}, body=body)

    page.route("**/v1/chat/completions", handle)


def test_model_output_is_text_never_html(desk, shot_dir):
    page = desk.open()
    bodies: list = []
    route_canned(page, bodies)
    set_setting(page, "json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    set_setting(page, "stop", "END\\n")
    set_setting(page, "api_key", "sekret")
    page.click("#system-box summary")
    page.fill("#system-prompt", "Be terse.")
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.locator("#prompt").press_sequentially("second")
    assert page.input_value("#prompt") == "first line\nsecond" and bodies == []
    scripts_before = page.locator("script").count()
    send(page, "Say something dangerous.")
    wait_idle(page)
    body = page.locator("#messages .msg.assistant .body")
    assert "<script>window.__pwned=1</script>" in body.inner_text()
    assert page.locator("script").count() == scripts_before
    assert page.locator("#messages img").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert [a.get_attribute("href") for a in body.locator("a").all()] == ["https://example.com"]
    assert body.locator("strong").inner_text() == "bold"
    assert "<script>window.__pwned=4</script>" in body.locator("pre code").inner_text()
    assert body.locator("li").count() == 2
    assert page.locator("#timeline .tl-cell").count() == len(HOSTILE) + 1
    page.screenshot(path=str(shot_dir / "playground-desktop-markdown.png"))

    sent = bodies[0]
    assert sent.pop("_auth") == "Bearer sekret"
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["max_tokens"] == 256 and sent["stop"] == ["END\n"]
    assert sent["response_format"]["type"] == "json_schema"
    assert sent["response_format"]["json_schema"]["schema"]["properties"]["a"] == {"type": "integer"}
    assert sent["messages"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say something dangerous."}]
    assert sent["logprobs"] is True  # one chunk per token, so one timeline cell per token

    page.check("#settings [name=colour_tokens]")
    assert page.locator("#messages .tok").count() == len(HOSTILE)
    assert page.locator("script").count() == scripts_before
    assert "<script>" in page.inner_text("#messages .tokens")

    page.click("#messages .regenerate")
    wait_idle(page)
    assert len(bodies) == 2 and bodies[1]["messages"] == sent["messages"]
    assert page.locator("#messages .msg.assistant").count() == 1


def test_busy_server_error_is_readable(desk):
    page = desk.open()
    error = {"error": {"message": "the queue is full (4 waiting)", "type": "server_error", "param": None, "code": "queue_full"}}
    route_canned(page, [], status=503, body=json.dumps(error), headers={"Retry-After": "1"})
    send(page, "Hello?")
    page.wait_for_selector("#messages .msg.error")
    assert "HTTP 503: the queue is full (4 waiting) (retry after 1 s)" in page.inner_text("#messages .msg.error")


def no_overflow(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth") <= 375


def test_phone_layout(phone, shot_dir):
    page = phone.open()
    long_line = "x = " + "1234567890" * 20
    many = [token_chunk(" t%d" % i) for i in range(200)]  # 200 cells: wider than the phone
    wide = sse(token_chunk("A long code line and a long word " + "w" * 120 + ":\n\n```\n" + long_line + "\n```\n"), *many,
               token_chunk(None, "stop"))
    route_canned(page, [], body=wide)
    assert not page.is_visible("#settings-panel")
    send(page, "Show me a wide thing, https://example.com/" + "a" * 80)
    wait_idle(page)
    assert page.locator("#messages .msg.assistant pre").count() == 1
    assert page.locator("#timeline .tl-cell").count() == 202
    assert page.evaluate("(s => s.scrollWidth > s.clientWidth)(document.querySelector('.tl-strip'))"), "the timeline should scroll inside itself"
    assert no_overflow(page), page.evaluate("document.documentElement.scrollWidth")

    page.unroute("**/v1/chat/completions")
    page.click("#toggle-settings")
    assert page.is_visible("#settings-panel") and no_overflow(page)
    set_setting(page, "max_tokens", "16")
    page.screenshot(path=str(shot_dir / "playground-phone-settings.png"))
    page.click("#settings-panel .drawer-close")
    assert not page.is_visible("#settings-panel")
    page.click("#toggle-chats")
    page.click("#new-chat")  # the canned answer is longer than the 512-token context
    assert not page.is_visible("#chats-panel")
    send(page, "What is the capital of France?")
    wait_idle(page)
    assert page.locator("#messages .msg.assistant").count() == 1, page.inner_text("#messages")
    assert 0 < page.locator("#timeline .tl-cell").count() <= 16
    assert no_overflow(page), page.evaluate("document.documentElement.scrollWidth")
    page.screenshot(path=str(shot_dir / "playground-phone.png"))

    page.click("#toggle-chats")
    assert page.is_visible("#chats-panel") and no_overflow(page)
    page.click("#scrim", position={"x": 360, "y": 400})
    assert not page.is_visible("#chats-panel")
