"""Stop rules (EOS, stop ids, stop strings, max_tokens, context) and stream-safe text deltas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from quill.engine.sequence import Sequence


@dataclass(frozen=True)
class StopResult:
    """Why a completion finished, and its final output text."""

    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None  # the stop string or stop token id; None for EOS and length
    text: str  # the final output text (stop string / stop token text removed unless included)


class StopChecker:
    """Decides whether a completion stops after its newest token; one place for all rules.

    Call once per appended token with the full detokenized output text and how many
    characters that token added. Rules, first match wins:
      1. before min_tokens output tokens nothing but the length rules can fire
      2. EOS (unless params.ignore_eos) -> "stop", stop_reason None
      3. a stop_token_id -> "stop", stop_reason = the id
         (for 2 and 3 the token's own text, if any, is dropped unless include_stop_str_in_output)
      4. a stop string in the new text -> "stop", stop_reason = the string, text cut before it
         (or after it with include_stop_str_in_output); the earliest match wins
      5. max_tokens reached, or the context is full (num_tokens >= max_model_len) -> "length"
    A natural stop on the last allowed token reports "stop", not "length".
    """

    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, output_text: str, num_new_chars: int) -> StopResult | None:
        """output_text: the whole output so far; num_new_chars: how much of its end the newest token added."""
        if not 0 <= num_new_chars <= len(output_text):
            raise ValueError(f"num_new_chars must be in [0, {len(output_text)}], got {num_new_chars}")
        if seq.num_output_tokens == 0:
            return None
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            result = self._check_token(seq.last_token_id, params, output_text, num_new_chars)
            if result is None:
                result = check_stop_strings(output_text, num_new_chars, params)
            if result is not None:
                return result
        max_tokens = params.max_tokens
        if (max_tokens is not None and seq.num_output_tokens >= max_tokens) or seq.num_tokens >= self.max_model_len:
            return StopResult("length", None, output_text)
        return None

    def _check_token(self, token_id: int, params: SamplingParams, text: str, num_new_chars: int) -> StopResult | None:
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        if not is_eos and token_id not in params.stop_token_ids:
            return None
        # Special tokens are usually skipped upstream (num_new_chars == 0); a visible stop
        # token's text is part of the stop, not of the answer.
        kept = text if params.include_stop_str_in_output else text[: len(text) - num_new_chars]
        return StopResult("stop", None if is_eos else token_id, kept)


def check_stop_strings(text: str, num_new_chars: int, params: SamplingParams) -> StopResult | None:
    """Find a stop string that ends inside the last num_new_chars characters of text.

    Each string s is searched from len(s) - 1 characters before the new tail, so a match
    split across tokens is found and none is found twice. The earliest match wins (ties:
    the first listed).
    """
    if not params.stop or num_new_chars == 0:
        return None
    tail_start = len(text) - num_new_chars
    best: tuple[int, str] | None = None
    for stop in params.stop:
        position = text.find(stop, max(0, tail_start - len(stop) + 1))
        if position != -1 and (best is None or position < best[0]):
            best = (position, stop)
    if best is None:
        return None
    position, stop = best
    end = position + len(stop) if params.include_stop_str_in_output else position
    return StopResult("stop", stop, text[:end])


class StreamingText:
    """Turns a growing output text into deltas that are safe to stream.

    Holds back any suffix that could still become a stop string, so text that a stop will
    remove is never sent. The concatenation of all deltas equals the final text exactly,
    provided the text only grows by appending, except at the final call, where it may be
    cut by a StopResult (a cut never reaches into text already sent).
    """

    def __init__(self, stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        # With the stop string kept in the output, everything before the match is emitted
        # anyway, and text after a match arrives in the same step as the match itself.
        self.stop = () if include_stop_str_in_output else tuple(stop)
        self.num_emitted = 0  # characters of the text already returned as deltas

    @classmethod
    def for_params(cls, params: SamplingParams) -> StreamingText:
        return cls(params.stop, params.include_stop_str_in_output)

    def delta(self, text: str, finished: bool) -> str:
        """The new text that is safe to emit; with finished=True, everything not yet sent."""
        if len(text) < self.num_emitted:
            raise ValueError(f"text shrank to {len(text)} characters below the {self.num_emitted} already streamed")
        end = len(text) if finished else max(self.num_emitted, len(text) - self._holdback(text))
        out = text[self.num_emitted : end]
        self.num_emitted = end
        return out

    def _holdback(self, text: str) -> int:
        return partial_match_len(text, self.stop)


def partial_match_len(text: str, markers) -> int:
    """Length of the longest suffix of text that is a prefix of some marker: the text a stream
    must hold back while it may still turn into one (stop strings here; the reasoning markers
    of quill.reasoning use the same rule)."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker), len(text)), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest
