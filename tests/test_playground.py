"""Browser tests of the web playground at `/`: headless Debian chromium against a real `quill serve`,
and against the server app around a scripted fake engine for what the default model cannot be made
to write (reasoning, tool calls)."""

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

    def __init__(self, browser, url, width=1280, height=800, model="SmolLM2"):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.url = url
        self.model = model

    def open(self):
        self.page.goto(self.url + "/")
        self.page.wait_for_selector(f"#model-name:has-text('{self.model}')")
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


# ---- reasoning and tool calls: the server app around a scripted fake engine ----

FAKE_MODEL = "fake-model"
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Today's weather in a city",
                                                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                                 "required": ["city"]}}}
# Hermes / Qwen markup: the template renders tools, calls and results as Qwen2.5's does, so the
# server reads calls out of the fake model's <tool_call> text once it parses tool calls.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '\\nCall one as <tool_call>\\n"
    "{\"name\": ..., \"arguments\": ...}\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{- '<tool_call>\\n' + (c.function | tojson) + '\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
THOUGHT = "I add 2 and 2.\nThat gives <b>4</b>, <img src=x onerror=\"window.__pwned=5\">."


def fake_script(prompt: str) -> str:
    """What the fake model writes (greedy, one token per character), from the rendered prompt."""
    if "<tool_response>" in prompt:
        return "<think>\nThe tool answered.\n</think>\n\nIt is 18 C in Paris."
    if "weather" in prompt:
        return '<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    if "2+2" in prompt:
        return f"<think>\n{THOUGHT}\n</think>\n\nThe answer is **4**."
    return "<think>\nA short one.\n</think>\n\nNoted."


@pytest.fixture(scope="module")
def fake():
    """The playground and API around a FakeEngine whose answers fake_script picks; yields the base URL."""
    from fake_engine import FakeEngine, FakeTokenizer
    from quill.chat_template import render_chat_template
    from quill.server.app import STATIC_DIR, create_app
    from server_utils import ThreadServer

    class HermesTokenizer(FakeTokenizer):
        chat_template = HERMES_TEMPLATE

        def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
            return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **kwargs)

        def encode_chat(self, messages, add_generation_prompt=True, **kwargs):
            return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs))

    # 10 ms a token: the reasoning streams for about a second, long enough to open it mid-stream.
    engine = FakeEngine(max_model_len=4096, token_delay=0.01, greedy_text=fake_script)
    engine.tokenizer = HermesTokenizer()
    app = create_app(engine, FAKE_MODEL, static_dir=STATIC_DIR, reasoning_format="deepseek")
    with ThreadServer(app) as server:
        yield server.url


@pytest.fixture
def fake_desk(browser, fake):
    p = Page(browser, fake, model=FAKE_MODEL)
    yield p
    p.close()


def capture_chat_requests(page) -> list[dict]:
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    return bodies


WATCH_REASONING = """() => {
  window.__thoughts = [];
  new MutationObserver(() => {
    const text = document.querySelector('#messages .msg.assistant .reasoning .reasoning-text');
    if (text) window.__thoughts.push(text.textContent.length);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""


def test_reasoning_streams_into_a_collapsed_block_and_goes_back_apart(fake_desk, shot_dir):
    page = fake_desk.open()
    sent = capture_chat_requests(page)
    set_setting(page, "temperature", "0")
    page.evaluate(WATCH_REASONING)
    send(page, "What is 2+2?")
    summary = "#messages .msg.assistant details.reasoning > summary"
    page.wait_for_selector(summary + ":has-text('Thinking')")
    assert page.get_attribute("#messages .msg.assistant details.reasoning", "open") is None, "reasoning must start collapsed"
    page.click(summary)  # opened while it streams: it stays open through every redraw
    wait_idle(page)

    answer = page.locator("#messages .msg.assistant")
    details = answer.locator("details.reasoning")
    assert details.get_attribute("open") is not None
    assert details.locator(".reasoning-text").inner_text() == THOUGHT
    lengths = [n for n in page.evaluate("window.__thoughts") if n > 0]
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), f"the reasoning did not stream in: {lengths}"
    assert details.locator("b, img").count() == 0 and page.evaluate("window.__pwned") is None
    reasoning_tokens = len(f"<think>\n{THOUGHT}\n</think>")  # one token per character, up to </think>
    assert details.locator("summary").inner_text() == f"Thought for {reasoning_tokens} tokens"
    body = answer.locator(".body")
    assert body.inner_text().strip() == "The answer is 4." and body.locator("strong").inner_text() == "4"
    assert "think>" not in answer.inner_text() + body.text_content()
    assert page.locator("#timeline .tl-cell.thinking").count() == reasoning_tokens
    assert page.locator("#timeline .tl-cell").count() == gauge(page, "#messages .msg.assistant", "output")
    page.screenshot(path=str(shot_dir / "playground-reasoning.png"))

    page.reload()  # kept in the saved chat, collapsed again
    page.wait_for_selector("#messages .msg.assistant details.reasoning")
    assert page.get_attribute("#messages .msg.assistant details.reasoning", "open") is None
    assert not page.is_visible("#messages .msg.assistant .reasoning-text")
    page.press("#messages .msg.assistant details.reasoning > summary", "Enter")  # keyboard opens it too
    assert page.inner_text("#messages .msg.assistant .reasoning-text") == THOUGHT

    sent = capture_chat_requests(page)
    send(page, "Thanks.")
    wait_idle(page)
    assert "reasoning_format" not in sent[0]  # the server's default splits the reasoning
    assert sent[0]["messages"][1:3] == [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "The answer is **4**.", "reasoning_content": THOUGHT},
    ]
    first, second = (page.locator("#messages .msg.assistant details.reasoning").nth(i) for i in (0, 1))
    assert first.get_attribute("open") is not None and second.get_attribute("open") is None  # the new one starts collapsed


def test_tools_box_must_hold_a_json_array(fake_desk):
    page = fake_desk.open()
    sent = capture_chat_requests(page)
    tools = "#settings [name=tools]"
    assert page.input_value(tools) == "" and page.input_value("#settings [name=tool_choice]") == "auto"
    for text, message in [('[{"type": "function",', "Tools (JSON): not valid JSON"),
                          (json.dumps(WEATHER_TOOL), "Tools (JSON): must be a JSON array of tools, got an object"),
                          ('[{"name": "get_weather"}]', 'Tools (JSON): item 0 must be {"type": "function"')]:
        set_setting(page, "tools", text)
        assert page.is_visible("#settings-error") and message in page.inner_text("#settings-error"), text
        assert page.get_attribute(tools, "aria-invalid") == "true"
        send(page, "Hello?")
        page.wait_for_selector("#composer-error", state="visible")
        assert page.inner_text("#composer-error").startswith("Not sent: " + message)
        assert page.input_value("#prompt") == "Hello?" and sent == []  # nothing sent, the prompt kept
    assert page.locator("#messages .msg").count() == 0

    set_setting(page, "tools", json.dumps([WEATHER_TOOL], indent=2))
    page.select_option("#settings [name=tool_choice]", "none")
    assert not page.is_visible("#settings-error") and not page.is_visible("#composer-error")
    assert page.get_attribute(tools, "aria-invalid") is None
    set_setting(page, "temperature", "0")
    page.press("#prompt", "Enter")
    wait_idle(page)
    assert sent[0]["tools"] == [WEATHER_TOOL] and sent[0]["tool_choice"] == "none"
    assert page.locator("#messages .msg.assistant .body").inner_text().strip() == "Noted."


def call_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def fragment(index: int, **fields) -> dict:
    return call_chunk({"tool_calls": [{"index": index, **fields}]})


# Two parallel calls whose fragments interleave; the second's arguments are not JSON and its
# name is hostile text.
TWO_CALLS = sse(
    call_chunk({"role": "assistant", "content": ""}),
    call_chunk({"reasoning_content": "Two lookups."}),
    fragment(0, id="call_a", type="function", function={"name": "get_weather", "arguments": ""}),
    fragment(1, id="call_b", type="function", function={"name": "<img src=x onerror=window.__pwned=6>", "arguments": ""}),
    fragment(0, function={"arguments": '{"city": '}),
    fragment(1, function={"arguments": "<script>window.__pwned=7</script>"}),
    fragment(0, function={"arguments": '"Paris", "days": [1, 2]}'}),
    call_chunk({}, "tool_calls"),
)
AFTER_TOOLS = sse(call_chunk({"content": "Sunny, then <b>rain</b>."}), call_chunk({}, "stop"))


def test_tool_calls_build_from_fragments_and_results_go_back(fake_desk, shot_dir):
    page = fake_desk.open()
    bodies: list = []
    page.route("**/v1/chat/completions", lambda route: (bodies.append(route.request.post_data_json), route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=TWO_CALLS if len(bodies) == 1 else AFTER_TOOLS)))
    set_setting(page, "tools", json.dumps([WEATHER_TOOL]))
    page.select_option("#settings [name=tool_choice]", "required")
    scripts_before = page.locator("script").count()
    send(page, "Weather in Paris, twice?")
    wait_idle(page)
    assert bodies[0]["tools"] == [WEATHER_TOOL] and bodies[0]["tool_choice"] == "required"

    calls = page.locator("#messages .msg.assistant .tool-call")
    assert calls.count() == 2
    assert page.locator("#messages .tool-call details[open]").count() == 0, "tool calls must start collapsed"
    first, second = calls.nth(0), calls.nth(1)
    assert first.locator("summary .tool-name").inner_text() == "get_weather"
    assert first.locator("summary .tool-preview").inner_text() == '{"city":"Paris","days":[1,2]}'
    assert not first.locator("pre").is_visible()
    first.locator("summary").click()
    assert first.locator("pre").inner_text() == json.dumps({"city": "Paris", "days": [1, 2]}, indent=2)
    second.locator("summary").click()
    assert second.locator("pre").inner_text() == "<script>window.__pwned=7</script>"
    assert "not valid JSON" in second.inner_text()
    assert second.locator("summary .tool-name").inner_text() == "<img src=x onerror=window.__pwned=6>"
    assert page.locator("#messages img").count() == 0 and page.locator("script").count() == scripts_before
    assert page.evaluate("window.__pwned") is None
    assert "finish: tool_calls" in page.inner_text("#messages .msg.assistant .foot")
    page.screenshot(path=str(shot_dir / "playground-tool-calls.png"))

    # A result for each call; the model continues once both have one.
    first.get_by_label("Reply with tool result for get_weather").fill('{"sky": "sunny"}')
    first.get_by_label("Reply with tool result for get_weather").press("Enter")
    assert len(bodies) == 1 and page.locator("#messages .msg.tool").count() == 1
    reply = page.locator("#messages .tool-reply input")
    assert reply.count() == 1 and page.evaluate("document.activeElement.name") == "tool_result"
    page.keyboard.type("rain")
    page.keyboard.press("Enter")
    wait_idle(page)
    assert len(bodies) == 2 and page.locator("#messages .tool-reply").count() == 0
    assert page.locator("#messages .msg.assistant").nth(1).locator(".body").inner_text().strip() == "Sunny, then <b>rain</b>."
    assert bodies[1]["messages"][1:] == [
        {"role": "user", "content": "Weather in Paris, twice?"},
        {"role": "assistant", "content": None, "reasoning_content": "Two lookups.", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}},
            {"id": "call_b", "type": "function", "function": {"name": "<img src=x onerror=window.__pwned=6>",
                                                             "arguments": "<script>window.__pwned=7</script>"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "sunny"}'},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
    ]
    page.reload()  # the tool turn and its results stay in the saved chat
    page.wait_for_selector("#messages .msg.tool")
    assert page.locator("#messages .tool-call").count() == 2 and page.locator("#messages .msg.tool").count() == 2
    page.set_viewport_size({"width": 375, "height": 740})
    page.locator("#messages .tool-call summary").first.click()
    assert no_overflow(page), page.evaluate("document.documentElement.scrollWidth")
    page.screenshot(path=str(shot_dir / "playground-phone-tool-results.png"))


def test_tool_call_round_trip_through_the_server(fake_desk, fake, shot_dir):
    page = fake_desk.open()
    sent = capture_chat_requests(page)
    set_setting(page, "temperature", "0")
    set_setting(page, "tools", json.dumps([WEATHER_TOOL]))
    send(page, "What is the weather in Paris?")
    wait_idle(page)
    answer = page.locator("#messages .msg.assistant")
    call = answer.locator(".tool-call")
    assert call.count() == 1 and call.locator("details").get_attribute("open") is None
    assert call.locator("summary .tool-name").inner_text() == "get_weather"
    assert "<tool_call>" not in answer.text_content() and "think>" not in answer.text_content()
    assert answer.locator("details.reasoning .reasoning-text").text_content() == "I need the weather tool."
    assert "finish: tool_calls" in answer.locator(".foot").inner_text()
    cells = page.locator("#timeline .tl-cell").count()
    assert cells == gauge(page, "#messages .msg.assistant", "output") and f"= {cells} generated tokens" in page.inner_text("#timeline")
    call.locator("summary").click()
    assert call.locator("pre").inner_text() == json.dumps({"city": "Paris"}, indent=2)
    page.screenshot(path=str(shot_dir / "playground-tool-round-trip.png"))

    call.get_by_label("Reply with tool result for get_weather").fill("18 C")
    call.get_by_role("button", name="Send result").click()
    wait_idle(page)
    assert page.locator("#messages .msg.assistant").nth(1).locator(".body").inner_text().strip() == "It is 18 C in Paris."
    assert sent[0]["tools"] == [WEATHER_TOOL] and sent[0]["tool_choice"] == "auto"
    turn, result = sent[1]["messages"][2:]
    call_id = turn["tool_calls"][0]["id"]
    assert call_id and turn["content"] is None and turn["reasoning_content"] == "I need the weather tool."
    assert turn["tool_calls"] == [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": turn["tool_calls"][0]["function"]["arguments"]}}]
    assert json.loads(turn["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert result == {"role": "tool", "tool_call_id": call_id, "content": "18 C"}
