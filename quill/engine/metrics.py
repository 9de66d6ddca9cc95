"""Per-request timings (DESIGN.md definitions) and the derived figures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


def now() -> float:
    return time.perf_counter()


@dataclass
class RequestMetrics:
    """Timestamps (perf_counter seconds) for one completion, and what follows from them."""

    arrival_time: float = field(default_factory=now)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_start_time: float | None = None  # start of the step that computed the first prompt chunk
    spec_proposed: int = 0  # speculative tokens proposed for this completion and verified
    spec_accepted: int = 0  # of those, accepted into the output

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        end = self.token_times[-1] if self.token_times else self.finished_time
        return None if end is None else end - self.arrival_time

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for a single output token."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def prompt_tps(self) -> float | None:
        """Prompt tokens actually computed (not cached) / prefill time."""
        pt = self.prefill_time
        if not pt:
            return None
        return self.computed_prompt_tokens / pt

    @property
    def generation_tps(self) -> float | None:
        """(output tokens - 1) / (E2E - TTFT)."""
        tpot = self.tpot
        return None if not tpot else 1.0 / tpot

    def as_dict(self) -> dict:
        ms = lambda s: None if s is None else round(s * 1000.0, 3)  # noqa: E731
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "queue_ms": ms(self.queue_time),
            "ttft_ms": ms(self.ttft),
            "tpot_ms": ms(self.tpot),
            "e2e_ms": ms(self.e2e),
            "prefill_ms": ms(self.prefill_time),
            "prompt_tps": None if self.prompt_tps is None else round(self.prompt_tps, 2),
            "generation_tps": None if self.generation_tps is None else round(self.generation_tps, 2),
            "spec_proposed_tokens": self.spec_proposed,
            "spec_accepted_tokens": self.spec_accepted,
        }
