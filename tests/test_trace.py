"""`quill trace`: every phase shows, and the KV count per step follows prompt + tokens generated."""

from __future__ import annotations

import pytest

from quill.commands.trace import format_trace
from quill.sampling_params import SamplingParams
from quill.trace import trace_request
from quill.trace_html import render_html

pytestmark = pytest.mark.slow


def test_trace_phases_and_kv_counts(make_llm):
    llm = make_llm()
    t = trace_request(llm, "Name a colour.", SamplingParams(temperature=0, max_tokens=6), chat=True)
    prompt_len = len(t.prompt_tokens)
    assert t.steps[0].kind == "prefill" and t.steps[0].positions == (0, prompt_len)
    decodes = [s for s in t.steps if s.kind == "decode"]
    assert len(decodes) == len([s for s in t.steps if s.token_id is not None]) - 1
    generated_before = 1  # the prefill step sampled the first token
    for s in decodes:
        assert s.kv_positions == prompt_len + generated_before
        assert s.positions == (prompt_len + generated_before - 1, prompt_len + generated_before)
        assert len(s.top) == 3 and abs(sum(p for *_, p in s.top)) <= 1.0 + 1e-6
        generated_before += 1
    text = "\n".join(format_trace(t))
    for phase in ("queue + tokenize", "prefill", "decode", "stop:", "release:"):
        assert phase in text
    assert "gets its K/V now" in text and "written next step" in text
    assert t.finish_reason in ("stop", "length")
    assert t.blocks_freed + t.blocks_cached >= 1
    page = render_html(t)
    assert page.count('class="cell decode"') == len(decodes)
    assert page.count('class="cell prefill"') == 1


def test_trace_reports_prefix_cache_hits(make_llm):
    llm = make_llm()
    prompt = "Tell me about the sea. " * 12
    trace_request(llm, prompt, SamplingParams(temperature=0, max_tokens=2))
    t = trace_request(llm, prompt, SamplingParams(temperature=0, max_tokens=2))
    assert t.steps[0].cached_positions >= 16
    assert t.steps[0].positions[0] == t.steps[0].cached_positions
    assert "max_tokens (2) reached" in t.stop


def test_trace_shows_proposed_and_accepted_tokens(make_llm):
    from quill.bench.speculative import QUOTE_FILE

    llm = make_llm(speculative="ngram")
    for rows in range(1, 64):  # rows cost nothing here: every allowed proposal is verified
        llm.engine.speculator.cost.record(rows, 1.0)
    llm.engine.speculator.record_step = lambda rows, seconds: None
    t = trace_request(llm, QUOTE_FILE[:400] + "\n\n" + QUOTE_FILE[:60], SamplingParams(temperature=0, max_tokens=24))
    verified = [s for s in t.steps if s.proposed]
    assert verified and any(s.accepted > 0 for s in verified)
    for s in verified:
        assert len(s.tokens) == s.accepted + 1 or t.steps[-1] is s  # the last step may stop inside the run
        assert [tok for tok, _ in s.tokens[: s.accepted]] == [tok for tok, _ in s.proposed[: s.accepted]]
    out = [tok for s in t.steps for tok, _ in s.tokens]
    assert len(out) == 24
    text = "\n".join(format_trace(t))
    assert "decode + verify" in text and "then its own pick" in text
