"""Scheduler units without a model: token budget, chunked prefill, preemption and resume, sibling sharing."""

from __future__ import annotations

import pytest

from quill.config import SchedulerConfig
from quill.engine.block_manager import BlockManager
from quill.engine.scheduler import Scheduler
from quill.engine.sequence import Sequence, SequenceStatus
from quill.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), bm), bm


def seq(rid, n, index=0, params=None):
    return Sequence(rid, list(range(100 + hash(rid) % 50, 100 + hash(rid) % 50 + n)), params or SamplingParams(), index=index)


def run_step(sched, token=7):
    """Schedule, pretend the model ran, append a token for every sampling sequence."""
    out = sched.schedule()
    samplers = [item.seq for item in out.scheduled if item.samples]
    sched.postprocess(out)
    for s in samplers:
        s.append_token(token, 0.0)
    return out


def test_budget_caps_tokens_and_chunks_a_long_prompt():
    sched, _ = make(budget=16)
    long = seq("long", 40)
    sched.add(long)
    sizes = []
    while long.num_output_tokens == 0:
        out = run_step(sched)
        sizes.append(sum(i.num_new_tokens for i in out.scheduled))
    assert sizes == [16, 16, 8]  # 40 prompt tokens in budget-sized chunks, last chunk samples
    assert long.num_computed_tokens == 40


def test_decodes_first_then_prefill_fills_the_rest():
    sched, _ = make(budget=10)
    a, b = seq("a", 3), seq("b", 3)
    for s in (a, b):
        sched.add(s)
    run_step(sched)  # both prompts (6 tokens) in one step
    c = seq("c", 30)
    sched.add(c)
    out = run_step(sched)
    kinds = [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled]
    assert kinds == [("a", 1), ("b", 1), ("c", 8)]  # decodes served first, the chunk takes the rest
    for _ in range(3):
        out = run_step(sched)
        assert {i.seq.request_id for i in out.scheduled if i.num_new_tokens == 1} >= {"a", "b"}


def test_max_num_seqs_caps_running():
    sched, _ = make(budget=64, max_seqs=2)
    for i in range(4):
        sched.add(seq(f"r{i}", 3))
    run_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_preemption_of_youngest_and_resume_keeps_tokens():
    sched, bm = make(num_blocks=4, block_size=4, budget=32)  # 16 token slots
    old, young = seq("old", 6), seq("young", 6)
    sched.add(old)
    run_step(sched)
    sched.add(young)
    run_step(sched)
    for _ in range(3):
        out = run_step(sched)
        if out.preempted:
            break
    assert out.preempted == [young] and young.status == SequenceStatus.PREEMPTED
    assert young.num_computed_tokens == 0 and young.block_table == []
    generated = young.output_token_ids
    assert sched.waiting[0] is young  # front of the queue
    sched.finish(old, SequenceStatus.FINISHED_STOPPED)
    out = sched.schedule()
    item = next(i for i in out.scheduled if i.seq is young)
    # K/V rebuilt for prompt + generated tokens (minus what the prefix cache still holds), then it samples
    assert item.start == young.num_cached_tokens or item.start % 4 == 0
    assert item.start + item.num_new_tokens == young.num_tokens and item.samples
    assert young.output_token_ids == generated
    assert young.status == SequenceStatus.RUNNING


def test_preempts_itself_when_alone_and_out_of_blocks():
    sched, bm = make(num_blocks=2, block_size=4, budget=32)
    s = seq("s", 7)
    sched.add(s)
    run_step(sched)  # 7 tokens in 2 blocks
    run_step(sched)  # 8th token fills the second block
    out = sched.schedule()  # the 9th needs a third block that does not exist
    assert out.preempted == [s] and not out.scheduled


def test_n_siblings_wait_for_the_first_prefill_then_share_blocks():
    sched, bm = make(budget=64, block_size=4)
    params = SamplingParams(n=2)
    first, second = seq("r", 10, 0, params), seq("r", 10, 1, params)
    first.prompt_token_ids = second.prompt_token_ids
    sched.add(first)
    sched.add(second)
    out = run_step(sched)
    assert [i.seq for i in out.scheduled] == [first]
    out = run_step(sched)
    item = next(i for i in out.scheduled if i.seq is second)
    assert second.num_cached_tokens == 8 and item.start == 8  # two full shared blocks
    assert second.block_table[:2] == first.block_table[:2]


def test_finish_frees_and_nothing_leaks():
    sched, bm = make()
    seqs = [seq(f"r{i}", 5 + i) for i in range(5)]
    for s in seqs:
        sched.add(s)
    for _ in range(4):
        run_step(sched)
    for s in seqs:
        sched.finish(s, SequenceStatus.FINISHED_ABORTED)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert not sched.running and not sched.waiting


def test_config_rejects_budget_below_seq_cap():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(budget=4, max_seqs=8)
