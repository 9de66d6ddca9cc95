"""Tool calls for models whose chat template knows nothing of tools (the default SmolLM2's plain
ChatML): quill describes the tools in the system message, and the model answers with one JSON
object, {"tool_calls": [{"name": "f", "arguments": {...}}, ...]} or {"response": "text"}, which the
grammar always enforces (there is no marker to wait for).

The approach is llama.cpp's generic chat handler (common/chat.cpp: common_chat_params_init_generic,
common_chat_parse_generic: a JSON schema of "tool_calls" or "response", and a system message asking
for it; its single-call shape {"tool_call": {...}} parses too), with the history rewritten the way
minja's polyfills show calls and results to such templates: an assistant's calls as
{"tool_calls": [...]} text, a tool result as a user message {"tool_response": {...}}.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from quill.tools.base import (
    GrammarBody,
    ToolCall,
    ToolParser,
    ToolSpec,
    array_items,
    call_schema,
    lark_json,
    object_members,
    skip_ws,
)

_KEYS = ("response", "tool_calls", "tool_call")
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
        start = skip_ws(text, 0)
        parsed = object_members(text, start)
        if parsed is None or skip_ws(text, parsed[1]) != len(text) or len(parsed[0]) != 1:
            return None
        (key, (value, value_start, _)), = parsed[0].items()
        if key == "tool_call":
            spans = [value_start]
        elif key == "tool_calls" and isinstance(value, list) and value:
            spans = _item_starts(text, value_start)
        else:
            return None
        calls = []
        for item_start in spans:
            members = object_members(text, item_start)
            call = members and self.make_call(members[0], text)
            if not call:
                return None
            calls.append(call)
        return calls

    @classmethod
    def _grammar_body(cls, tools: list[ToolSpec], required: bool, parallel: bool,
                      added_token: Callable[[str], Any], lead: str) -> GrammarBody:
        items = {"type": "array", "items": call_schema(tools, "arguments"), "minItems": 1,
                 **({} if parallel else {"maxItems": 1})}
        calls = _object({"tool_calls": items})
        schema = calls if required else {"anyOf": [calls, _object({"response": {"type": "string"}})]}
        return GrammarBody(lark_json(schema))

    @classmethod
    def prepare_messages(cls, messages: list[dict], tools: list[ToolSpec], template_renders_tools: bool) -> list[dict]:
        """The tools and the answer format in the first system message (the tools only when the
        template does not render them itself), and past calls and results as that format's text."""
        listed = [{"name": spec.name, **({"description": spec.description} if spec.description else {}),
                   "parameters": spec.parameters} for spec in tools]
        prompt = FORMAT_PROMPT
        if not template_renders_tools:
            prompt = "You can use these tools:\n" + json.dumps(listed, ensure_ascii=False) + "\n\n" + prompt
        out: list[dict] = []
        names: dict[str, str] = {}  # tool_call_id -> function name
        for message in messages:
            role = message.get("role")
            if role == "assistant" and message.get("tool_calls"):
                message = {"role": "assistant", "content": _calls_text(message["tool_calls"], names)}
            elif role == "tool":
                message = {"role": "user", "content": _result_text(message, names)}
            if message.get("role") == "user" and out and out[-1].get("role") == "user":
                merged = _merge(out[-1], message)
                if merged is not None:
                    out[-1] = merged
                    continue
            out.append(message)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": _append(out[0].get("content"), prompt)}
        else:
            out.insert(0, {"role": "system", "content": prompt})
        return out


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _head(text: str) -> tuple[str, int]:
    """Where a whole output stands from its start: ("response", index after the string's
    opening quote), ("calls", 0), ("start", 0) while undecided, or ("raw", 0)."""
    index = skip_ws(text, 0)
    if index == len(text):
        return "start", 0
    if text[index] != "{":
        return "raw", 0
    index = skip_ws(text, index + 1)
    if index == len(text):
        return "start", 0
    if text[index] != '"':
        return "raw", 0
    close = text.find('"', index + 1)
    key = text[index + 1:close if close >= 0 else len(text)]
    if close < 0:
        return ("start", 0) if any(k.startswith(key) for k in _KEYS) else ("raw", 0)
    if key not in _KEYS:
        return "raw", 0
    index = skip_ws(text, close + 1)
    if index == len(text):
        return "start", 0
    if text[index] != ":":
        return "raw", 0
    if key != "response":
        return "calls", 0
    index = skip_ws(text, index + 1)
    if index == len(text):
        return "start", 0
    return ("response", index + 1) if text[index] == '"' else ("raw", 0)


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


def _item_starts(text: str, start: int) -> list[int]:
    items = array_items(text, start)
    return [item_start for item_start, _ in items[0]] if items else []


def _calls_text(tool_calls: list, names: dict[str, str]) -> str:
    calls = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append({"name": function.get("name"), "arguments": arguments, "id": call.get("id")})
        if call.get("id") is not None:
            names[call["id"]] = function.get("name")
    return json.dumps({"tool_calls": calls}, ensure_ascii=False)


def _result_text(message: dict, names: dict[str, str]) -> str:
    call_id = message.get("tool_call_id")
    response = {"tool": message.get("name") or names.get(call_id), "tool_call_id": call_id,
                "content": _text(message.get("content"))}
    return json.dumps({"tool_response": response}, ensure_ascii=False)


def _text(content) -> Any:
    """A message's content as one string when it is text parts; other values as they are."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _join(first, second: str, separator: str):
    first = _text(first)
    if first is None or first == "":
        return second
    return first + separator + second if isinstance(first, str) else None


def _append(content, text: str):
    """A system message's content with text added: after a blank line, or as one more part."""
    joined = _join(content, text, "\n\n")
    if joined is None and isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return joined if joined is not None else text


def _merge(previous: dict, message: dict) -> dict | None:
    """Two user messages as one (content joined by "\\n"), or None when one is not text."""
    second = _text(message.get("content"))
    if not isinstance(second, str):
        return None
    content = _join(previous.get("content"), second, "\n")
    return None if content is None else {**previous, "content": content}
