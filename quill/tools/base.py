"""OpenAI tool calling, the parts every model family shares: the request's `tools` and
`tool_choice` checked, the ToolParser contract (stream a completion's text in, get safe content and
finished calls out) and the marker-driven parser two families share, the JSON scanning the parsers
use, and the llguidance Lark pieces their grammars are built from.

The families (hermes.py, llama3_json.py, mistral.py, generic.py) each say how their models write a
call, how to find one in streamed text, and which grammar constrains an output to it; the package's
__init__ picks the family for a chat template.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from quill.engine.guided_spec import DEFAULT_JSON_WHITESPACE
from quill.engine.stop_checker import partial_match_len
from quill.reasoning import THINK_END, THINK_START

MAX_TOOLS = 128  # tools per request: each adds its schema to the prompt and to the grammar
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICE_MODES = ("auto", "none", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` in a request; the server answers 400 naming `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


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

    @classmethod
    def grammar(cls, tools: list[ToolSpec], choice: ToolChoice, parallel: bool,
                added_token: Callable[[str], Any], reasoning: str | None) -> str | None:
        """The llguidance Lark grammar for this request's output, or None (unconstrained).

        `added_token(text)` is truthy when text is one added token of the tokenizer; it may give
        the token's id instead of True, which a marker llguidance can only name by id needs (see
        lark_token). `reasoning`: None, "optional" or "opened" (reasoning_prefix).
        """
        if choice.mode == "none" or not tools:
            return None
        required = choice.mode in ("required", "named")
        if choice.mode == "named":
            tools = [spec for spec in tools if spec.name == choice.name]
            if not tools:
                raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
        prefix = reasoning_prefix(reasoning, added_token)
        try:
            body = cls._grammar_body(tools, required, parallel, added_token, prefix.lead)
        except UnnamedToken:
            return None
        return assemble(prefix, body)

    @classmethod
    def _grammar_body(cls, tools: list[ToolSpec], required: bool, parallel: bool,
                      added_token: Callable[[str], Any], lead: str) -> GrammarBody:
        """The grammar after any think block; `lead` is the lexeme for free text that begins it."""
        raise NotImplementedError

    @classmethod
    def prepare_messages(cls, messages: list[dict], tools: list[ToolSpec], template_renders_tools: bool) -> list[dict]:
        """The messages the chat template gets; the families whose template knows them unchanged."""
        return messages


class MarkedCallParser(ToolParser):
    """A family whose calls each begin with a marker among text (markers[0]). Text streams,
    holding back what may start a marker; at a marker the family's _read_block reads what
    follows. Whitespace between text and a call is dropped; a block that is not calls is
    content, raw, with the whitespace before it."""

    def __init__(self, tools: list[ToolSpec]):
        super().__init__(tools)
        self._in_block = False  # self._pending starts with the marker
        self._gap = ""  # the whitespace before the block being read
        self._after_call = False  # whitespace after a call waits until text follows

    def _read_block(self, final: bool) -> tuple[int, list[ToolCall] | None] | None:
        """The block self._pending starts with: (its end, its calls, or None when it is not
        calls), or None while it is unfinished (never when final)."""
        raise NotImplementedError

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._pending:
            if self._in_block:
                block = self._read_block(final)
                if block is None:
                    break
                end, found = block
                if found:
                    calls.extend(found)
                else:
                    content.append(self._gap + self._pending[:end])
                self._after_call = bool(found)
                self._pending = self._pending[end:]
                self._in_block = False
                continue
            start = self._pending.find(self.markers[0])
            if start >= 0:
                text = self._pending[:start].rstrip()
                self._gap = self._pending[len(text):start]
                self._emit_text(text, content)
                self._pending = self._pending[start:]
                self._in_block = True
                continue
            ready = len(self._pending) if final else len(self._pending) - hold_back(self._pending, self.markers)
            self._emit_text(self._pending[:ready], content)
            self._pending = self._pending[ready:]
            break
        return "".join(content), calls

    def _emit_text(self, text: str, content: list[str]) -> None:
        if self._after_call and not text.strip():
            return  # whitespace between calls, or after the last one
        content.append(text)
        self._after_call = False


def hold_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of text must wait: a marker's start, and the whitespace
    before it (whitespace next to a call is dropped, so it waits until text follows)."""
    keep = len(text) - partial_match_len(text, markers)
    return len(text) - len(text[:keep].rstrip())


# --- JSON scanning: values parsed by the json module, with where each one lies in the text ---

_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def skip_ws(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index


def _value(text: str, index: int) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text, index)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
        return None


def object_members(text: str, start: int) -> tuple[dict[str, tuple[Any, int, int]], int] | None:
    """The JSON object at text[start]: {key: (value, value start, value end)} and the index past
    its "}", or None when no whole object starts there."""
    if text[start:start + 1] != "{":
        return None
    members: dict[str, tuple[Any, int, int]] = {}
    index = skip_ws(text, start + 1)
    if text[index:index + 1] == "}":
        return members, index + 1
    while True:
        key = _value(text, index) if text[index:index + 1] == '"' else None
        if key is None:
            return None
        index = skip_ws(text, key[1])
        if text[index:index + 1] != ":":
            return None
        value_start = skip_ws(text, index + 1)
        value = _value(text, value_start)
        if value is None:
            return None
        members[key[0]] = (value[0], value_start, value[1])
        index = skip_ws(text, value[1])
        if text[index:index + 1] == "}":
            return members, index + 1
        if text[index:index + 1] != ",":
            return None
        index = skip_ws(text, index + 1)


def array_items(text: str, start: int) -> tuple[list[tuple[int, int]], int] | None:
    """The JSON array at text[start]: each item's (start, end) and the index past its "]"."""
    if text[start:start + 1] != "[" or _value(text, start) is None:
        return None
    items: list[tuple[int, int]] = []
    index = skip_ws(text, start + 1)
    if text[index:index + 1] == "]":
        return items, index + 1
    while True:
        value = _value(text, index)
        items.append((index, value[1]))
        index = skip_ws(text, value[1])
        if text[index:index + 1] == "]":
            return items, index + 1
        index = skip_ws(text, index + 1)  # "," (the whole array parsed above)


class JsonEnd:
    """Where the JSON object or array starting at text[start] closes, found as the text grows
    (brackets counted outside strings; whether it parses is checked once it closes)."""

    def __init__(self, start: int):
        self._index = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str) -> int | None:
        """The index past the closing bracket, or None while it has not come."""
        while self._index < len(text):
            char = text[self._index]
            self._index += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._index
        return None


# --- llguidance Lark pieces ---
#
# What llguidance 1.9.1 does with markers (measured in tests/test_tool_grammars.py): an added token
# is a special token to it when tokenizer.json marks it special or when it is written <...>
# (toktrie_hf_tokenizers: "we treat all added tokens of the form <...> as special tokens"). A
# quoted "<tool_call>" then never matches the token, and no terminal, free text included, can
# contain one: a special marker is written <tool_call> in the grammar, and free text ends at it.
# A special token is named <name> only when its name is <...>; any other ([TOOL_CALLS]) only by
# id, <[id]>. A text marker ends free text through a lazy rule, `trigger[lazy]: TEXT "marker"`.

FREE_TEXT = "TEXT: /(.|\\n)*/"
JSON_OPTIONS = {
    "lenient": True,  # keywords llguidance cannot enforce are ignored instead of failing the request
    "whitespace_pattern": DEFAULT_JSON_WHITESPACE,  # bounded, so a sampled model cannot loop on spaces
}


class UnnamedToken(Exception):
    """A marker that is an added token llguidance can only name by id, and no id was given."""


@dataclass(frozen=True)
class GrammarBody:
    """A family's grammar for the output after any think block: `start` (a Lark expression),
    the rules it uses, and whether it begins with free text (which takes whitespace itself)."""

    start: str
    rules: tuple[str, ...] = ()
    free_start: bool = False


def lark_token(text: str, added_token: Callable[[str], Any]) -> str:
    """How a grammar writes a marker: "text", <text> for an added <...> token, <[id]> when
    added_token gave an id. An added token of another shape with no id raises UnnamedToken:
    it may be special to llguidance (Mistral marks [TOOL_CALLS] special), which no name reaches."""
    added = added_token(text)
    if added is None or added is False:
        return json.dumps(text)
    if isinstance(added, int) and not isinstance(added, bool):
        return f"<[{added}]>"
    if text.startswith("<") and text.endswith(">"):
        return text
    raise UnnamedToken(text)


def is_token(spelling: str) -> bool:
    """True when lark_token spelled a marker as a token (free text cannot contain it)."""
    return spelling.startswith("<")


def lark_json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def arguments_schema(spec: ToolSpec) -> dict:
    return spec.parameters if spec.parameters.get("type") == "object" else {**spec.parameters, "type": "object"}


def call_schema(tools: list[ToolSpec], arguments_key: str, extra: dict | None = None) -> dict:
    """{"name": <one of the tools>, <arguments_key>: <its arguments>} in that order, plus the
    optional `extra` properties."""
    shapes = [{
        "type": "object",
        "properties": {"name": {"const": spec.name}, arguments_key: arguments_schema(spec), **(extra or {})},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    } for spec in tools]
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


def marked_calls(marker: str, call: str, required: bool, parallel: bool, added_token: Callable[[str], Any],
                 separator: str = "", lead: str = "TEXT") -> GrammarBody:
    """Calls that each begin with `marker` and go on as `call` (Lark). required: calls only (one
    unless parallel, joined by `separator`); auto: free text with the calls among it (at most
    one unless parallel), each checked once its marker appears. Free text never holds the
    marker's text otherwise: the parser would read a call there."""
    opener = lark_token(marker, added_token)
    if required:
        more = f" ({separator} {opener} {call})*" if parallel else ""
        return GrammarBody(f"{opener} {call}{more}")
    no_marker = f"NO_MARKER: /(.|\\n)*/ & ~/(.|\\n)*{regex_text(marker)}(.|\\n)*/"
    if is_token(opener):  # free text cannot contain the token: it ends there
        start = (f"(NO_MARKER {opener} {call})* NO_MARKER" if parallel
                 else f"NO_MARKER ({opener} {call} NO_MARKER)?")
        return GrammarBody(start, (no_marker,), free_start=True)
    # A text marker ends free text through a lazy lexeme: the first place the marker appears.
    # The first one uses `lead`, so that a think block's text cannot be read as answer text.
    first = "trigger" if lead == "TEXT" else "first_trigger"
    rules = [f"trigger[lazy]: TEXT {opener}", FREE_TEXT]
    if first != "trigger":
        rules.append(f"first_trigger[lazy]: {lead} {opener}")
    if parallel:
        return GrammarBody(f"{first} {call} (trigger {call})* TEXT | {lead}", tuple(rules), free_start=True)
    # After the one call, text that never writes the marker again.
    return GrammarBody(f"{lead} | {first} {call} NO_MARKER", (*rules, no_marker), free_start=True)


def regex_text(text: str) -> str:
    """text as a literal inside a Lark /regex/ (Rust regex syntax; "/" ends the regex)."""
    return re.escape(text).replace("/", "\\/")


@dataclass(frozen=True)
class ThinkPrefix:
    """The grammar of a think block before the answer (`expr`, empty for none), its rules, and
    `lead`: the lexeme for free text at the answer's start (see reasoning_prefix)."""

    expr: str = ""
    rules: tuple[str, ...] = ()
    lead: str = "TEXT"


def reasoning_prefix(reasoning: str | None, added_token: Callable[[str], Any]) -> ThinkPrefix:
    """None: no think block; "optional": the output may open one (<think> first thing);
    "opened": the prompt opened it, so the output starts inside and must close it. The text
    inside is free: a marker there is no call. When the output may open the block with a text
    <think>, answer text may not begin with one, else a lazy call marker inside the block
    could end the answer's first text first."""
    if reasoning is None:
        return ThinkPrefix()
    if reasoning not in ("optional", "opened"):
        raise ValueError(f"reasoning must be None, 'optional' or 'opened', got {reasoning!r}")
    closer = lark_token(THINK_END, added_token)
    rules = [FREE_TEXT]
    if is_token(closer):
        inside = f"TEXT {closer}"
    else:
        inside = "think_end"
        rules.append(f"think_end[lazy]: TEXT {closer}")
    if reasoning == "opened":
        return ThinkPrefix(inside, tuple(rules))
    opener = lark_token(THINK_START, added_token)
    if is_token(opener):
        return ThinkPrefix(f"({opener} {inside})?", tuple(rules))
    rules.append(f"LEAD_TEXT: /(.|\\n)*/ & ~/{regex_text(THINK_START)}(.|\\n)*/")
    return ThinkPrefix(f"({opener} {inside})?", tuple(rules), "LEAD_TEXT")


def assemble(prefix: ThinkPrefix, body: GrammarBody) -> str:
    start = f"({body.start})"
    rules = list(body.rules)
    if prefix.expr:
        # Whitespace between </think> and an answer that does not begin with free text.
        start = f"{prefix.expr} {start}" if body.free_start else f"{prefix.expr} THINK_WS? {start}"
        rules += [rule for rule in prefix.rules if rule not in rules]
        if not body.free_start:
            rules.append("THINK_WS: /[ \\t\\r\\n]{1,8}/")
    return "%llguidance {}\n" + f"start: {start}\n" + "".join(rule + "\n" for rule in rules)
