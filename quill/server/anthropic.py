"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as an adapter over the
chat-completions path: the request becomes a ChatCompletionRequest (same engine path, tools,
reasoning parser, cancellation and metrics), and AnthropicAdapter turns the OpenAI body or chunks
that path builds into Anthropic's message or event stream. Error bodies: errors.error_body_for."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from quill.server import handlers
from quill.server.anthropic_adapter import AnthropicAdapter
from quill.server.errors import APIError, _is_type_tag, bad_request
from quill.server.protocol import ChatCompletionRequest, _Request

_BLOCK = ConfigDict(extra="allow", strict=True)  # extra keys (cache_control, citations) are ignored


class TextBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["text"]
    text: str


class ThinkingBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool | None = None  # accepted; the result's text is what the model reads


class ToolDefinition(BaseModel):
    model_config = _BLOCK
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = _BLOCK
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class InputMessage(BaseModel):
    model_config = _BLOCK
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]  # blocks, checked one by one (chat_request) to name the exact place


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: what a message request renders, without the sampling fields."""

    model: str
    messages: list[InputMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted, ignored


# Which block types each role may send, and the model that reads each.
_BLOCKS = {"user": {"text": TextBlock, "tool_result": ToolResultBlock},
           "assistant": {"text": TextBlock, "thinking": ThinkingBlock, "tool_use": ToolUseBlock}}


def _parse(model: type[BaseModel], data: Any, where: str):
    """`data` as `model`; pydantic's first complaint as a 400 named from `where`."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"] if not _is_type_tag(str(p)))
        raise bad_request(f"{where}{field}: {first['msg']}", where.split("[", 1)[0]) from exc


def _block(data: dict, allowed: dict, where: str, context: str):
    kind = data.get("type")
    if kind not in allowed:
        supported = ", ".join(repr(k) for k in allowed)
        raise bad_request(f"{where}.type: {kind!r} blocks are not supported by quill in {context} (supported: {supported})",
                          where.split("[", 1)[0])
    return _parse(allowed[kind], data, where)


def _texts(content: str | list[dict], where: str, context: str) -> list[dict]:
    """A string or text blocks -> OpenAI text parts (anything else is a 400 naming its place)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    allowed = {"text": TextBlock}
    return [{"type": "text", "text": _block(b, allowed, f"{where}[{k}]", context).text} for k, b in enumerate(content)]


def _message(i: int, message: InputMessage) -> list[dict]:
    """One Anthropic message -> OpenAI chat messages: a user turn's tool results first (one tool
    message each, in order), then its text; an assistant turn's thinking, text and tool calls."""
    where = f"messages[{i}].content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    blocks = [_block(b, _BLOCKS[message.role], f"{where}[{j}]", f"{message.role} messages") for j, b in enumerate(message.content)]
    texts = [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]
    if message.role == "user":
        results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b, f"{where}[{j}].content")}
                   for j, b in enumerate(blocks) if isinstance(b, ToolResultBlock)]
        return results + ([{"role": "user", "content": texts}] if texts or not results else [])
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    out = {"role": "assistant", "content": texts or None}
    thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return [out]


def _result_text(block: ToolResultBlock, where: str) -> str:
    return "\n".join(part["text"] for part in _texts(block.content, where, "tool results"))


def _tools(tools: list[dict]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"tools[{i}].type: {kind!r} (a tool Anthropic runs) is not supported by quill; "
                              "describe the tool with name, description and input_schema", "tools")
        spec = _parse(ToolDefinition, tool, f"tools[{i}]")
        function = {"name": spec.name, "parameters": spec.input_schema}
        if spec.description is not None:
            function["description"] = spec.description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: ToolChoice, tools: list | None) -> tuple[str | dict, bool | None]:
    """(OpenAI tool_choice, parallel_tool_calls)."""
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice.name: required when tool_choice.type is 'tool'", "tool_choice")
        picked = {"type": "function", "function": {"name": choice.name}}
    else:
        picked = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.type in ("any", "tool") and not tools:
        raise bad_request(f"tool_choice: type {choice.type!r} needs at least one tool in tools, got none", "tool_choice")
    return picked, (False if choice.disable_parallel_tool_use else None)


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The Anthropic request as the chat-completions request it means."""
    messages = []
    if body.system:
        messages.append({"role": "system", "content": _texts(body.system, "system", "the system prompt")})
    for i, message in enumerate(body.messages):
        messages.extend(_message(i, message))
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools is not None:
        fields["tools"] = _tools(body.tools)
    if body.tool_choice is not None:
        fields["tool_choice"], parallel = _tool_choice(body.tool_choice, body.tools)
        if parallel is not None:
            fields["parallel_tool_calls"] = parallel
    if isinstance(body, MessagesRequest):
        fields["max_tokens"] = body.max_tokens
        sampling = {"stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
        fields.update({k: v for k, v in sampling.items() if v is not None})
        if body.stream:
            fields.update(stream=True, stream_options={"include_usage": True})  # message_delta's output_tokens
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # the checks above should have caught it; still the caller's 400
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise bad_request(f"the request does not translate to a chat request: {where}: {first['msg']}") from exc


# The chat path names its own fields in errors; say the ones this request sent instead.
_RENAMES = [
    (re.compile(r"^stop\b"), "stop_sequences"),
    (re.compile(r"\btools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
]


def _rename_fields(err: APIError) -> None:
    for pattern, name in _RENAMES:
        err.message = pattern.sub(name, err.message)
    err.args = (err.message,)


async def messages(request: Request, body: MessagesRequest, state) -> Response:
    adapter = AnthropicAdapter(body.model, body.stop_sequences)
    try:
        return await handlers.chat_completions(request, chat_request(body), state, adapter=adapter)
    except APIError as err:
        _rename_fields(err)
        raise


async def count_tokens(body: CountTokensRequest, state) -> dict:
    """{"input_tokens": N}: the rendered prompt of the same request, tools included."""
    engine = state.require_engine()
    handlers.check_model(state, body.model)
    try:
        ids, _ = await run_in_threadpool(handlers.chat_prompt, state, engine, chat_request(body))
    except APIError as err:
        _rename_fields(err)
        raise
    return {"input_tokens": len(ids)}
