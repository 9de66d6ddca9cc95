"""`quill bench coldstart`: real runs of quill generate on a .quill file beside import torch, the two-server
page-sharing report, and its refusals."""

from __future__ import annotations

import pytest

from quill.cli import main
from quill.kernels import native


@pytest.mark.skipif(native.load() is None, reason=".quill files hold the native kernels' layouts")
def test_coldstart_times_generate_and_reports_sharing(tmp_path, capsys):
    import json

    from quill.models.convert import convert

    model = tmp_path / "default.quill"
    convert(None, model, progress=False)
    out_json = tmp_path / "cold.json"
    assert main(["bench", "coldstart", "--models", str(model), "--runs", "1", "--commands", "generate", "--share",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "import torch" in out and "quill generate -n 4  default.quill" in out and "x" in out
    runs = json.loads(out_json.read_text())
    gen = runs["runs"]["quill generate -n 4  default.quill"][0]
    assert gen["wall_s"] > 0 and gen["rss_mib"] > 0 and 0 < gen["ready_s"] <= gen["wall_s"]
    second = runs["share"][0]["mapping"][1]
    assert second["Rss"] > 0 and second["Private_Dirty"] == 0  # the weights are the file's shared pages
    assert "two servers on default.quill" in out


def test_coldstart_refusals(capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_BIN", raising=False)
    assert main(["bench", "coldstart", "--vs", "llama.cpp", "--runs", "1"]) == 1
    assert "LLAMA_BIN" in capsys.readouterr().err
    assert main(["bench", "coldstart", "--commands", "chat"]) == 1
    assert "--commands takes generate, serve" in capsys.readouterr().err
    assert main(["bench", "coldstart", "--models", "/nonexistent.gguf"]) == 1
    assert main(["bench", "coldstart", "--runs", "0"]) == 1


def test_cold_start_line_and_slow_load_hint():
    from quill import coldstart

    phases = {"load_ms": 300, "load_format": "quill", "load_phases": {"map": 1, "tokenizer": 200, "model": 20},
              "engine_ms": 10, "warmup_ms": 150}
    line = coldstart.line(2000, phases, 2500, torch_ms=1500)
    assert line == ("cold start: import 2.00 s (torch 1.50 s), weights 0.30 s (quill: map 0.00 s, tokenizer 0.20 s, "
                    "model 0.02 s), engine 0.01 s, warm-up 0.15 s, ready 2.50 s after process start")
    assert "warm-up" not in coldstart.line(None, {"load_ms": 9000, "load_format": "gguf"}, None)
    assert coldstart.hint(phases) is None and coldstart.hint({"load_format": "gguf", "load_ms": 100}) is None
    assert "quill convert" in coldstart.hint({"load_format": "gguf", "load_ms": 9400})
    assert coldstart.process_age_ms() > 0
