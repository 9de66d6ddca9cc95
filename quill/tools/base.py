"""OpenAI tool calling, the parts every model family shares: the request's `tools` and
`tool_choice` checked, the calls a completion made, and the ToolParser contract (stream a
completion's text in, get safe content and finished calls out; the request's grammar; the
messages the chat template gets).

The families (hermes.py, llama3_json.py, mistral.py, generic.py) each say how their models write a
call, how to find one in streamed text (with scan.py, and marked.py for the marker-driven ones),
and which grammar constrains an output to it (with lark.py); the package's __init__ picks the
family for a chat template.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from quill.tools.lark import AddedToken, GrammarBody, assemble, reasoning_prefix
from quill.tools.scan import object_members, skip_ws

MAX_TOOLS = 128  # tools per request: each adds its schema to the prompt and to the grammar
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICE_MODES = ("auto", "none", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` in a request, or a bad tool call in its history; the server
    answers 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """One checked entry of a request's `tools`."""

    name: str
    description: str | None
    parameters: dict  # JSON schema of the arguments object


@dataclass(frozen=True)
class ToolChoice:
    """A checked `tool_choice`: mode "auto" | "none" | "required" | "named" (then `name`)."""

    mode: str
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One call a completion made: `arguments` is the model's JSON object text (stripped)."""

    name: str
    arguments: str
    id: str


def check_tools(tools) -> list[ToolSpec]:
    """A request's `tools` (OpenAI shape) as ToolSpecs; ToolError names the first bad place."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolError("tools", f"must be a list of tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ToolError("tools", f"at most {MAX_TOOLS} tools per request, got {len(tools)}")
    specs: list[ToolSpec] = []
    first_index: dict[str, int] = {}
    for index, tool in enumerate(tools):
        spec = _check_tool(tool, f"tools[{index}]")
        if spec.name in first_index:
            raise ToolError(f"tools[{index}].function.name",
                            f"duplicate function name {spec.name!r} (also tools[{first_index[spec.name]}])")
        first_index[spec.name] = index
        specs.append(spec)
    return specs


def _check_tool(tool, where: str) -> ToolSpec:
    if not isinstance(tool, dict):
        raise ToolError(where, f"must be an object, got {type(tool).__name__}")
    if tool.get("type") != "function":
        raise ToolError(f"{where}.type", f"only 'function' is supported, got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function", f"must be an object, got {type(function).__name__}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ToolError(f"{where}.function.name", f"must match ^{NAME_PATTERN.pattern}$, got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description", f"must be a string, got {type(description).__name__}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    elif not isinstance(parameters, dict):
        raise ToolError(f"{where}.function.parameters",
                        f"must be a JSON schema object, got {type(parameters).__name__}")
    elif parameters.get("type", "object") != "object":
        # The arguments are one JSON object in every format and in the OpenAI response.
        raise ToolError(f"{where}.function.parameters.type", f"must be 'object', got {parameters['type']!r}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict", f"must be a boolean, got {type(strict).__name__}")
    return ToolSpec(name, description, parameters)


def check_tool_choice(choice, tools: list[ToolSpec]) -> ToolChoice:
    """A request's `tool_choice` checked against its tools. Unset is "auto" with tools and
    "none" without, as OpenAI documents the default."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise ToolError("tool_choice", f"must be 'auto', 'none', 'required' or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
        if choice == "required" and not tools:
            raise ToolError("tool_choice", "'required' needs at least one tool in `tools`, got none")
        return ToolChoice(choice)
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise ToolError("tool_choice", f"must be a string or {{\"type\": \"function\", \"function\": "
                        f"{{\"name\": ...}}}}, got {json.dumps(choice, default=str)[:200]}")
    name = choice["function"].get("name")
    offered = [spec.name for spec in tools]
    if not isinstance(name, str) or name not in offered:
        listed = ", ".join(repr(n) for n in offered) if offered else "none"
        raise ToolError("tool_choice", f"function {name!r} is not among the tools offered ({listed})")
    return ToolChoice("named", name)


class ToolParser:
    """One completion's output text, fed as it streams, split into content and tool calls.

    feed() and finish() return (content now safe to show, calls completed by this text). Text
    that may still become a call (a marker's start, an unfinished call) is held back; a call goes
    out only whole and parsed; a malformed or unfinished call goes out as content, raw. However
    the text is split, the content and calls add up to what one feed of the whole text gives.
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[ToolSpec]):
        self.tools = {spec.name: spec for spec in tools}
        self.content = ""
        self.calls: list[ToolCall] = []
        self._pending = ""  # fed text not given out yet
        self._finished = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        return self._record(*self._advance(final=False))

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._finished:
            return "", []
        self._finished = True
        return self._record(*self._advance(final=True))

    def _record(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        self.content += content
        self.calls.extend(calls)
        return content, calls

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        """Consume what self._pending allows (all of it when final); the family's parsing."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def make_call(self, members: dict[str, tuple[Any, int, int]], text: str) -> ToolCall | None:
        """A call from a parsed {"name": ..., "arguments" | "parameters": {...}} object (the
        members of object_members over `text`), or None: unknown function, arguments not an
        object. Arguments may be left out only by an object with nothing else ("{}")."""
        name = members.get("name", (None,))[0]
        if not isinstance(name, str) or name not in self.tools:
            return None
        key = "arguments" if "arguments" in members else "parameters" if "parameters" in members else None
        if key is None:
            return ToolCall(name, "{}", self.new_call_id()) if set(members) <= {"name", "id", "type"} else None
        value, start, end = members[key]
        if not isinstance(value, dict):
            return None
        return ToolCall(name, text[start:end].strip(), self.new_call_id())

    def call_from_text(self, text: str) -> ToolCall | None:
        """make_call over text that must be exactly one JSON object (whitespace around allowed)."""
        start = skip_ws(text, 0)
        parsed = object_members(text, start)
        if parsed is None or skip_ws(text, parsed[1]) != len(text):
            return None
        return self.make_call(parsed[0], text)

    def calls_at(self, text: str, starts: Iterable[int] | None) -> list[ToolCall] | None:
        """make_call on the JSON object at each of `starts` (scan.value_starts /
        array_item_starts; None: the text held no such run): all the calls, or None when there
        are none or one is not a call (a block of calls is taken whole or not at all)."""
        calls = []
        for start in starts or ():
            parsed = object_members(text, start)
            call = parsed and self.make_call(parsed[0], text)
            if not call:
                return None
            calls.append(call)
        return calls or None

    @classmethod
    def grammar(cls, tools: list[ToolSpec], choice: ToolChoice, parallel: bool,
                added_token: AddedToken, reasoning: str | None) -> str:
        """The llguidance Lark grammar for this request's output, for a choice that check_tool_choice
        made over these tools and that calls for tools (auto, required or named: the server asks
        for no grammar when the choice is "none" or there are no tools).

        `added_token(text)`: the token id when text is one added token of the tokenizer, else
        None (see lark.py). `reasoning`: None, "optional" or "opened" (lark.reasoning_prefix).
        """
        if choice.mode == "named":
            tools = [spec for spec in tools if spec.name == choice.name]
        assert tools and choice.mode != "none", f"no tool grammar for {choice} over {len(tools)} tools"
        prefix = reasoning_prefix(reasoning, added_token)
        body = cls._grammar_body(tools, choice.mode != "auto", parallel, added_token, prefix.lead)
        return assemble(prefix, body)

    @classmethod
    def _grammar_body(cls, tools: list[ToolSpec], required: bool, parallel: bool,
                      added_token: AddedToken, lead: str) -> GrammarBody:
        """The grammar after any think block; `lead` is the lexeme for free text that begins it."""
        raise NotImplementedError

    @classmethod
    def prepare_history(cls, messages: list[dict]) -> list[dict]:
        """Past tool calls and results as this family's chat template can show them, whatever the
        request's tools: unchanged (the same list) for the families whose template renders
        `tool_calls` and role "tool" itself. Takes messages whose call arguments are objects
        (quill.tools.template_history, the one caller, makes them so)."""
        return messages

    @classmethod
    def prepare_messages(cls, messages: list[dict], tools: list[ToolSpec], template_renders_tools: bool) -> list[dict]:
        """The messages the chat template gets when the request offers `tools`, from messages
        that already went through template_history (the server calls that on every chat
        request, then this one on requests with a tool plan): unchanged for the families whose
        template describes the tools itself."""
        return messages
