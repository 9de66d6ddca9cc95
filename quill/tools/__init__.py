"""OpenAI tool calling: checked `tools` / `tool_choice`, a streaming parser per model family for
the calls a completion writes, and the llguidance grammar that constrains them.

The server's path, per chat request: template_history on its messages, whatever its tools (LLM.chat
does the same, so both render one history); check_tools / check_tool_choice; the family from
--tool-parser, else detect_parser(template) (a few substring tests, cheap enough for every
request), then parser_class(name); prepare_messages before the chat template; grammar() as the
request's constraint; one parser per completion, fed the decoded text (reasoning already split
off), finish() at the end.
"""

from __future__ import annotations

import json
import re

from quill.tools.base import (
    MAX_TOOLS,
    ToolCall,
    ToolChoice,
    ToolError,
    ToolParser,
    ToolSpec,
    check_tool_choice,
    check_tools,
)
from quill.tools.generic import GenericParser
from quill.tools.hermes import HermesParser
from quill.tools.llama3_json import Llama3JsonParser
from quill.tools.mistral import MistralParser

__all__ = [
    "MAX_TOOLS", "PARSER_NAMES", "GenericParser", "HermesParser", "Llama3JsonParser", "MistralParser",
    "ToolCall", "ToolChoice", "ToolError", "ToolParser", "ToolSpec", "check_tool_choice", "check_tools",
    "detect_parser", "parser_class", "template_history", "template_renders_tools", "tool_prompt",
]

_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, GenericParser)
}
PARSER_NAMES: tuple[str, ...] = tuple(_PARSERS)


# --- the family registry: the one place a chat template decides the format ---

_JINJA_CODE = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_TOOLS_VARIABLE = re.compile(r"(?<![\w.])tools\b")


def template_renders_tools(chat_template: str | None) -> bool:
    """True when the template reads the `tools` variable (in Jinja code, not in its text)."""
    if not chat_template:
        return False
    return any(_TOOLS_VARIABLE.search(_STRING_LITERAL.sub("''", code.group()))
               for code in _JINJA_CODE.finditer(chat_template))


def detect_parser(chat_template: str | None) -> str:
    """The tool-call family of a model, from the markers its chat template writes: Qwen2.5/3,
    Hermes 2/3 and SmolLM3 templates wrap calls in <tool_call>; Mistral's write [TOOL_CALLS];
    Llama 3.1-3.3's write <|python_tag|> or render `tools` between Llama 3 headers; anything
    else gets the generic JSON format (quill tells the model about the tools itself)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and template_renders_tools(template)):
        return "llama3_json"
    return "generic"


def parser_class(name: str) -> type[ToolParser]:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; the parsers are {', '.join(PARSER_NAMES)}")
    return _PARSERS[name]


# --- the conversation as the chat template gets it ---


def template_history(messages: list[dict], chat_template: str | None, parser_name: str | None = None) -> list[dict]:
    """`messages` with their past tool calls and results as the model's template can show them,
    the same for the server (every chat request, whatever its tools and tool_choice) and LLM.chat:
    each assistant call's function.arguments as an object (JSON text parsed, as transformers'
    templates expect), then the family's prepare_history (parser_name, else
    detect_parser(chat_template)). Messages with no tool_calls and no role "tool" come back as
    they are (the same list); the input is never changed.

    A call that is not {"function": {"arguments": <a JSON object or its text>, ...}, ...} raises
    ToolError naming it, e.g. `messages[1].tool_calls[0].function.arguments`."""
    if not any(message.get("tool_calls") or message.get("role") == "tool" for message in messages):
        return messages
    checked = [{**message, "tool_calls": _object_arguments(message["tool_calls"], f"messages[{i}].tool_calls")}
               if message.get("tool_calls") else message for i, message in enumerate(messages)]
    return parser_class(parser_name or detect_parser(chat_template)).prepare_history(checked)


def _object_arguments(tool_calls, where: str) -> list[dict]:
    if not isinstance(tool_calls, list):
        raise ToolError(where, f"must be a list of tool calls, got {type(tool_calls).__name__}")
    out = []
    for j, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ToolError(f"{where}[{j}]", f"must be an object, got {type(call).__name__}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{where}[{j}].function", f"must be an object, got {type(function).__name__}")
        arguments = function.get("arguments")
        place = f"{where}[{j}].function.arguments"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError) as exc:
                raise ToolError(place, f"is not valid JSON ({exc})") from exc
        if not isinstance(arguments, dict):
            raise ToolError(place, f"must be a JSON object, got {type(arguments).__name__}")
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def tool_prompt(messages: list[dict], tools: list[dict], chat_template: str | None,
                parser_name: str | None = None, checked: list | None = None) -> tuple[list[dict], dict]:
    """(messages, extra template variables) that show the request's `tools` (OpenAI's list, as
    sent) to the model, the same for the server and LLM.chat: a template that reads `tools` gets
    them as a variable; otherwise the family (parser_name, else detect_parser) describes them in
    the messages (the generic family's system message). `checked`: check_tools(tools), where the
    caller has it already. Run template_history first."""
    renders = template_renders_tools(chat_template)
    family = parser_class(parser_name or detect_parser(chat_template))
    messages = family.prepare_messages(messages, check_tools(tools) if checked is None else checked, renders)
    return messages, ({"tools": tools} if renders else {})
