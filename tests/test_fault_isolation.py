"""Fault isolation on the real default model: a request that fails at any phase of a step
finishes alone with finish_reason "error"; the others in its batch produce bit-identical output
to a run without it, and no KV block leaks. Faults are injected per request (quill.engine.faults)."""

from __future__ import annotations

import asyncio

import pytest

from quill.engine.errors import AdmissionError, RequestFailed
from quill.engine.faults import FAULT_PHASES
from quill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

HEALTHY = [
    ("The three primary colours are", SamplingParams(temperature=0, max_tokens=12)),
    ("Write a haiku about rivers:", SamplingParams(temperature=0.8, seed=11, max_tokens=12)),
    ("List the planets in order: Mercury,", SamplingParams(temperature=0, max_tokens=12, logprobs=2)),
]
FAULTY = ("Say something long about mountains and valleys and lakes.", SamplingParams(temperature=0, max_tokens=12))


def run(engine, items, faults=None):
    """Add (prompt, params) items in order (item i gets fault faults[i]); step to the end -> {id: output}."""
    faults = faults or {}
    for i, (prompt, params) in enumerate(items):
        engine.add_request(f"r{i}", engine.tokenizer.encode(prompt), params, prompt=prompt, fault=faults.get(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def assert_no_leak(engine):
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(fault_injection=True, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(llm):
    done = run(llm.engine, HEALTHY)
    return {rid: out.outputs[0] for rid, out in done.items()}


def same_output(got, want) -> bool:
    """Bit-identical tokens and text; logprobs within 2e-3 and the same top ids. Decode rows are
    batch-invariant, but prefill rows are batched with whatever else prefills in that step, and a
    torch GEMM's rounding depends on the batch's height; through the fp16 KV cache that moves later
    logprobs by up to ~5e-4 (measured), never the tokens."""
    if (got.token_ids, got.text, got.finish_reason) != (want.token_ids, want.text, want.finish_reason):
        return False
    if want.logprobs is None:
        return got.logprobs is None
    return all(abs(a["logprob"] - b["logprob"]) < 2e-3 and [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
               for a, b in zip(got.logprobs, want.logprobs, strict=True))


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_a_request_failing_at_any_phase_fails_alone(llm, reference, phase):
    engine = llm.engine
    done = run(engine, HEALTHY + [FAULTY], faults={3: phase})  # the faulty one arrives last (newest)
    bad = done.pop("r3")
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.error and "request failed while" in bad.error and "injected fault" in bad.error, bad.error
    for rid, out in done.items():
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), (rid, c.finish_reason, out.error)
        assert same_output(c, reference[rid]), rid
    assert engine.stats.failures[phase] >= 1
    assert_no_leak(engine)


def test_forward_failure_of_an_older_request_fails_that_request_only(llm, reference):
    """The retry without the newest request fails too when the fault is elsewhere; the retries
    then narrow down (by halves) to the request whose rows fail on their own. Only it fails; the
    others keep this step's results and finish exactly as without it."""
    engine = llm.engine
    items = [FAULTY] + HEALTHY  # the faulty one is the oldest
    done = run(engine, items, faults={0: "forward"})
    bad = done.pop("r0")
    assert bad.outputs[0].finish_reason == "error" and "forward pass" in bad.error
    for i, (rid, out) in enumerate(sorted(done.items())):
        assert same_output(out.outputs[0], reference[f"r{i}"]), rid
    assert_no_leak(engine)


def test_fault_injection_must_be_enabled_and_the_phase_known(make_llm, llm):
    off = make_llm()
    with pytest.raises(AdmissionError, match="--enable-fault-injection"):
        off.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), fault="sample")
    with pytest.raises(AdmissionError, match="unknown fault phase 'nope'; the phases are queued"):
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2), fault="nope")
    assert_no_leak(llm.engine)


def test_min_tokens_with_a_choice_grammar_beside_plain_prompts(make_llm):
    """Issue 13's first reproduction, offline: guided_choice + min_tokens=8 next to two plain
    prompts. The grammar wins over min_tokens (vLLM's rule); nothing fails; the plain outputs
    equal their outputs alone."""
    llm = make_llm(enable_prefix_caching=False)
    plain = [("Tell me about the sea.", SamplingParams(temperature=0, max_tokens=16)),
             ("Count: one, two,", SamplingParams(temperature=0, max_tokens=16))]
    alone = [llm.generate(p, sp)[0].outputs[0].token_ids for p, sp in plain]
    choice = SamplingParams(temperature=0, max_tokens=20, min_tokens=8, choice=["yes", "no"])
    outs = llm.generate(["yes or no?"] + [p for p, _ in plain], [choice] + [sp for _, sp in plain])
    assert outs[0].outputs[0].text in ("yes", "no") and outs[0].outputs[0].finish_reason == "stop"
    assert [o.outputs[0].token_ids for o in outs[1:]] == alone
    sampled = SamplingParams(temperature=0.7, seed=5, max_tokens=20, min_tokens=8, choice=["yes", "no"])
    assert llm.generate("yes or no?", sampled)[0].outputs[0].text in ("yes", "no")
    assert_no_leak(llm.engine)


def test_async_engine_raises_request_failed_for_that_request_only(make_llm):
    from quill.engine.async_engine import AsyncEngine

    llm = make_llm(fault_injection=True)
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        async def one(rid, prompt, params, fault=None):
            text = ""
            async for out in engine.generate(llm.tokenizer.encode(prompt), params, rid, fault=fault):
                text = out.outputs[0].text
            return text

        async def main():
            return await asyncio.gather(
                one("a", *HEALTHY[0]), one("b", *FAULTY, fault="detokenize"), one("c", *HEALTHY[1]),
                return_exceptions=True)

        a, b, c = asyncio.run(main())
        assert isinstance(b, RequestFailed) and "detokenizing" in str(b)
        assert isinstance(a, str) and isinstance(c, str) and a and c
    finally:
        engine.shutdown(drain_timeout=0)
    assert_no_leak(llm.engine)


def test_validate_is_pure_so_the_server_may_call_it_off_the_engine_thread(make_llm):
    """Issue 13, point 11: validate() used to build the MaskWorker and swap runner.guided from the
    event loop. Now it only reads (and compiles through the thread-safe compiler); the engine thread
    attaches the mask worker when the request is added."""
    import threading

    llm = make_llm()
    engine = llm.engine
    params = SamplingParams(max_tokens=4, choice=["yes", "no"])
    worker = threading.Thread(target=engine.validate, args=([1, 2, 3], params))
    worker.start()
    worker.join()
    assert engine.runner.guided is None and not engine.requests and not engine.scheduler.waiting
    assert llm.generate("yes or no?", params)[0].outputs[0].text in ("yes", "no")
    assert engine.runner.guided is not None


def test_two_engines_number_their_sequences_independently(make_llm):
    a, b = make_llm(), make_llm()
    for llm in (a, b):
        llm.generate("Hi", SamplingParams(max_tokens=1))
    first = [next(llm.engine._seq_ids) for llm in (a, b)]
    assert first[0] == first[1]  # each engine counts its own (no process-wide counter)


def test_budget_equal_to_max_num_seqs_runs_end_to_end(make_llm):
    """Issue 13's defect 2 through the real engine: SchedulerConfig(2, 2) puts a decode row beside a
    1-token non-final prefill chunk (on b7ef9fa: "logits must be (B=1, V), got shape (2, 49152)")."""
    llm = make_llm(max_num_batched_tokens=2, max_num_seqs=2, enable_prefix_caching=False)
    prompts = ["Hello there", "The capital of France is a city called"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    alone = [llm.generate(p, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_no_leak(llm.engine)
