"""Reasoning output: the text a model writes between <think> and </think> (Qwen3, QwQ, SmolLM3,
DeepSeek-R1 and its distills), kept apart from the answer.

The OpenAI-compatible servers that do this agree on the shape: a chat completion's message carries
the reasoning in `reasoning_content` and only the answer in `content`; a stream sends
`delta.reasoning_content` chunks, then `delta.content` chunks (llama-server's chat parser, vLLM's
`--reasoning-parser deepseek_r1` / `qwen3`; vLLM >= 0.11 also names the field `reasoning`). The
choice is llama-server's `--reasoning-format` / request `reasoning_format`: `none` leaves the text
untouched in `content`, `deepseek` splits it.

Everything here is pure: one streaming parser (a whole text is one feed), used by the server's
non-streaming and streaming paths alike; Python callers split an LLM.chat output with split_reasoning
(LLM.chat itself returns the text whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from quill.engine.stop_checker import partial_match_len

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_FORMATS = ("none", "deepseek")
PROMPT_TAIL_TOKENS = 16  # prompt ids decoded to see whether the prompt opened a think block


def default_reasoning_format(chat_template: str | None) -> str:
    """The format a model gets unless told otherwise: `deepseek` when its chat template mentions a
    think marker (it writes, strips or opens reasoning blocks, so its model produces them), else
    `none`. </think> counts too: the first DeepSeek-R1-Distill templates only strip
    `content.split('</think>')[-1]` and never write <think>. The one place this is decided."""
    return "deepseek" if chat_template and (THINK_START in chat_template or THINK_END in chat_template) else "none"


def check_reasoning_format(value: str, name: str = "reasoning_format") -> str:
    if value not in REASONING_FORMATS:
        raise ValueError(f"{name} must be one of {', '.join(REASONING_FORMATS)}; got {value!r}")
    return value


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the prompt ends inside a think block, so the output starts in the reasoning with
    no <think> of its own: DeepSeek-R1's templates end the generation prompt with
    `<｜Assistant｜><think>\\n`, Qwen3-Thinking-2507's with `<|im_start|>assistant\\n<think>\\n`.
    llama.cpp's chat parser calls this `thinking_forced_open` and decides it the same way, from
    the prompt's end. Only the end counts: a <think> a user quoted earlier opens nothing, and
    Qwen3's `enable_thinking=false` prompt ends with an empty, closed block."""
    return prompt_text.rstrip().endswith(THINK_START)


def prompt_ids_open_reasoning(decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]) -> bool:
    """prompt_opens_reasoning on the decoded tail of a prompt given as ids."""
    return prompt_opens_reasoning(decode(list(prompt_token_ids[-PROMPT_TAIL_TOKENS:])))


_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ReasoningParser:
    """One completion's text, fed in pieces as it streams, split into reasoning and content.

    - The reasoning starts where the output starts when the prompt opened a think block
      (`opened`), or when the output starts (after whitespace) with <think>, as llama-server
      accepts it; otherwise the whole output is content, untouched, a later <think> included.
    - It ends at the first </think>; everything after is content, untouched.
    - Neither marker appears in either part. Whitespace around the reasoning and before the
      content that follows </think> is dropped, as llama-server strips them (vLLM keeps them).
    - With no </think> by the end (max_tokens ran out while reasoning), all of it is reasoning.

    While streaming, text that may still become a marker (partial_match_len, the rule stop
    strings are held back by) and whitespace that may yet turn out to end the reasoning are held
    back, so each kind's deltas add up to exactly what one feed of the whole text gives, however
    the text was split.
    """

    def __init__(self, opened: bool = False):
        self._state = _REASONING if opened else _START
        self._pending = ""  # fed text not yet given out
        self._trim = opened  # drop leading whitespace of the section just entered
        self.has_reasoning = opened  # a think block was opened (by the prompt or the output)
        self.closed = False  # its </think> was seen
        self.reasoning = ""  # every reasoning delta so far, joined
        self.content = ""  # every content delta so far, joined

    def feed(self, text: str) -> tuple[str, str]:
        """Append output text; returns the (reasoning, content) that became safe to send."""
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """The output ended: give out whatever was held back."""
        return self._advance(final=True)

    def message(self) -> tuple[str | None, str | None]:
        """(reasoning_content, content) as a chat message carries them once finished: reasoning
        None when there was none; content None when the reasoning took the whole output (vLLM's
        shape), else the answer ("" only for an output with no reasoning and no text)."""
        reasoning = self.reasoning or None
        if reasoning is None:
            return None, self.content
        return reasoning, self.content or None

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while True:
            if self._state == _START:
                head = self._pending.lstrip()
                if head.startswith(THINK_START):
                    self._state, self._trim, self.has_reasoning = _REASONING, True, True
                    self._pending = head[len(THINK_START):]
                    continue
                if not final and THINK_START.startswith(head):  # only whitespace, or "<thi" so far
                    break
                self._state = _CONTENT
                continue
            if self._trim:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    break
                self._trim = False
            if self._state == _CONTENT:
                content += self._pending
                self._pending = ""
                break
            end = self._pending.find(THINK_END)
            if end >= 0:
                reasoning += self._pending[:end].rstrip()
                self._pending = self._pending[end + len(THINK_END):]
                self._state, self._trim, self.closed = _CONTENT, True, True
                continue
            safe = self._pending if final else self._pending[: len(self._pending) - partial_match_len(self._pending, (THINK_END,))]
            safe = safe.rstrip()  # trailing whitespace waits: it is dropped if </think> comes next
            reasoning += safe
            self._pending = "" if final else self._pending[len(safe):]
            break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """A finished output's (reasoning_content, content), as ReasoningParser.message gives them."""
    parser = ReasoningParser(opened)
    parser.feed(text)
    parser.finish()
    return parser.message()


def count_reasoning_tokens(parser: ReasoningParser, token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> int:
    """Output tokens spent reasoning, for usage.completion_tokens_details.reasoning_tokens.

    Counted as the tokens generated before and including the one that completes </think>: the
    smallest k whose decode(token_ids[:k]) holds </think>, found by bisection (O(log n) decodes,
    once per finished completion; the markers are generated tokens too, so they count). All of
    them when the reasoning never closed; 0 when the output had no reasoning.
    """
    n = len(token_ids)
    if not parser.has_reasoning:
        return 0
    if not parser.closed or n == 0 or THINK_END not in decode(list(token_ids)):
        return n
    low, high = 1, n
    while low < high:
        middle = (low + high) // 2
        if THINK_END in decode(list(token_ids[:middle])):
            high = middle
        else:
            low = middle + 1
    return low
