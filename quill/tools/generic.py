"""Tool calls for models whose chat template knows nothing of tools (the default SmolLM2's plain
ChatML): quill describes the tools in the system message, and the model answers with one JSON
object, {"tool_calls": [{"name": "f", "arguments": {...}}, ...]} or {"response": "text"}, which the
grammar always enforces (there is no marker to wait for). Past calls and results are rewritten
into that format's text on every request (prepare_history), so a later turn without tools still
shows them.

The approach is llama.cpp's generic chat handler (common/chat.cpp: common_chat_params_init_generic,
common_chat_parse_generic: a JSON schema of "tool_calls" or "response", and a system message asking
for it; its single-call shape {"tool_call": {...}} parses too), with the history rewritten the way
minja's polyfills show calls and results to such templates: an assistant's calls as
{"tool_calls": [...]} text, a tool result as a user message {"tool_response": {...}}.
"""

from __future__ import annotations

import json
import re

from quill.tools.base import ToolCall, ToolParser, ToolSpec
from quill.tools.lark import AddedToken, GrammarBody, call_schema, lark_json
from quill.tools.scan import array_item_starts, object_members, skip_ws

_KEYS = ("response", "tool_calls", "tool_call")
# How an output begins, as far as it goes: {"<key>": and, for a response, its string's opening quote.
_HEAD = re.compile(r'[ \t\n\r]*(?:\{[ \t\n\r]*(?:"(?P<key>[^"]*)'
                   r'(?P<closed>"[ \t\n\r]*(?P<colon>:[ \t\n\r]*(?P<quote>"?))?)?)?)?')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
FORMAT_PROMPT = (
    "Answer with one JSON object and nothing else. To call tools: "
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}. '
    'To answer the user yourself: {"response": "<your answer>"}.'
)


class GenericParser(ToolParser):
    """The one JSON object: a "response" string streams as content as it decodes; calls come out
    when the object completes. An output not of either shape is content, raw: all of it, or what
    follows the part of a response already given out."""

    name = "generic"
    markers = ()

    def __init__(self, tools: list[ToolSpec]):
        super().__init__(tools)
        self._mode = "start"  # start | response | after_response | calls | raw

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        if self._mode == "start":
            self._mode, head_end = _head(self._pending)
            if self._mode == "response":
                self._pending = self._pending[head_end:]
        out = ""
        if self._mode == "response":
            out = self._decode_response()
        if self._mode == "after_response":
            rest = self._pending.lstrip()
            if rest and (rest[0] != "}" or rest[1:].strip()):
                self._mode = "raw"
            elif final:
                self._pending = ""
        if self._mode == "raw" or final:
            calls = self._parse_calls(self._pending) if self._mode == "calls" and final else None
            if calls:
                self._pending = ""
                return out, calls
            out, self._pending = out + self._pending, ""
        return out, []

    def _decode_response(self) -> str:
        """The response string's characters decoded so far; never half an escape."""
        text, index, out = self._pending, 0, []
        while index < len(text):
            char = text[index]
            if char == '"':
                self._mode = "after_response"
                index += 1
                break
            if char == "\\":
                escape = _escape(text, index)
                if escape is None:
                    break  # unfinished
                if escape == "":
                    self._mode = "raw"
                    break
                out.append(escape[0])
                index = escape[1]
            elif char < " ":  # a raw control character: not JSON
                self._mode = "raw"
                break
            else:
                out.append(char)
                index += 1
        self._pending = text[index:]
        return "".join(out)

    def _parse_calls(self, text: str) -> list[ToolCall] | None:
        parsed = object_members(text, skip_ws(text, 0))
        if parsed is None or skip_ws(text, parsed[1]) != len(text) or len(parsed[0]) != 1:
            return None
        (key, (_, value_start, _)), = parsed[0].items()
        if key == "tool_call":
            return self.calls_at(text, [value_start])
        return self.calls_at(text, array_item_starts(text, value_start)) if key == "tool_calls" else None

    @classmethod
    def _grammar_body(cls, tools: list[ToolSpec], required: bool, parallel: bool,
                      added_token: AddedToken, lead: str) -> GrammarBody:
        items = {"type": "array", "items": call_schema(tools, "arguments"), "minItems": 1,
                 **({} if parallel else {"maxItems": 1})}
        calls = _object({"tool_calls": items})
        schema = calls if required else {"anyOf": [calls, _object({"response": {"type": "string"}})]}
        return GrammarBody(lark_json(schema))

    @classmethod
    def prepare_history(cls, messages: list[dict]) -> list[dict]:
        """Past calls and results as this format's text, in roles a plain template alternates:
        an assistant's calls as {"tool_calls": [...]} content (any text it wrote with them goes:
        the format has no room for it), each result as a user message {"tool_response": {...}},
        joined by "\\n" with the user messages next to it. Applying it twice changes nothing."""
        out: list[dict] = []
        names: dict[str, str] = {}  # tool_call_id -> function name
        for message in messages:
            role = message.get("role")
            if role == "assistant" and message.get("tool_calls"):
                message = {"role": "assistant", "content": _calls_text(message["tool_calls"], names)}
            elif role == "tool":
                message = {"role": "user", "content": _result_text(message, names)}
            merged = _merge(out[-1], message) if out else None
            if merged is not None:
                out[-1] = merged
            else:
                out.append(message)
        return out

    @classmethod
    def prepare_messages(cls, messages: list[dict], tools: list[ToolSpec], template_renders_tools: bool) -> list[dict]:
        """The tools and the answer format at the end of the first system message (the tools
        only when the template does not render them itself); the history is prepare_history's
        already (the server applies template_history to every chat request first)."""
        prompt = FORMAT_PROMPT
        if not template_renders_tools:
            listed = [{"name": spec.name, **({"description": spec.description} if spec.description else {}),
                       "parameters": spec.parameters} for spec in tools]
            prompt = "You can use these tools:\n" + json.dumps(listed, ensure_ascii=False) + "\n\n" + prompt
        if messages and messages[0].get("role") == "system":
            system = messages[0].get("content")
            return [{**messages[0], "content": f"{system}\n\n{prompt}" if system else prompt}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _head(text: str) -> tuple[str, int]:
    """Where a whole output stands from its start: ("response", index after the string's
    opening quote), ("calls", 0), ("raw", 0) when it can be neither, ("start", 0) while undecided."""
    head = _HEAD.match(text)
    key = head["key"]
    if head["colon"] and key in _KEYS:
        if key != "response":
            return "calls", 0
        if head["quote"]:
            return "response", head.end()
    possible = key is None or (key in _KEYS if head["closed"] else any(k.startswith(key) for k in _KEYS))
    return ("start", 0) if possible and head.end() == len(text) else ("raw", 0)


def _escape(text: str, index: int) -> tuple[str, int] | str | None:
    """The JSON escape at text[index] ("\\"): (character, index after), "" when invalid, None
    while unfinished. A surrogate pair is one character; a lone surrogate is invalid."""
    if index + 1 >= len(text):
        return None
    kind = text[index + 1]
    if kind in _ESCAPES:
        return _ESCAPES[kind], index + 2
    if kind != "u":
        return ""
    code = _hex4(text, index + 2)
    if code is None:
        return None
    if code < 0:
        return ""
    if 0xDC00 <= code <= 0xDFFF:
        return ""
    if code < 0xD800 or code > 0xDBFF:
        return chr(code), index + 6
    if len(text) < index + 8:
        return None if "\\u".startswith(text[index + 6:index + 8]) else ""
    low = _hex4(text, index + 8) if text[index + 6:index + 8] == "\\u" else -1
    if low is None:
        return None
    if not 0xDC00 <= low <= 0xDFFF:
        return ""
    return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), index + 12


def _hex4(text: str, index: int) -> int | None:
    """The 4 hex digits at text[index]: their value, -1 when not hex, None while unfinished."""
    digits = text[index:index + 4]
    if any(d not in "0123456789abcdefABCDEF" for d in digits):
        return -1
    return int(digits, 16) if len(digits) == 4 else None


def _calls_text(tool_calls: list[dict], names: dict[str, str]) -> str:
    calls = []
    for call in tool_calls:
        function = call["function"]
        calls.append({"name": function.get("name"), "arguments": function["arguments"], "id": call.get("id")})
        if call.get("id") is not None:
            names[call["id"]] = function.get("name")
    return json.dumps({"tool_calls": calls}, ensure_ascii=False)


def _result_text(message: dict, names: dict[str, str]) -> str:
    call_id = message.get("tool_call_id")
    response = {"tool": message.get("name") or names.get(call_id), "tool_call_id": call_id,
                "content": message.get("content")}
    return json.dumps({"tool_response": response}, ensure_ascii=False)


def _merge(previous: dict, message: dict) -> dict | None:
    """Two user messages as one, their text joined by "\\n"; None for any other pair."""
    if previous.get("role") != "user" or message.get("role") != "user":
        return None
    first, second = previous.get("content"), message.get("content")
    if not (isinstance(first, str) and isinstance(second, str)):
        return None  # content that is not text (LLM.chat takes any): left to the template
    return {**previous, "content": f"{first}\n{second}" if first else second}
