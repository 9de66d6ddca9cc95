"""Mistral tool calls, after the [TOOL_CALLS] token, in either of Mistral's two formats:

- a JSON list, [TOOL_CALLS] [{"name": "f", "arguments": {...}, "id": "a1b2c3d4e"}, ...]: tokenizers
  before v11 (Mistral 7B v0.3 writes "[TOOL_CALLS] [", Mistral Nemo "[TOOL_CALLS][", both from their
  chat templates, which also require 9-character alphanumeric call ids);
- name then arguments, [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}: v11 and later (Mistral
  Small 3.2, Magistral, Devstral), some with [CALL_ID]id before [ARGS] (mistral-common's
  SpecialTokens: "[ARGS]", "[CALL_ID]").

Both parse; the grammar writes the list form, which llama.cpp's Mistral Nemo handler constrains
too. In Mistral's tokenizers [TOOL_CALLS] is a special token not written <...>, which llguidance
names only by id (the grammar writes every added-token marker by id: see lark.py).
"""

from __future__ import annotations

import re
import secrets
import string
from quill.tools.base import ToolCall, ToolSpec
from quill.tools.lark import AddedToken, GrammarBody, call_schema, lark_json, marked_calls
from quill.tools.marked import MarkedCallParser
from quill.tools.scan import JsonEnd, array_item_starts, object_members, skip_ws

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
ID_ALPHABET = string.ascii_letters + string.digits
ID_LENGTH = 9
_NAME = re.compile(r"[a-zA-Z0-9_-]*")
_ID = re.compile(r"[a-zA-Z0-9]*")


class MistralParser(MarkedCallParser):
    """Text, then calls after [TOOL_CALLS] in either format; a block that does not parse, or
    names a function not offered, is content, marker included."""

    name = "mistral"
    markers = (TOOL_CALLS,)

    def __init__(self, tools: list[ToolSpec]):
        super().__init__(tools)
        self._json: JsonEnd | None = None  # where the block's JSON (list, or arguments) closes

    def new_call_id(self) -> str:
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(ID_LENGTH))

    def _read_block(self, final: bool) -> tuple[int, list[ToolCall] | None] | None:
        block = self._read(self._pending)
        if block is None and final:
            block = (len(self._pending), None)
        if block is not None:
            self._json = None
        return block

    def _read(self, text: str) -> tuple[int, list[ToolCall] | None] | None:
        index = skip_ws(text, len(TOOL_CALLS))
        if index == len(text):
            return None
        if text[index] == "[":
            return self._read_list(text, index)
        head = _name_head(text, index)
        if head is None:
            return None
        name, brace = head
        if brace < 0:  # not a call: the marker and what follows up to here
            return index, None
        self._json = self._json or JsonEnd(brace)
        end = self._json.end(text)
        if end is None:
            return None
        parsed = object_members(text, brace)
        if parsed is None:
            return end, None
        call = self.make_call({"name": (name, 0, 0), "arguments": (parsed[0], brace, end)}, text)
        return end, [call] if call else None

    def _read_list(self, text: str, start: int) -> tuple[int, list[ToolCall] | None] | None:
        self._json = self._json or JsonEnd(start)
        end = self._json.end(text)
        if end is None:
            return None
        return end, self.calls_at(text, array_item_starts(text, start))

    @classmethod
    def _grammar_body(cls, tools: list[ToolSpec], required: bool, parallel: bool,
                      added_token: AddedToken, lead: str) -> GrammarBody:
        item = call_schema(tools, "arguments", {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}})
        calls = {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        # One block holds every call, so auto allows one marker whether parallel or not.
        return marked_calls(TOOL_CALLS, f'" "? {lark_json(calls)}', required, False, added_token, lead=lead)


def _name_head(text: str, index: int) -> tuple[str, int] | None:
    """After [TOOL_CALLS] at text[index]: name [CALL_ID]id? [ARGS]? then "{". Returns (name,
    index of "{"), (name, -1) when the text cannot be that, or None while it still may be."""
    name = _NAME.match(text, index).group()
    index += len(name)
    for tag, tail in ((CALL_ID, _ID), (ARGS, None)):
        if text.startswith(tag, index):
            index += len(tag)
            if tail is not None:
                index = tail.match(text, index).end()
        elif tag.startswith(text[index:]) and index < len(text):
            return None
        if index == len(text):
            return None
    index = skip_ws(text, index)
    if index == len(text):
        return None
    return (name, index) if name and text[index] == "{" else (name, -1)
