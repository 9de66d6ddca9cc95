"""What the engine hands back: per-completion text, tokens, finish reason and timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a request's n completions, as of this step."""

    index: int
    text: str  # full text so far (stop string stripped)
    token_ids: "Sequence[int]"  # a list once finished; while running, a no-copy view of the ids so far
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    delta_text: str = ""  # new text since the previous output (safe to stream)
    stop_reason: str | int | None = None
    logprobs: "Sequence[dict] | None" = None  # per token (a view while running, like token_ids): {"token_id", "logprob", "top": [(id, logprob), ...]}
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request failed inside the engine (finish_reason "error")

    @property
    def text(self) -> str:
        return self.outputs[0].text
