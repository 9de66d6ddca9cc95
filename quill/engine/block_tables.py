"""Per-sequence block tables as int32 arrays, kept between steps so a decode step's host work is O(batch).

`Sequence.block_table` is a Python list the block manager owns: it only grows while the sequence
runs (`extend`), and is replaced by a new empty list when the sequence is freed or preempted. The
array mirror of a sequence is therefore extended in place by the new entries only; a different
list object, a shorter list, or a changed entry (cheap checks) rebuilds it from scratch.
"""

from __future__ import annotations

import numpy as np

from quill.engine.sequence import Sequence


class BlockTableArrays:
    def __init__(self):
        # seq_id -> (the list mirrored, array with spare capacity, entries valid)
        self._rows: dict[int, tuple[list[int], np.ndarray, int]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, seq: Sequence) -> np.ndarray:
        """seq.block_table as an int32 array (a view: valid until the next get for this sequence)."""
        table = seq.block_table
        n = len(table)
        entry = self._rows.get(seq.seq_id)
        if entry is not None:
            src, arr, count = entry
            if src is table and count <= n and (count == 0 or (arr[0] == table[0] and arr[count - 1] == table[count - 1])):
                if count < n:
                    if n > len(arr):
                        grown = np.empty(max(n, 2 * len(arr)), dtype=np.int32)
                        grown[:count] = arr[:count]
                        arr = grown
                    arr[count:n] = table[count:n]
                    self._rows[seq.seq_id] = (table, arr, n)
                return arr[:n]
        arr = np.empty(max(n, 16), dtype=np.int32)
        arr[:n] = table
        self._rows[seq.seq_id] = (table, arr, n)
        return arr[:n]

    def release(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)


def stack_tables(tables: list[np.ndarray]) -> np.ndarray:
    """One row's table per decode row -> (rows, longest) int32, zero past each row's own blocks
    (entries past a row's context are never read)."""
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
    for row, t in zip(out, tables):
        row[: len(t)] = t
    return out
