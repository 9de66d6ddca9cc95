"""Chat templates of the model families quill runs render exactly as transformers' apply_chat_template.

The real templates are not in the repository (they come with the model files, and are not ours to
copy). Each template below was written for this test: it uses the Jinja constructs, filters, globals
and variables of its family's template (date helpers and `date_string` for Llama 3, a reversed scan and
`enable_thinking` for Qwen3, role alternation checked with raise_exception for Gemma 3 and Mistral,
...). Every conversation is rendered by quill and by a transformers PreTrainedTokenizerFast holding the
same template and special tokens, and the texts must be equal; a conversation transformers rejects
must raise quill's ChatTemplateError with the template's message. strftime_now reads the clock in
both (datetime.now()); the clock is frozen in both modules so that they render the same day.
"""

from __future__ import annotations

import datetime as dt

import pytest

from quill.chat_template import ChatTemplateError, check_template_kwargs, render_chat_template
from quill.sampling_params import SamplingParams
from quill.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
jinja2 = pytest.importorskip("jinja2")
import transformers.utils.chat_template_utils as hf_chat_utils  # noqa: E402
from tokenizers import Tokenizer as Backend  # noqa: E402
from tokenizers import models  # noqa: E402

FROZEN_NOW = dt.datetime(2025, 3, 7, 23, 59, 30)  # a one-digit day: %d must give "07"


class _FrozenDatetime(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN_NOW if tz is None else FROZEN_NOW.replace(tzinfo=tz)


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    """Both strftime_now helpers call `datetime.now()` through their module's `datetime` name."""
    import quill.chat_template

    monkeypatch.setattr(quill.chat_template, "datetime", _FrozenDatetime)
    monkeypatch.setattr(hf_chat_utils, "datetime", _FrozenDatetime)


def _backend(special: dict) -> Backend:
    vocab = {"<unk>": 0}
    for token in special.values():
        vocab.setdefault(token, len(vocab))
    return Backend(models.WordLevel(vocab, unk_token="<unk>"))


class Pair:
    """quill's Tokenizer and transformers' tokenizer over one template and one set of special tokens."""

    def __init__(self, template: str, **special: str):
        special = {"unk_token": "<unk>", **special}
        self.ours = Tokenizer(_backend(special), special_tokens=special, chat_template=template)
        self.hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_backend(special), chat_template=template, **special)

    def render(self, messages, add_generation_prompt=True, **kwargs) -> str:
        """Both renderings; asserts they are equal and returns quill's."""
        expected = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        got = self.ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        assert got == expected
        return got

    def rejects(self, messages, match: str, add_generation_prompt=True, hf_error=None, **kwargs) -> None:
        """transformers raises a jinja2 TemplateError (or `hf_error`) with `match`; quill a
        ChatTemplateError with it."""
        with pytest.raises(hf_error or jinja2.exceptions.TemplateError, match=match):
            self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        with pytest.raises(ChatTemplateError, match=match):
            self.ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)


SYSTEM = {"role": "system", "content": "  You answer in one line.\n"}
USER = {"role": "user", "content": "What is the capital of Peru?"}
ASSISTANT = {"role": "assistant", "content": "Lima."}
USER2 = {"role": "user", "content": " And of Chile? "}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — «now»",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}


# ---- Llama 3.x --------------------------------------------------------------------------------
# bos_token; `is defined` defaults for tools_in_user_message / date_string / tools; strftime_now
# guarded by `is defined`; the system message trimmed and cut off by reassigning `messages`;
# "Cutting Knowledge Date"; builtin_tools through reject('equalto', ...) | join; tools as
# tojson(indent=4) in the system or the first user message; `'tool_calls' in message`;
# `content is mapping or content is iterable` (a string is iterable: tojson quotes it);
# `+ x | trim +` precedence; raise_exception for more than one tool call.
LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if tools_in_user_message is not defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "01 Jan 1970" %}
    {%- endif %}
{%- endif %}
{%- if tools is not defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You may call these functions (JSON):\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content'] | trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("tools go in the first user message, and there is none") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("Only one tool call per assistant message is supported.") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + call.name + '", "parameters": ' }}{{- call.arguments | tojson }}{{- "}" }}
        {{- "<|eot_id|>" if builtin_tools is not defined else "<|eom_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""


@pytest.fixture(scope="module")
def llama3():
    return Pair(LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def test_llama3_date_from_the_clock_and_from_date_string(llama3):
    text = llama3.render([USER])
    assert "Cutting Knowledge Date: December 2023\nToday Date: 07 Mar 2025\n\n" in text
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    text = llama3.render([SYSTEM, USER], date_string="26 Jul 2024")
    assert "Today Date: 26 Jul 2024\n\nYou answer in one line.<|eot_id|>" in text


@pytest.mark.parametrize("conversation", [
    [USER],
    [SYSTEM, USER],
    [SYSTEM, USER, ASSISTANT, USER2],
    [USER, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
     {"role": "tool", "content": "18 C, cloudy"}, {"role": "tool", "content": {"temp": 18}}],
    # an OpenAI client's explicit nulls: transformers drops None keys, so 'tool_calls' in message is false
    [USER, {"role": "assistant", "content": "Lima.", "tool_calls": None}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_llama3_conversations(llama3, conversation, add_generation_prompt):
    llama3.render(conversation, add_generation_prompt)


def test_llama3_tools_and_builtin_tools(llama3):
    text = llama3.render([SYSTEM, USER], tools=[WEATHER_TOOL])
    assert '    "function": {' in text and "«now»" in text  # tojson(indent=4), ensure_ascii off
    llama3.render([SYSTEM, USER], tools=[WEATHER_TOOL], tools_in_user_message=False)
    text = llama3.render([USER], builtin_tools=["brave_search", "code_interpreter", "wolfram_alpha"])
    assert "Tools: brave_search, wolfram_alpha\n\n" in text
    llama3.render([USER, {"role": "assistant", "tool_calls": [TOOL_CALL]}], builtin_tools=["brave_search"])


def test_llama3_errors(llama3):
    two_calls = {"role": "assistant", "tool_calls": [TOOL_CALL, TOOL_CALL]}
    llama3.rejects([USER, two_calls], "Only one tool call per assistant message")
    llama3.rejects([SYSTEM], "there is none", tools=[WEATHER_TOOL])


# ---- Qwen3 ------------------------------------------------------------------------------------
# tools block with tojson; namespace(multi_step_tool=true, last_query_index=...) updated in a
# reversed scan (messages[::-1]) for the last real user query; `is string`; str methods
# (startswith, endswith, split, rstrip, lstrip, strip); reasoning_content from the message or cut out
# of <think>...</think>; tool_call.function unwrapping; arguments `is string` or tojson; grouped tool
# responses via loop.previtem / loop.nextitem and messages[loop.index0 - 1]; `enable_thinking is
# defined and enable_thinking is false` adds an empty think block.
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- "# Tools\n\nFunction signatures, one per line, in <tools></tools>:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nCall one with <tool_call></tool_call> around a JSON object.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
          and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or loop.previtem.role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

QWEN_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


@pytest.fixture(scope="module")
def qwen3():
    return Pair(QWEN3, **QWEN_SPECIAL)


def test_qwen3_enable_thinking(qwen3):
    plain = qwen3.render([USER])
    assert plain.endswith("<|im_start|>assistant\n")
    assert qwen3.render([USER], enable_thinking=True) == plain
    off = qwen3.render([USER], enable_thinking=False)
    assert off == plain + "<think>\n\n</think>\n\n"
    assert qwen3.render([USER], enable_thinking=0) == plain  # `is false` is identity: 0 is not False
    assert qwen3.render([USER], add_generation_prompt=False, enable_thinking=False).endswith("<|im_end|>\n")


THINKING_TURN = {"role": "assistant", "content": "<think>\nThe user asks.\n</think>\n\nLima."}


@pytest.mark.parametrize("conversation", [
    [USER],
    [SYSTEM, USER, THINKING_TURN, USER2],
    [SYSTEM, USER, THINKING_TURN],  # the last turn after the last query keeps its reasoning
    [USER, {"role": "assistant", "content": "Lima.", "reasoning_content": "\nEasy.\n"}],
    [USER, {"role": "assistant", "content": "Lima.", "reasoning": "Easy."}],  # aliased as transformers does
    [USER, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
     {"role": "tool", "content": "18 C"}, {"role": "tool", "content": "19 C"},
     {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
     {"role": "assistant", "content": "Done", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}],
    [SYSTEM, USER, {"role": "system", "content": "late system"}, ASSISTANT],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_conversations(qwen3, conversation, add_generation_prompt):
    qwen3.render(conversation, add_generation_prompt)
    qwen3.render(conversation, add_generation_prompt, enable_thinking=False)


def test_qwen3_tools(qwen3):
    text = qwen3.render([SYSTEM, USER], tools=[WEATHER_TOOL])
    assert '"description": "Weather for a city — «now»"' in text  # tojson keeps non-ASCII
    qwen3.render([USER], tools=[WEATHER_TOOL, {"type": "function", "function": {"name": "noop"}}])


def test_qwen3_errors(qwen3):
    qwen3.rejects([], "empty conversation", hf_error=ValueError)
    qwen3.rejects([USER, {"role": "assistant", "tool_calls": 5}], "not iterable", hf_error=TypeError)


def test_values_json_cannot_hold_become_placeholders(qwen3):
    # transformers rebuilds what the template sees from plain types: a set becomes "<set>"
    odd_call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {1j}}}]}
    assert '"arguments": <set>}' in qwen3.render([USER, odd_call])


# ---- Gemma 3 ----------------------------------------------------------------------------------
# bos_token; `-%}` on both sides; the system message folded into the first user turn
# (string or list-of-parts content); loop_messages = messages[1:]; role alternation checked with
# raise_exception; assistant renamed "model"; `| trim`; image / text parts.
GEMMA3 = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Turns must go user, assistant, user, assistant, ...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Content must be a string or a list of parts") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


@pytest.fixture(scope="module")
def gemma3():
    return Pair(GEMMA3, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


@pytest.mark.parametrize("conversation", [
    [USER],
    [SYSTEM, USER],
    [SYSTEM, USER, ASSISTANT, USER2],
    [{"role": "system", "content": [{"type": "text", "text": "Parts system."}]},
     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "  What is this? "}]}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma3_conversations(gemma3, conversation, add_generation_prompt):
    gemma3.render(conversation, add_generation_prompt)


def test_gemma3_system_folds_into_the_first_user_turn(gemma3):
    text = gemma3.render([SYSTEM, USER])
    assert text == ("<bos><start_of_turn>user\n  You answer in one line.\n\n\nWhat is the capital of Peru?"
                    "<end_of_turn>\n<start_of_turn>model\n")


def test_gemma3_errors(gemma3):
    gemma3.rejects([USER, USER2], "Turns must go user, assistant")
    gemma3.rejects([SYSTEM, ASSISTANT], "Turns must go user, assistant")
    gemma3.rejects([{"role": "user", "content": 42}], "Content must be a string")


# ---- Mistral Nemo ([INST], [AVAILABLE_TOOLS], [TOOL_CALLS]) ----------------------------------------
# selectattr('role', 'equalto', 'user') | list; namespace() with attributes set later; role alternation
# counted in ns.index, skipping tool turns; `message == user_messages[-1]` (dict equality); the system
# message joined to the last user turn (`loop.last and system_message is defined`); tool JSON built
# from function.items() with tojson; tool call ids checked by length; raise for unknown roles.
MISTRAL_NEMO = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After an optional system message, roles must alternate user/assistant") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS][" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}{{- '"' + key + '": "' + val + '"' }}{%- else %}{{- '"' + key + '": ' + val|tojson }}{%- endif %}
                    {%- if not loop.last %}{{- ", " }}{%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" }}{%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST]" + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST]" + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS][" }}
        {%- for tool_call in message.tool_calls %}
            {%- if not tool_call.id is defined or tool_call.id | length != 9 %}
                {{- raise_exception("Tool call ids must be 9 characters long") }}
            {%- endif %}
            {{- '{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments | tojson + ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- message["content"] + eos_token }}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS]{"content": ' + message.content | string + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user, assistant and tool turns may follow the system message") }}
    {%- endif %}
{%- endfor %}"""


# ---- Mistral Small 3 ([SYSTEM_PROMPT]) ----------------------------------------------------------
# strftime_now("%Y-%m-%d") into a default system prompt; yesterday computed with slicing, |int and
# the format filter; [SYSTEM_PROMPT] / [INST]; raise for unknown roles.
MISTRAL_SMALL3 = r"""{%- set today = strftime_now("%Y-%m-%d") %}
{%- set day = today[8:10] | int %}
{%- set yesterday = today[:8] + "%02d" | format(day - 1 if day > 1 else day) %}
{%- set default_system_message = "You are a helpful assistant. Your knowledge stops at 2023-10-01. Today is " + today + " (yesterday was " + yesterday + ")." %}
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = default_system_message %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'system' %}
        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Roles are user, system and assistant.') }}
    {%- endif %}
{%- endfor %}"""

MISTRAL_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def nemo():
    return Pair(MISTRAL_NEMO, **MISTRAL_SPECIAL)


@pytest.fixture(scope="module")
def small3():
    return Pair(MISTRAL_SMALL3, **MISTRAL_SPECIAL)


CALL_WITH_ID = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}


@pytest.mark.parametrize("conversation", [
    [USER],
    [SYSTEM, USER],
    [SYSTEM, USER, ASSISTANT, USER2],
    [USER, {"role": "assistant", "tool_calls": [CALL_WITH_ID]},
     {"role": "tool", "content": {"temp": 18}, "tool_call_id": "call00001"}, ASSISTANT, USER2],
])
def test_mistral_nemo_conversations(nemo, conversation):
    nemo.render(conversation)
    nemo.render(conversation, tools=[WEATHER_TOOL])


def test_mistral_nemo_shape_and_errors(nemo):
    text = nemo.render([SYSTEM, USER, ASSISTANT, USER2], tools=[WEATHER_TOOL])
    assert text.startswith("<s>[INST]What is the capital of Peru?[/INST]Lima.</s>[AVAILABLE_TOOLS][")
    assert text.endswith("[INST]  You answer in one line.\n\n\n And of Chile? [/INST]")
    nemo.rejects([USER, USER2], "roles must alternate")
    nemo.rejects([USER, {"role": "assistant", "tool_calls": [{**CALL_WITH_ID, "id": "short"}]}], "9 characters")
    nemo.rejects([USER, ASSISTANT, {"role": "critic", "content": "x"}], "roles must alternate")
    nemo.rejects([USER, {"role": "critic", "content": "x"}], "Only user, assistant and tool")


@pytest.mark.parametrize("conversation", [[USER], [SYSTEM, USER, ASSISTANT, USER2], [USER, SYSTEM, USER2]])
def test_mistral_small3_conversations(small3, conversation):
    small3.render(conversation)


def test_mistral_small3_default_system_prompt_and_errors(small3):
    text = small3.render([USER])
    assert text.startswith("<s>[SYSTEM_PROMPT]You are a helpful assistant. Your knowledge stops at 2023-10-01. "
                           "Today is 2025-03-07 (yesterday was 2025-03-06).[/SYSTEM_PROMPT][INST]")
    small3.rejects([USER, {"role": "tool", "content": "x"}], "Roles are user, system and assistant")


# ---- Phi-3 / Phi-4-mini ----------------------------------------------------------------------------
# role tokens built from pieces ('<|' + role + '|>'); `'tools' in message and message['tools'] is
# not none` on the system message; eos_token when no generation prompt is asked for.
PHI4_MINI = r"""{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"""
PHI3 = r"""{% for message in messages %}
{% if message['role'] in ['system', 'user', 'assistant'] %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"""


@pytest.mark.parametrize("template", [PHI4_MINI, PHI3], ids=["phi4-mini", "phi3"])
@pytest.mark.parametrize("conversation", [
    [USER],
    [SYSTEM, USER, ASSISTANT, USER2],
    [{"role": "system", "content": "Use tools.", "tools": '[{"name": "get_weather"}]'}, USER],
    [{"role": "system", "content": "No tools.", "tools": None}, USER],  # None dropped: 'tools' in message is false
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_phi_conversations(template, conversation, add_generation_prompt):
    pair = Pair(template, bos_token="<s>", eos_token="<|endoftext|>")
    text = pair.render(conversation, add_generation_prompt)
    assert text.endswith("<|assistant|>" if template is PHI4_MINI and add_generation_prompt else
                         "<|assistant|>\n" if add_generation_prompt else "<|endoftext|>")


# ---- OLMo 2 -----------------------------------------------------------------------------------
# bos_token; eos_token after an assistant turn, with a newline unless it is the last message
# (loop.last); the generation prompt written inside the loop (`loop.last and add_generation_prompt`).
OLMO2 = r"""{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>
' + message['content'] + '
' }}{% elif message['role'] == 'user' %}{{ '<|user|>
' + message['content'] + '
' }}{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>
' + message['content'] + eos_token + '
' }}{% else %}{{ '<|assistant|>
' + message['content'] + eos_token }}{% endif %}{% endif %}{% if loop.last and add_generation_prompt %}{{ '<|assistant|>
' }}{% endif %}{% endfor %}"""


@pytest.mark.parametrize("conversation", [[USER], [SYSTEM, USER, ASSISTANT, USER2], [USER, ASSISTANT]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_olmo2_conversations(conversation, add_generation_prompt):
    pair = Pair(OLMO2, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|pad|>")
    text = pair.render(conversation, add_generation_prompt)
    assert text.startswith("<|endoftext|><|")


# ---- SmolLM3 ----------------------------------------------------------------------------------
# `enable_thinking is not defined` default; /think and /no_think flags in the system message
# (`in`, replace, rstrip) win over the kwarg; /system_override; strftime_now("%d %B %Y") joined
# with `~`; xml_tools | default([]) and tools; `is string` content; {% generation %} around
# assistant turns; `-%}` trimming everywhere.
SMOLLM3 = r"""{%- if enable_thinking is not defined -%}{%- set enable_thinking = true -%}{%- endif -%}
{%- set reasoning_mode = "/think" if enable_thinking else "/no_think" -%}
{{- "<|im_start|>system\n" -}}
{%- set ns = namespace(instructions="") -%}
{%- if messages[0].role == "system" -%}
    {%- set system_message = messages[0].content -%}
    {%- if "/no_think" in system_message -%}
        {%- set reasoning_mode = "/no_think" -%}
    {%- elif "/think" in system_message -%}
        {%- set reasoning_mode = "/think" -%}
    {%- endif -%}
    {%- set ns.instructions = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}
{%- endif -%}
{%- if "/system_override" in system_message -%}
    {{- ns.instructions.replace("/system_override", "").rstrip() -}}
    {{- "<|im_end|>\n" -}}
{%- else -%}
    {{- "## Metadata\n\nKnowledge Cutoff Date: June 2025\n" -}}
    {%- set today = strftime_now("%d %B %Y") -%}
    {{- "Today Date: " ~ today ~ "\n" -}}
    {{- "Reasoning Mode: " + reasoning_mode + "\n\n" -}}
    {{- "## Custom Instructions\n\n" -}}
    {%- if ns.instructions -%}
        {{- ns.instructions + "\n\n" -}}
    {%- elif reasoning_mode == "/think" -%}
        {{- "Think step by step inside <think> before you answer.\n\n" -}}
    {%- else -%}
        {{- "Answer directly.\n\n" -}}
    {%- endif -%}
    {%- if xml_tools or tools -%}
        {{- "### Tools\n\n<tools>\n" -}}
        {%- for tool in (xml_tools | default([])) + (tools | default([], true)) -%}
            {{- tool | tojson ~ "\n" -}}
        {%- endfor -%}
        {{- "</tools>\n\n" -}}
    {%- endif -%}
    {{- "<|im_end|>\n" -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set content = message.content if message.content is string else "" -%}
    {%- if message.role == "user" -%}
        {{ "<|im_start|>user\n" + content + "<|im_end|>\n" }}
    {%- elif message.role == "assistant" -%}
        {% generation %}
        {%- if reasoning_mode == "/think" -%}
            {{ "<|im_start|>assistant\n" + content.lstrip("\n") + "<|im_end|>\n" }}
        {%- else -%}
            {{ "<|im_start|>assistant\n<think>\n\n</think>\n" + content.lstrip("\n") + "<|im_end|>\n" }}
        {%- endif -%}
        {% endgeneration %}
    {%- elif message.role == "tool" -%}
        {{ "<|im_start|>user\n<tool_response>\n" + content + "\n</tool_response><|im_end|>\n" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ "<|im_start|>assistant\n" if reasoning_mode == "/think" else "<|im_start|>assistant\n<think>\n\n</think>\n" }}
{%- endif -%}"""


@pytest.fixture(scope="module")
def smollm3():
    return Pair(SMOLLM3, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|finetune_right_pad_id|>")


@pytest.mark.parametrize("conversation", [
    [USER],
    [{"role": "system", "content": "Be terse. /no_think"}, USER, ASSISTANT, USER2],
    [{"role": "system", "content": "/think Be careful."}, USER],
    [{"role": "system", "content": "Custom header only /system_override"}, USER],
    [USER, {"role": "assistant", "content": "\n\nLima."}, {"role": "tool", "content": "ok"}],
])
@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_smollm3_conversations(smollm3, conversation, enable_thinking):
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    smollm3.render(conversation, **kwargs)
    smollm3.render(conversation, add_generation_prompt=False, **kwargs)


def test_smollm3_flags_date_and_tools(smollm3):
    text = smollm3.render([USER], enable_thinking=False)
    assert "Today Date: 07 March 2025\nReasoning Mode: /no_think\n\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")
    # the system message's flag wins over the kwarg
    text = smollm3.render([{"role": "system", "content": "Hi /think"}, USER], enable_thinking=False)
    assert "Reasoning Mode: /think" in text and text.endswith("<|im_start|>assistant\n")
    text = smollm3.render([USER], xml_tools=[WEATHER_TOOL], tools=[{"name": "noop"}])
    assert '<tools>\n{"type": "function"' in text and '{"name": "noop"}\n</tools>' in text


# ---- Granite 3.x ------------------------------------------------------------------------------
# a default system message with strftime_now('%B %d, %Y'); branches on tools / documents /
# thinking kwargs; `'citations' in controls` on a kwarg that may be undefined; tools |
# tojson(indent=4); documents with doc_id | string; controls | tojson() on the generation prompt.
GRANITE3 = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\nToday's Date: " + strftime_now('%B %d, %Y') + ".\nYou are a helpful model." %}
    {%- if tools and documents %}
        {%- set system_message = system_message + " Use the tools and the documents." %}
    {%- elif tools %}
        {%- set system_message = system_message + " Use the tools when they help." %}
    {%- elif documents %}
        {%- set system_message = system_message + " Answer from the documents." %}
    {%- elif thinking %}
        {%- set system_message = system_message + " Think first, between <think></think>, then answer." %}
    {%- endif %}
    {%- if 'citations' in controls and documents %}
        {%- set system_message = system_message + "\n\nCite the documents you use." %}
    {%- endif %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}
{%- if tools %}
    {{- '<|start_of_role|>tools<|end_of_role|>' }}{{- tools | tojson(indent=4) }}{{- '<|end_of_text|>\n' }}
{%- endif %}
{%- if documents %}
    {%- for document in documents %}
        {{- '<|start_of_role|>document {"document_id": "' + document['doc_id'] | string + '"}<|end_of_role|>\n' }}
        {{- document['text'] }}{{- '<|end_of_text|>\n' }}
    {%- endfor %}
{%- endif %}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_of_role|>assistant' }}
        {%- if controls %}{{- ' ' + controls | tojson() }}{%- endif %}
        {{- '<|end_of_role|>' }}
    {%- endif %}
{%- endfor %}"""

DOCUMENTS = [{"doc_id": 1, "title": "Peru", "text": "Lima is the capital of Peru."},
             {"doc_id": "b", "title": "Chile", "text": "Santiago is the capital of Chile."}]


@pytest.fixture(scope="module")
def granite3():
    return Pair(GRANITE3, bos_token="<|end_of_text|>", eos_token="<|end_of_text|>", pad_token="<|end_of_text|>")


@pytest.mark.parametrize("kwargs", [
    {},
    {"tools": [WEATHER_TOOL]},
    {"documents": DOCUMENTS},
    {"documents": DOCUMENTS, "controls": {"citations": True, "length": "short"}},
    {"tools": [WEATHER_TOOL], "documents": DOCUMENTS},
    {"thinking": True},
])
@pytest.mark.parametrize("conversation", [[USER], [SYSTEM, USER, ASSISTANT, USER2]])
def test_granite3_conversations(granite3, conversation, kwargs):
    granite3.render(conversation, **kwargs)
    granite3.render(conversation, add_generation_prompt=False, **kwargs)


def test_granite3_date_documents_and_controls(granite3):
    text = granite3.render([USER], documents=DOCUMENTS, controls={"citations": True})
    assert "Today's Date: March 07, 2025." in text and "Cite the documents you use." in text
    assert '<|start_of_role|>document {"document_id": "1"}<|end_of_role|>\nLima' in text
    assert text.endswith('<|start_of_role|>assistant {"citations": true}<|end_of_role|>')


# ---- the helpers transformers provides, beyond the families ----------------------------------------

HELPERS = r"""{%- set ns = namespace(n=0, seen=[]) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.n = ns.n + 1 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'skip' %}{%- continue %}{%- endif %}
    {%- if m.role == 'stop' %}{%- break %}{%- endif %}
    {{- loop.index ~ '/' ~ loop.length ~ ' ' ~ (loop.previtem.role if loop.previtem is defined else '-') ~ '>' ~ m.role }}
    {{- ' ' ~ loop.cycle('odd', 'even') ~ ' ' ~ loop.revindex0 ~ (' first' if loop.first else '') ~ (' last' if loop.last else '') ~ '\n' }}
{%- endfor %}
{{- ns.n ~ ' users; ' ~ dict(a=1, b=[1, 2]) | tojson(sort_keys=true) ~ '; ' ~ {'k': '<&>'} | tojson(separators=(',', ':')) }}
{{- '; ' ~ (messages | map(attribute='role') | unique | join(',')) ~ '; ' ~ strftime_now('%Y-%m-%dT%H:%M:%S') }}
{{- '; ' ~ (messages | selectattr('content', 'defined') | list | length) ~ ' with content; ' ~ bos_token ~ eos_token }}"""


def test_loop_controls_namespace_dict_tojson_and_clock():
    pair = Pair(HELPERS, bos_token="<s>", eos_token="</s>")
    conversation = [USER, {"role": "skip", "content": "x"}, ASSISTANT, {"role": "user", "content": None},
                    {"role": "stop", "content": "x"}, USER2]
    text = pair.render(conversation)
    assert "2026" not in text and "2025-03-07T23:59:30" in text
    assert '{"a": 1, "b": [1, 2]}' in text and '{"k":"<&>"}' in text  # no HTML escaping, as in transformers
    assert "; 5 with content;" in text  # the None content was dropped, as transformers drops it


def test_namespace_attributes_starting_with_underscore_are_refused():
    for template in ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "{% set ns = namespace() %}{% set ns._x = 1 %}x"):
        Pair(template, bos_token="<s>").rejects([USER], "underscore|'_x'")


def test_kwargs_override_special_tokens_as_in_transformers():
    pair = Pair("{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}", bos_token="<s>", eos_token="</s>")
    assert pair.render([USER], bos_token="[B]") == "[B]|</s>|False"


def test_raise_exception_message_reaches_the_error():
    pair = Pair("{% if messages|length > 1 %}{{ raise_exception('only ' ~ 1 ~ ' message, got ' ~ messages|length) }}{% endif %}ok",
                bos_token="<s>")
    assert pair.render([USER]) == "ok"
    pair.rejects([USER, USER2], "only 1 message, got 2")


# ---- chat_template_kwargs: which names a caller may set ---------------------------------------------


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "tools", "documents", "chat_template",
                                 "tokenize", "continue_final_message", "max_seconds", "special_tokens", "_quill_loop_items"])
def test_reserved_template_kwargs_are_refused(key):
    with pytest.raises(ChatTemplateError, match=rf"chat_template_kwargs\.{key}: may not be set"):
        check_template_kwargs({key: 1})


def test_template_kwargs_checks():
    assert check_template_kwargs(None) == {}
    kwargs = {"enable_thinking": False, "date_string": "1 Jan 2025", "bos_token": "[B]"}
    assert check_template_kwargs(kwargs) == kwargs and check_template_kwargs(kwargs) is not kwargs
    with pytest.raises(ChatTemplateError, match="must be a dict"):
        check_template_kwargs(["enable_thinking"])
    with pytest.raises(ChatTemplateError, match="keys must be strings"):
        check_template_kwargs({1: True})
    with pytest.raises(ChatTemplateError, match="reserves"):  # the loop guard cannot be replaced
        render_chat_template("{% for m in messages %}{{ m.role }}{% endfor %}", [USER], _quill_loop_items=list)


# ---- LLM.chat -------------------------------------------------------------------------------------


def test_llm_chat_passes_chat_template_kwargs(make_llm):
    llm = make_llm()
    params = SamplingParams(temperature=0, max_tokens=2)
    conversation = [USER]
    on, off = (llm.chat(conversation, params, chat_template=QWEN3, chat_template_kwargs={"enable_thinking": flag})[0]
               for flag in (True, False))
    assert off.prompt == on.prompt + "<think>\n\n</think>\n\n"
    assert off.prompt_token_ids[:len(on.prompt_token_ids)] == on.prompt_token_ids
    assert len(off.prompt_token_ids) > len(on.prompt_token_ids)
    assert off.prompt == Pair(QWEN3, **QWEN_SPECIAL).render(conversation, enable_thinking=False)
    # the model's own template (SmolLM2's ChatML) has no such variable: the prompt is unchanged
    plain = llm.chat(conversation, params)[0]
    assert llm.chat(conversation, params, chat_template_kwargs={"enable_thinking": False})[0].prompt == plain.prompt
    streamed = list(llm.stream_chat(conversation, params, chat_template=QWEN3, chat_template_kwargs={"enable_thinking": False}))
    assert streamed[-1].prompt == off.prompt and streamed[-1].finished
    for bad in ({"add_generation_prompt": False}, {"messages": []}, {"chat_template": QWEN3}):
        with pytest.raises(ChatTemplateError, match=rf"chat_template_kwargs\.{next(iter(bad))}: may not be set"):
            llm.chat(conversation, params, chat_template_kwargs=bad)
    assert not llm.engine.requests
