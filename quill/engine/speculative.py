"""Speculative decoding: propose tokens for running sequences, and decide how many are worth verifying.

Why outputs never change. A proposed token is only a guess at what the sequence will pick next. The
engine verifies a sequence's guesses in one VERIFY row (scheduler.RowKind): one decode row per
position through the batch-invariant fused decode kernel, so each position's logits are bit-identical
to those a one-token decode step gives there. The request's own sampler then picks at each position in
turn, exactly as it would without speculation (same penalties, grammar mask, seeded generator), and
the run stops at the first pick that differs from the guess. Guesses change only how many positions
one weight pass covers. For a proposer that puts all its probability on its guess, this is the
standard rejection rule (accept with probability p(guess); otherwise draw from p without the guess).

What is decided here, per step, with no tensors:
- what to propose: prompt lookup (NgramIndex), the tokens that followed the latest earlier occurrence
  of the sequence's last n tokens (n from ngram_max down to ngram_min), in its prompt and output;
- how many to verify: each guess j of a sequence is accepted with probability about alpha^j, alpha that
  sequence's recent per-guess acceptance; a step of r decode rows costs t(r), measured by StepCostModel
  on this machine and model. The step takes the guesses, most likely first, that maximise expected
  tokens per second, (B + sum of alpha^j) / t(B + guesses), over B plain decode rows. So a sequence
  whose guesses keep failing stops being verified (its alpha falls below what a row costs), and a batch
  large enough that extra rows cost nearly a full step (compute-bound decode) verifies nothing.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from quill.config import SpeculativeConfig
from quill.engine.sequence import Sequence

PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 2.0  # a new sequence's guesses: accepted 60% of the time, worth 2 trials
DECAY_PER_VERIFY = 0.8  # evidence fades, so a sequence that starts quoting is noticed within a few steps
DECAY_PER_TOKEN = 0.98  # and between verifications, so an idle sequence's alpha drifts back to the prior


class NgramIndex:
    """Prompt lookup over one sequence's tokens, updated incrementally as tokens are appended.

    For every n in [n_min, n_max], a table maps each n-gram that has a successor to where its latest
    occurrence's successor starts; the sequence's own last n tokens are looked up, longest n first.
    A quote is followed where it was found: the source position that lines up with the sequence's
    end is kept (as an offset) and preferred while its suffix matches at least as long as the
    table's, so repeated phrases inside a quoted text do not make the lookup jump elsewhere."""

    MAX_MATCH = 16  # suffix tokens compared when checking the kept alignment

    def __init__(self, n_min: int, n_max: int):
        self.n_min = n_min
        self.lengths = tuple(range(n_max, n_min - 1, -1))
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.lengths}
        self.tokens: list[int] = []
        self.indexed = 0  # n-grams ending at positions below this have their successor recorded
        self.offset: int | None = None  # source start - sequence length, of the last proposal

    def update(self, seq: Sequence) -> None:
        tokens, total = self.tokens, seq.num_tokens
        if len(tokens) < total:  # a sequence's tokens only grow
            tokens += seq.token_ids_slice(len(tokens), total)
        for end in range(self.indexed, total - 1):  # the n-gram ending at `end` is followed by end + 1
            for n in self.lengths:
                if end + 1 >= n:
                    self.tables[n][tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self.indexed = max(self.indexed, total - 1)

    def _match(self, start: int) -> int:
        """How many tokens before `start` equal the sequence's last ones (start < len(tokens))."""
        tokens, m = self.tokens, 0
        while m < self.MAX_MATCH and m < start and tokens[start - 1 - m] == tokens[-1 - m]:
            m += 1
        return m

    def propose(self, k: int) -> list[int]:
        tokens, size = self.tokens, len(self.tokens)
        start, matched = None, 0
        for n in self.lengths:
            if size >= n:
                found = self.tables[n].get(tuple(tokens[-n:]))
                if found is not None:
                    start, matched = found, n
                    break
        if self.offset is not None and 0 < size + self.offset < size:
            kept = size + self.offset
            length = self._match(kept)
            if length >= max(matched, self.n_min):
                start = kept
        if start is None:
            self.offset = None
            return []
        self.offset = start - size
        return tokens[start : start + k]


class StepCostModel:
    """Seconds per engine step by its number of decode rows, measured: the median of the last few
    steps of each size (robust to a slow outlier, and following drift as contexts grow).

    Between measured row counts the estimate is interpolated; past the largest it stays flat, an
    optimistic guess that the first such step then measures."""

    KEEP = 9

    def __init__(self):
        self._rows: list[int] = []  # sorted
        self._recent: dict[int, deque[float]] = {}
        self._median: dict[int, float] = {}  # of _recent, kept at record(): estimate() runs per candidate

    def record(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        recent = self._recent.get(rows)
        if recent is None:
            bisect.insort(self._rows, rows)
            recent = self._recent[rows] = deque(maxlen=self.KEEP)
        recent.append(seconds)
        self._median[rows] = statistics.median(recent)

    def estimate(self, rows: int) -> float | None:
        known, median = self._rows, self._median
        if not known:
            return None
        if rows in median:
            return median[rows]
        i = bisect.bisect_left(known, rows)
        if i == 0:
            return median[known[0]] * rows / known[0]
        if i == len(known):
            return median[known[-1]]
        lo, hi = known[i - 1], known[i]
        return median[lo] + (median[hi] - median[lo]) * (rows - lo) / (hi - lo)


@dataclass
class _SeqState:
    index: NgramIndex
    accepted: float = 0.0  # decayed evidence: guesses accepted
    trials: float = 0.0  # and guesses that had their chance (accepted ones plus the first rejected one)
    last_output: int = 0  # output tokens at the last update

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)


class Speculator:
    """Owned by the engine when speculation is on; reads Sequences, writes their draft_token_ids."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, is_stop: Callable[[Sequence, int], bool]):
        if config.method != "ngram":
            raise ValueError(f"no proposer for speculative method {config.method!r}")
        self.config = config
        self.max_model_len = max_model_len
        self._is_stop = is_stop  # the engine's rule: does this token stop this sequence
        self.cost = StepCostModel()
        self._states: dict[int, _SeqState] = {}
        self._drafted: list[Sequence] = []

    def _state(self, seq: Sequence) -> _SeqState:
        st = self._states.get(seq.seq_id)
        if st is None:
            st = self._states[seq.seq_id] = _SeqState(NgramIndex(self.config.ngram_min, self.config.ngram_max))
        return st

    def _room(self, seq: Sequence) -> int:
        """Guesses that could all be kept: one output token is always the row's own pick."""
        left = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return min(self.config.num_tokens, left - 1)

    def propose(self, running: list[Sequence], constrained: Callable[[Sequence], bool]) -> list[Sequence]:
        """Set draft_token_ids of the running sequences that decode next step; -> those given guesses."""
        self.clear()
        ready = [seq for seq in running if seq.num_uncomputed_tokens == 1]
        candidates: list[tuple[float, int, Sequence]] = []  # (expected gain, order, seq): one per guess
        proposals: dict[int, list[int]] = {}
        for seq in ready:
            st = self._state(seq)
            st.index.update(seq)
            idle = seq.num_output_tokens - st.last_output
            if idle > 0:
                factor = DECAY_PER_TOKEN ** idle
                st.accepted, st.trials, st.last_output = st.accepted * factor, st.trials * factor, seq.num_output_tokens
            room = self._room(seq)
            guesses = st.index.propose(room) if room > 0 else []
            if guesses and constrained(seq):
                # a grammar's matcher is never fed a stop token, so a constrained run ends before one
                guesses = guesses[: next((j for j, t in enumerate(guesses) if self._is_stop(seq, t)), len(guesses))]
            proposals[seq.seq_id] = guesses
            alpha = st.alpha
            for j in range(len(guesses)):
                candidates.append((alpha ** (j + 1), len(candidates), seq))
        if not candidates:
            return []
        candidates.sort(key=lambda c: (-c[0], c[1]))
        base = len(ready)
        t_base = self.cost.estimate(base)
        best, best_rate, gain = 0, None, 0.0
        for count, (g, _, _) in enumerate(candidates, start=1):
            gain += g
            t = self.cost.estimate(base + count)
            if t is None or t_base is None:
                best = count  # nothing measured yet: try, and measure
                continue
            rate = (base + gain) / t
            if rate > (best_rate if best_rate is not None else base / t_base):
                best, best_rate = count, rate
        take: dict[int, int] = {}
        for _, _, seq in candidates[:best]:  # a sequence's guesses in order: their gains only fall
            take[seq.seq_id] = take.get(seq.seq_id, 0) + 1
        for seq in ready:
            n = take.get(seq.seq_id)
            if n:
                seq.draft_token_ids = proposals[seq.seq_id][:n]
                self._drafted.append(seq)
        return list(self._drafted)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """After seq's VERIFY row: `accepted` of its `proposed` guesses were kept."""
        st = self._states.get(seq.seq_id)
        if st is not None:
            trials = accepted + (1 if accepted < proposed else 0)
            st.accepted = st.accepted * DECAY_PER_VERIFY + accepted
            st.trials = st.trials * DECAY_PER_VERIFY + trials
            st.last_output = seq.num_output_tokens
        seq.metrics.spec_proposed += proposed
        seq.metrics.spec_accepted += accepted

    def record_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` decode rows and nothing else took `seconds`."""
        self.cost.record(rows, seconds)

    def clear(self) -> None:
        for seq in self._drafted:
            seq.draft_token_ids = []
        self._drafted = []

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

