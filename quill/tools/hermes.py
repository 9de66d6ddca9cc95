"""Hermes-style tool calls (Qwen2.5, Qwen3, Hermes 2 Pro / 3, SmolLM3): each call is a JSON object
between <tool_call> and </tool_call>, after any text, several in a row for parallel calls.

The format, from Qwen2.5's chat template (a call is `<tool_call>\\n{"name": <function-name>,
"arguments": <args-json-object>}\\n</tool_call>`, calls in history joined by "\\n") and
NousResearch's Hermes-Function-Calling README (the same tags; its prompt lists "arguments" before
"name"). Some fine-tunes write "parameters" for "arguments"; both parse. In Qwen's tokenizers both
tags are added tokens (151657 and 151658 in Qwen2.5's tokenizer.json), not marked special.
"""

from __future__ import annotations

from quill.tools.base import ToolCall, ToolSpec
from quill.tools.lark import AddedToken, GrammarBody, call_schema, lark_json, lark_token, marked_calls
from quill.tools.marked import MarkedCallParser

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(MarkedCallParser):
    """<tool_call>{json}</tool_call> calls among text. A call ends at the first </tool_call> (an
    argument string holding that text would cut it short); one whose JSON does not parse, or
    that names a function not offered, is content with its tags."""

    name = "hermes"
    markers = (OPEN,)

    def _read_block(self, final: bool) -> tuple[int, list[ToolCall] | None] | None:
        close = self._pending.find(CLOSE, len(OPEN))
        if close < 0:
            return (len(self._pending), None) if final else None
        call = self.call_from_text(self._pending[len(OPEN):close])
        return close + len(CLOSE), [call] if call else None

    @classmethod
    def _grammar_body(cls, tools: list[ToolSpec], required: bool, parallel: bool,
                      added_token: AddedToken, lead: str) -> GrammarBody:
        closer = lark_token(CLOSE, added_token)
        call = f'"\\n" {lark_json(call_schema(tools, "arguments"))} "\\n" {closer}'
        return marked_calls(OPEN, call, required, parallel, added_token, separator='"\\n"', lead=lead)
