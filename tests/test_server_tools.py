"""Tool calling on /v1/chat/completions through the official openai client.

First against the fake engine (one token per character, so every marker is split across tokens
and chunks) with Qwen3's template and scripted outputs in the Hermes format: calls, parallel
calls, text around calls, malformed calls, the whole tool loop, streamed and not, and the 400s.
Then real `quill serve` processes, where the tool grammar shapes what the model writes: a tiny
random Qwen3 whose tokenizer has <tool_call> as one added token, and the default model, whose
template knows no tools (the generic format)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from fake_engine import FakeEngine
from quill.server.app import create_app
from server_utils import ThreadServer, serving
from test_chat_template_families import QWEN3
from test_server_reasoning import TemplateTokenizer, tiny_qwen3_folder

MODEL = "fake-model"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
                   "required": ["city"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]  # bounded strings and numbers: a random model must still finish its call


def call(name: str, **arguments) -> str:
    return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps(arguments))


# The last user message picks what the fake model writes; after a tool result, it answers.
SCRIPTS = {
    "Q-one": call("get_weather", city="Paris"),
    "Q-two": call("get_weather", city="Paris") + "\n" + call("get_time", city="Lima", utc_offset=-5),
    "Q-text-first": "Let me check that.\n" + call("get_weather", city="Oslo"),
    "Q-think": "<think>\nThe user wants weather.\n</think>\n\n" + call("get_weather", city="Rome"),
    "Q-bad": '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
    "Q-unclosed": 'Sure. <tool_call>\n{"name": "get_weather", "argum',
    "Q-plain": "No tool needed: 4.",
}


def script(prompt: str) -> str:
    last_turn = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    if "<tool_response>" in last_turn:
        results = [part.split("\n</tool_response>")[0] for part in last_turn.split("<tool_response>\n")[1:]]
        return "Done: " + "; ".join(results) + "."
    if "Q-echo-tools" in last_turn:
        return "tools shown" if "<tools>" in prompt else "no tools"
    return next(text for key, text in SCRIPTS.items() if key in last_turn)


@pytest.fixture(scope="module")
def live():
    engine = FakeEngine(max_model_len=4096, max_num_seqs=8, token_delay=0.0005, greedy_text=script)
    engine.tokenizer = TemplateTokenizer(QWEN3)
    server = ThreadServer(create_app(engine, MODEL, static_dir=None))
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with server:
        yield server


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def create(server, text, **kwargs):
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("temperature", 0)  # the fake model writes its script greedily
    return server.client.chat.completions.create(model=MODEL, messages=ask(text) if isinstance(text, str) else text, **kwargs)


def stream(server, text, **kwargs):
    """(content, reasoning, calls by index as dicts, finish_reason, the raw tool_call deltas)."""
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("temperature", 0)
    content, reasoning, calls, finish, deltas = "", "", {}, None, []
    for chunk in server.client.chat.completions.create(model=MODEL, messages=ask(text) if isinstance(text, str) else text,
                                                       stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            piece = delta.content or ""
            assert "<" not in piece and ">" not in piece, piece  # no markup, nor a piece of it
            content += piece
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for item in delta.tool_calls or ():
                deltas.append(item)
                entry = calls.setdefault(item.index, {"id": None, "name": None, "arguments": ""})
                if item.id:
                    assert entry["id"] is None
                    entry["id"], entry["name"] = item.id, item.function.name
                    assert item.type == "function" and item.function.arguments == ""
                else:
                    assert entry["id"] is not None, "arguments before the call's id and name"
                    entry["arguments"] += item.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish, deltas


def test_one_call_non_streamed(live):
    out = create(live, "Q-one")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    assert tool_call.function.name == "get_weather" and json.loads(tool_call.function.arguments) == {"city": "Paris"}


def test_one_call_streamed_in_openai_shape(live):
    content, _, calls, finish, deltas = stream(live, "Q-one")
    assert content == "" and finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert deltas[0].index == 0 and deltas[0].function.name == "get_weather"


def test_two_parallel_calls(live):
    out = create(live, "Q-two")
    names = [(c.function.name, json.loads(c.function.arguments)) for c in out.choices[0].message.tool_calls]
    assert names == [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Lima", "utc_offset": -5})]
    assert len({c.id for c in out.choices[0].message.tool_calls}) == 2
    _, _, calls, finish, _ = stream(live, "Q-two")
    assert finish == "tool_calls" and sorted(calls) == [0, 1]
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in (0, 1)] == names


def test_text_before_a_call_is_content(live):
    out = create(live, "Q-text-first")
    assert out.choices[0].message.content.strip() == "Let me check that."
    assert out.choices[0].message.tool_calls[0].function.name == "get_weather"
    content, _, calls, finish, _ = stream(live, "Q-text-first")
    assert content.strip() == "Let me check that." and finish == "tool_calls" and len(calls) == 1


def test_reasoning_then_call(live):
    out = create(live, "Q-think")
    message = out.choices[0].message
    assert message.reasoning_content == "The user wants weather." and message.content is None
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Rome"}
    content, reasoning, calls, finish, _ = stream(live, "Q-think")
    assert (content, reasoning, finish) == ("", "The user wants weather.", "tool_calls") and len(calls) == 1


@pytest.mark.parametrize("key", ["Q-bad", "Q-unclosed"])
def test_malformed_calls_are_content_never_a_half_call(live, key):
    out = create(live, key)
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == SCRIPTS[key]
    raw = httpx.post(live.url + "/v1/chat/completions",
                     json={"model": MODEL, "messages": ask(key), "tools": TOOLS, "stream": True, "temperature": 0}).text
    assert '"tool_calls"' not in raw


def test_plain_answer_with_tools_offered(live):
    out = create(live, "Q-plain")
    assert out.choices[0].message.content == "No tool needed: 4." and out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("streamed", [False, True])
def test_the_whole_tool_loop(live, streamed):
    """call -> tool results -> final answer, the calls sent back as the client got them."""
    messages = ask("Q-two")
    first = create(live, messages)
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    results = {"get_weather": "18 C, cloudy", "get_time": "09:30"}
    for tool_call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": results[tool_call.function.name]})
    if streamed:
        content, _, calls, finish, _ = stream(live, messages)
        assert calls == {}
    else:
        final = create(live, messages)
        content, finish = final.choices[0].message.content, final.choices[0].finish_reason
    assert (content, finish) == ("Done: 18 C, cloudy; 09:30.", "stop")


def test_tool_choice_none_hides_the_tools_and_parses_nothing(live):
    assert create(live, "Q-echo-tools").choices[0].message.content == "tools shown"
    assert create(live, "Q-echo-tools", tool_choice="none").choices[0].message.content == "no tools"
    out = create(live, "Q-one", tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content == SCRIPTS["Q-one"]


def test_every_choice_gets_its_own_calls(live):
    out = create(live, "Q-two", n=2)
    assert [len(c.message.tool_calls) for c in out.choices] == [2, 2]
    assert len({c.id for choice in out.choices for c in choice.message.tool_calls}) == 4


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "'bad name'"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'retrieval'"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "response_format", "cannot be combined with tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(live, extra, param, words):
    body = {"model": MODEL, "messages": ask("Q-one"), "tools": TOOLS, "temperature": 0, **extra}
    response = httpx.post(live.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_bad_arguments_in_history_are_a_400(live):
    messages = [*ask("Q-one"), {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]
    response = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS})
    assert response.status_code == 400
    assert "messages[1].tool_calls[0].function.arguments" in response.json()["error"]["message"]


# ---------------------------------------------------------------- real servers, grammar-shaped


def tool_schema_ok(call) -> dict:
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["parameters"])
    return arguments


@pytest.fixture(scope="module")
def qwen3_tools(tmp_path_factory):
    folder = tiny_qwen3_folder(tmp_path_factory.mktemp("tiny-qwen3-tools"), QWEN3, added=("<tool_call>", "</tool_call>"),
                               max_positions=2048)
    with serving(tmp_path_factory.mktemp("serve"), "--model", str(folder), "--kv-cache-memory", "32MiB",
                 "--max-model-len", "2048", model_name="tiny-qwen3", client_timeout=120) as proc:
        yield proc


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True])
def test_tiny_qwen3_tool_loop_with_required_calls(qwen3_tools, streamed):
    """A random model forced by the Hermes grammar: its calls always parse and validate; the loop
    continues with the results; the <tool_call> added token never reaches content."""
    client = qwen3_tools.client
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    # One byte per token and random JSON whitespace: a call takes ~100 tokens; one call per turn.
    common = dict(model="tiny-qwen3", tools=TOOLS, temperature=1.0, seed=7, max_tokens=400, parallel_tool_calls=False,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    out = client.chat.completions.create(messages=messages, tool_choice="required", **common)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    for tool_call in choice.message.tool_calls:
        tool_schema_ok(tool_call)
    messages.append(choice.message.model_dump(exclude_none=True))
    for tool_call in choice.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "18 C"})
    # The results go back; whatever the random model answers, with auto its markup never shows as content
    # and a call that comes out is whole and valid.
    content, calls, finish = "", {}, None
    if streamed:
        for chunk in client.chat.completions.create(messages=messages, tool_choice="auto", stream=True, **common):
            for c in chunk.choices:
                content += c.delta.content or ""
                for item in c.delta.tool_calls or ():
                    calls[item.index] = calls.get(item.index, "") + (item.function.arguments or "")
                finish = c.finish_reason or finish
        arguments = list(calls.values())
    else:
        final = client.chat.completions.create(messages=messages, tool_choice="auto", **common)
        content, finish = final.choices[0].message.content or "", final.choices[0].finish_reason
        arguments = [c.function.arguments for c in final.choices[0].message.tool_calls or ()]
    assert finish in ("stop", "tool_calls")
    assert "<tool_call>" not in content and all(isinstance(json.loads(a), dict) for a in arguments)


@pytest.mark.slow
def test_tiny_qwen3_named_and_auto(qwen3_tools):
    client = qwen3_tools.client
    common = dict(model="tiny-qwen3", messages=[{"role": "user", "content": "Time in Lima?"}], tools=TOOLS, max_tokens=400,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           parallel_tool_calls=False, temperature=1.0, seed=3, **common)
    (only,) = named.choices[0].message.tool_calls
    assert only.function.name == "get_time"
    tool_schema_ok(only)
    for seed in range(4):  # auto: whatever the model writes, a call that comes out is whole and valid
        out = client.chat.completions.create(tool_choice="auto", temperature=1.0, seed=seed, parallel_tool_calls=False, **common)
        for tool_call in out.choices[0].message.tool_calls or ():
            tool_schema_ok(tool_call)
        assert "<tool_call>" not in (out.choices[0].message.content or "")


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("serve-default"), "--kv-cache-memory", "256MiB", "--max-num-seqs", "16",
                 client_timeout=300) as proc:
        yield proc


@pytest.mark.slow
def test_default_model_required_calls_validate_100_of_100(default_model):
    """The acceptance figure: tool_choice required at temperature 1.0, 100 sampled requests, every
    call's arguments valid against its function's schema."""
    client = default_model.client
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time in Lima?"}]

    def one(seed: int):
        out = client.chat.completions.create(model="quill-test", messages=messages, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=120)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        return [tool_schema_ok(c) for c in choice.message.tool_calls]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    assert len(results) == 100 and all(results)


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True])
def test_default_model_tool_loop(default_model, streamed):
    """The whole loop on the default model (the generic format: its template knows no tools). Greedy,
    it answers this question with two parallel calls on the CPUs tried; at least one is required."""
    client = default_model.client
    messages = [{"role": "user", "content": "Weather in Paris and in Lima?"}]
    out = client.chat.completions.create(model="quill-test", messages=messages, tools=TOOLS, tool_choice="required",
                                         temperature=0, max_tokens=300)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls, out.choices[0]
    messages.append(message.model_dump(exclude_none=True))
    for tool_call in message.tool_calls:
        tool_schema_ok(tool_call)
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "18 C and sunny"})
    if streamed:
        text, finish = "", None
        for chunk in client.chat.completions.create(model="quill-test", messages=messages, tools=TOOLS, temperature=0,
                                                    parallel_tool_calls=False, max_tokens=120, stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
    else:
        final = client.chat.completions.create(model="quill-test", messages=messages, tools=TOOLS, temperature=0,
                                               parallel_tool_calls=False, max_tokens=120)
        text, finish = final.choices[0].message.content or "", final.choices[0].finish_reason
    assert finish in ("stop", "tool_calls")
    assert '"response"' not in text and '"tool_calls"' not in text  # the generic format's JSON never shows
