"""Engine-wide counters and step-time split, read by gauges, /metrics and the bench."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Totals since start: steps, tokens by kind, time by kind, finishes by reason."""

    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0  # steps that carried any prefill tokens
    decode_seconds: float = 0.0  # decode-only steps
    preemptions: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)  # requests that failed alone, by phase
    spec_proposed: int = 0  # speculative guesses verified
    spec_accepted: int = 0  # of those, kept as output tokens
    spec_verifications: int = 0  # VERIFY rows run

    def record_speculation(self, proposed: int, accepted: int) -> None:
        self.spec_proposed += proposed
        self.spec_accepted += accepted
        self.spec_verifications += 1

    def record_failure(self, phase: str) -> None:
        self.failures[phase] += 1

    def record_step(self, prefill_tokens: int, decode_tokens: int, seconds: float, preempted: int) -> None:
        self.num_steps += 1
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        if prefill_tokens:
            self.prefill_seconds += seconds
        else:
            self.decode_seconds += seconds
        self.preemptions += preempted

    def record_finish(self, seq) -> None:
        m = seq.metrics
        self.finished[seq.status.finish_reason] += 1
        self.prompt_tokens_computed += m.computed_prompt_tokens if m.first_scheduled_time is not None else 0
        self.prompt_tokens_cached += m.cached_tokens
        self.generation_tokens += m.output_tokens

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "step_prefill_tokens": self.prefill_tokens,
            "step_decode_tokens": self.decode_tokens,
            "step_prefill_seconds": round(self.prefill_seconds, 6),
            "step_decode_seconds": round(self.decode_seconds, 6),
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "prompt_tokens_cached": self.prompt_tokens_cached,
            "generation_tokens": self.generation_tokens,
            "num_requests_finished": dict(self.finished),
            "num_requests_failed_by_phase": dict(self.failures),
            "spec_proposed_tokens": self.spec_proposed,
            "spec_accepted_tokens": self.spec_accepted,
            "spec_verifications": self.spec_verifications,
            # the one definition of both rates
            "spec_acceptance_rate": self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0,
            # tokens a VERIFY row yields on average: its accepted guesses plus its own pick
            "spec_mean_accepted_length": ((self.spec_accepted + self.spec_verifications) / self.spec_verifications
                                          if self.spec_verifications else 0.0),
        }
