"""Property test (hypothesis) of the scheduler and the runner's row handling, without a model.

Random scheduler configurations and request mixes (prompt lengths, output lengths, n, arrival
steps, aborts) run through the real Scheduler, BlockManager and ModelRunner (a stand-in model
returns zeros) until every request ends. Invariants checked at every step:
- the token budget and the sequence limit hold; every row's kind is the one definition's;
- decode rows lead the batch (where the batch-invariant decode path takes them);
- the runner samples exactly one row per scheduled item whose kind samples;
- blocks cover every computed token; at the end no block is held and every request ended.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quill.config import ModelConfig, SchedulerConfig
from quill.engine.block_manager import BlockManager
from quill.engine.kv_cache import KVCache
from quill.engine.sampler import Sampler
from quill.engine.scheduler import RowKind, Scheduler, row_kind
from quill.engine.sequence import Sequence, SequenceStatus
from quill.sampling_params import SamplingParams

CFG = ModelConfig("llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=4, max_position_embeddings=4096)


class ZeroModel:
    """Stands in for the model: hidden states of zeros, logits that favour token (position % 31) + 1."""

    config = CFG
    layers: list = []

    def __call__(self, input_ids, positions, kv_layers, meta):
        return torch.zeros(len(input_ids), CFG.hidden_size)

    def compute_logits(self, hidden):
        logits = torch.zeros(hidden.shape[0], CFG.vocab_size)
        logits[:, 5] = 1.0
        return logits


class ZeroFused:
    """Stands in for the fused decode path: one zero row per decode row it is given."""

    def forward(self, input_ids, *rest):
        return torch.zeros(len(input_ids), CFG.hidden_size)


def make_runner(fused: bool, num_blocks: int, block_size: int, monkeypatch):
    from quill.engine import model_runner

    class NoFused:
        def __init__(self, *a, **k):
            self.available = False

    monkeypatch.setattr("quill.kernels.fused_decode.FusedDecoder", NoFused)
    runner = model_runner.ModelRunner(ZeroModel(), CFG, KVCache(CFG, num_blocks, block_size), Sampler(CFG.vocab_size, (0,)))
    runner.fused = ZeroFused() if fused else None
    return runner


request = st.tuples(
    st.integers(1, 40),  # prompt tokens
    st.integers(1, 12),  # max_tokens
    st.integers(1, 2),  # n
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 20)),  # abort at step
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(8, 96),
    max_num_seqs=st.integers(1, 8),
    extra_budget=st.integers(0, 40),
    caching=st.booleans(),
    fused=st.booleans(),
    requests=st.lists(request, min_size=1, max_size=10),
)
def test_scheduler_and_runner_invariants(block_size, num_blocks, max_num_seqs, extra_budget, caching, fused,
                                         requests, monkeypatch):
    budget = max_num_seqs + extra_budget  # budget == max_num_seqs is the configuration of issue 13's defect 2
    bm = BlockManager(num_blocks, block_size, caching)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs), bm)
    runner = make_runner(fused, num_blocks, block_size, monkeypatch)
    seqs: list[Sequence] = []
    pending = sorted(enumerate(requests), key=lambda r: r[1][3])
    step = 0
    while pending or sched.num_unfinished:
        while pending and pending[0][1][3] <= step:
            i, (prompt_len, max_tokens, n, _, abort_at) = pending.pop(0)
            if -(-(prompt_len + max_tokens) // block_size) > num_blocks:
                continue  # the engine's admission check refuses what can never fit
            params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)
            prompt = [(i * 7 + j) % 31 + 1 for j in range(prompt_len)]
            for k in range(n):
                seq = Sequence(f"r{i}", prompt, params, index=k, seq_id=len(seqs))
                seq.abort_at = abort_at
                seqs.append(seq)
                sched.add(seq)
        for seq in list(sched.running) + list(sched.waiting):
            if seq.abort_at is not None and step >= seq.abort_at:
                sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        out = sched.schedule()
        step += 1
        assert step < 5000, "no progress"
        if out.is_empty:
            assert not sched.waiting or sched.running, "stalled with nothing running"
            continue
        items = out.scheduled
        assert sum(i.num_new_tokens for i in items) <= budget
        assert len(sched.running) <= max_num_seqs
        assert len({i.seq.seq_id for i in items}) == len(items)
        kinds = [i.kind for i in items]
        for item in items:
            assert item.kind is row_kind(item.seq, item.start, item.num_new_tokens)
            assert item.start == item.seq.num_computed_tokens
            assert len(item.seq.block_table) * block_size >= item.start + item.num_new_tokens
        first_other = next((k for k, kind in enumerate(kinds) if kind is not RowKind.DECODE), len(kinds))
        assert all(kind is not RowKind.DECODE for kind in kinds[first_other:]), kinds
        result = runner.execute(out)
        assert not result.failed
        assert [s.seq_id for s, _, _ in result.sampled] == [i.seq.seq_id for i in items if i.samples]
        sched.postprocess(out)
        for seq, token, _ in result.sampled:
            seq.append_token(token, 0.0)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, SequenceStatus.FINISHED_LENGTH)
                runner.release(seq)
    assert all(s.is_finished for s in seqs)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks


@pytest.mark.parametrize("fused", [True, False])
def test_decode_beside_a_one_token_chunk_with_budget_equal_to_max_seqs(fused, monkeypatch):
    """Issue 13's defect 2, exactly: SchedulerConfig(2, 2), one sequence decoding and one whose
    prompt gets a 1-token, non-final chunk. Two one-token rows, but only one samples."""
    bm = BlockManager(32, 4, False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2, max_num_seqs=2), bm)
    runner = make_runner(fused, 32, 4, monkeypatch)
    a = Sequence("a", [1, 2], SamplingParams(temperature=0, max_tokens=5), seq_id=0)
    sched.add(a)
    out = sched.schedule()
    sched.postprocess(out)
    a.append_token(runner.execute(out).sampled[0][1], 0.0)
    b = Sequence("b", [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=5), seq_id=1)
    sched.add(b)
    out = sched.schedule()
    assert [(i.kind, i.num_new_tokens) for i in out.scheduled] == [(RowKind.DECODE, 1), (RowKind.PREFILL_CHUNK, 1)]
    result = runner.execute(out)
    assert [s.seq_id for s, _, _ in result.sampled] == [0] and not result.failed
