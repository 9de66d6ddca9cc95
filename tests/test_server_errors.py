"""Every bad input gets its status and an OpenAI error body; the server stays healthy."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from fake_engine import FakeEngine
from quill.server.app import attach_engine, create_app
from server_utils import ThreadServer, read_sse_then_close, wait_until

MODEL = "fake-model"
HELLO = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(max_model_len=128)
    with ThreadServer(create_app(engine, MODEL, max_body_bytes=4096, static_dir=None)) as server:
        server.engine = engine
        yield server


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": HELLO, **fields}


# (id, path, body (dict, or bytes sent as-is), expected status, expected param (or None), expected code (or None))
BAD_INPUTS = [
    ("invalid-json", CHAT, b'{"model": "fake-model", "messages": [', 400, None, "invalid_json"),
    ("body-not-object", CHAT, b"[1, 2, 3]", 400, None, None),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", None),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages", None),
    ("bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role", None),
    ("content-wrong-type", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content", None),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages", None),
    ("template-rejects", CHAT, chat(messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]), 400, "messages", None),
    ("temperature-type", CHAT, chat(temperature="hot"), 400, "temperature", None),
    ("temperature-range", CHAT, chat(temperature=-1), 400, "temperature", None),
    ("temperature-nan", CHAT, b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, None, None),
    ("top-p-range", CHAT, chat(top_p=0), 400, "top_p", None),
    ("n-zero", CHAT, chat(n=0), 400, "n", None),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    ("max-completion-tokens-neg", CHAT, chat(max_completion_tokens=-3), 400, "max_completion_tokens", None),
    ("top-logprobs-range", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", None),
    ("top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, "top_logprobs", None),
    ("presence-range", CHAT, chat(presence_penalty=3), 400, "presence_penalty", None),
    ("too-many-stops", CHAT, chat(stop=[f"s{i}" for i in range(17)]), 400, "stop", None),
    ("stop-token-out-of-vocab", CHAT, chat(stop_token_ids=[99999]), 400, "stop_token_ids", None),
    ("two-constraints", CHAT, chat(guided_regex="a+", guided_choice=["a"]), 400, "guided_regex", None),
    ("engine-param-error", CHAT, chat(guided_regex="("), 400, "guided_regex", None),
    ("response-format-type", CHAT, chat(response_format={"type": "xml"}), 400, "response_format", None),
    ("logit-bias-out-of-vocab", CHAT, chat(logit_bias={"260": 10}), 400, "logit_bias", None),
    ("logit-bias-range", COMP, {"model": MODEL, "prompt": "x", "logit_bias": {"5": -100.5}}, 400, "logit_bias", None),
    ("tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "two words"}}]), 400, "tools[0].function.name", "invalid_request"),
    ("seed-range", CHAT, chat(seed=2**70), 400, "seed", None),
    ("context-exceeded", CHAT, chat(max_tokens=120), 400, "max_tokens", "context_length_exceeded"),
    ("prompt-too-long", CHAT, chat(messages=[{"role": "user", "content": "x" * 200}]), 400, "messages", "context_length_exceeded"),
    ("unknown-model", CHAT, chat(model="gpt-9"), 404, "model", "model_not_found"),
    ("body-too-large", CHAT, chat(messages=[{"role": "user", "content": "x" * 5000}]), 413, None, "request_too_large"),
    ("prompt-empty-list", COMP, {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("prompt-empty-string", COMP, {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("prompt-token-out-of-vocab", COMP, {"model": MODEL, "prompt": [1, 2, 100000]}, 400, "prompt", None),
    ("prompt-mixed-list", COMP, {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt", None),
    ("completions-logprobs-range", COMP, {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs", None),
    ("suffix", COMP, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix", "unsupported_parameter"),
    ("too-many-choices", COMP, {"model": MODEL, "prompt": ["a"] * 20, "n": 10}, 400, "prompt", None),
    ("detokenize-bad-id", "/detokenize", {"tokens": [-1]}, 400, "tokens", None),
    ("tokenize-neither", "/tokenize", {}, 400, "prompt", None),
    ("no-such-route", "/v1/embeddings", {"input": "x"}, 404, None, None),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(live, case):
    _, path, body, status, param, code = case
    if isinstance(body, bytes):
        r = httpx.post(live.url + path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = httpx.post(live.url + path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_error_messages_name_the_numbers(live):
    r = httpx.post(live.url + CHAT, json=chat(max_tokens=120)).json()["error"]["message"]
    assert "120" in r and "128" in r  # max_tokens and the context
    r = httpx.post(live.url + CHAT, json=chat(temperature=-1)).json()["error"]["message"]
    assert "temperature" in r and "-1" in r


def test_stream_request_errors_before_the_stream(live):
    r = httpx.post(live.url + CHAT, json=chat(stream=True, max_tokens=0))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chunked_body_over_limit_is_413(live):
    def body():
        yield b'{"model": "fake-model", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    r = httpx.post(live.url + CHAT, content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_healthy_after_all_bad_inputs(live):
    for case in BAD_INPUTS:
        body = case[2]
        httpx.post(live.url + case[1], **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert httpx.get(live.url + "/health").status_code == 200
    ok = httpx.post(live.url + CHAT, json=chat(max_tokens=3, temperature=0))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "The"
    assert not live.engine.requests  # nothing left running
    metrics = httpx.get(live.url + "/metrics").text
    assert 'quill_request_errors_total{code="context_length_exceeded",status="400"}' in metrics


def test_openai_client_raises_typed_errors(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=7000)
    assert info.value.param == "temperature"


def test_api_key():
    with ThreadServer(create_app(FakeEngine(), MODEL, api_key="sekret", static_dir=None)) as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(server.url + CHAT, json=chat(max_tokens=1), headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_queue_full_is_503_with_retry_after():
    engine = FakeEngine(max_num_seqs=1, max_waiting=1, token_delay=0.01)
    with ThreadServer(create_app(engine, MODEL, static_dir=None)) as server:
        long = chat(max_tokens=150, ignore_eos=True, stream=True)
        runner = threading.Thread(target=read_sse_then_close, args=(server.url + CHAT, long, 10_000))
        runner.start()
        assert wait_until(lambda: engine.stats()["running"] == 1)
        queued = threading.Thread(target=lambda: httpx.post(server.url + CHAT, json=chat(max_tokens=2), timeout=30))
        queued.start()
        assert wait_until(lambda: engine.stats()["waiting"] == 1)
        r = httpx.post(server.url + CHAT, json=chat(max_tokens=2))
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        runner.join(timeout=10)
        queued.join(timeout=10)
        assert httpx.get(server.url + "/health").status_code == 200


def test_health_503_while_loading_then_200_and_draining():
    app = create_app(None, static_dir=None)
    with ThreadServer(app) as server:
        r = httpx.get(server.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = httpx.post(server.url + CHAT, json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading" and "Retry-After" in r.headers
        attach_engine(app, FakeEngine())
        assert httpx.get(server.url + "/health").status_code == 200
        assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == [MODEL]
        app.state.quill.draining = True
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + CHAT, json=chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"


def test_static_page_mounted_only_when_present(tmp_path):
    (tmp_path / "index.html").write_text("<html>quill</html>")
    with ThreadServer(create_app(FakeEngine(), MODEL, static_dir=tmp_path)) as server:
        assert "quill" in httpx.get(server.url + "/").text
        r = httpx.get(server.url + "/nope.js")
        assert r.status_code == 404 and "error" in r.json()
        assert httpx.get(server.url + "/health").status_code == 200
    with ThreadServer(create_app(FakeEngine(), MODEL, static_dir=tmp_path / "missing")) as server:
        assert httpx.get(server.url + "/").status_code == 404
