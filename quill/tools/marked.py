"""The streaming parser of the families whose calls each begin with a marker among text (hermes'
<tool_call>, mistral's [TOOL_CALLS]): text streams out, holding back only what may start a marker."""

from __future__ import annotations

from quill.engine.stop_checker import partial_match_len
from quill.tools.base import ToolCall, ToolParser, ToolSpec


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
