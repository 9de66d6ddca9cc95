"""Speculative decoding: VERIFY rows, prompt lookup, the cost model, and outputs identical to decoding without it."""

from __future__ import annotations

import json

import pytest
import torch

from quill.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, parse_draft_layers
from quill.engine.block_manager import BlockManager
from quill.engine.engine import LLMEngine, _token_times
from quill.engine.sampler import Sampler, SamplingRow
from quill.engine.scheduler import RowKind, ScheduledSeq, Scheduler, row_kind
from quill.engine.sequence import Sequence, SequenceStatus
from quill.engine.speculative import NgramIndex, Speculator, StepCostModel
from quill.kernels.options import use as use_kernel_options
from quill.sampling_params import SamplingParams


def _decoding(prompt_len: int, outputs: int = 1, max_tokens: int | None = 64) -> Sequence:
    """A sequence whose prompt and outputs but the last are computed: it decodes next."""
    seq = Sequence("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))
    for t in range(outputs):
        seq.append_token(100 + t, 0.0)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


# ---- row kinds and the scheduler ---------------------------------------------------------


def test_a_row_past_the_known_tokens_is_a_verify_row():
    seq = _decoding(8)
    seq.draft_token_ids = [5, 6, 7]
    assert row_kind(seq, 8, 1) is RowKind.DECODE
    assert row_kind(seq, 8, 3) is RowKind.VERIFY
    item = ScheduledSeq.plan(seq, 8, 4)
    assert item.kind.fused and item.samples and item.num_sampled_rows == 4
    with pytest.raises(ValueError, match="3 proposed"):
        ScheduledSeq.plan(seq, 8, 5)  # one more than the proposals
    with pytest.raises(ValueError):
        ScheduledSeq.plan(seq, 7, 4)  # a prefill chunk cannot run into proposals


def _scheduler(num_blocks=16, block_size=4, budget=64):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=min(budget, 8)), bm), bm


def _running(sched, bm, seq):
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)  # blocks for every known token
    sched.running.append(seq)


def test_proposals_become_verify_rows_with_what_the_budget_leaves():
    sched, bm = _scheduler(budget=4)
    a, b = _decoding(6), _decoding(6)
    _running(sched, bm, a)
    _running(sched, bm, b)
    a.draft_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    # every running sequence decodes first; the proposals get the 2 tokens left
    assert [(i.seq is a, i.kind, i.num_new_tokens) for i in out.scheduled] == [
        (True, RowKind.VERIFY, 3), (False, RowKind.DECODE, 1)]
    assert out.num_decode_tokens == 4 and out.num_prefill_tokens == 0


def test_proposals_that_find_no_blocks_are_dropped_and_nobody_is_preempted():
    sched, bm = _scheduler(num_blocks=4, block_size=4)
    a, b = _decoding(5), _decoding(5)  # 6 tokens each, position 5 next: two blocks each, the pool is full
    _running(sched, bm, a)
    _running(sched, bm, b)
    a.draft_token_ids = [1, 2, 3]  # positions 6..8 would need a fifth block
    out = sched.schedule()
    assert not out.preempted and sched.running == [a, b]
    assert [(i.kind, i.num_new_tokens) for i in out.scheduled] == [(RowKind.DECODE, 1)] * 2


def test_rejected_proposals_are_rolled_back_and_only_accepted_tokens_are_cached():
    sched, bm = _scheduler(num_blocks=8, block_size=4)
    seq = _decoding(7)  # 8 tokens, position 7 decodes next
    _running(sched, bm, seq)
    seq.draft_token_ids = [11, 12, 13, 14, 15]
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.kind is RowKind.VERIFY and item.num_new_tokens == 6
    assert len(seq.block_table) == 4  # positions 0..12
    free_before = bm.num_free_blocks
    sched.postprocess(out)
    assert seq.num_computed_tokens == 8  # the known token only, until the run is settled
    for k, t in enumerate((11, 12, 99)):  # two proposals accepted, then the row's own pick
        if k:
            sched.accept_draft(seq)  # as the engine does before each token after a run's first
        seq.append_token(t, 0.0)
    released = sched.settle_run(seq)
    assert seq.num_computed_tokens == 10 and seq.num_tokens == 11
    assert released == 1 and len(seq.block_table) == 3 and bm.num_free_blocks == free_before + 1
    cached = [bm.is_cached(b) for b in seq.block_table]
    assert cached == [True, True, False]  # block 2 holds tokens 8..11, not all computed: no hash
    # what is cached is the accepted tokens: a new prompt with the same first 8 tokens hits both blocks
    assert bm.get_computed_blocks(seq.all_token_ids[:9])[1] == 8


def test_a_run_that_stops_inside_still_caches_its_accepted_blocks():
    sched, bm = _scheduler(num_blocks=8, block_size=4)
    seq = _decoding(7)
    _running(sched, bm, seq)
    seq.draft_token_ids = [11, 12, 13, 14, 15]
    out = sched.schedule()
    sched.postprocess(out)
    for k, t in enumerate((11, 12, 13, 14, 15)):  # four proposals accepted, a stop string ends it on the fifth
        if k:
            sched.accept_draft(seq)
        seq.append_token(t, 0.0)
    table = list(seq.block_table)
    sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    assert [bm.is_cached(b) for b in table[:3]] == [True, True, True]  # positions 0..11 computed: 3 full blocks
    assert bm.num_used_blocks == 0


def test_proposals_never_evict_a_cached_prefix():
    sched, bm = _scheduler(num_blocks=4, block_size=4)
    cached = _decoding(8)  # 9 tokens in 3 blocks: the first two full, cached, then released
    assert bm.allocate(cached, 1)
    bm.cache_blocks(cached, 8)
    seq = _decoding(3)  # 4 tokens, position 3 next: one block
    _running(sched, bm, seq)
    bm.free(cached)  # its two full blocks stay cached (evictable); one block is unused
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 3
    seq.draft_token_ids = [1, 2, 3, 4, 5]  # positions 4..8 would need two more blocks: only one is unused
    out = sched.schedule()
    assert [i.kind for i in out.scheduled] == [RowKind.DECODE] and bm.num_cached_blocks == 2
    seq.draft_token_ids = [1, 2]  # positions 4..5: the unused block is enough
    out = sched.schedule()
    assert [(i.kind, i.num_new_tokens) for i in out.scheduled] == [(RowKind.VERIFY, 3)] and bm.num_cached_blocks == 2


# ---- prompt lookup ------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_last_tokens():
    index = NgramIndex(2, 4)
    seq = Sequence("r", [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3], SamplingParams())
    index.update(seq)
    assert index.propose(3) == [4, 5, 6]
    assert index.propose(10) == [4, 5, 6, 9, 9, 1, 2, 3]  # up to the end of the tokens
    seq.append_token(4, 0.0)
    index.update(seq)
    assert index.propose(2) == [5, 6]
    seq.append_token(7, 0.0)  # no earlier "4 7", "7" is new
    index.update(seq)
    assert index.propose(3) == []


def test_prompt_lookup_keeps_following_the_quote_it_found():
    # "a b" occurs twice in the source; once aligned with the first, the lookup stays there
    source = [1, 2, 50, 51, 1, 2, 60, 61, 62]
    seq = Sequence("r", source + [0, 1, 2, 50], SamplingParams())
    index = NgramIndex(2, 2)
    index.update(seq)
    assert index.propose(3) == [51, 1, 2]
    for t in (51, 1, 2):
        seq.append_token(t, 0.0)
    index.update(seq)
    # the table's latest "1 2" is the copy's own; the kept alignment (16 matching tokens or fewer) wins
    assert index.propose(2) == [60, 61]


# ---- cost model and the choice of proposals -----------------------------------------------


def test_step_cost_model_takes_medians_and_interpolates():
    cost = StepCostModel()
    assert cost.estimate(3) is None
    for s in (1.0, 1.0, 9.0):  # an outlier does not move the median
        cost.record(1, s)
    cost.record(5, 3.0)
    assert cost.estimate(1) == 1.0
    assert cost.estimate(3) == pytest.approx(2.0)
    assert cost.estimate(9) == 3.0  # past the largest measured: flat, so it gets tried and measured


def _speculator(num_tokens=4):
    return Speculator(SpeculativeConfig("ngram", num_tokens), 10_000, lambda seq: (0,))


def _quoting(seq_id=0, max_tokens=100):
    seq = Sequence("r", [5, 6, 7, 8, 9, 10, 11, 12, 5, 6], SamplingParams(max_tokens=max_tokens), seq_id=seq_id)
    seq.append_token(7, 0.0)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_speculator_proposes_while_rows_are_cheap_and_stops_when_they_cost_a_step():
    spec = _speculator()
    seq = _quoting()
    for rows in range(1, 6):
        spec.record_step(rows, 1.0)  # memory-bound: extra rows are free
    assert spec.propose([seq], lambda s: False) == [seq]
    assert seq.draft_token_ids == [8, 9, 10, 11]
    spec.clear()
    assert seq.draft_token_ids == []
    compute_bound = _speculator()
    for rows in range(1, 6):
        compute_bound.record_step(rows, float(rows))  # each row costs a whole step
    assert compute_bound.propose([seq], lambda s: False) == [] and seq.draft_token_ids == []


def test_speculator_learns_a_low_acceptance_and_stops_proposing():
    spec = _speculator()
    seq = _quoting()
    for rows in range(1, 6):
        spec.record_step(rows, 1.0 + 0.3 * (rows - 1))
    assert spec.propose([seq], lambda s: False)
    for _ in range(6):
        spec.record(seq, 4, 0)  # every first guess rejected
    spec.clear()
    assert spec.propose([seq], lambda s: False) == []


def test_speculator_leaves_room_for_max_tokens_and_cuts_constrained_runs_at_stop_tokens():
    spec = _speculator()
    seq = _quoting(max_tokens=3)  # 1 output so far: 2 more at most, one of them the row's own pick
    assert spec.propose([seq], lambda s: False) == [seq] and seq.draft_token_ids == [8]
    spec = Speculator(SpeculativeConfig("ngram", 4), 10_000, lambda s: (10,))
    seq = _quoting()
    spec.propose([seq], lambda s: True)
    assert seq.draft_token_ids == [8, 9]  # 10 is a stop token: a grammar never sees it


def test_draft_options_name_one_draft_and_parse_layer_ranges():
    assert parse_draft_layers("3") == (0, 1, 2)
    assert parse_draft_layers("0-2, 7,5-6") == (0, 1, 2, 5, 6, 7)
    for bad in ("", "x", "3-1", "1-"):
        with pytest.raises(ValueError, match="draft layers"):
            parse_draft_layers(bad)
    assert SpeculativeConfig.from_options().method == "ngram"
    assert SpeculativeConfig.from_options(draft_layers="4") == SpeculativeConfig("draft", draft_layers=(0, 1, 2, 3))
    assert SpeculativeConfig.from_options(None, 3, "d.gguf").draft_model == "d.gguf"
    with pytest.raises(ValueError, match="exactly one"):
        SpeculativeConfig("draft")
    with pytest.raises(ValueError, match="exactly one"):
        SpeculativeConfig("draft", draft_model="d.gguf", draft_layers=(0,))
    with pytest.raises(ValueError, match="not 'ngram'"):
        SpeculativeConfig.from_options("ngram", draft_model="d.gguf")
    with pytest.raises(ValueError, match="distinct"):
        SpeculativeConfig("draft", draft_layers=(2, 1))


class _FakeDraft:
    """DraftRunner's interface: guesses token 40 + j, or fails."""

    def __init__(self, fail=False):
        self.fail, self.calls, self.released, self.step_seconds = fail, [], [], []

    def guess(self, items, banned):
        if self.fail:
            raise RuntimeError("draft broke")
        self.step_seconds = []
        for item in items:
            if item.kind is RowKind.VERIFY:
                item.seq.draft_token_ids = [40 + j for j in range(item.num_new_tokens - 1)]
                self.calls.append((item.seq.seq_id, banned(item.seq)))
        self.step_seconds = [(1, 0.5)]

    def release(self, seq):
        self.released.append(seq.seq_id)


def _draft_speculator(draft, num_tokens=4):
    return Speculator(SpeculativeConfig("draft", num_tokens, draft_layers=(0,)), 10_000, lambda seq: (0, 2), draft)


def test_a_draft_is_asked_for_as_many_guesses_as_are_worth_verifying_then_fills_them():
    draft = _FakeDraft()
    spec = _draft_speculator(draft)
    seq = _quoting()
    assert spec.propose([seq], lambda s: True) == [seq] and seq.draft_token_ids == [-1] * 4  # unmeasured: try all
    item = ScheduledSeq.plan(seq, seq.num_computed_tokens, 4)  # the scheduler's budget left room for 3
    scheduled = [item]
    spec.fill(scheduled)
    assert seq.draft_token_ids == [40, 41, 42] and draft.calls == [(seq.seq_id, (0, 2))]  # constrained: no stop ids
    assert spec.draft_cost.estimate(1) == 0.5
    spec.release(seq)
    assert draft.released == [seq.seq_id]


def test_a_draft_slower_than_its_acceptance_pays_for_is_not_run():
    seq = _quoting()
    for draft_seconds, expect in ((0.01, 4), (1.0, 0)):
        spec = _draft_speculator(_FakeDraft())
        for rows in range(1, 6):
            spec.record_step(rows, 1.0)  # verify rows are free
        spec.draft_cost.record(1, draft_seconds)  # a draft step: 1% of a step, or a whole step
        spec.propose([seq], lambda s: False)
        assert len(seq.draft_token_ids) == expect
        spec.clear()


def test_a_failing_draft_turns_its_verify_rows_into_plain_decode_rows():
    spec = _draft_speculator(_FakeDraft(fail=True))
    seq = _quoting()
    spec.propose([seq], lambda s: False)
    scheduled = [ScheduledSeq.plan(seq, seq.num_computed_tokens, 5)]
    spec.fill(scheduled)
    assert scheduled[0].kind is RowKind.DECODE and seq.draft_token_ids == []


# ---- sampling a run, and when its tokens count -------------------------------------------


def test_seeded_rows_after_a_rejection_draw_nothing():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=0.8, seed=3)
    gen = torch.Generator().manual_seed(3)
    rows = [SamplingRow(params, [], [], gen)]
    rows.append(SamplingRow(params, [], [], gen, follows=(rows[0], -5)))  # -5 is never drawn: run stops
    rows.append(SamplingRow(params, [], [], gen, follows=(rows[1], 1)))
    out = Sampler(50, (0,))(logits, rows)
    assert out.token_ids[1:] == [-1, -1]
    alone = torch.Generator().manual_seed(3)
    first = Sampler(50, (0,))(logits[:1], [SamplingRow(params, [], [], alone)]).token_ids[0]
    assert out.token_ids[0] == first
    assert torch.equal(gen.get_state(), alone.get_state())  # one draw, as decode without speculation


def test_a_runs_tokens_are_spread_since_the_previous_token():
    a, b = Sequence("a", [1], SamplingParams()), Sequence("b", [1], SamplingParams())
    a.append_token(2, 10.0)
    times = _token_times([(a, 5, None), (b, 6, None), (a, 7, None), (a, 8, None)], 13.0)
    assert times == [11.0, 13.0, 12.0, 13.0]


# ---- the real model -------------------------------------------------------------------------

QUOTE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
         "    return 2 * (width + height)\n\n\nprint(area(3, 4), perimeter(3, 4))\n")


@pytest.fixture(scope="module")
def engines(default_loaded):
    cache = CacheConfig(num_blocks_override=256)  # 4096 tokens: a small pool, touched quickly
    scheduler = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16)
    off = LLMEngine(EngineConfig(cache=cache, scheduler=scheduler, speculative=SpeculativeConfig("off")),
                    loaded=default_loaded)
    assert off.speculator is None
    on = LLMEngine(EngineConfig(cache=cache, scheduler=scheduler, speculative=SpeculativeConfig("ngram", 4)),
                   loaded=off.loaded)
    assert on.speculator is not None, on.speculative_refusal
    _flat_costs(on)
    return off, on


def _flat_costs(engine) -> None:
    """Rows and draft steps cost nothing here, whatever this machine measures: every proposal the
    acceptance rates allow is verified, so the tests see many VERIFY rows (the cost policy has its own
    tests above)."""
    for rows in range(1, 257):
        engine.speculator.cost.record(rows, 1.0)
        engine.speculator.draft_cost.record(rows, 1e-9)
    engine.speculator.record_step = lambda rows, seconds: None
    engine.speculator.draft_cost.record = lambda rows, seconds: None


DRAFT_LAYERS = "0-3,8-29"  # the default model without 4 of its 30 layers guesses right about 60% of the time


def _gguf_copy(src: str, dst, layers: list[int] | None = None, swap_tokens: tuple[int, int] | None = None) -> None:
    """A copy of a GGUF model file, with only these layers (renumbered) and with two tokens'
    strings swapped (another tokenizer): a separate draft model with its own KV cache."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    layers = list(range(int(reader.fields[f"{arch}.block_count"].contents()))) if layers is None else layers
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = len(layers) if field.name == f"{arch}.block_count" else field.contents()
        if field.name == "tokenizer.ggml.tokens" and swap_tokens:
            a, b = swap_tokens
            value[a], value[b] = value[b], value[a]
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    renumber = {old: new for new, old in enumerate(layers)}
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            i = int(name.split(".")[1])
            if i not in renumber:
                continue
            name = f"blk.{renumber[i]}." + name.split(".", 2)[2]
        quantized = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        writer.add_tensor(name, t.data, raw_dtype=t.tensor_type if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def drafting(engines, tmp_path_factory):
    """Engines that verify a draft's guesses: 26 of the target's own layers (shared KV), and a copy of
    the target in a file of its own (a separate draft model: its own KV cache in the same block
    manager; being the target, its greedy guesses must nearly all be right, which they are only if
    its cache is kept right)."""
    from quill.models.loader import resolve_model_path

    off, _ = engines
    cache = CacheConfig(num_blocks_override=256)
    scheduler = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16)
    path = tmp_path_factory.mktemp("draft") / "draft-copy.gguf"
    _gguf_copy(str(resolve_model_path(None)), path)
    out = {}
    for name, draft in (("draft-layers", {"draft_layers": DRAFT_LAYERS}), ("draft-model", {"draft_model": str(path)})):
        engine = LLMEngine(EngineConfig(cache=cache, scheduler=scheduler,
                                        speculative=SpeculativeConfig.from_options(None, 4, **draft)), loaded=off.loaded)
        assert engine.speculator is not None, engine.speculative_refusal
        _flat_costs(engine)
        out[name] = engine
    assert out["draft-model"].draft_kv_cache is not None
    return out


def test_a_verify_row_gives_the_logits_of_one_token_decode_steps_bit_for_bit(engines):
    off, _ = engines
    runner, bm = off.runner, off.block_manager
    tokens = off.tokenizer.encode(QUOTE)
    steps, run = Sequence("steps", tokens[:-4], SamplingParams()), Sequence("run", tokens[:-4], SamplingParams())
    try:
        with use_kernel_options(off.kernel_options):
            for seq in (steps, run):
                assert bm.allocate(seq, seq.num_tokens + 4)
                runner.forward([ScheduledSeq.plan(seq, 0, seq.num_tokens - 1)])
                seq.num_computed_tokens = seq.num_tokens - 1
            expected = []
            for t in tokens[-4:] + [None]:  # one decode step per position
                hidden, _ = runner.forward([ScheduledSeq.plan(steps, steps.num_computed_tokens, 1)])
                expected.append(runner.model.compute_logits(hidden))
                steps.num_computed_tokens += 1
                if t is not None:
                    steps.append_token(t, 0.0)
            run.draft_token_ids = tokens[-4:]
            item = ScheduledSeq.plan(run, run.num_computed_tokens, 5)
            assert item.kind is RowKind.VERIFY
            hidden, rows = runner.forward([item])
            assert rows == [0, 1, 2, 3, 4]
            assert torch.equal(runner.model.compute_logits(hidden), torch.cat(expected))
    finally:
        bm.free(steps)
        bm.free(run)


def _prompts(tok) -> list[tuple[list[int], dict]]:
    """32 prompts: quoting ones (speculation proposes a lot) and open ones, with stop strings,
    max_tokens, penalties, logprobs and a JSON-schema constraint among them."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "sizes": {"type": "array", "items": {"type": "integer"}}},
              "required": ["name", "sizes"]}
    out = []
    for i in range(32):
        kind = i % 8
        if kind in (0, 1, 2):
            text = QUOTE[(i * 7) % 40 :] + "\n\n" + QUOTE[: 30 + i]
            ids, extra = tok.encode(text), {}
        elif kind == 3:
            ids = tok.encode_chat([{"role": "user", "content": f"Give a JSON object for item {i} with sizes 1, 2, 1, 2, 1, 2."}])
            extra = {"json_schema": schema}
        elif kind == 4:
            ids, extra = tok.encode(QUOTE + "\n\n" + QUOTE[:40]), {"stop": ["perimeter", "(3"]}
        elif kind == 5:
            ids, extra = tok.encode(QUOTE + QUOTE[:25]), {"presence_penalty": 0.5, "logprobs": 2}
        elif kind == 6:
            ids = tok.encode_chat([{"role": "user", "content": f"Tell me a fact about the number {i}."}])
            extra = {"n": 2}  # two completions, each with its own generator
        else:
            ids, extra = tok.encode(QUOTE + QUOTE[:20]), {"max_tokens": 5 + i % 3, "stop": ["\n\n\n"]}
        extra.setdefault("max_tokens", 16 + (i % 4) * 8)
        out.append((ids, extra))
    return out


def _run(engine, batch: list[tuple[str, list[int], SamplingParams]]) -> dict:
    for rid, ids, params in batch:
        engine.add_request(rid, ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                                         json.dumps(c.logprobs) if c.logprobs is not None else None, out.error)
                                        for c in out.outputs]
    return done


_WITHOUT: dict = {}  # (mode, batch size, batch's first id) -> the outputs without speculation, computed once


@pytest.mark.parametrize("proposer", ["ngram", "draft-layers", "draft-model"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_outputs_with_speculation_are_identical_to_without(engines, drafting, mode, proposer):
    off, on = engines
    on = on if proposer == "ngram" else drafting[proposer]
    sampling = {"temperature": 0.0} if mode == "greedy" else {"temperature": 0.8, "top_p": 0.9}
    prompts = _prompts(off.tokenizer)
    requests = [(f"p{i}", ids, SamplingParams(**sampling, **extra, **({"seed": 100 + i} if mode == "seeded" else {})))
                for i, (ids, extra) in enumerate(prompts)]
    before = on.stats.as_dict()
    for batch_size in (1, 8):
        # batch-1 runs cover the first 8 prompts (every kind once), batches of 8 all 32: the suite's time
        some = requests[:8] if batch_size == 1 else requests
        batches = [some[k : k + batch_size] for k in range(0, len(some), batch_size)]
        for batch in batches:
            key = (mode, batch_size, batch[0][0])
            a = _WITHOUT[key] if key in _WITHOUT else _WITHOUT.setdefault(key, _run(off, batch))
            b = _run(on, batch)
            for rid in a:
                assert a[rid] == b[rid], (rid, batch_size, mode, proposer)
                assert all(c[5] is None for c in a[rid])
    after = on.stats.as_dict()
    verified = after["spec_verifications"] - before["spec_verifications"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    assert verified > 20 and 0 < accepted < proposed  # runs were verified, some accepted, some rejected
    for engine in (off, on):
        assert engine.block_manager.num_used_blocks == 0 and not engine.scheduler.running
    assert on.speculator.draft_failures == 0
    if proposer == "draft-model":
        assert not on.speculator.draft._computed  # every finished sequence's draft state released
        if mode == "greedy":  # the target's own guesses: wrong only before a stop it may not guess, or a tie
            assert accepted >= 0.9 * proposed, (accepted, proposed)


def test_a_failed_forward_keeps_the_other_requests_runs(engines, default_loaded):
    off, _ = engines
    faulty = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks_override=128), fault_injection=True,
                                    speculative=SpeculativeConfig("ngram", 4)), loaded=default_loaded)
    for rows in range(1, 64):
        faulty.speculator.cost.record(rows, 1.0)
    faulty.speculator.record_step = lambda rows, seconds: None
    ids = off.tokenizer.encode(QUOTE + "\n\n" + QUOTE[:30])
    params = SamplingParams(temperature=0, max_tokens=30)
    expected = _run(off, [("b", ids, params)])["b"]
    faulty.add_request("b", ids, params)
    outs = {}
    for _ in range(3):  # b runs ahead, then a request whose forward fails joins the batch
        for o in faulty.step():
            outs[o.request_id] = o
    faulty.add_request("a", ids[:20], SamplingParams(max_tokens=5), fault="forward")
    while faulty.has_unfinished_requests():
        for o in faulty.step():
            outs[o.request_id] = o
    assert outs["a"].outputs[0].finish_reason == "error"
    assert faulty.stats.as_dict()["spec_accepted_tokens"] > 0
    c = outs["b"].outputs[0]
    assert [(list(c.token_ids), c.text, c.finish_reason)] == [x[:3] for x in expected]
    assert faulty.block_manager.num_used_blocks == 0


def test_speculation_is_off_without_the_fused_decode_path(engines):
    _, on = engines
    fused = on.runner.fused
    try:
        on.runner.fused, on.runner.fused_refusal = None, "test: refused"
        speculator, why = on._speculator(on.config)
        assert speculator is None and "fused decode path" in why and "test: refused" in why
    finally:
        on.runner.fused, on.runner.fused_refusal = fused, None


def test_per_request_counters_and_token_times(engines):
    _, on = engines
    ids = on.tokenizer.encode(QUOTE + "\n\n" + QUOTE[:30])
    on.add_request("counted", ids, SamplingParams(temperature=0, max_tokens=40))
    final = None
    while on.has_unfinished_requests():
        for o in on.step():
            final = o if o.finished else final
    m = final.outputs[0].metrics
    assert m["spec_proposed_tokens"] >= m["spec_accepted_tokens"] > 0
    assert min(m["itl_ms"]) > 0  # a verified run's tokens are spread in time: ITL counts tokens, not steps


def test_aborts_between_draft_verification_steps_leak_nothing(drafting):
    engine = drafting["draft-model"]
    ids = engine.tokenizer.encode(QUOTE + "\n\n" + QUOTE[:30])
    for i in range(3):
        engine.add_request(f"abort{i}", ids[: 40 + 10 * i], SamplingParams(temperature=0, max_tokens=64))
    verified = 0
    for _ in range(40):
        engine.step()
        verified += bool(engine.last_step.verified)
        if verified >= 2:
            break
    assert verified >= 2 and engine.speculator.draft._computed
    engine.abort("abort1")
    assert engine.abort("abort0")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0 and not engine.speculator.draft._computed


def test_a_draft_must_share_the_targets_tokenizer_and_fit_its_layers(engines, tmp_path):
    from quill.models.loader import resolve_model_path

    off, _ = engines
    path = tmp_path / "other-tokenizer.gguf"
    _gguf_copy(str(resolve_model_path(None)), path, layers=[0], swap_tokens=(1000, 1001))
    with pytest.raises(ValueError, match="another tokenizer"):
        LLMEngine(EngineConfig(cache=CacheConfig(num_blocks_override=16),
                               speculative=SpeculativeConfig.from_options(draft_model=str(path))), loaded=off.loaded)
    with pytest.raises(ValueError, match="fewer than the target's 30 layers"):
        LLMEngine(EngineConfig(cache=CacheConfig(num_blocks_override=16),
                               speculative=SpeculativeConfig.from_options(draft_layers="0-30")), loaded=off.loaded)


def test_an_int8_copy_of_a_folder_model_drafts_for_it(tmp_path):
    """--draft-model SAME_FOLDER --draft-quantize int8: the model's own int8 copy guesses, with its own KV."""
    import transformers as tf
    from test_model_parity import _byte_tokenizer_folder

    from quill.kernels.packed import PackedLinear
    from quill.llm import LLM

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    tf.LlamaForCausalLM(cfg).float().save_pretrained(tmp_path, safe_serialization=True)
    _byte_tokenizer_folder(tmp_path, cfg.vocab_size)
    off = LLM(str(tmp_path), kv_cache_memory=8 << 20, speculative="off")
    on = LLM(str(tmp_path), kv_cache_memory=8 << 20, draft_model=str(tmp_path), draft_quantize="int8",
             num_speculative_tokens=4)
    assert isinstance(on.engine.draft_loaded.model.layers[0].mlp.down_proj, PackedLinear)
    assert on.engine.kv_cache.num_blocks < off.engine.kv_cache.num_blocks  # the draft's K/V shares the budget
    _flat_costs(on.engine)
    prompts = ["hello world", "the quick brown fox jumps", "int8 weights guess", "a b c d e f g"]
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)):
        a, b = off.generate(prompts, params), on.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
        if params.temperature == 0:  # int8 rounding barely moves the argmax (a random model's sampling is near flat)
            stats = on.engine.stats.as_dict()
            assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"] > 0
    assert on.engine.speculator.draft_failures == 0 and on.engine.block_manager.num_used_blocks == 0
