"""Check that the decode path agrees with the prefill path, through the engine's real paged cache."""

from __future__ import annotations

import torch

from quill.engine.scheduler import ScheduledSeq
from quill.engine.sequence import Sequence
from quill.kernels.options import use as use_kernel_options
from quill.sampling_params import SamplingParams


def chunk_logits(engine, seq: Sequence, start: int, n: int) -> torch.Tensor:
    """Run tokens [start, start+n) of seq; -> (n, V) logits for every computed row."""
    runner = engine.runner
    if not engine.block_manager.allocate(seq, n):
        raise RuntimeError("not enough KV blocks for the consistency check")
    with use_kernel_options(engine.kernel_options):  # as the engine's step binds them
        hidden, _ = runner.forward([ScheduledSeq.plan(seq, start, n)])  # (n, H): decodes take the fused path
        seq.num_computed_tokens = start + n
        return runner.model.compute_logits(hidden)


def prefill_vs_decode(engine, token_ids: list[int], num_prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits for positions num_prefill-1 .. end from one long prefill, and from a short prefill
    plus one-token decode steps. -> (a, b), each (len - num_prefill + 1, V)."""
    if not 1 <= num_prefill < len(token_ids):
        raise ValueError(f"num_prefill must be in [1, {len(token_ids) - 1}], got {num_prefill}")
    bm = engine.block_manager
    full = Sequence("consistency-full", token_ids, SamplingParams())
    step = Sequence("consistency-step", token_ids[:num_prefill], SamplingParams())
    try:
        a = chunk_logits(engine, full, 0, len(token_ids))[num_prefill - 1 :]
        rows = [chunk_logits(engine, step, 0, num_prefill)[-1:]]
        for pos in range(num_prefill, len(token_ids)):
            step.append_token(token_ids[pos], 0.0)  # as decode grows a sequence: each row is a decode row
            rows.append(chunk_logits(engine, step, pos, 1))
        return a, torch.cat(rows)
    finally:
        bm.free(full)
        bm.free(step)
