"""Sequence: one completion's tokens, progress through the KV cache, and status."""

from __future__ import annotations

import enum
import itertools

from quill.engine.metrics import RequestMetrics
from quill.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

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
}


class Sequence:
    """One completion (a request with n > 1 has n Sequences sharing request_id)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        arrival_time: float | None = None,
    ):
        self.seq_id = next(_seq_counter)
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

    # Read-only views keep stray appends out; append_token is the one writer.
    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._output_token_ids)

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
        n = len(self.prompt_token_ids)
        if end <= n:
            return list(self.prompt_token_ids[start:end])
        return self.all_token_ids[start:end]

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
