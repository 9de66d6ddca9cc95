"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole answer is {"name": "f", "parameters": {...}},
possibly after <|python_tag|>, several separated by ";".

The format, from Meta's Llama 3.1 chat template ("Respond in the format {"name": function name,
"parameters": dictionary of argument name and its value}. Do not use variables.") and the
llama-models prompt format docs (<|python_tag|>, id 128010, opens a tool call; a call ends the turn
with <|eom_id|>). vLLM's llama3_json parser also takes "arguments" for "parameters" and ";" between
calls. There is no marker when the model writes the JSON bare, so only an answer that begins with a
call is one, and then all of it must be calls.
"""

from __future__ import annotations

from quill.tools.base import ToolCall, ToolParser, ToolSpec
from quill.tools.lark import FREE_TEXT, AddedToken, GrammarBody, call_schema, lark_json, lark_token, regex_text
from quill.tools.scan import skip_ws, value_starts

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    """An output that begins (after whitespace) with "{" or <|python_tag|> is held to the end and
    must be calls only, else it is all content; any other output streams as content."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def __init__(self, tools: list[ToolSpec]):
        super().__init__(tools)
        self._mode = "start"  # "start" (undecided) | "calls" (held to the end) | "content"

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        if self._mode == "start":
            head = self._pending.lstrip()
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self._mode = "calls"
            elif head and not PYTHON_TAG.startswith(head):
                self._mode = "content"
        if self._mode == "content" or final:
            text, self._pending = self._pending, ""
            calls = self._parse_calls(text) if self._mode == "calls" else None
            return ("", calls) if calls else (text, [])
        return "", []

    def _parse_calls(self, text: str) -> list[ToolCall] | None:
        index = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, index):
            index = skip_ws(text, index + len(PYTHON_TAG))
        return self.calls_at(text, value_starts(text, index, ";", None))

    @classmethod
    def _grammar_body(cls, tools: list[ToolSpec], required: bool, parallel: bool,
                      added_token: AddedToken, lead: str) -> GrammarBody:
        tag = lark_token(PYTHON_TAG, added_token)
        call = lark_json(call_schema(tools, "parameters"))
        calls = f"{tag}? {call}" + (f" (/; ?/ {call})*" if parallel else "")
        if required:
            return GrammarBody(calls)
        # auto: calls, or text that does not begin like one (the parser's rule, so they agree).
        not_a_call = (f"NOT_A_CALL: /[^ \\t\\r\\n](.|\\n)*/ & ~/([{{]|{regex_text(PYTHON_TAG)})(.|\\n)*/ & {lead}")
        return GrammarBody("LEADING_WS? (calls | NOT_A_CALL)?",
                           (f"calls: {calls}", not_a_call, "LEADING_WS: /[ \\t\\r\\n]+/", FREE_TEXT),
                           free_start=True)
