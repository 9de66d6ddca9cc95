"""OpenAI tool calling: checked `tools` / `tool_choice`, a streaming parser per model family for
the calls a completion writes, and the llguidance grammar that constrains them.

The server's path: check_tools / check_tool_choice on the request; detect_parser(template) once per
model, then parser_class(name); prepare_messages before the chat template; grammar() as the
request's constraint; one parser per completion, fed the decoded text (reasoning already split
off), finish() at the end.
"""

from __future__ import annotations

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
    "detect_parser", "parser_class", "template_renders_tools",
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
