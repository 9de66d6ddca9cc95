"""SamplingParams: how one request is sampled and when it stops (validated at construction)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# logit_bias (OpenAI semantics): token id -> a bias added to that token's logit before sampling.
# The range [-100, 100] is OpenAI's API reference ("an associated bias value from -100 to 100",
# platform.openai.com/docs/api-reference/chat/create#chat-create-logit_bias). The cap of 300
# entries is the one quill's issue 16 gives as OpenAI's; OpenAI's reference and help article
# (help.openai.com/en/articles/5247780) as found do not state a count, so the number is kept here
# as the one place to change it.
LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_MAX_ENTRIES = 300
_INTEGER = re.compile(r"-?[0-9]{1,18}")  # longer is no token id (and int() of >4300 digits raises)


class ParamError(ValueError):
    """A sampling parameter is out of range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _check(cond: bool, param: str, message: str) -> None:
    if not cond:
        raise ParamError(param, message)


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters.

    temperature 0 means greedy. top_k <= 0 and top_p == 1 disable those filters.
    Penalties: repetition_penalty follows Hugging Face (divide positive logits, multiply
    negative ones, for every token seen in prompt or output); presence_penalty and
    frequency_penalty follow OpenAI (subtract, over output tokens only).
    logit_bias follows OpenAI: {token id: bias in [-100, 100]} added to those logits before
    sampling (greedy included); keys may be ints or strings of ints, as JSON sends them, and
    are stored as ints. Ids beyond the model's vocabulary are refused when the engine admits
    the request (check_logit_bias).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus top-k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output (one at most).
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # OpenAI's logit_bias: token id -> bias in [-100, 100], at most 300 entries (see the top).
    logit_bias: dict[int, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        # Normalise sequences given as lists / a single string into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", f"must be an integer in [1, 128], got {self.n!r}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _check(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature!r}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"top logprobs must be in [0, 20], got {self.logprobs!r}",
        )
        kinds = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        _check(len(kinds) <= 1, kinds[-1] if kinds else "json_schema", f"at most one constraint, got {kinds}")
        if self.choice is not None:
            _check(len(self.choice) >= 1 and all(isinstance(c, str) and c for c in self.choice), "choice", "must be a non-empty list of non-empty strings")

    def check_logit_bias(self, vocab_size: int) -> None:
        """Refuse a logit_bias key outside [0, vocab_size) (the engine calls it at admission; the
        server before it, with the tokenizer's vocabulary)."""
        if self.logit_bias:
            bad = next((t for t in self.logit_bias if t >= vocab_size), None)
            _check(bad is None, "logit_bias", f"token id {bad} is outside the vocabulary [0, {vocab_size})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        return self.json_object or any(
            getattr(self, k) is not None for k in ("json_schema", "regex", "choice", "grammar")
        )


def _normalise_logit_bias(value: Any) -> dict[int, float] | None:
    """{int or integer string: real number} -> {int: float}, or ParamError naming the bad entry."""
    _check(isinstance(value, Mapping), "logit_bias", f"must be a mapping of token id to bias, got {type(value).__name__}")
    _check(
        len(value) <= LOGIT_BIAS_MAX_ENTRIES,
        "logit_bias",
        f"at most {LOGIT_BIAS_MAX_ENTRIES} entries, got {len(value)}",
    )
    out: dict[int, float] = {}
    given: dict[int, Any] = {}  # token id -> the key it came from, to name both of a duplicate
    for key, bias in value.items():
        if isinstance(key, str) and _INTEGER.fullmatch(key):
            token = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
            token = int(key)
        else:
            raise ParamError("logit_bias", f"key {_short(key)} is not a token id (an integer, or a string of one, of at most 18 digits)")
        _check(token >= 0, "logit_bias", f"token id {token} is negative; token ids start at 0")
        _check(token not in out, "logit_bias", f"keys {given.get(token)!r} and {key!r} are the same token id {token}")
        _check(
            isinstance(bias, numbers.Real) and not isinstance(bias, bool),
            "logit_bias",
            f"bias for token id {token} must be a number, got {_short(bias)}",
        )
        _check(
            isinstance(bias, numbers.Integral) or math.isfinite(bias),
            "logit_bias",
            f"bias for token id {token} must be finite, got {bias!r}",
        )
        _check(  # compared as given: an int too large for a float is out of range, not an error
            -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX,
            "logit_bias",
            f"bias for token id {token} must be in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {_short(bias)}",
        )
        out[token] = float(bias)
        given[token] = key
    return out or None


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
