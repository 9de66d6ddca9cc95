"""One HTTP request's choices as outputs arrive: streamed deltas, final body, usage, timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from quill.reasoning import ReasoningParser, count_reasoning_tokens
from quill.server.responses import TokenText, chat_logprobs, completion_logprobs, timings, usage
from quill.server.tool_calls import call_json, finish_reason


@dataclass
class Delta:
    """What is new for one choice since the last chunk."""

    index: int
    text: str  # the answer's new text (chat with reasoning parsed: content only)
    logprobs: list[dict] | None  # engine entries for the new tokens; None when not requested
    finish_reason: str | None
    stop_reason: str | int | None
    text_offset: int  # characters of this choice already sent (completions logprobs)
    reasoning: str = ""  # new reasoning text (chat with reasoning_format deepseek)
    tool_calls: list = field(default_factory=list)  # calls completed in this delta (quill.tools.ToolCall)
    first_call: int = 0  # the choice's index of tool_calls[0]


class Accumulator:
    """Tracks every choice of a request (prompt p, completion j -> choice index p * n + j)."""

    def __init__(self, *, kind, response_id, model, created, n, num_prompts, names: TokenText, echo, include_usage,
                 reasoning_opened: bool | None = None, tool_parser=None):
        self.kind = kind  # "chat" | "completion"
        self.id = response_id
        self.model = model
        self.created = created
        self.n = n
        self.names = names
        self.echo = echo  # per prompt, the prompt text to prepend (completions echo=true)
        self.include_usage = include_usage
        self.num_choices = n * num_prompts
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.latest: dict = {}  # choice index -> CompletionOutput
        self.sent: dict[int, str] = {}
        self.sent_logprobs: dict[int, int] = {}
        self.finished: set[int] = set()
        # Chat with reasoning_format deepseek: whether the prompt opened a think block (else None:
        # the text goes out untouched); one parser per choice splits reasoning from content.
        self.reasoning_opened = reasoning_opened
        self.parsers: dict[int, ReasoningParser] = {}
        # Chat with tools: a factory of quill.tools parsers (None: no tools), one per choice, fed
        # the content (after reasoning is split off); it gives out text and completed calls.
        self.tool_parser = tool_parser
        self.tool_parsers: dict = {}

    # ---- bookkeeping ----------------------------------------------------------------

    def update(self, prompt_index: int, output) -> list[Delta]:
        self.prompt_tokens[prompt_index] = len(output.prompt_token_ids)
        self.cached_tokens[prompt_index] = max(self.cached_tokens[prompt_index], output.num_cached_tokens or 0)
        deltas = []
        for completion in output.outputs:
            index = prompt_index * self.n + completion.index
            if index in self.finished:
                continue
            self.latest[index] = completion
            deltas.extend(self._delta(index, prompt_index, completion))
        return deltas

    def _delta(self, index: int, prompt_index: int, completion) -> list[Delta]:
        before = self.sent.get(index, "")
        text = completion.delta_text or ""
        if completion.finished:
            self.finished.add(index)
            cached = (completion.metrics or {}).get("cached_tokens") or 0
            self.cached_tokens[prompt_index] = max(self.cached_tokens[prompt_index], cached)
            # Whatever the deltas held back must still reach the client, so that the streamed
            # text equals the non-streamed text.
            full = completion.text or ""
            if full.startswith(before + text):
                text = full[len(before):]
        new_logprobs = None
        if completion.logprobs is not None:
            done = self.sent_logprobs.get(index, 0)
            new_logprobs = completion.logprobs[done:]
            self.sent_logprobs[index] = len(completion.logprobs)
        self.sent[index] = before + text
        reasoning = ""
        if self.reasoning_opened is not None:
            parser = self.parsers.get(index)
            if parser is None:
                parser = self.parsers[index] = ReasoningParser(self.reasoning_opened)
            reasoning, text = parser.feed(text)
            if completion.finished:
                more_reasoning, more_text = parser.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        calls, first_call = [], 0
        if self.tool_parser is not None:
            tools = self.tool_parsers.get(index)
            if tools is None:
                tools = self.tool_parsers[index] = self.tool_parser()
            first_call = len(tools.calls)
            text, calls = tools.feed(text)
            if completion.finished:
                more_text, more_calls = tools.finish()
                text, calls = text + more_text, calls + more_calls
        if not (text or reasoning or calls or new_logprobs or completion.finished):
            return []
        reason = completion.finish_reason
        if completion.finished and self.tool_parser is not None:
            reason = finish_reason(reason, bool(self.tool_parsers[index].calls))
        return [Delta(index, text, new_logprobs, reason, completion.stop_reason, len(before), reasoning, calls, first_call)]

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.num_choices

    def usage(self) -> dict:
        generated = sum(len(c.token_ids) for c in self.latest.values())
        reasoning_tokens = None
        if self.reasoning_opened is not None:
            reasoning_tokens = sum(count_reasoning_tokens(self.parsers[i], c.token_ids, self.names.decode)
                                   for i, c in self.latest.items() if i in self.parsers)
        return usage(sum(self.prompt_tokens), generated, sum(self.cached_tokens), reasoning_tokens)

    def timings(self) -> dict:
        groups = []
        for p in range(len(self.prompt_tokens)):
            outs = [self.latest.get(p * self.n + j) for j in range(self.n)]
            groups.append([c.metrics or {} for c in outs if c is not None])
        return timings(groups)

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    # ---- streaming ------------------------------------------------------------------

    def _chunk(self, choices: list[dict]) -> dict:
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        chunk = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunks(self) -> list[dict]:
        """Chat: the assistant role first, no content. Completions with echo: the prompt."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""}
            return [self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]) for i in range(self.num_choices)]
        if self.echo:
            return [self._chunk([{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}]) for i in range(self.num_choices)]
        return []

    def chunks(self, prompt_index: int, output) -> list[dict]:
        chunks = [self._chunk([choice]) for d in self.update(prompt_index, output) for choice in self._choice_deltas(d)]
        if chunks and self.all_finished and not self.include_usage:
            chunks[-1]["timings"] = self.timings()
        return chunks

    def _choice_deltas(self, d: Delta) -> list[dict]:
        """One chunk's choice, or several when a step holds several kinds, in the output's order:
        reasoning, content, then each completed tool call as OpenAI streams one (its id, type and
        name with empty arguments, then the arguments). The last carries the step's logprobs and
        finish_reason."""
        if self.kind == "chat":
            lp = chat_logprobs(d.logprobs, self.names) if d.logprobs else None
            pieces = [{"reasoning_content": d.reasoning}] if d.reasoning else []
            if d.text:
                pieces.append({"content": d.text})
            for number, call in enumerate(d.tool_calls, d.first_call):
                head = call_json(call)
                head["function"] = {"name": call.name, "arguments": ""}
                pieces.append({"tool_calls": [{"index": number, **head}]})
                pieces.append({"tool_calls": [{"index": number, "function": {"arguments": call.arguments}}]})
            choices = [{"index": d.index, "delta": piece, "logprobs": None, "finish_reason": None} for piece in pieces or [{}]]
            choice = choices[-1]
            choice["logprobs"], choice["finish_reason"] = lp, d.finish_reason
        else:
            offset = len(self._echo(d.index)) + d.text_offset
            lp = completion_logprobs(d.logprobs, self.names, offset) if d.logprobs else None
            choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
            choices = [choice]
        if d.finish_reason is not None:
            choice["stop_reason"] = d.stop_reason
        return choices

    def closing_chunk(self) -> dict | None:
        """The usage chunk (choices: []), when stream_options.include_usage asked for it."""
        if not self.include_usage:
            return None
        chunk = self._chunk([])
        chunk["usage"] = self.usage()
        chunk["timings"] = self.timings()
        return chunk

    # ---- non-streaming --------------------------------------------------------------

    def response(self) -> dict:
        choices = [self._final_choice(i, self.latest[i]) for i in sorted(self.latest)]
        kind = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
            "timings": self.timings(),
        }

    def _final_choice(self, index: int, c) -> dict:
        entries = c.logprobs
        if self.kind == "chat":
            lp = chat_logprobs(entries, self.names) if entries is not None else None
            message = {"role": "assistant", "content": c.text}
            if index in self.parsers:
                reasoning, content = self.parsers[index].message()
                message = {"role": "assistant", "content": content, "reasoning_content": reasoning}
            reason = c.finish_reason
            tools = self.tool_parsers.get(index)
            if tools is not None:
                message["content"] = tools.content or (None if tools.calls or message["content"] is None else "")
                if tools.calls:
                    message["tool_calls"] = [call_json(call) for call in tools.calls]
                reason = finish_reason(reason, bool(tools.calls))
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason, "stop_reason": c.stop_reason}
        echo = self._echo(index)
        lp = completion_logprobs(entries, self.names, len(echo)) if entries is not None else None
        return {"index": index, "text": echo + c.text, "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
