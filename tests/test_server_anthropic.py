"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
anthropic client: first against the fake engine with scripted outputs (one token per character,
a template with think markers), then a real `quill serve` on the default model."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from fake_engine import FakeEngine
from quill.server.anthropic import CountTokensRequest, chat_request
from quill.server.app import create_app
from quill.server.errors import APIError, error_body_for
from server_utils import ThreadServer, metric_value, post_then_close, read_sse_then_close, serving, wait_until
from test_chat_template_families import QWEN3
from test_server_reasoning import TEMPLATE, TemplateTokenizer

MODEL = "fake-model"
GREEDY = {"temperature": 0}  # sent as extra_body: the fake engine follows its script only when greedy
WEATHER = {"name": "get_weather", "description": "Current weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}

# The prompt picks what the fake model writes (then EOS); after a tool result, it answers with it.
SCRIPTS = {
    "Q-think": "<think>\nI add 2 and 2.\n</think>\n\nThe answer is 4.",
    "Q-stop": "one two STOP three",
    "Q-tool": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
}
PLAIN = "Hello from quill."


def script(prompt: str) -> str:
    if "<tool_response>" in prompt:
        return "It is " + prompt.split("<tool_response>\n", 1)[1].split("\n</tool_response>")[0] + " in Paris."
    return next((text for key, text in SCRIPTS.items() if key in prompt), PLAIN)


def fake_server(template: str = TEMPLATE, **options) -> ThreadServer:
    engine = FakeEngine(max_model_len=2048, max_num_seqs=4, token_delay=options.pop("token_delay", 0.0005), greedy_text=script)
    engine.tokenizer = TemplateTokenizer(template)
    server = ThreadServer(create_app(engine, MODEL, static_dir=None, **options))
    server.engine = engine
    server.client = anthropic.Anthropic(base_url=server.url, api_key=options.get("api_key") or "unused", max_retries=0)
    return server


@pytest.fixture(scope="module")
def live():
    with fake_server() as server:
        yield server


def create(server, text, **fields):
    fields.setdefault("max_tokens", 200)
    fields.setdefault("extra_body", GREEDY)
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    return server.client.messages.create(model=MODEL, messages=messages, **fields)


def raw_events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream; every `event:` line names its data's type."""
    body = {"model": MODEL, "max_tokens": 200, "stream": True, **GREEDY, **body}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers=headers or {}, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = []
    for block in text.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def shape(events) -> list[str]:
    """Event names with each run of deltas written once."""
    names = [name for name, _ in events]
    return [n for i, n in enumerate(names) if i == 0 or n != names[i - 1] or n != "content_block_delta"]


def streamed_message(server, text, **fields):
    fields.setdefault("max_tokens", 200)
    messages = [{"role": "user", "content": text}]
    with server.client.messages.stream(model=MODEL, messages=messages, extra_body=GREEDY, **fields) as stream:
        for _ in stream:
            pass
        return stream.get_final_message()


# ---- messages ----------------------------------------------------------------------------

def test_message(live):
    out = create(live, "Q-plain", system="Be brief.")
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert [(b.type, b.text) for b in out.content] == [("text", PLAIN)]
    assert (out.stop_reason, out.stop_sequence) == ("end_turn", None)
    prompt = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ-plain<|im_end|>\n<|im_start|>assistant\n"
    assert live.engine.seen_prompts[-1] == tuple(prompt.encode())  # the system prompt came first
    usage = out.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt) and usage.cache_creation_input_tokens == 0
    assert usage.output_tokens == len(PLAIN) + 1  # + EOS
    again = create(live, "Q-plain", system="Be brief.")  # the same prompt: the prefix cache serves most of it
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(prompt)
    metrics = httpx.get(live.url + "/metrics").text
    assert metric_value(metrics, "quill_requests_total", {"finish_reason": "stop"}) >= 2


def test_streamed_message_equals_the_message_and_keeps_the_event_order(live):
    whole = create(live, "Q-plain")
    final = streamed_message(live, "Q-plain")
    assert [(b.type, b.text) for b in final.content] == [("text", PLAIN)]
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", whole.usage.output_tokens)
    events = raw_events(live, {"messages": [{"role": "user", "content": "Q-plain"}]})
    assert shape(events) == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                             "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == PLAIN
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_thinking_then_text(live):
    out = create(live, "Q-think")
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert (out.content[0].thinking, out.content[0].signature, out.content[1].text) == ("I add 2 and 2.", "", "The answer is 4.")
    final = streamed_message(live, "Q-think")
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in final.content] == [("thinking", "I add 2 and 2."), ("text", "The answer is 4.")]
    events = raw_events(live, {"messages": [{"role": "user", "content": "Q-think"}]})
    assert shape(events) == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                             "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    starts = [(d["index"], d["content_block"]["type"]) for n, d in events if n == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    kinds = {(d["index"], d["delta"]["type"]) for n, d in events if n == "content_block_delta"}
    assert kinds == {(0, "thinking_delta"), (1, "text_delta")}


@pytest.mark.parametrize("streamed", [False, True])
def test_stop_sequence_and_max_tokens(live, streamed):
    ask = streamed_message if streamed else create
    out = ask(live, "Q-stop", stop_sequences=["NEVER", "STOP"])
    assert (out.content[0].text, out.stop_reason, out.stop_sequence) == ("one two ", "stop_sequence", "STOP")
    out = ask(live, "Q-plain", max_tokens=5)
    assert (out.content[0].text, out.stop_reason, out.stop_sequence, out.usage.output_tokens) == (PLAIN[:5], "max_tokens", None, 5)


def test_count_tokens_is_the_prompt_the_engine_gets(live):
    counted = live.client.messages.count_tokens(model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Q-plain"}])
    create(live, "Q-plain", system="Be brief.")
    assert counted.input_tokens == len(live.engine.seen_prompts[-1])
    raw = httpx.post(live.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert raw.json() == {"input_tokens": len("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")}


# ---- errors, in Anthropic's shape -----------------------------------------------------------

def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


# (id, body (merged into a valid one; None deletes the field), path, status, error type, text the message has)
BAD = [
    ("image-block", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                  {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "/v1/messages", 400, "invalid_request_error", "messages[2].content[0].type: 'image' blocks are not supported"),
    ("tool-use-from-user", {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "/v1/messages", 400, "invalid_request_error", "messages[0].content[0].type: 'tool_use'"),
    ("tool-result-image", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}]}]},
     "/v1/messages", 400, "invalid_request_error", "messages[0].content[0].content[0].type: 'image'"),
    ("text-block-without-text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "/v1/messages", 400, "invalid_request_error", "messages[0].content[0].text: Field required"),
    ("missing-max-tokens", {"max_tokens": None}, "/v1/messages", 400, "invalid_request_error", "max_tokens: Field required"),
    ("zero-max-tokens", {"max_tokens": 0}, "/v1/messages", 400, "invalid_request_error", "max_tokens"),
    ("temperature-type", {"temperature": "hot"}, "/v1/messages", 400, "invalid_request_error", "temperature"),
    ("bad-role", {"messages": [{"role": "system", "content": "x"}]}, "/v1/messages", 400, "invalid_request_error", "role"),
    ("server-tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "/v1/messages", 400, "invalid_request_error", "tools[0].type: 'web_search_20250305'"),
    ("tool-choice-without-name", {"tool_choice": {"type": "tool"}}, "/v1/messages", 400, "invalid_request_error", "tool_choice.name"),
    ("tool-without-schema", {"tools": [{"name": "f"}]}, "/v1/messages", 400, "invalid_request_error", "tools[0].input_schema: Field required"),
    ("too-many-stop-sequences", {"stop_sequences": [f"s{i}" for i in range(40)]}, "/v1/messages", 400, "invalid_request_error",
     "stop_sequences:"),
    ("context-exceeded", {"max_tokens": 10**6}, "/v1/messages", 400, "invalid_request_error", "this model's context"),
    ("unknown-model", {"model": "claude-9"}, "/v1/messages", 404, "not_found_error", "'claude-9' does not exist"),
    ("count-unknown-model", {"model": "claude-9", "max_tokens": None}, "/v1/messages/count_tokens", 404, "not_found_error", "claude-9"),
    ("count-bad-block", {"max_tokens": None, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "/v1/messages/count_tokens", 400, "invalid_request_error", "messages[0].content[0].type: 'document'"),
    ("no-such-route", {}, "/v1/messages/batches", 404, "not_found_error", "no route"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests(live, case):
    _, fields, path, status, kind, text = case
    body = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **fields}
    body = {k: v for k, v in body.items() if v is not None}
    assert text in anthropic_error(httpx.post(live.url + path, json=body), status, kind)


def test_error_type_by_status_and_path():
    types = {status: error_body_for(APIError(status, "m"), "/v1/messages")["error"]["type"]
             for status in (400, 401, 403, 404, 405, 408, 413, 422, 429, 431, 500, 502, 503, 529)}
    assert types == {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                     405: "invalid_request_error", 408: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error",
                     429: "rate_limit_error", 431: "invalid_request_error", 500: "api_error", 502: "api_error",
                     503: "overloaded_error", 529: "overloaded_error"}
    assert error_body_for(APIError(404, "m"), "/v1/messages/count_tokens")["type"] == "error"
    for path in ("/v1/chat/completions", "/v1/messagesX", "/v1/models"):
        assert error_body_for(APIError(404, "m", param="model", code="model_not_found"), path) == {
            "error": {"message": "m", "type": "not_found_error", "param": "model", "code": "model_not_found"}}


def test_the_sdk_raises_its_own_errors(live):
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(live, [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "messages[0].content[0].type" in bad.value.message
    with pytest.raises(anthropic.NotFoundError):
        live.client.messages.create(model="claude-9", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.InternalServerError) as failed:  # failed inside the engine before its first token
        create(live, "FAIL_EARLY")
    assert failed.value.body["error"]["type"] == "api_error"


def test_openai_paths_keep_the_openai_shape(live):
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": "claude-9", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and "type" in r.json()["error"]


def test_api_key_as_x_api_key_or_bearer():
    with fake_server(api_key="sekret") as server:
        body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
        url = server.url + "/v1/messages"
        assert "API key" in anthropic_error(httpx.post(url, json=body, headers={"x-api-key": "wrong"}), 401, "authentication_error")
        anthropic_error(httpx.post(url, json=body), 401, "authentication_error")
        assert httpx.post(url, json=body, headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        chat = {"model": MODEL, "max_tokens": 3, "messages": body["messages"]}
        assert httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"x-api-key": "sekret"}).status_code == 200
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**body)
        sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", default_headers={"x-api-key": "sekret"}, max_retries=0)
        assert sdk.messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens > 0


def test_body_too_large():
    with fake_server(max_body_bytes=2048) as server:
        body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x" * 4000}]}
        assert "--max-body-size" in anthropic_error(httpx.post(server.url + "/v1/messages", json=body), 413, "request_too_large")


def test_failure_mid_stream_is_an_error_event(live):
    events = raw_events(live, {"messages": [{"role": "user", "content": "FAIL_REQUEST"}]})
    assert events[0][0] == "message_start" and events[-1][0] == "error" and "message_stop" not in shape(events)
    assert events[-1][1]["error"]["type"] == "api_error" and "failed" in events[-1][1]["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as raised:
        streamed_message(live, "FAIL_MIDSTREAM")
    assert raised.value.body["error"]["type"] == "api_error"


def test_fault_header_reaches_the_engine(live):
    before = len(live.engine.received_faults)
    r = httpx.post(live.url + "/v1/messages", headers={"X-Quill-Fault": "sample"},
                   json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and list(live.engine.received_faults.values())[before:] == ["sample"]


@pytest.mark.parametrize("streamed", [True, False])
def test_disconnect_aborts_the_engine_request(streamed):
    with fake_server(token_delay=0.01) as server:
        engine = server.engine
        body = {"model": MODEL, "max_tokens": 400, "messages": [{"role": "user", "content": "go"}], "temperature": 1.0}
        if streamed:
            assert len(read_sse_then_close(server.url + "/v1/messages", {**body, "stream": True}, 3)) == 3
        else:
            post_then_close(server.port, "/v1/messages", body, wait_s=0.3)
        assert wait_until(lambda: list(engine.aborted.values()) == ["decode"], timeout=2.0)
        assert wait_until(lambda: not engine.requests and engine.stats()["kv_blocks_used"] == 0, timeout=2.0)


# ---- the translation, and tools ---------------------------------------------------------------

def test_request_translation():
    body = CountTokensRequest.model_validate({
        "model": MODEL,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "text", "text": "Thanks."},
                                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny", "is_error": False}]},
        ],
        "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    })
    chat = chat_request(body).model_dump(exclude_none=True)
    text = [{"type": "text", "text": "Weather in Paris?"}]
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert chat["messages"][0]["content"] == [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]
    assert chat["messages"][1]["content"] in ("Weather in Paris?", text)
    assistant = chat["messages"][2]
    assert assistant["reasoning_content"] == "Call it." and assistant["content"] == [{"type": "text", "text": "Checking."}]
    (call,) = assistant["tool_calls"]
    assert (call["id"], call["type"], call["function"]["name"]) == ("toolu_1", "function", "get_weather")
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert [(m["tool_call_id"], m["content"]) for m in chat["messages"][3:5]] == [("toolu_1", "18 C"), ("toolu_2", "sunny")]
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                               "parameters": WEATHER["input_schema"]}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ("required", False)
    named = CountTokensRequest.model_validate({"model": MODEL, "messages": [], "tool_choice": {"type": "tool", "name": "f"},
                                                 "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert chat_request(named).tool_choice == {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("tool, named", [({"name": "get weather!", "input_schema": {"type": "object"}}, "tools[0].name: "),
                                         ({"name": "f", "input_schema": {"type": "array"}}, "tools[0].input_schema.type: ")])
def test_tool_errors_name_the_fields_sent(live, tool, named):
    with pytest.raises(anthropic.BadRequestError) as raised:
        create(live, "hi", tools=[tool])
    assert named in raised.value.body["error"]["message"]


@pytest.mark.parametrize("kind", ["any", "tool"])
def test_a_forced_tool_choice_without_tools_names_tool_choice(live, kind):
    choice = {"type": kind, "name": "get_weather"} if kind == "tool" else {"type": kind}
    with pytest.raises(anthropic.BadRequestError) as raised:
        live.client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}], tool_choice=choice)
    assert raised.value.body["error"]["message"].startswith(f"tool_choice: type '{kind}' needs at least one tool"), raised.value.body


@pytest.mark.parametrize("streamed", [False, True])
def test_tool_use_round_trip(streamed):
    with fake_server(QWEN3) as server:
        ask = streamed_message if streamed else create
        question = [{"role": "user", "content": "Q-tool: weather in Paris?"}]
        first = ask(server, question[0]["content"], tools=[WEATHER])
        assert first.stop_reason == "tool_use"
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert (use.name, use.input) == ("get_weather", {"city": "Paris"}) and use.id
        if streamed:
            events = raw_events(server, {"messages": question, "tools": [WEATHER]})
            assert [d["content_block"]["type"] for n, d in events if n == "content_block_start"] == ["tool_use"]
            assert {d["delta"]["type"] for n, d in events if n == "content_block_delta"} == {"input_json_delta"}
            arguments = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
            assert json.loads(arguments) == {"city": "Paris"} and events[-2][1]["delta"]["stop_reason"] == "tool_use"
        history = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
        final = create(server, history, tools=[WEATHER])
        assert ([b.type for b in final.content], final.content[0].text, final.stop_reason) == (["text"], "It is 18 C in Paris.", "end_turn")
        with_tools = server.client.messages.count_tokens(model=MODEL, messages=question, tools=[WEATHER]).input_tokens
        assert with_tools > server.client.messages.count_tokens(model=MODEL, messages=question).input_tokens  # the tools are rendered


# ---- a real quill serve on the default model -------------------------------------------------

@pytest.mark.slow
def test_real_model(tmp_path):
    with serving(tmp_path, "--max-model-len", "1024") as proc:
        client = anthropic.Anthropic(base_url=proc.url, api_key="none", max_retries=0, timeout=300)
        hello = [{"role": "user", "content": "Say hello."}]
        out = client.messages.create(model="quill-test", max_tokens=8, messages=hello, extra_body=GREEDY)
        assert out.content[0].type == "text" and out.content[0].text and out.stop_reason in ("end_turn", "max_tokens")
        counted = client.messages.count_tokens(model="quill-test", messages=hello).input_tokens
        assert out.usage.input_tokens + out.usage.cache_read_input_tokens == counted
        with client.messages.stream(model="quill-test", max_tokens=8, messages=hello, extra_body=GREEDY) as stream:
            assert "".join(stream.text_stream) == out.content[0].text  # greedy: the same text
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.messages.create(
            model="quill-test", max_tokens=64, messages=question, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            extra_body=GREEDY)
        (use,) = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input.get("city"), str)
        history = question + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, cloudy"}]}]
        final = client.messages.create(model="quill-test", max_tokens=16, messages=history, tools=[WEATHER], extra_body=GREEDY)
        assert final.content and final.content[0].type == "text" and final.stop_reason in ("end_turn", "max_tokens")
