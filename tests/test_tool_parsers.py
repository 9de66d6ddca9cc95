"""quill.tools: request checks, the family registry, the history every chat request's template gets
(template_history), the generic family's prompt, and the streaming parsers on outputs written the
way each family's models write them.

Every recorded output is fed whole, one character at a time, split in two at every place, and in
random chunks (hypothesis): the content and the calls must always be those of one whole feed, and
no piece of content may hold a marker that opened a call.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.chat_template import render_chat_template
from quill.tools import (
    MAX_TOOLS,
    PARSER_NAMES,
    ToolChoice,
    ToolError,
    ToolSpec,
    check_tool_choice,
    check_tools,
    detect_parser,
    parser_class,
    template_history,
    template_renders_tools,
)
from quill.tools.generic import FORMAT_PROMPT

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = check_tools([WEATHER, TIME])

# --- request checks ---


@pytest.mark.parametrize("tools, param, message", [
    ({"type": "function"}, "tools", "must be a list of tools, got dict"),
    ([WEATHER, "x"], "tools[1]", "must be an object, got str"),
    ([{"type": "x", "function": {"name": "f"}}], "tools[0].type", "only 'function' is supported, got 'x'"),
    ([{"function": {"name": "f"}}], "tools[0].type", "only 'function' is supported, got None"),
    ([{"type": "function"}], "tools[0].function", "must be an object, got NoneType"),
    ([WEATHER, {"type": "function", "function": {"name": "a b"}}], "tools[1].function.name",
     "must match ^[a-zA-Z0-9_-]{1,64}$, got 'a b'"),
    ([{"type": "function", "function": {"name": "f" * 65}}], "tools[0].function.name", "must match"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description",
     "must be a string, got int"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters",
     "must be a JSON schema object, got list"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters.type", "must be 'object', got 'string'"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict",
     "must be a boolean, got str"),
    ([WEATHER, TIME, WEATHER], "tools[2].function.name", "duplicate function name 'get_weather' (also tools[0])"),
    ([TIME] * (MAX_TOOLS + 1), "tools", f"at most {MAX_TOOLS} tools per request, got {MAX_TOOLS + 1}"),
])
def test_check_tools_names_the_place(tools, param, message):
    with pytest.raises(ToolError) as info:
        check_tools(tools)
    assert info.value.param == param
    assert message in str(info.value)
    assert str(info.value).startswith(f"{param}: ")


def test_check_tools_shapes():
    assert check_tools(None) == []
    weather, time = check_tools([WEATHER, {**TIME, "function": {"name": "get_time", "strict": True}}])
    assert weather == ToolSpec("get_weather", "Current weather in a city.", WEATHER["function"]["parameters"])
    assert time == ToolSpec("get_time", None, {"type": "object", "properties": {}})


def test_check_tool_choice():
    assert check_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert check_tool_choice(None, []) == ToolChoice("none")
    for mode in ("auto", "none", "required"):
        assert check_tool_choice(mode, TOOLS) == ToolChoice(mode)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert check_tool_choice(named, TOOLS) == ToolChoice("named", "get_time")
    bad = [
        ("always", TOOLS, "must be 'auto', 'none', 'required'"),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS,
         "function 'nope' is not among the tools offered ('get_weather', 'get_time')"),
        ({"type": "function", "function": {"name": "get_time"}}, [], "not among the tools offered (none)"),
        ({"function": {"name": "get_time"}}, TOOLS, "must be a string or"),
        ("required", [], "'required' needs at least one tool"),
    ]
    for choice, tools, message in bad:
        with pytest.raises(ToolError, match=re.escape(message)) as info:
            check_tool_choice(choice, tools)
        assert info.value.param == "tool_choice"


# --- the registry ---

QWEN_LIKE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{{- '</tools>\\nCall them as <tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>' }}
{{- '<|im_end|>\\n' }}{%- endif %}"""
MISTRAL_LIKE = """{%- for m in messages %}{%- if m.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}{%- endfor %}"""
LLAMA31_LIKE = """{%- if tools is not none %}{{- '<|start_header_id|>user<|end_header_id|>' }}{%- endif %}
{%- if builtin_tools is defined %}{{- '<|python_tag|>' }}{%- endif %}"""
LLAMA32_LIKE = """{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools is not none %}{{- tools | tojson }}{%- endif %}"""
LLAMA30_LIKE = """{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}
{{- m['content'] }}{% endfor %}"""
# A ChatML template that knows nothing of tools (the default SmolLM2's kind), checking alternation.
CHATML = """{%- for m in messages %}{%- if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}
{{- raise_exception('roles must alternate') }}{%- endif %}
{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}
{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
PROSE_TOOLS = """{{ '<|start_header_id|>system<|end_header_id|>You have no tools.' }}{# tools #} tools"""


@pytest.mark.parametrize("template, family, renders_tools", [
    (QWEN_LIKE, "hermes", True),
    (MISTRAL_LIKE, "mistral", False),
    (LLAMA31_LIKE, "llama3_json", True),
    (LLAMA32_LIKE, "llama3_json", True),
    (LLAMA30_LIKE, "generic", False),
    (CHATML, "generic", False),
    (PROSE_TOOLS, "generic", False),
    (None, "generic", False),
])
def test_detect_parser(template, family, renders_tools):
    assert detect_parser(template) == family
    assert template_renders_tools(template) is renders_tools
    assert parser_class(family).name == family


def test_parser_class_names():
    assert PARSER_NAMES == ("hermes", "llama3_json", "mistral", "generic")
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'; the parsers are hermes, llama3_json, "
                                         "mistral, generic"):
        parser_class("qwen")


# --- the history, and the generic family's messages ---

HISTORY = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "user", "content": "Thanks. And in Rome?"},
]  # as a client sends it back: arguments as JSON text, content as text (the server joins parts)
SYSTEM = {"role": "system", "content": "Be brief."}


def test_template_history_parses_arguments_for_every_family():
    for name in ("hermes", "llama3_json", "mistral"):
        history = template_history(HISTORY, None, name)
        assert history[1]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                               "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        assert history[1]["tool_calls"][1]["function"]["arguments"] == {}
        assert history[:1] + history[2:] == HISTORY[:1] + HISTORY[2:]
        # the families whose template renders calls and results keep the rest as it is
        assert parser_class(name).prepare_history(history) is history
        assert parser_class(name).prepare_messages(history, TOOLS, True) is history
    assert template_history(HISTORY, QWEN_LIKE) == template_history(HISTORY, None, "hermes")
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # input untouched
    plain = [SYSTEM, HISTORY[0]]
    assert template_history(plain, CHATML) is plain  # nothing of tools: nothing to do


@pytest.mark.parametrize("arguments, message", [
    ("{not json", "is not valid JSON (Expecting property name"),
    ('["Paris"]', "must be a JSON object, got list"),
    (None, "must be a JSON object, got NoneType"),
])
def test_template_history_names_a_bad_call(arguments, message):
    bad = {"role": "assistant", "tool_calls": [HISTORY[1]["tool_calls"][0],
                                               {"id": "c", "function": {"name": "get_time", "arguments": arguments}}]}
    with pytest.raises(ToolError, match=re.escape(message)) as info:
        template_history([HISTORY[0], bad], CHATML)
    assert info.value.param == "messages[1].tool_calls[1].function.arguments"
    with pytest.raises(ToolError) as info:
        template_history([HISTORY[0], {"role": "assistant", "tool_calls": [{"id": "c"}]}], CHATML)
    assert info.value.param == "messages[1].tool_calls[0].function"
    assert str(info.value) == "messages[1].tool_calls[0].function: must be an object, got NoneType"


def test_generic_history_renders_through_an_alternating_template_without_tools():
    """A later turn with tool_choice "none", or without `tools`: the calls and results still show."""
    messages = template_history(HISTORY, CHATML)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert json.loads(messages[1]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"},
        {"name": "get_time", "arguments": {}, "id": "call_2"}]}
    results, question = messages[2]["content"].rsplit("\n", 1)
    first, second = (json.loads(line) for line in results.split("\n"))
    assert first == {"tool_response": {"tool": "get_weather", "tool_call_id": "call_1", "content": "18 C, sunny"}}
    assert second == {"tool_response": {"tool": "get_time", "tool_call_id": "call_2", "content": "14:05"}}
    assert question == "Thanks. And in Rome?"
    prompt = render_chat_template(CHATML, messages)
    assert '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather"' in prompt
    generic = parser_class("generic")
    assert generic.prepare_history(messages) == messages  # applying it again changes nothing
    assert template_history(HISTORY, QWEN_LIKE, "generic") == messages  # --tool-parser decides
    with pytest.raises(Exception, match="roles must alternate"):
        render_chat_template(CHATML, [*HISTORY[:1], {"role": "user", "content": "again"}])


def test_generic_prepare_messages_describes_the_tools():
    generic = parser_class("generic")
    history = template_history([SYSTEM, *HISTORY], CHATML)
    messages = generic.prepare_messages(history, TOOLS, template_renders_tools=False)
    assert messages[1:] == history[1:]  # the history is template_history's
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\nYou can use these tools:\n") and system.endswith(FORMAT_PROMPT)
    listed = json.loads(system.split("\n")[3])
    assert listed == [{"name": "get_weather", "description": "Current weather in a city.",
                       "parameters": WEATHER["function"]["parameters"]},
                      {"name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    prompt = render_chat_template(CHATML, messages)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can use these tools:\n")
    # Without a system message, one is added; a template that renders `tools` gets only the format.
    first = generic.prepare_messages(HISTORY[:1], TOOLS, template_renders_tools=False)[0]
    assert first["role"] == "system" and first["content"].startswith("You can use these tools:\n")
    first = generic.prepare_messages([SYSTEM, HISTORY[0]], TOOLS, template_renders_tools=True)[0]
    assert first == {"role": "system", "content": "Be brief.\n\n" + FORMAT_PROMPT}
    assert SYSTEM == {"role": "system", "content": "Be brief."}  # input untouched


# --- recorded outputs: (text, content, [(name, arguments)]) ---

W = '{"city": "Paris"}'
HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "", [("get_weather", W)]),
    ("I'll check the weather first.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
     "</tool_call>", "I'll check the weather first.", [("get_weather", W)]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {}}\n</tool_call>', "", [("get_weather", W), ("get_time", "{}")]),
    # Hermes 2 Pro puts "arguments" first; some fine-tunes say "parameters".
    ('<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>', "", [("get_weather", W)]),
    ('<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>', "", [("get_weather", W)]),
    # Qwen3 pretty-printing, non-ASCII as written.
    ('<tool_call>\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Z\u00fcrich",\n'
     '    "unit": "celsius"\n  }\n}\n</tool_call>', "",
     [("get_weather", '{\n    "city": "Z\u00fcrich",\n    "unit": "celsius"\n  }')]),
    ('Before <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nand after.', "Before\n\nand after.",
     [("get_time", "{}")]),
    ("Plain answer, 3 < 4 and <tool <b>.\n", "Plain answer, 3 < 4 and <tool <b>.\n", []),
    ("", "", []),
]
HERMES_RAW = [  # malformed, unknown, unclosed: content, tags and all
    ('A <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call> B', None, []),
    ('<tool_call>\n{"name": "send_email", "arguments": {"to": "x"}}\n</tool_call>', None, []),
    ('<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', None, []),
    ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),
    ("Almost <tool_call", None, []),
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
     [("get_time", "{}")]),
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", W)]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", W)]),
    ('\n\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", W)]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}', "",
     [("get_weather", W), ("get_time", "{}")]),
    ("The weather in Paris is sunny; see <|python_tag|> docs {here}.", None, []),
    ("  <|python", None, []),
]
LLAMA3_RAW = [
    ('{"answer": 42}', None, []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}} Done.', None, []),
    ('{"name": "search", "parameters": {"q": "x"}}', None, []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {', None, []),
    ('<|python_tag|>brave_search.call(query="Paris weather")', None, []),
]
MISTRAL = [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [("get_weather", W)]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}, '
     '{"name": "get_time", "arguments": {}, "id": "Zz9Yy8Xx7"}]', "", [("get_weather", W), ("get_time", "{}")]),
    ('Let me look.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Let me look.",
     [("get_weather", W)]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", W)]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", W), ("get_time", "{}")]),
    ('[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', "", [("get_weather", W)]),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}', "", [("get_weather", W)]),
    ("No tools needed: [TOOL or [TOOL_CALL", None, []),
]
MISTRAL_RAW = [
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}', None, []),
    ('[TOOL_CALLS] [{"name": "send_email", "arguments": {}}]', None, []),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, 7]', None, []),
    ("[TOOL_CALLS] []", None, []),
    ('[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', None, []),
    ('[TOOL_CALLS]send_email[ARGS]{"to": "x"}[TOOL_CALLS]get_time[ARGS]{}',
     '[TOOL_CALLS]send_email[ARGS]{"to": "x"}', [("get_time", "{}")]),
]
GENERIC = [
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}', "", [("get_weather", W)]),
    ('{\n  "tool_calls": [\n    {"name": "get_weather", "arguments": {"city": "Paris"}},\n'
     '    {"name": "get_time", "arguments": {}}\n  ]\n}\n', "", [("get_weather", W), ("get_time", "{}")]),
    ('{"tool_call": {"name": "get_time", "arguments": {}}}', "", [("get_time", "{}")]),
    ('{"response": "Hello! \\"Quoted\\" caf\\u00e9 \\ud83d\\ude00\\n\\tdone \\\\ /\\/"}',
     'Hello! "Quoted" caf\u00e9 \U0001F600\n\tdone \\ //', []),
    (' {"response": ""} ', "", []),
]
GENERIC_RAW = [
    ("Sure, here you go.", None, []),
    ('{"tool_calls": [{"name": "send_email", "arguments": {}}]}', None, []),
    ('{"tool_calls": []}', None, []),
    ('{"tool_calls": [{"name": "get_time", "arguments": {}}], "response": "x"}', None, []),
    ('{"answer": "x"}', None, []),
    ('{"response": 42}', None, []),
    ('{"tool_calls": [{"name": "get_time", "arguments": {}}]', None, []),
    # What streamed of a response stays out; the rest, raw.
    ('{"response": "abc", "extra": 1}', 'abc, "extra": 1}', []),
    ('{"response": "bad \\q escape"}', 'bad \\q escape"}', []),
    ('{"response": "lone \\ud800 surrogate"}', 'lone \\ud800 surrogate"}', []),
    ('{"response": "cut \\u00', "cut \\u00", []),
]
CASES = {"hermes": HERMES + HERMES_RAW, "llama3_json": LLAMA3 + LLAMA3_RAW,
         "mistral": MISTRAL + MISTRAL_RAW, "generic": GENERIC + GENERIC_RAW}
ALL = [(family, *case) for family, cases in CASES.items() for case in cases]


def run(family: str, chunks: list[str]):
    parser = parser_class(family)(TOOLS)
    pieces, calls = [], []
    for chunk in chunks:
        content, new = parser.feed(chunk)
        pieces.append(content)
        calls += new
    content, new = parser.finish()
    pieces.append(content)
    calls += new
    assert "".join(pieces) == parser.content
    assert calls == parser.calls
    return pieces, calls


def check(family: str, text: str, content: str | None, expected: list, chunks: list[str], clean: bool):
    pieces, calls = run(family, chunks)
    assert "".join(pieces) == (text if content is None else content)
    assert [(c.name, c.arguments) for c in calls] == expected
    markers = parser_class(family).markers
    if clean and calls:
        assert not any(marker in piece for piece in pieces for marker in markers)
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)
        pattern = r"[a-zA-Z0-9]{9}" if family == "mistral" else r"call_[0-9a-f]{24}"
        assert re.fullmatch(pattern, call.id)
    assert len({call.id for call in calls}) == len(calls)


@pytest.mark.parametrize("family, text, content, expected", ALL)
def test_recorded_output_whole_and_by_character(family, text, content, expected):
    clean = any(case[0] == text for case in HERMES + LLAMA3 + MISTRAL + GENERIC)
    check(family, text, content, expected, [text], clean)
    check(family, text, content, expected, list(text), clean)
    for cut in range(len(text) + 1):
        check(family, text, content, expected, [text[:cut], text[cut:]], clean)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ALL), st.lists(st.floats(0, 1), max_size=12))
def test_recorded_output_in_random_chunks(case, cuts):
    family, text, content, expected = case
    points = sorted({round(c * len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    clean = any(c[0] == text for c in HERMES + LLAMA3 + MISTRAL + GENERIC)
    check(family, text, content, expected, chunks, clean)


def test_generic_response_streams_as_it_decodes():
    parser = parser_class("generic")(TOOLS)
    assert parser.feed('{"response": "Hel') == ("Hel", [])
    assert parser.feed("lo \\") == ("lo ", [])  # never half an escape
    assert parser.feed("u00e") == ("", [])
    assert parser.feed('9!"') == ("\u00e9!", [])
    assert parser.feed("}") == ("", [])
    assert parser.finish() == ("", [])


def test_calls_come_out_as_soon_as_complete():
    hermes = parser_class("hermes")(TOOLS)
    content, calls = hermes.feed('Hi <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool')
    assert content == "Hi" and [c.name for c in calls] == ["get_time"]
    mistral = parser_class("mistral")(TOOLS)
    content, calls = mistral.feed('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Pa')
    assert content == "" and [c.name for c in calls] == ["get_time"]
    # Llama 3 waits for the end: until then a later part may make the whole output content.
    llama = parser_class("llama3_json")(TOOLS)
    assert llama.feed('{"name": "get_time", "parameters": {}}') == ("", [])
    assert [c.name for c in llama.finish()[1]] == ["get_time"]
    with pytest.raises(RuntimeError):
        llama.feed("more")


def test_text_streams_without_holding_more_than_a_marker_start():
    hermes = parser_class("hermes")(TOOLS)
    assert hermes.feed("Hello there <tool_") == ("Hello there", [])
    assert hermes.feed("box>") == (" <tool_box>", [])
    llama = parser_class("llama3_json")(TOOLS)
    assert llama.feed("  <|py") == ("", [])
    assert llama.feed("thon is nice") == ("  <|python is nice", [])
