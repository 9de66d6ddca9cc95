"""Structured output: compile constraints once per engine, one matcher per sequence.

The engine's per-step flow (see docs/helpers/GUIDED_README.md):
build the batch → MaskWorker.submit(rows) → forward → MaskWorker.apply(logits) → sample
→ GuidedMatcher.accept(token) for each constrained row.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections import OrderedDict

import llguidance
import numpy as np
import tokenizers

from quill.engine.guided_mask import MaskWorker, unpack_bitmask
from quill.engine.guided_spec import (
    DEFAULT_JSON_WHITESPACE,
    GuidedError,
    api_param,
    build_constraint_spec,
    clean_message,
    constraint_kind,
    constraint_kwargs,
)
from quill.sampling_params import SamplingParams

__all__ = [
    "GuidedError",
    "GuidedMatcher",
    "GrammarCompiler",
    "MaskWorker",
    "build_constraint_spec",
    "constraint_kwargs",
]

logger = logging.getLogger(__name__)


class GuidedMatcher:
    """One sequence's position in its grammar; advances with every accepted token."""

    def __init__(self, template: llguidance.LLMatcher, param: str, kind: str, vocab_size: int):
        self._template = template  # initial state, shared and never advanced
        self._matcher = template.deep_copy()
        self.param = param
        self.kind = kind
        self.vocab_size = vocab_size
        self.num_tokens = 0  # tokens accepted since the last reset

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher (MaskWorker fills masks from it)."""
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advance by one sampled token; GuidedError if the grammar forbids it."""
        if not self._matcher.consume_token(int(token_id)):
            raise GuidedError(
                self.param,
                f"token {int(token_id)} breaks the {self.kind} constraint after {self.num_tokens} tokens: "
                f"{clean_message(self._matcher.get_error())}",
            )
        self.num_tokens += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"rollback: num_tokens must be in [0, {self.num_tokens}], got {num_tokens}")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise GuidedError(self.param, f"cannot roll back {num_tokens} tokens: {clean_message(self._matcher.get_error())}")
        self.num_tokens -= num_tokens

    def reset(self) -> None:
        """Back to the initial state (also clears an error state, which llguidance never leaves)."""
        self._matcher = self._template.deep_copy()
        self.num_tokens = 0

    def replay(self, token_ids) -> None:
        """Reset, then accept token_ids: rebuilds the state after preemption."""
        self.reset()
        for token_id in token_ids:
            self.accept(token_id)

    def is_terminated(self) -> bool:
        """The grammar is complete: only EOS may follow (or EOS was already accepted)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self._matcher.is_accepting()

    def is_error(self) -> bool:
        return self._matcher.is_error()

    def allowed_token_ids(self) -> np.ndarray:
        """Token ids allowed next, ascending (int64); computes a mask (tests, debugging)."""
        bitmask = np.full((1, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        return np.flatnonzero(unpack_bitmask(bitmask, self.vocab_size)[0])


class GrammarCompiler:
    """Compiles constraints against one tokenizer; caches compiled grammars (LRU)."""

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        *,
        json_whitespace: str | None = DEFAULT_JSON_WHITESPACE,
        cache_size: int = 64,
    ):
        tokenizer_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size < tokenizer_size:
            raise ValueError(f"vocab_size {vocab_size} (logits width) is below the tokenizer's {tokenizer_size} tokens")
        eos = tuple(int(t) for t in eos_token_ids)
        if not eos or not all(0 <= t < vocab_size for t in eos):
            raise ValueError(f"eos_token_ids must be non-empty ids below vocab_size {vocab_size}, got {eos_token_ids!r}")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self.json_whitespace = json_whitespace
        self._ll_tokenizer = llguidance.LLTokenizer(_tokenizer_json(hf_tokenizer), n_vocab=vocab_size, eos_token=list(eos))
        # verbose_errors=False keeps parser state (and the user's schema) out of messages.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # validate runs on the server thread, new_matcher on the engine's

    def validate(self, params: SamplingParams) -> None:
        """Raise GuidedError if params' constraint cannot compile; call at admission."""
        spec = build_constraint_spec(params, self.json_whitespace)
        if spec is not None:
            self._template(spec, params)

    def new_matcher(self, params: SamplingParams) -> GuidedMatcher | None:
        """A fresh matcher for one sequence, or None for an unconstrained request."""
        spec = build_constraint_spec(params, self.json_whitespace)
        if spec is None:
            return None
        kind = constraint_kind(params)
        return GuidedMatcher(self._template(spec, params), api_param(params, kind), kind, self.vocab_size)

    def _template(self, spec: str, params: SamplingParams) -> llguidance.LLMatcher:
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template
        template = self._compile(spec, params)
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def _compile(self, spec: str, params: SamplingParams) -> llguidance.LLMatcher:
        kind = constraint_kind(params)
        # Bounded by llguidance's fuel limits, so a hostile schema errors instead of hanging.
        matcher = llguidance.LLMatcher(self._ll_tokenizer, spec, log_level=0, limits=self._limits)
        if matcher.is_error():
            what = {"json_schema": "JSON schema", "json_object": "JSON object", "choice": "choice list"}.get(kind, kind)
            raise GuidedError(api_param(params, kind), f"invalid {what}: {clean_message(matcher.get_error())}")
        for warning in matcher.get_grammar_warnings():
            logger.info("guided %s: %s", kind, warning)
        # One mask now builds the first lexer states, which every deep copy then inherits.
        scratch = np.empty((1, (self.vocab_size + 31) // 32), dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        return matcher


def _tokenizer_json(hf_tokenizer: tokenizers.Tokenizer) -> str:
    """The tokenizer's JSON without padding / truncation (which would distort tokens)."""
    tokenizer = copy.copy(hf_tokenizer)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer.to_str()
