"""A draft model's guesses for the scheduler's VERIFY rows (speculative method "draft").

The Speculator (no tensors) decides how many tokens each sequence proposes this step, the scheduler
gives those VERIFY rows their blocks, and then DraftRunner.guess fills in the tokens: k greedy steps
of a draft model over the same block tables, each step one decode row per sequence still guessing,
through the fused decode kernel. Guesses only decide how many positions one target pass covers;
the target's own rows and sampler decide every token (speculative.py says why outputs never change).

Two kinds of draft:
- Self-speculation (draft_layers): a subset of the target's own layers, then its final norm and LM
  head. It reads and writes the target's KV cache. At positions the target has computed it reads
  the target's K/V (for a leading run of layers exactly what it would compute itself). It writes
  only at the positions the VERIFY row is about to compute, and the target's pass overwrites those
  before any of its rows attends. So it needs no weights, no memory and no catch-up of its own.
- A separate model (draft_model) with the target's tokenizer and its own KV cache, indexed by the
  same block ids (the engine sizes one block pool for both models, so every block table serves
  both). It tracks how far it has computed each sequence and catches up before guessing: a short
  gap as extra decode rows of the first step, a long one (a new prompt) as a prefill on the torch path.

A guess is never an id outside the target's sampler vocabulary, and never a stop token of a
constrained sequence (a grammar's matcher is never fed one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from quill.engine.block_tables import BlockTableArrays, stack_tables
from quill.engine.scheduler import RowKind, ScheduledSeq
from quill.engine.sequence import Sequence

CATCH_UP_ROWS = 16  # a gap of up to this many tokens is caught up as decode rows, a longer one by a prefill
PREFILL_CHUNK = 512  # tokens per catch-up prefill call


class DraftRunner:
    """Greedy guesses of a draft for VERIFY rows. `decoder` is a FusedDecoder over the draft's layers
    and KV cache; `layers` the subset of them to run (self-speculation) or None (all); `prefill` the
    draft's own ModelRunner when it has its own KV cache (catch-up prefills), None when it shares the
    target's; `tables` the target runner's block-table arrays (the same tables serve both)."""

    def __init__(self, model, decoder, tables: BlockTableArrays, block_size: int, vocab_size: int,
                 layers: tuple[int, ...] | None = None, prefill=None):
        self.model, self.decoder, self.tables = model, decoder, tables
        self.block_size, self.vocab_size = block_size, vocab_size
        self.layers = None if layers is None else list(layers)
        self.prefill = prefill
        # own KV only: seq_id -> (the block table list it was computed into, positions with draft K/V)
        self._computed: dict[int, tuple[list[int], int]] = {}
        self.step_seconds: list[tuple[int, float]] = []  # the last guess(): (sequences, seconds) per draft step

    @property
    def own_kv(self) -> bool:
        return self.prefill is not None

    def release(self, seq: Sequence) -> None:
        self._computed.pop(seq.seq_id, None)

    def _valid(self, seq: Sequence) -> int:
        """Leading positions of seq whose draft K/V is in place. The block manager hands a freed or
        preempted sequence a new table list, so a different list means nothing is."""
        table, count = self._computed.get(seq.seq_id, (None, 0))
        return min(count, seq.num_computed_tokens) if table is seq.block_table else 0

    @torch.inference_mode()
    def guess(self, items: list[ScheduledSeq], banned: Callable[[Sequence], tuple[int, ...]]) -> None:
        """Set seq.draft_token_ids of each VERIFY item to its num_new_tokens - 1 guesses.
        banned(seq): token ids seq must not be offered (a constrained sequence's stop tokens)."""
        self.step_seconds = []
        verify = [item for item in items if item.kind is RowKind.VERIFY]
        if not verify:
            return
        want = {item.seq.seq_id: item.num_new_tokens - 1 for item in verify}
        guesses: dict[int, list[int]] = {item.seq.seq_id: [] for item in verify}
        extra: dict[int, int] = {}  # own KV: catch-up rows before a sequence's first guessing row
        if self.own_kv:
            extra = self._catch_up(verify)
        for j in range(max(want.values())):
            t0 = time.perf_counter()
            ids, positions, tables, picks, seqs = [], [], [], [], []
            for item in verify:
                seq = item.seq
                if want[seq.seq_id] <= j:
                    continue
                table = self.tables.get(seq)
                n = item.start  # the last known token's position
                first = n - extra.get(seq.seq_id, 0) if j == 0 else n + j
                for p in range(first, n + j + 1):
                    ids.append(seq.token_ids_slice(p, p + 1)[0] if p <= n else guesses[seq.seq_id][p - n - 1])
                    positions.append(p)
                    tables.append(table)
                picks.append(len(ids) - 1)
                seqs.append(seq)
            hidden = self.decoder.forward(*_rows(ids, positions, tables), self.block_size, max(positions) + 1,
                                          layers=self.layers)
            logits = self.model.compute_logits(hidden[picks])[:, : self.vocab_size]
            for r, seq in enumerate(seqs):
                ban = banned(seq)
                if ban:
                    logits[r, [t for t in ban if t < logits.shape[1]]] = float("-inf")
            for seq, token in zip(seqs, logits.argmax(dim=-1).tolist()):
                guesses[seq.seq_id].append(int(token))
            self.step_seconds.append((len(seqs), time.perf_counter() - t0))  # by sequences, as the policy asks
        for item in verify:
            seq = item.seq
            seq.draft_token_ids = guesses[seq.seq_id]
            if self.own_kv:  # written: positions up to the last guess's input (the last known token, then guesses)
                self._computed[seq.seq_id] = (seq.block_table, item.start + want[seq.seq_id])

    def _catch_up(self, verify: list[ScheduledSeq]) -> dict[int, int]:
        """Give the draft's cache every position before each sequence's last known token: a long gap
        by prefill chunks now; -> the short gaps, run as extra rows of the first guessing step."""
        short: dict[int, int] = {}
        for item in verify:
            seq, n = item.seq, item.start
            done = self._valid(seq)
            if n - done > CATCH_UP_ROWS:
                while done < n:
                    count = min(PREFILL_CHUNK, n - done)
                    input_ids, positions, meta, _ = self.prefill.prepare([ScheduledSeq.plan(seq, done, count)])
                    self.prefill.model(input_ids, positions, self.prefill.kv_cache.layers, meta)
                    done += count
                    self._computed[seq.seq_id] = (seq.block_table, done)  # kept even if a later part fails
            if n > done:
                short[seq.seq_id] = n - done
        return short


def _rows(ids: list[int], positions: list[int], tables: list[np.ndarray]):
    """Decode rows -> FusedDecoder.forward's ids, positions, (R, max_blocks) int32 tables, context lengths."""
    return (torch.tensor(ids), torch.tensor(positions, dtype=torch.long), torch.from_numpy(stack_tables(tables)),
            torch.tensor([p + 1 for p in positions], dtype=torch.long))
