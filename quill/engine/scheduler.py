"""Continuous batching: one token budget per step shared by decodes and prefill chunks.

No phases: every sequence has num_computed_tokens and catches up to num_tokens. A decode is
a sequence one token behind; a prefill is one many tokens behind, served in chunks. The
scheduler returns plain data (SchedulerOutput) and never touches a tensor.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from quill.config import SchedulerConfig
from quill.engine.block_manager import BlockManager
from quill.engine.metrics import now
from quill.engine.sequence import Sequence, SequenceStatus


class RowKind(enum.Enum):
    """What one sequence's share of a step is. Decided once, by the scheduler (row_kind); the
    runner, the fused decode path, the sampler's row list and the step statistics read it."""

    DECODE = "decode"  # exactly one token, the last known one: samples (the fused decode path's row)
    VERIFY = "verify"  # the last known token and the proposed ones after it: a decode row each, each samples
    PREFILL_FINAL = "prefill_final"  # several tokens ending at the last known one: samples
    PREFILL_CHUNK = "prefill_chunk"  # tokens that stop short of the last known one: no sample

    @property
    def samples(self) -> bool:
        return self is not RowKind.PREFILL_CHUNK

    @property
    def fused(self) -> bool:
        """Rows of the batch-invariant decode path: each row's numbers never depend on its neighbours."""
        return self is RowKind.DECODE or self is RowKind.VERIFY


def row_kind(seq: Sequence, start: int, num_new_tokens: int) -> RowKind:
    """The one definition of a row's kind."""
    end = start + num_new_tokens
    if end < seq.num_tokens:
        return RowKind.PREFILL_CHUNK
    if end > seq.num_tokens:
        return RowKind.VERIFY  # runs past the known tokens, into seq.draft_token_ids
    if num_new_tokens == 1:
        return RowKind.DECODE
    return RowKind.PREFILL_FINAL


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens [start, start + num_new_tokens). A VERIFY row's
    tokens are the last known one and then seq.draft_token_ids[: num_new_tokens - 1]."""

    seq: Sequence
    start: int
    num_new_tokens: int
    kind: RowKind

    @classmethod
    def plan(cls, seq: Sequence, start: int, num_new_tokens: int) -> "ScheduledSeq":
        known = seq.num_tokens - start
        if not 0 < num_new_tokens <= known and not (known == 1 and num_new_tokens <= 1 + len(seq.draft_token_ids)):
            raise ValueError(f"cannot schedule {num_new_tokens} tokens from {start} of {seq!r} "
                             f"({len(seq.draft_token_ids)} proposed)")
        return cls(seq, start, num_new_tokens, row_kind(seq, start, num_new_tokens))

    @property
    def samples(self) -> bool:
        """After this chunk every known token has K/V, so the last row's logits pick the next token."""
        return self.kind.samples

    @property
    def is_decode(self) -> bool:
        """A decode-path row (DECODE or VERIFY)."""
        return self.kind.fused

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits pick a token: every row of a VERIFY, the last of other sampling kinds."""
        return self.num_new_tokens if self.kind is RowKind.VERIFY else int(self.samples)


@dataclass
class SchedulerOutput:
    """What to run this step."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_decode)

    @property
    def num_leading_decodes(self) -> int:
        """Decode-path items (DECODE, VERIFY) at the front of the batch (schedule() puts them first)."""
        count = 0
        for item in self.scheduled:
            if not item.kind.fused:
                break
            count += 1
        return count

    def without(self, seqs) -> None:
        """Drop these sequences' rows (they failed before the forward ran)."""
        gone = {s.seq_id for s in seqs}
        self.scheduled = [item for item in self.scheduled if item.seq.seq_id not in gone]

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)


class Scheduler:
    """Owns the waiting queue, the running list and the block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({config.max_num_seqs}) so every running sequence can decode each step"
            )
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # Decodes first, then running prefill chunks, so streams in flight keep their pace (and
        # the decode rows lead the batch, where the runner's batch-invariant decode path takes them).
        ordered = sorted(self.running, key=lambda s: row_kind(s, s.num_computed_tokens, 1) is not RowKind.DECODE)
        for seq in ordered:
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue
            if not self._allocate_or_preempt(seq, num_new, out):
                continue
            out.scheduled.append(ScheduledSeq.plan(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        self._add_drafts(out, budget)
        # Every decode row leads the batch, including one-token rows of sequences admitted just now
        # (a prompt whose prefix cache hit leaves one token): the runner's batch-invariant decode
        # path takes the leading decode rows, so a row's numbers never depend on its neighbours.
        out.scheduled.sort(key=lambda item: not item.kind.fused)
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Turn decode rows with proposed tokens into VERIFY rows, with what is left of the token
        budget once every running sequence and admission had theirs. A proposal that finds no
        blocks is dropped (speculation never preempts anyone)."""
        for k, item in enumerate(out.scheduled):
            seq = item.seq
            if budget <= 0:
                break
            if item.kind is not RowKind.DECODE or not seq.draft_token_ids:
                continue
            extra = min(len(seq.draft_token_ids), budget)
            if not self.block_manager.allocate_unused(seq, 1 + extra):
                continue
            out.scheduled[k] = ScheduledSeq.plan(seq, item.start, 1 + extra)
            budget -= extra

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Find blocks for seq, preempting the youngest other running sequences if needed."""
        scheduled_ids = {s.seq.seq_id for s in out.scheduled}
        while not self.block_manager.allocate(seq, num_new):
            victims = [s for s in self.running if s is not seq and s.seq_id not in scheduled_ids]
            victim = victims[-1] if victims else seq
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the K/V, keep the generated tokens, queue at the front."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._sibling_prefilling(seq):
                # n > 1: let the first completion write the prompt's blocks, then share them.
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_cached = self.block_manager.get_computed_blocks(seq.all_token_ids)
            seq.num_computed_tokens = num_cached
            num_new = min(seq.num_tokens - num_cached, budget)
            if not self.block_manager.allocate(seq, num_new, computed_blocks):
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if seq.status == SequenceStatus.WAITING:
                seq.num_cached_tokens = num_cached
                seq.metrics.cached_tokens = num_cached
                seq.metrics.first_scheduled_time = now()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq.plan(seq, num_cached, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _sibling_prefilling(self, seq: Sequence) -> bool:
        if seq.index == 0 or not self.block_manager.enable_prefix_caching or seq.status != SequenceStatus.WAITING:
            return False
        for other in self.running:
            if other.request_id == seq.request_id and other.num_computed_tokens < other.num_prompt_tokens:
                return True
        return any(o.request_id == seq.request_id and o.index < seq.index for o in self.waiting)

    def postprocess(self, out: SchedulerOutput) -> None:
        """Advance computed counts and publish newly full blocks to the prefix cache. A VERIFY row
        counts its known token only here; accept_draft adds each proposed token that was kept."""
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + (1 if item.kind is RowKind.VERIFY else item.num_new_tokens)
            self.block_manager.cache_blocks(seq, seq.num_computed_tokens)

    @staticmethod
    def accept_draft(seq: Sequence) -> None:
        """One proposed token of seq's VERIFY row was accepted (it is now an output token, and the
        row's next token follows it): the K/V the row wrote for it counts as computed. Called before
        that next token is appended, so the proposal is the sequence's one uncomputed token."""
        if seq.num_computed_tokens + 1 != seq.num_tokens:
            raise RuntimeError(f"an accepted proposal must be the one uncomputed token: {seq!r}")
        seq.num_computed_tokens += 1

    def settle_run(self, seq: Sequence) -> int:
        """After seq's VERIFY row and its accepted proposals (accept_draft): publish newly full blocks,
        and give back the blocks that only rejected proposals filled (their slots are rolled back; only
        accepted tokens' blocks are ever hashed). -> blocks released."""
        if seq.is_finished:  # finished inside the run: finish() cached what was computed and freed the rest
            return 0
        self.block_manager.cache_blocks(seq, seq.num_computed_tokens)
        return self.block_manager.trim(seq, seq.num_computed_tokens)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Set a finished status and release the blocks (full ones stay cached)."""
        self.block_manager.cache_blocks(seq, seq.num_computed_tokens)  # incl. a run's accepted proposals
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.metrics.finished_time = now()
