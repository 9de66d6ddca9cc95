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
def qwen3_tools_folder(tmp_path_factory):
    return tiny_qwen3_folder(tmp_path_factory.mktemp("tiny-qwen3-tools"), QWEN3, added=("<tool_call>", "</tool_call>"),
                             max_positions=2048)


@pytest.fixture(scope="module")
def qwen3_tools(tmp_path_factory, qwen3_tools_folder):
    folder = qwen3_tools_folder
    with serving(tmp_path_factory.mktemp("serve"), "--model", str(folder), "--kv-cache-memory", "32MiB",
                 "--max-model-len", "2048", model_name="tiny-qwen3", client_timeout=120) as proc:
        yield proc


def turn(client, streamed: bool, **kwargs) -> tuple[str, list[dict], str]:
    """One chat turn, streamed or not: (content, the assistant message to send back, finish_reason);
    a streamed turn's calls are put together from their deltas as a client does."""
    if not streamed:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content or "", choice.message.model_dump(exclude_none=True), choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for item in c.delta.tool_calls or ():
                entry = calls.setdefault(item.index, {"id": item.id, "type": "function",
                                                      "function": {"name": item.function.name, "arguments": ""}})
                entry["function"]["arguments"] += item.function.arguments or ""
            finish = c.finish_reason or finish
    message = {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)] or None}
    return content, {k: v for k, v in message.items() if v is not None}, finish


def checked_calls(message: dict) -> list[dict]:
    """The message's calls, each one's arguments valid against its function's schema."""
    tools = {t["function"]["name"]: t["function"] for t in TOOLS}
    for tool_call in message.get("tool_calls", ()):
        jsonschema.validate(json.loads(tool_call["function"]["arguments"]), tools[tool_call["function"]["name"]]["parameters"])
    return message.get("tool_calls", [])


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True])
def test_tiny_qwen3_tool_loop(qwen3_tools, streamed):
    """A random model forced by the Hermes grammar (<tool_call> is one added token here): parallel
    required calls, each whole and valid, the results sent back, then an answer in which, with
    auto, no markup shows; streamed turns assembled from deltas."""
    client = qwen3_tools.client
    messages = [{"role": "user", "content": "Weather in Paris and in Lima?"}]
    # One byte per token and random JSON whitespace: a call takes ~100 tokens.
    common = dict(model="tiny-qwen3", tools=TOOLS, temperature=1.0, max_tokens=700,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    seed = 11  # a seed whose required turn makes two calls (a random model picks how many)
    content, message, finish = turn(client, streamed, messages=messages, tool_choice="required", seed=seed, **common)
    calls = checked_calls(message)
    assert (content, finish, len(calls)) == ("", "tool_calls", 2), message
    messages.append(message)
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "18 C"} for c in calls]
    content, message, finish = turn(client, streamed, messages=messages, tool_choice="auto", seed=seed,
                                    parallel_tool_calls=False, **common)
    assert finish in ("stop", "tool_calls") and "<tool_call>" not in content
    assert len(checked_calls(message)) <= 1


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
    made = 0
    for seed in range(8):  # auto: a call that comes out is whole and valid; some seeds make one
        out = client.chat.completions.create(tool_choice="auto", temperature=1.0, seed=seed, parallel_tool_calls=False, **common)
        for tool_call in out.choices[0].message.tool_calls or ():
            tool_schema_ok(tool_call)
            made += 1
        assert "<tool_call>" not in (out.choices[0].message.content or "")
    assert made >= 1


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
    """The whole loop on the default model (the generic format: its template knows no tools):
    greedy, it answers this question with two parallel calls; then, told the results and asked
    with tool_choice "none", a plain answer (the calls and results stay in its prompt)."""
    client = default_model.client
    messages = [{"role": "user", "content": "Weather in Paris and in Lima?"}]
    common = dict(model="quill-test", tools=TOOLS, temperature=0)
    content, message, finish = turn(client, streamed, messages=messages, tool_choice="required", max_tokens=300, **common)
    calls = checked_calls(message)
    assert (content, finish) == ("", "tool_calls") and len(calls) >= 2, message
    messages.append(message)
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "18 C and sunny"} for c in calls]
    content, message, finish = turn(client, streamed, messages=messages, tool_choice="none", max_tokens=60, **common)
    assert content.strip() and finish in ("stop", "length") and "tool_calls" not in message
    assert '"response"' not in content and '"tool_calls"' not in content  # no JSON of the generic format


def test_llm_chat_renders_tools(qwen3_tools_folder):
    """The Python API: LLM.chat(tools=...) shows the tools to the template (no constraint, no
    parsing: the text is the model's own), and a bad tool list names its entry."""
    from quill import LLM, SamplingParams
    from quill.tools import ToolError

    llm = LLM(str(qwen3_tools_folder), kv_cache_memory=8 << 20)
    messages = [{"role": "user", "content": "Weather?"}]
    plain, offered = (llm.chat(messages, SamplingParams(max_tokens=1), tools=tools)[0].prompt for tools in (None, [WEATHER]))
    assert "<tools>" not in plain and '"name": "get_weather"' in offered
    with pytest.raises(ToolError, match=r"tools\[0\]\.function\.name"):
        llm.chat(messages, tools=[{"type": "function", "function": {"name": "no spaces please"}}])


def test_special_markers_are_decoded_for_the_parser():
    """A marker that is a special token (Mistral's [TOOL_CALLS]) would be dropped on decode: the
    plan turns skip_special_tokens off for it, and the text then holds it; an added non-special
    marker (Qwen's <tool_call>) is kept anyway and changes nothing."""
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

    from quill.detokenizer import IncrementalDetokenizer
    from quill.server.protocol import ChatCompletionRequest, to_sampling_params
    from quill.server.tool_calls import ToolPlan
    from quill.tokenizer import Tokenizer
    from quill.tools import ToolChoice, check_tools, parser_class

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    backend.add_special_tokens(["</s>", "[TOOL_CALLS]"])
    backend.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    tokenizer = Tokenizer(backend, special_tokens={"eos_token": "</s>"})
    assert [tokenizer.added_token_kind(t) for t in ("[TOOL_CALLS]", "<tool_call>", "hello")] == ["special", "added", None]
    assert tokenizer.added_token_id("[TOOL_CALLS]") == backend.token_to_id("[TOOL_CALLS]") and tokenizer.added_token_id("x") is None

    tools = check_tools(TOOLS)
    plan = lambda name: ToolPlan(parser_class(name), tools, ToolChoice("auto"), True, TOOLS)  # noqa: E731
    assert plan("mistral").needs_special_tokens(tokenizer) and not plan("hermes").needs_special_tokens(tokenizer)
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    params = to_sampling_params(request, 16, tokenizer.vocab_size, keep_special_tokens=plan("mistral").needs_special_tokens(tokenizer))
    assert params.skip_special_tokens is False
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    detok = IncrementalDetokenizer(tokenizer, [], params.skip_special_tokens)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        detok.add(token_id)
    parser = plan("mistral").new_parser()
    content, calls = parser.feed(detok.text)
    more, last = parser.finish()
    assert (content + more, [(c.name, json.loads(c.arguments)) for c in calls + last]) == ("", [("get_weather", {"city": "Oslo"})])


def test_tool_parser_flag_lists_every_parser():
    import argparse

    from quill.server.serve_cmd import add_arguments
    from quill.tools import PARSER_NAMES

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "tool_parser")
    assert list(action.choices) == ["auto", *PARSER_NAMES] and parser.parse_args([]).tool_parser == "auto"
