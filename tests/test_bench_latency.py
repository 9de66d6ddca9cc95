"""quill bench latency --skip-prefill on the default model: decode figures at long contexts without
the prefill, and the per-step breakdown that shows host work does not grow with the context."""

from __future__ import annotations

import json

import pytest

from quill.cli import main

pytestmark = pytest.mark.slow


def test_skip_prefill_reports_decode_steps_and_the_context_delta(tmp_path, capsys):
    out_json = tmp_path / "lat.json"
    code = main(["bench", "latency", "--skip-prefill", "--contexts", "64,300", "--batches", "1,2", "--repeats", "1",
                 "--decode-steps", "2", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads(out_json.read_text())["quill"]
    assert report["prefill_tps"] == {} and set(report["decode_tps"]) == {"1x64", "2x64", "1x300", "2x300"}
    for key, bd in report["step_breakdown"].items():
        assert bd["step_ms"] > 0 and bd["overhead_ms"] >= 0, key
    assert "batch 1, ctx 300 vs 64: step" in text and "the extra K/V read" in text


def test_skip_prefill_refuses_a_reference_it_cannot_give(capsys):
    assert main(["bench", "latency", "--skip-prefill", "--vs", "llama.cpp"]) == 2
    assert "--skip-prefill measures quill alone" in capsys.readouterr().err
