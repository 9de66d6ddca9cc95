"""Continuous batching: one token budget per step shared by decodes and prefill chunks.

No phases: every sequence has num_computed_tokens and catches up to num_tokens. A decode is
a sequence one token behind; a prefill is one many tokens behind, served in chunks. The
scheduler returns plain data (SchedulerOutput) and never touches a tensor.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from quill.config import SchedulerConfig
from quill.engine.block_manager import BlockManager
from quill.engine.metrics import now
from quill.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """After this chunk every known token has K/V, so the last row's logits pick the next token."""
        return self.start + self.num_new_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.seq.num_output_tokens > 0 and self.samples


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
        # Decodes first, then running prefill chunks, so streams in flight keep their pace.
        ordered = sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1)
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
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            budget -= num_new
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        return out

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
            out.scheduled.append(ScheduledSeq(seq, num_cached, num_new))
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
        """Advance computed counts and publish newly full blocks to the prefix cache."""
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed_tokens = item.start + item.num_new_tokens
            self.block_manager.cache_blocks(seq, seq.num_computed_tokens)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Set a finished status and release the blocks (full ones stay cached)."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.metrics.finished_time = now()
