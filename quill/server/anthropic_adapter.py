"""The chat path's OpenAI output as Anthropic's Messages API sends it: a message body, or the
event stream (message_start, content blocks with their deltas, message_delta, message_stop)."""

from __future__ import annotations

import json


def message_id(openai_id: str) -> str:
    """msg_<hex> for chatcmpl-<hex>: the same hex as the engine request's id, for the logs."""
    return "msg_" + openai_id.rsplit("-", 1)[-1]


def anthropic_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """Anthropic counts prefix-cache reads apart: input + cache reads + cache writes is the prompt
    (quill's prefix cache fills itself, so nothing is counted as a write)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def _usage_from(openai_usage: dict) -> dict:
    cached = (openai_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return anthropic_usage(openai_usage["prompt_tokens"], openai_usage["completion_tokens"], cached)


def event(kind: str, data: dict) -> bytes:
    payload = json.dumps({"type": kind, **data}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode()


class AnthropicAdapter:
    """One /v1/messages request's way out (the responses.OpenAIAdapter contract); a stream's
    blocks are opened and closed as the chunks' kinds change (thinking, text, each tool call)."""

    def __init__(self, model: str, stop_sequences: list[str] | None):
        self.model = model
        self.stop_sequences = tuple(stop_sequences or ())
        self.open_block: tuple[int, str] | None = None  # (index, kind): "thinking" | "text" | "tool:<call index>"
        self.num_blocks = 0
        self.tool_blocks: dict[int, int] = {}  # OpenAI tool call index -> block index
        self.finish: tuple[str | None, str | int | None] = (None, None)  # OpenAI finish_reason, engine stop_reason
        self.usage: dict | None = None

    def stop_reason(self, finish_reason: str | None, engine_stop: str | int | None) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): a stop string the request named is a stop_sequence."""
        if finish_reason == "length":
            return "max_tokens", None
        if finish_reason == "tool_calls":
            return "tool_use", None
        if isinstance(engine_stop, str) and engine_stop in self.stop_sequences:
            return "stop_sequence", engine_stop
        return "end_turn", None

    # ---- non-streaming ----------------------------------------------------------------

    def body(self, response: dict) -> dict:
        choice = response["choices"][0]
        message = choice["message"]
        content = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            # a quill.tools.ToolCall's arguments always parse to an object (the parsers' contract)
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})
        stop_reason, stop_sequence = self.stop_reason(choice["finish_reason"], choice.get("stop_reason"))
        return {"id": message_id(response["id"]), "type": "message", "role": "assistant", "model": response["model"], "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage_from(response["usage"])}

    # ---- streaming --------------------------------------------------------------------

    def start(self, response_id: str, prompt_tokens: int, cached_tokens: int) -> bytes:
        message = {"id": message_id(response_id), "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": anthropic_usage(prompt_tokens, 0, cached_tokens)}
        return event("message_start", {"message": message})

    def chunk(self, chunk: dict) -> bytes:
        out = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._to_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                out += self._to_block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                out += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return b"".join(out)

    def _tool_call(self, call: dict) -> list[bytes]:
        out = []
        if call.get("id") is not None:  # a new call: its id and name come first, then its arguments
            block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}}
            out += self._to_block(f"tool:{call['index']}", block)
            self.tool_blocks[call["index"]] = self.open_block[0]
        fragment = (call.get("function") or {}).get("arguments")
        if fragment:
            out.append(self._delta({"type": "input_json_delta", "partial_json": fragment}, self.tool_blocks[call["index"]]))
        return out

    def _to_block(self, kind: str, block: dict) -> list[bytes]:
        """Keep writing the open block if it is of `kind`; else close it and open a new one."""
        if self.open_block is not None and self.open_block[1] == kind:
            return []
        out = self._close_block()
        self.open_block = (self.num_blocks, kind)
        self.num_blocks += 1
        out.append(event("content_block_start", {"index": self.open_block[0], "content_block": block}))
        return out

    def _close_block(self) -> list[bytes]:
        if self.open_block is None:
            return []
        index, self.open_block = self.open_block[0], None
        return [event("content_block_stop", {"index": index})]

    def _delta(self, delta: dict, index: int | None = None) -> bytes:
        return event("content_block_delta", {"index": self.open_block[0] if index is None else index, "delta": delta})

    def error(self, body: dict) -> bytes:
        return event("error", {"error": body["error"]})  # the stream ends here, as Anthropic's does

    def end(self) -> bytes:
        out = self._close_block()
        stop_reason, stop_sequence = self.stop_reason(*self.finish)
        usage = _usage_from(self.usage) if self.usage else {"output_tokens": 0}
        out.append(event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage}))
        out.append(event("message_stop", {}))
        return b"".join(out)
