"""Sequence: one completion's tokens, progress through the KV cache, and status."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence as SequenceABC

from quill.engine.metrics import RequestMetrics
from quill.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # this request's own work failed (the others in its batch carried on)

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


class PrefixView(SequenceABC):
    """The first `length` items of a list that only grows: a snapshot without a copy.

    Outputs carry these while a request runs, so building one per step costs O(1), not
    O(tokens so far); list(view) copies when a caller needs to keep or mutate it."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list):
        self._items = items
        self._length = len(items)  # the snapshot: later appends to items are not seen

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step == 1:
                return self._items[start:stop]
            return [self._items[i] for i in range(start, stop, step)]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError("PrefixView index out of range")
        return self._items[index]

    def __iter__(self):
        return itertools.islice(self._items, self._length)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, PrefixView)):
            return len(other) == self._length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


class Sequence:
    """One completion (a request with n > 1 has n Sequences sharing request_id)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival_time: float | None = None,
        seq_id: int | None = None,
    ):
        # The engine numbers its sequences itself (no process-wide counter); a sequence built by
        # hand (tests, consistency checks) is told apart by its object identity while it lives.
        self.seq_id = id(self) if seq_id is None else seq_id
        self.request_id = request_id
        self.index = index  # choice index within the request
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self._output_token_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.block_table: list[int] = []
        self.stop_reason: str | int | None = None  # the stop string / token id that fired
        self.metrics = RequestMetrics(prompt_tokens=len(self.prompt_token_ids))
        if arrival_time is not None:
            self.metrics.arrival_time = arrival_time
        self.output_logprobs: list[dict] = []  # per output token, when params.logprobs is set
        self.num_preemptions = 0
        # Tokens proposed for the next step (speculative decoding): set by the Speculator before a step,
        # read by the scheduler (a VERIFY row) and the runner, cleared after the step. Never output
        # unless verified.
        self.draft_token_ids: list[int] = []

    # append_token is the one writer; readers get a view, so reading is O(1) per step.
    @property
    def output_token_ids(self) -> PrefixView:
        return PrefixView(self._output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return list(self.prompt_token_ids) + self._output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without building the whole list: O(end - start)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return list(self.prompt_token_ids[start:end])
        head = list(self.prompt_token_ids[start:n]) if start < n else []
        return head + self._output_token_ids[max(start - n, 0) : end - n]

    @property
    def last_token_id(self) -> int:
        return self._output_token_ids[-1] if self._output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, when: float) -> None:
        self._output_token_ids.append(int(token_id))
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = when
        self.metrics.token_times.append(when)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
