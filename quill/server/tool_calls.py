"""Tool calling on /v1/chat/completions: a request's tools, tool_choice and parallel_tool_calls
checked once, and turned into what the chat path needs (template inputs, the output constraint,
the parser that reads calls out of the text). The formats themselves live in quill.tools."""

from __future__ import annotations

from dataclasses import dataclass

from quill.server.errors import bad_request


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools (None from plan_tools when it does not)."""

    parser_cls: type  # a quill.tools.ToolParser subclass: the model family's format
    tools: list  # [ToolSpec]
    choice: object  # ToolChoice
    parallel: bool
    request_tools: list[dict]  # the request's own tools, as the template gets them

    def template_inputs(self, messages: list[dict], chat_template: str | None) -> tuple[list[dict], dict]:
        """(messages, extra template variables) for the chat template (quill.tools.tool_prompt)."""
        from quill.tools import tool_prompt

        return tool_prompt(messages, self.request_tools, chat_template, self.parser_cls.name, checked=self.tools)

    def grammar(self, tokenizer, reasoning_opened: bool | None) -> str:
        """The llguidance grammar the output must follow (every plan constrains: lazily for auto).

        reasoning_opened: None when reasoning is not split for this request, else whether the
        prompt left the output inside a think block (quill.server.handlers.reasoning_opened)."""
        reasoning = None if reasoning_opened is None else ("opened" if reasoning_opened else "optional")
        return self.parser_cls.grammar(self.tools, self.choice, self.parallel, tokenizer.added_token_id, reasoning)

    def needs_special_tokens(self, tokenizer) -> bool:
        """Whether a marker of this format is a special token, which decoding would otherwise drop."""
        return any(tokenizer.added_token_kind(marker) == "special" for marker in self.parser_cls.markers)

    def new_parser(self):
        return self.parser_cls(self.tools)


def plan_tools(body, family: str) -> ToolPlan | None:
    """The request's tool plan in the model's tool-call format `family` (--tool-parser, else
    quill.tools.detect_parser); None without tools or with tool_choice "none" (then the template
    is not shown the tools either, so the model is not invited to call one). A bad tools list or
    tool_choice is a 400 naming the exact field."""
    if body.tools is None and body.tool_choice is None:
        return None
    from quill.tools import ToolError, check_tool_choice, check_tools, parser_class

    try:
        tools = check_tools(body.tools or [])
        choice = check_tool_choice(body.tool_choice, tools)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from exc
    if choice.mode == "none" or not tools:
        return None
    return ToolPlan(parser_class(family), tools, choice, body.parallel_tool_calls is not False, list(body.tools))


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's finish_reason for a choice: "tool_calls" when the model ended its turn (EOS or a
    stop) after making calls; "length" stays "length" (the turn was cut, whatever it held)."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def call_json(call) -> dict:
    """A quill.tools.ToolCall as a message's tool_calls entry."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
