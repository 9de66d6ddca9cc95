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
  of the sequence's last n tokens (n from ngram_max down to ngram_min), in its prompt and output; or,
  with a draft model, how many tokens it is to guess (draft.DraftRunner fills them in once the
  scheduler has given the VERIFY rows their blocks: fill());
- how many to verify: each guess j of a sequence is accepted with probability about alpha^j, alpha that
  sequence's recent per-guess acceptance; a step of r decode rows costs t(r), measured by StepCostModel
  on this machine and model. The step takes the guesses, most likely first, that maximise expected
  tokens per second, (B + sum of alpha^j) / (t(B + guesses) + k d(S)), over B plain decode rows,
  where a draft model guesses in k sequential steps of S rows each costing d(S), measured likewise
  (0 for prompt lookup). So a sequence whose guesses keep failing stops being verified (its alpha
  falls below what a row costs), a batch large enough that extra rows cost nearly a full step
  (compute-bound decode) verifies nothing, and a draft too slow for its acceptance is not run.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from quill.config import SpeculativeConfig
from quill.engine.scheduler import RowKind, ScheduledSeq
from quill.engine.sequence import Sequence

logger = logging.getLogger("quill.engine")

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
    index: NgramIndex | None  # prompt lookup's; None with a draft model
    accepted: float = 0.0  # decayed evidence: guesses accepted
    trials: float = 0.0  # and guesses that had their chance (accepted ones plus the first rejected one)
    last_output: int = 0  # output tokens at the last update

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_ALPHA * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)


class Speculator:
    """Owned by the engine when speculation is on; reads Sequences, writes their draft_token_ids."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, stop_ids: Callable[[Sequence], tuple[int, ...]],
                 draft=None):
        """stop_ids(seq): the engine's rule for the token ids that stop seq; draft: a draft.DraftRunner
        (method "draft")."""
        if config.method not in ("ngram", "draft") or (config.method == "draft") != (draft is not None):
            raise ValueError(f"no proposer for speculative method {config.method!r}")
        self.config = config
        self.max_model_len = max_model_len
        self._stop_ids = stop_ids
        self.draft = draft
        self.cost = StepCostModel()  # whole steps of plain and VERIFY rows, without the draft's time
        self.draft_cost = StepCostModel()  # one draft step, by the sequences guessing in it
        self._draft_seconds = 0.0  # this step's
        self._states: dict[int, _SeqState] = {}
        self._drafted: list[Sequence] = []
        self._constrained: dict[int, bool] = {}  # this step's drafted sequences: constrained?
        self.draft_failures = 0

    def _state(self, seq: Sequence) -> _SeqState:
        st = self._states.get(seq.seq_id)
        if st is None:
            index = NgramIndex(self.config.ngram_min, self.config.ngram_max) if self.draft is None else None
            st = self._states[seq.seq_id] = _SeqState(index)
        return st

    def _guesses(self, seq: Sequence, st: _SeqState, room: int, constrained: bool) -> list[int]:
        """Prompt lookup's guesses, or a draft's placeholders (room of them: fill() sets the tokens)."""
        if room <= 0:
            return []
        if self.draft is not None:
            return [-1] * room
        st.index.update(seq)
        guesses = st.index.propose(room)
        if guesses and constrained:
            # a grammar's matcher is never fed a stop token, so a constrained run ends before one
            stops = self._stop_ids(seq)
            guesses = guesses[: next((j for j, t in enumerate(guesses) if t in stops), len(guesses))]
        return guesses

    def _draft_time(self, steps: int, rows: int) -> float | None:
        """Seconds for a draft to guess `steps` tokens for `rows` sequences (0 without a draft)."""
        if self.draft is None or not steps:
            return 0.0
        one = self.draft_cost.estimate(rows)
        return None if one is None else steps * one

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
            idle = seq.num_output_tokens - st.last_output
            if idle > 0:
                factor = DECAY_PER_TOKEN ** idle
                st.accepted, st.trials, st.last_output = st.accepted * factor, st.trials * factor, seq.num_output_tokens
            is_constrained = self._constrained[seq.seq_id] = constrained(seq)
            guesses = proposals[seq.seq_id] = self._guesses(seq, st, self._room(seq), is_constrained)
            alpha = st.alpha
            for j in range(len(guesses)):
                candidates.append((alpha ** (j + 1), len(candidates), seq))
        if not candidates:
            return []
        candidates.sort(key=lambda c: (-c[0], c[1]))
        base = len(ready)
        t_base = self.cost.estimate(base)
        best, best_rate, gain = 0, None, 0.0
        counts: dict[int, int] = {}  # guesses taken so far per sequence: a draft runs max(counts) steps
        for count, (g, _, seq) in enumerate(candidates, start=1):
            gain += g
            counts[seq.seq_id] = counts.get(seq.seq_id, 0) + 1
            t, d = self.cost.estimate(base + count), self._draft_time(max(counts.values()), len(counts))
            if t is None or t_base is None or d is None:
                best = count  # nothing measured yet: try, and measure
                continue
            rate = (base + gain) / (t + d)
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

    def fill(self, scheduled: list[ScheduledSeq]) -> None:
        """After scheduling, with a draft model: guess the tokens of the VERIFY rows (in place). If the
        draft fails, the step verifies nothing: its VERIFY rows become plain decode rows (their extra
        blocks stay with the sequence for its next tokens), and the failure is logged."""
        self._draft_seconds = 0.0
        if self.draft is None or not any(item.kind is RowKind.VERIFY for item in scheduled):
            return
        t0 = time.perf_counter()
        try:
            self.draft.guess(scheduled, self._banned)
        except Exception:  # noqa: BLE001 - guesses are optional; no request fails for them
            self.draft_failures += 1
            if self.draft_failures == 1 or self.draft_failures % 1000 == 0:
                logger.warning("draft model failed (%d times so far); those steps verify no guesses",
                               self.draft_failures, exc_info=self.draft_failures == 1)
            for k, item in enumerate(scheduled):
                if item.kind is RowKind.VERIFY:
                    item.seq.draft_token_ids = []
                    scheduled[k] = ScheduledSeq.plan(item.seq, item.start, 1)
            return
        finally:
            self._draft_seconds = time.perf_counter() - t0
        for rows, seconds in self.draft.step_seconds:
            self.draft_cost.record(rows, seconds)

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """Ids a draft must not guess for seq: a constrained sequence's stop tokens (its grammar's
        matcher is never fed one)."""
        return self._stop_ids(seq) if self._constrained.get(seq.seq_id) else ()

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
        """A step of `rows` decode rows and nothing else took `seconds`, its draft's guessing included."""
        self.cost.record(rows, seconds - self._draft_seconds)

    def clear(self) -> None:
        for seq in self._drafted:
            seq.draft_token_ids = []
        self._drafted = []
        self._constrained = {}

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)
        if self.draft is not None:
            self.draft.release(seq)

