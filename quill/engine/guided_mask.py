"""MaskWorker: allowed-token masks computed on a worker thread while the forward runs."""

from __future__ import annotations

import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

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

    def __init__(self, rows: list[int], allowed: np.ndarray, vocab_size: int, failed: dict[int, Exception] | None = None):
        # allowed: (R, V) bool; failed: logits row -> why its mask could not be computed
        self.failed = dict(failed or {})
        if self.failed:  # a failed row's mask is not applied; the engine fails that request alone
            good = [k for k, row in enumerate(rows) if row not in self.failed]
            rows, allowed = [rows[k] for k in good], allowed[good]
        row_ids = np.asarray(rows, dtype=np.int64)
        keep = np.count_nonzero(allowed, axis=1) <= vocab_size // 2
        self.rows = rows
        self.vocab_size = vocab_size
        self.keep_rows = row_ids[keep].tolist()
        self.keep_index = torch.from_numpy(_flat_index(row_ids[keep], allowed[keep], vocab_size))
        self.ban_index = torch.from_numpy(_flat_index(row_ids[~keep], ~allowed[~keep], vocab_size))


def _flat_index(row_ids: np.ndarray, selected: np.ndarray, vocab_size: int) -> np.ndarray:
    """(N,) int64 positions row * V + token of the True entries of selected (len(row_ids), V)."""
    local = np.flatnonzero(selected)
    return row_ids[local // vocab_size] * vocab_size + local % vocab_size


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def _apply_result(logits: torch.Tensor, result: _Result) -> None:
    """logits: (B, V) contiguous; -inf everywhere result forbids."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        # numpy stays on this thread; a torch op over a whole row enters an OpenMP region,
        # which can stall for milliseconds when the forward's threads hold the cores.
        flat = logits.detach().numpy().reshape(-1)
        flat[result.ban_index.numpy()] = -np.inf
        if result.keep_rows:
            keep_index = result.keep_index.numpy()
            kept = flat[keep_index]
            logits.detach().numpy()[result.keep_rows] = -np.inf
            flat[keep_index] = kept
        return
    flat = logits.view(-1)
    if result.ban_index.numel():
        flat.index_fill_(0, result.ban_index.to(logits.device, non_blocking=True), float("-inf"))
    if result.keep_rows:
        keep_index = result.keep_index.to(logits.device, non_blocking=True)
        kept = flat.index_select(0, keep_index)
        logits[result.keep_rows] = float("-inf")
        flat.index_copy_(0, keep_index, kept)


def _default_threads() -> int:
    """Parallel fills only where cores are plentiful enough to spare some from the forward."""
    cores = os.cpu_count() or 1
    return 1 if cores < 16 else min(8, cores // 8)


class MaskWorker:
    """Fills next-token bitmasks for constrained rows off the critical path.

    submit() starts the fill on a background thread and returns; llguidance drops the GIL
    while it computes, so the model forward proceeds in parallel. apply() waits for it and
    writes -inf into the logits of the submitted rows only; other rows are never touched.
    The engine must not call GuidedMatcher.accept between submit() and apply().

    matcher_for (optional) maps a sequence to its GuidedMatcher or None, so submit() may
    also take this step's sampled sequences in logits-row order.
    """

    def __init__(self, matcher_for: Callable[[Any], GuidedMatcher | None] | None = None, *, num_threads: int | None = None):
        self._matcher_for = matcher_for
        # By default the one worker thread fills the masks in turn: a fill takes ~10 µs, and
        # llguidance's parallel pool (num_threads > 1) adds threads that fight the forward's
        # for cores; it pays off only for big constrained batches on many cores.
        threads = num_threads if num_threads is not None else _default_threads()
        self._executor = llguidance.LLExecutor(threads) if threads > 1 else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quill-guided-mask")
        self._bitmask = np.empty((0, 0), dtype=np.int32)  # (rows, words), grown on demand
        self._future: Future[_Result] | None = None

    def submit(self, items: list) -> None:
        """Start this step's masks; returns at once.

        items: (logits row, GuidedMatcher) pairs, or sequences in logits-row order (needs matcher_for).
        A sequence on several consecutive rows is a speculative run: row j gets the mask after the
        sequence's first j proposed tokens (seq.draft_token_ids), and the matcher is rolled back
        before apply() returns. Rows after a proposed token the grammar forbids get no mask: the
        row before cannot pick that token, so the run never reaches them.
        """
        self.discard()  # a job left over from a failed step must finish before matchers move
        runs = self._runs(items)
        if not runs:
            return
        rows = [row for run_rows, _, _ in runs for row in run_rows]
        if len(set(rows)) != len(rows) or min(rows) < 0:
            raise ValueError(f"submit: rows must be distinct non-negative indices, got {rows}")
        vocab_size = runs[0][1].vocab_size
        if any(matcher.vocab_size != vocab_size for _, matcher, _ in runs):
            raise ValueError(f"submit: matchers disagree on vocab_size: {sorted({m.vocab_size for _, m, _ in runs})}")
        words = (vocab_size + 31) // 32
        if len(rows) > self._bitmask.shape[0] or words != self._bitmask.shape[1]:
            self._bitmask = np.empty((max(8, 2 * len(rows)), words), dtype=np.int32)
        self._future = self._pool.submit(self._compute, runs, vocab_size)

    def _runs(self, items: list) -> list[tuple[list[int], GuidedMatcher, list[int]]]:
        """-> (rows, matcher, proposed tokens along the rows) per constrained sequence."""
        if not items or isinstance(items[0], tuple):
            return [([int(row)], matcher, []) for row, matcher in items]
        if self._matcher_for is None:
            raise TypeError("submit: pass (row, matcher) pairs, or build MaskWorker(matcher_for) to pass sequences")
        runs, row = [], 0
        while row < len(items):
            seq, end = items[row], row + 1
            while end < len(items) and items[end] is seq:
                end += 1
            matcher = self._matcher_for(seq)
            if matcher is not None:
                drafts = getattr(seq, "draft_token_ids", ())  # any key matcher_for knows; a Sequence may carry proposals
                runs.append((list(range(row, end)), matcher, list(drafts[: end - row - 1])))
            row = end
        return runs

    def _compute(self, runs: list, vocab_size: int) -> _Result:
        failed: dict[int, Exception] = {}
        singles = [(matcher.ll_matcher, k) for k, (rows, matcher, _) in enumerate(runs) if len(rows) == 1]
        if self._executor is not None and len(singles) == len(runs):
            try:
                fill_next_token_bitmask_par(self._executor, singles, self._bitmask[: len(runs)])
                rows = [rows[0] for rows, _, _ in runs]
                return _Result(rows, unpack_bitmask(self._bitmask[: len(rows)], vocab_size), vocab_size)
            except Exception:  # noqa: BLE001 - find the failing rows one by one below
                pass
        filled: list[int] = []  # logits rows with a mask, in bitmask-slot order
        for run_rows, matcher, drafts in runs:  # each llguidance call drops the GIL while it computes
            ll, consumed, j = matcher.ll_matcher, 0, 0
            try:
                if ll.is_error():
                    raise ValueError(f"the grammar matcher is in an error state: {ll.get_error()}")
                for j, row in enumerate(run_rows):
                    slot = self._bitmask[len(filled)]
                    ll.unsafe_compute_mask_ptr(slot.ctypes.data, slot.nbytes)
                    filled.append(row)
                    if j == len(drafts):
                        break
                    token = drafts[j]
                    if not (int(slot[token >> 5]) >> (token & 31)) & 1 or not ll.consume_token(token):
                        break  # the grammar forbids it: row j cannot pick it, later rows are never reached
                    consumed += 1
            except Exception as exc:  # noqa: BLE001 - that row fails; its sequence fails if the run reaches it
                failed[run_rows[j]] = exc
            finally:
                if consumed:
                    ll.rollback(consumed)
        return _Result(filled, unpack_bitmask(self._bitmask[: len(filled)], vocab_size), vocab_size, failed)

    def has_matcher(self, seq) -> bool:
        """Whether `seq` is constrained (needs the matcher_for given at construction)."""
        return self._matcher_for is not None and self._matcher_for(seq) is not None

    def apply(self, logits: torch.Tensor, _sequences: list | None = None) -> dict[int, Exception]:
        """Wait for this step's masks; set forbidden tokens of the submitted rows to -inf in place.

        logits: (B, V') float with V' >= the matchers' vocab_size (ids beyond it are
        forbidden on constrained rows). The rows are those given to submit(); a second
        argument (the sequences again) is accepted and ignored. No-op when nothing was submitted.
        Returns the rows whose mask could not be computed (row -> error); their logits are left
        as they were, and the caller fails those rows alone.
        """
        future, self._future = self._future, None
        if future is None:
            return {}
        result = future.result()  # a failure outside any one row re-raises here, on the engine thread
        if result.rows:
            # Logits made under torch.inference_mode() may only be written to inside it.
            with torch.inference_mode(logits.is_inference()):
                self._write(logits, result)
        return result.failed

    @staticmethod
    def _write(logits: torch.Tensor, result: _Result) -> None:
        vocab_size = result.vocab_size
        if logits.dim() != 2 or logits.shape[1] < vocab_size:
            raise ValueError(f"apply: logits must be (B, >= {vocab_size}), got {tuple(logits.shape)}")
        if max(result.rows) >= logits.shape[0]:
            raise ValueError(f"apply: row {max(result.rows)} is outside a batch of {logits.shape[0]}")
        if logits.shape[1] == vocab_size and logits.is_contiguous():
            _apply_result(logits, result)
            return
        # Rare: padded or strided logits. Mask a compact copy of the vocab columns, write it back.
        compact = logits[:, :vocab_size].contiguous()
        _apply_result(compact, result)
        logits[:, :vocab_size].copy_(compact)
        for row in result.rows:
            logits[row, vocab_size:] = float("-inf")

    def discard(self) -> None:
        """Wait for and drop an in-flight job (e.g. after a failed forward)."""
        future, self._future = self._future, None
        if future is not None:
            future.exception()  # waits; the error, if any, belonged to the abandoned step

    def close(self) -> None:
        """Finish any job and stop the worker thread."""
        self.discard()
        self._pool.shutdown(wait=True)
