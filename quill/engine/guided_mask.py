"""MaskWorker: allowed-token masks computed on a worker thread while the forward runs."""

from __future__ import annotations

import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch
from llguidance.numpy import fill_next_token_bitmask_par

if TYPE_CHECKING:
    from quill.engine.guided import GuidedMatcher

# llguidance writes bit k of 32-bit word w for token 32*w + k; reading the words as bytes
# with little-endian bit order gives token order only on a little-endian host.
assert sys.byteorder == "little", "guided decoding assumes a little-endian host"


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """(R, ceil(V/32)) int32 packed masks → (R, V) bool, True where a token is allowed."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].view(np.bool_)


class _Result:
    """One step's masks as flat indices into a contiguous (B, V) logits tensor.

    Rows with few allowed tokens (JSON structure) list what to keep, rows with few
    forbidden ones (free string content) list what to ban, so apply() touches only
    those elements plus a memset, instead of scanning whole rows with a bool mask.
    """

    def __init__(self, rows: list[int], allowed: np.ndarray, vocab_size: int):
        # allowed: (R, V) bool
        row_ids = np.asarray(rows, dtype=np.int64)
        keep = np.count_nonzero(allowed, axis=1) <= vocab_size // 2
        self.rows = rows
        self.keep_rows = row_ids[keep].tolist()
        self.keep_index = torch.from_numpy(_flat_index(row_ids[keep], allowed[keep], vocab_size))
        self.ban_index = torch.from_numpy(_flat_index(row_ids[~keep], ~allowed[~keep], vocab_size))


def _flat_index(row_ids: np.ndarray, selected: np.ndarray, vocab_size: int) -> np.ndarray:
    """(N,) int64 positions row * V + token of the True entries of selected (len(row_ids), V)."""
    local = np.flatnonzero(selected)
    return row_ids[local // vocab_size] * vocab_size + local % vocab_size


def _apply_result(logits: torch.Tensor, result: _Result) -> None:
    """logits: (B, V) contiguous; -inf everywhere result forbids."""
    flat = logits.view(-1)
    if result.ban_index.numel():
        flat.index_fill_(0, result.ban_index.to(logits.device, non_blocking=True), float("-inf"))
    if result.keep_rows:
        keep_index = result.keep_index.to(logits.device, non_blocking=True)
        kept = flat.index_select(0, keep_index)
        for row in result.keep_rows:
            logits[row].fill_(float("-inf"))
        flat.index_copy_(0, keep_index, kept)


class MaskWorker:
    """Fills next-token bitmasks for constrained rows off the critical path.

    submit() starts the fill on a background thread and returns; llguidance drops the GIL
    while it computes, so the model forward proceeds in parallel. apply() waits for it and
    writes -inf into the logits of the submitted rows only; other rows are never touched.
    The engine must not call GuidedMatcher.accept between submit() and apply().
    """

    def __init__(self, vocab_size: int, num_threads: int | None = None):
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        # llguidance's own pool spreads a batch's matchers over cores; ours only hands off.
        threads = num_threads or max(1, min(4, (os.cpu_count() or 2) - 1))
        self._executor = llguidance.LLExecutor(threads)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quill-guided-mask")
        self._bitmask = np.full((8, self._words), -1, dtype=np.int32)  # grown on demand
        self._future: Future[_Result] | None = None

    def submit(self, matchers: list[tuple[int, GuidedMatcher]]) -> None:
        """Start computing masks for (logits row, matcher) pairs of this step; returns at once."""
        self.discard()  # a job left over from a failed step must finish before matchers move
        if not matchers:
            return
        rows = [int(row) for row, _ in matchers]
        if len(set(rows)) != len(rows) or min(rows) < 0:
            raise ValueError(f"submit: rows must be distinct non-negative indices, got {rows}")
        for _, matcher in matchers:
            if matcher.vocab_size != self.vocab_size:
                raise ValueError(f"submit: matcher vocab_size {matcher.vocab_size} != worker's {self.vocab_size}")
        if len(rows) > self._bitmask.shape[0]:
            self._bitmask = np.full((2 * len(rows), self._words), -1, dtype=np.int32)
        pairs = [(matcher.ll_matcher, slot) for slot, (_, matcher) in enumerate(matchers)]
        self._future = self._pool.submit(self._compute, rows, pairs)

    def _compute(self, rows: list[int], pairs: list) -> _Result:
        bitmask = self._bitmask[: len(rows)]  # (R, W) int32, contiguous
        fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        return _Result(rows, unpack_bitmask(bitmask, self.vocab_size), self.vocab_size)

    def apply(self, logits: torch.Tensor) -> None:
        """Wait for this step's masks; set forbidden tokens of the submitted rows to -inf in place.

        logits: (B, V) float. No-op when nothing was submitted.
        """
        future, self._future = self._future, None
        if future is None:
            return
        result = future.result()  # re-raises a worker failure here, on the engine thread
        if logits.dim() != 2 or logits.shape[1] != self.vocab_size:
            raise ValueError(f"apply: logits must be (B, {self.vocab_size}), got {tuple(logits.shape)}")
        if max(result.rows) >= logits.shape[0]:
            raise ValueError(f"apply: row {max(result.rows)} is outside a batch of {logits.shape[0]}")
        if logits.is_contiguous():
            _apply_result(logits, result)
        else:  # rare (a strided view): mask a compact copy, then write it back
            compact = logits.contiguous()
            _apply_result(compact, result)
            logits.copy_(compact)

    def discard(self) -> None:
        """Wait for and drop an in-flight job (e.g. after a failed forward)."""
        future, self._future = self._future, None
        if future is not None:
            future.exception()  # waits; the error, if any, belonged to the abandoned step

    def close(self) -> None:
        """Finish any job and stop the worker thread."""
        self.discard()
        self._pool.shutdown(wait=True)
