"""JSON scanning for the tool-call parsers: values parsed by the json module, with where each one
lies in the text (a call's arguments go out as the model wrote them), and where a JSON object or
array closes in text that is still streaming in."""

from __future__ import annotations

import json
from typing import Any

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


def value_starts(text: str, index: int, separator: str, closer: str | None) -> list[int] | None:
    """Where each JSON value of a run from text[index] starts: values separated by `separator`,
    the run ending at `closer`, or at the end of the text when closer is None (whitespace
    allowed between them all). None when the text is not such a run."""
    starts: list[int] = []
    while True:
        value = _value(text, index)
        if value is None:
            return None
        starts.append(index)
        index = skip_ws(text, value[1])
        if (index == len(text)) if closer is None else text.startswith(closer, index):
            return starts
        if not text.startswith(separator, index):
            return None
        index = skip_ws(text, index + len(separator))


def array_item_starts(text: str, start: int) -> list[int] | None:
    """Where each item of the JSON array at text[start] starts, or None when no whole array
    starts there."""
    if text[start:start + 1] != "[":
        return None
    index = skip_ws(text, start + 1)
    return [] if text[index:index + 1] == "]" else value_starts(text, index, ",", "]")


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
