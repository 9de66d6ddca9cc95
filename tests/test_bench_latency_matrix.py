"""`quill bench latency --models`: the argument, the matrix's figures and table (from made-up reports), and
one run over two tiny synth files (one engine alive at a time). No test asserts a speed."""

from __future__ import annotations

import json
import weakref

import pytest

from quill.bench.latency import format_matrix, matrix_row, model_list
from quill.cli import build_parser, main

MIB = 2**20


def _report(path: str, quill: dict, ref: dict | None = None, file_mib: float = 100, resident_mib: float = 120) -> dict:
    r = {"path": path, "file_bytes": int(file_mib * MIB), "weight_bytes": int(resident_mib * MIB),
         "step_weight_bytes": int(resident_mib * MIB),
         "kv_bytes_per_token": 1000, "bandwidth_gbs": 10.0, "quill": quill,
         "bandwidth_probes": {"start": [9.0], "decode": [10.0, 9.5]}}
    if ref is not None:
        r["llama.cpp"] = ref
    return r


QUILL = {"prefill_tps": {"16": 50.0, "64": 200.0},
         "decode_tps": {"1x16": 10.0, "4x16": 30.0, "1x64": 9.0, "4x64": 25.0}}
REF = {"prefill_tps": {"16": 40.0, "64": 100.0},
       "decode_tps": {"1x16": 20.0, "4x16": 40.0, "1x64": 18.0, "4x64": 35.0}}


# --- the argument ----------------------------------------------------------------------------------

def test_models_comma_separated_and_repeated(tmp_path):
    files = [tmp_path / f"{name}.gguf" for name in "abc"]
    for f in files:
        f.write_bytes(b"x")
    args = build_parser().parse_args(["bench", "latency", "--models", f"{files[0]}, {files[1]}", "--models",
                                      str(files[2])])
    assert args.models == [f"{files[0]}, {files[1]}", str(files[2])] and args.model is None
    assert model_list(args.models) == [str(f) for f in files]
    with pytest.raises(ValueError, match="nope.gguf"):
        model_list([f"{files[0]},{tmp_path / 'nope.gguf'}"])
    with pytest.raises(ValueError, match="at least one"):
        model_list([" , ,"])


def test_models_help_and_refusals(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "latency", "--help"])
    assert "comma-separated and/or the option repeated" in " ".join(capsys.readouterr().out.split())
    a = tmp_path / "a.gguf"
    a.write_bytes(b"x")
    assert main(["bench", "latency", "--model", str(a), "--models", str(a)]) == 2
    assert "--model or --models, not both" in capsys.readouterr().err
    assert main(["bench", "latency", "--models", f"{a},{tmp_path / 'missing.gguf'}"]) == 2
    assert "not a file" in capsys.readouterr().err


# --- the figures and the table ---------------------------------------------------------------------

def test_matrix_row_figures_and_ratios():
    row = matrix_row(_report("/m/a.gguf", QUILL, REF), [16, 64], [1, 4], [16, 64])
    assert row["model"] == "a.gguf" and (row["prefill_len"], row["context"], row["top_batch"]) == (64, 16, 4)
    assert row["resident_over_file"] == pytest.approx(1.2)
    assert (row["prefill_tps"], row["decode_b1_tps"], row["decode_top_tps"]) == (200.0, 10.0, 30.0)
    assert row["batch_over_b1"] == pytest.approx(3.0)
    # b=1 at ctx 16 reads the weights and 16 tokens of K/V per step
    assert row["roofline_b1"] == pytest.approx(10.0 * (120 * MIB + 16 * 1000) / 1e9 / 10.0)
    vs = row["vs_llama.cpp"]
    assert vs == pytest.approx({"prefill_tps": 2.0, "decode_b1_tps": 0.5, "decode_top_tps": 0.75,
                                "batch_over_b1": 1.5})


def test_roofline_counts_the_bytes_a_step_reads():
    """An untied token embedding is resident but a decode step reads only its tokens' rows: the roofline
    divides what a step reads (step_weight_bytes, the model's decode_read_bytes), resident stays resident."""
    r = _report("/m/a.gguf", QUILL)
    r["step_weight_bytes"] = 90 * MIB
    row = matrix_row(r, [16], [1, 4], [16])
    assert row["roofline_b1"] == pytest.approx(10.0 * (90 * MIB + 16 * 1000) / 1e9 / 10.0)
    assert row["resident_bytes"] == 120 * MIB


@pytest.mark.parametrize("shape,tied", [("llama-3.2-1b", True), ("olmo-2-0425-1b", False)])
def test_decode_read_bytes_leave_out_only_an_untied_embedding(tmp_path, shape, tied):
    from quill.bench.synth import MODELS, write_synth
    from quill.models.loader import load_model

    path = tmp_path / f"{shape}.gguf"
    write_synth(path, MODELS[shape], "Q4_K_M", num_layers=1, vocab=512)
    model = load_model(str(path), context_len=64).model
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    table = sum(t.numel() * t.element_size() for t in model._weight_tensors(model.embed_tokens))
    assert table > 0
    assert model.decode_read_bytes() == model.resident_bytes() - (0 if tied else table)


def test_matrix_row_without_batch_one_or_prefill():
    quill = {"prefill_tps": {}, "decode_tps": {"2x32": 12.0, "8x32": 40.0}}
    row = matrix_row(_report("b.gguf", quill), [], [2, 8], [32])
    assert row["prefill_len"] is None and row["prefill_tps"] is None
    assert row["decode_b1_tps"] is None and row["batch_over_b1"] is None and row["roofline_b1"] is None
    assert row["decode_top_tps"] == 40.0 and "vs_llama.cpp" not in row


def test_format_matrix_one_aligned_row_per_model():
    rows = [matrix_row(_report("/m/first-model.gguf", QUILL, REF), [16, 64], [1, 4], [16, 64]),
            matrix_row(_report("/m/b.gguf", QUILL, {"prefill_tps": {"64": 400.0}, "decode_tps": {"1x16": 5.0,
                                                                                            "4x16": 60.0}},
                               file_mib=50, resident_mib=25), [16, 64], [1, 4], [16, 64])]
    lines = format_matrix(rows, has_ref=True)
    assert lines[0].startswith("matrix: tok/s, prefill at 64 tokens, decode at context 16")
    head, first, second = lines[1:]
    assert head.split()[:4] == ["model", "file", "MiB", "resident"] and head.count("vs l.cpp") == 4
    assert "decode b=4" in head and "b=4/b=1" in head and "roofline b=1" in head
    assert len({len(head), len(first), len(second)}) == 1  # columns line up
    assert first.split() == ["first-model.gguf", "100.0", "120.0", "1.200", "200.0", "2.00x", "10.0", "0.50x",
                             "30.0", "0.75x", "3.00x", "1.50x", f"{rows[0]['roofline_b1'] * 100:.0f}%"]
    assert second.split()[:4] == ["b.gguf", "50.0", "25.0", "0.500"]
    assert second.split()[5] == "0.50x" and second.split()[7] == "2.00x"  # 200 / 400, 10 / 5
    assert "vs l.cpp" not in "\n".join(format_matrix(rows, has_ref=False))


def test_format_matrix_dashes_for_figures_not_measured():
    quill = {"prefill_tps": {}, "decode_tps": {"2x32": 12.0, "8x32": 40.0}}
    lines = format_matrix([matrix_row(_report("b.gguf", quill), [], [2, 8], [32])], has_ref=False)
    assert lines[0].startswith("matrix: tok/s, decode at context 32;")
    cells = lines[2].split()
    assert cells == ["b.gguf", "100.0", "120.0", "1.200", "-", "-", "40.0", "-", "-"]


# --- two tiny synth files through the command ---------------------------------------------------------

TINY = ["--prefill", "16", "--batches", "1,2", "--contexts", "16", "--decode-steps", "2", "--repeats", "1"]


@pytest.fixture(scope="module")
def two_files(tmp_path_factory):
    from quill.bench.synth import MODELS, write_synth

    folder = tmp_path_factory.mktemp("matrix")
    paths = [folder / "gemma-q8.gguf", folder / "gemma-q4km.gguf"]
    write_synth(paths[0], MODELS["gemma-3-1b"], "Q8_0", num_layers=1, vocab=512)
    write_synth(paths[1], MODELS["gemma-3-1b"], "Q4_K_M", num_layers=1, vocab=512, seed=1)
    return paths


def test_models_runs_each_in_turn_and_prints_the_matrix(two_files, tmp_path, capsys, monkeypatch):
    from quill.bench.quill_runner import QuillRunner

    loaded, alive_at_load = [], []
    init = QuillRunner.__init__

    def tracking_init(self, *args, **kwargs):
        alive_at_load.append([ref() is not None for ref in loaded])
        init(self, *args, **kwargs)
        loaded.append(weakref.ref(self.engine.loaded.model))

    monkeypatch.setattr(QuillRunner, "__init__", tracking_init)
    a, b = two_files
    out_json = tmp_path / "matrix.json"
    code = main(["bench", "latency", "--models", f"{a},{b}", *TINY, "--json", str(out_json)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert alive_at_load == [[], [False]]  # the first model was gone before the second loaded
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("matrix:"))
    head, rows = lines[start + 1], lines[start + 2:]
    assert "decode b=2" in head and "res/file" in head
    assert [r.split()[0] for r in rows] == [a.name, b.name]
    for row, path in zip(rows, two_files):
        cells = row.split()
        assert float(cells[1]) == pytest.approx(path.stat().st_size / MIB, abs=0.05)
        assert float(cells[3]) > 0  # resident / file
    report = json.loads(out_json.read_text())
    assert [m["path"] for m in report["models"]] == [str(a), str(b)]
    for row, model in zip(report["matrix"], report["models"]):
        assert row["file_bytes"] == model["file_bytes"] == (a if row["model"] == a.name else b).stat().st_size
        # the bandwidth probed before each decode figure; the roofline is against the run's highest
        probes = model["bandwidth_probes"]
        assert len(probes["decode"]) == 2  # batches 1 and 2, one context
        assert model["bandwidth_gbs"] == max(probes["start"] + probes["decode"])
        assert row["resident_bytes"] == model["weight_bytes"] > 0
        assert row["resident_over_file"] == pytest.approx(model["weight_bytes"] / model["file_bytes"])
        assert set(model["quill"]["decode_tps"]) == {"1x16", "2x16"} and row["prefill_len"] == 16
        assert row["decode_b1_tps"] > 0 and row["decode_top_tps"] > 0 and row["roofline_b1"] > 0
    assert text.count("read bandwidth probed (GB/s): start ") == 2


def test_model_alone_prints_no_matrix(two_files, capsys):
    assert main(["bench", "latency", "--model", str(two_files[0]), *TINY]) == 0
    text = capsys.readouterr().out
    assert text.startswith("model ") and "figure" in text and "matrix:" not in text and "==" not in text


def test_runner_close_lets_the_model_go(two_files):
    from quill.bench.quill_runner import QuillRunner

    runner = QuillRunner(str(two_files[1]), None, 64, 2)
    model = weakref.ref(runner.engine.loaded.model)
    assert runner.file_bytes == two_files[1].stat().st_size
    runner.close()
    assert model() is None and runner.engine is None


# --- the roofline's bandwidth probe ----------------------------------------------------------------

@pytest.mark.parametrize("streams,prefetch", [(1, 1), (1, 0), (8, 0), (8, 1), (3, 1)])
def test_the_bandwidth_probe_reads_every_block_once(streams, prefetch):
    """quill_read_sum reads each 32-float block exactly once in every form (streams per thread side by side,
    with or without the request ahead), the threads' remainders included: its sum over ones counts them."""
    import torch

    from quill.kernels import native

    lib = native.load()
    if lib is None:
        pytest.skip("no native kernels on this machine")
    n = 32 * 1003 + 7  # 1003 blocks (not a multiple of threads x streams) and a tail the probe leaves out
    assert lib.quill_read_sum(torch.ones(n).data_ptr(), n, streams, prefetch) == 32 * 1003


def test_the_bandwidth_probe_takes_the_fastest_form():
    from quill.bench.latency import measure_bandwidth

    assert measure_bandwidth(1, mib=8) > 0


# --- quill and llama.cpp alternated -----------------------------------------------------------------

class _FakeRunner:
    """Records each call; returns its next made-up figure."""

    def __init__(self, name: str, log: list, values: list[float]):
        self.name, self.log, self.values = name, log, list(values)

    def prefill_tps(self, tokens, repeats, warm=True):
        self.log.append((self.name, "prefill", len(tokens), repeats, warm))
        return self.values.pop(0)

    def decode_tps(self, tokens, batch, steps, repeats):
        self.log.append((self.name, f"decode {batch}x{len(tokens)}", steps, repeats))
        self.last_breakdown = {"step_ms": float(len(self.log))} if self.name == "quill" else None
        return self.values.pop(0)


def _measure_fakes(monkeypatch, quill_values, ref_values, prefill, batches):
    """latency._measure over two fake engines (3 repeats, context 8, a probe reading 7.0): (out, log, probes)."""
    import argparse

    from quill.bench import latency

    monkeypatch.setattr(latency, "measure_bandwidth", lambda repeats: 7.0)
    log: list = []
    runners = {"quill": _FakeRunner("quill", log, quill_values), "llama.cpp": _FakeRunner("llama.cpp", log, ref_values)}
    probes: list[float] = []
    args = argparse.Namespace(repeats=3, decode_steps=4)
    return latency._measure(runners, list(range(32)), prefill, batches, [8], args, probes), log, probes


def test_each_figure_alternates_the_engines_and_reports_medians(monkeypatch):
    """Every run of a figure alternates quill and llama.cpp (A B, B A, A B), each run one repeat, and each
    engine's median is its figure; the warm-up prefill only before a figure's first run; one bandwidth probe
    before each decode figure, for both."""
    out, log, probes = _measure_fakes(monkeypatch, [10, 30, 20, 1, 3, 2], [5, 4, 6, 9, 7, 8], [16], [2])
    assert [(call[0], call[1]) for call in log] == [("quill", "prefill"), ("llama.cpp", "prefill"),
                                                   ("llama.cpp", "prefill"), ("quill", "prefill"),
                                                   ("quill", "prefill"), ("llama.cpp", "prefill"),
                                                   ("quill", "decode 2x8"), ("llama.cpp", "decode 2x8"),
                                                   ("llama.cpp", "decode 2x8"), ("quill", "decode 2x8"),
                                                   ("quill", "decode 2x8"), ("llama.cpp", "decode 2x8")]
    assert [call[4] for call in log[:6]] == [True, True, False, False, False, False]  # warm-up: first run only
    assert all(call[3] == 1 for call in log)  # one repeat per call
    assert out["quill"]["prefill_tps"] == {"16": 20} and out["llama.cpp"]["prefill_tps"] == {"16": 5}
    assert out["quill"]["decode_tps"] == {"2x8": 2} and out["llama.cpp"]["decode_tps"] == {"2x8": 8}
    assert out["quill"]["step_breakdown"] == {"2x8": {"step_ms": 11.0}} and out["llama.cpp"]["step_breakdown"] == {}
    assert probes == [7.0]


def test_decode_batches_take_turns_within_each_round(monkeypatch):
    """A context's batches alternate run by run (b1 b16, b16 b1, b1 b16), each with the engines alternating,
    so a batch's ratio to batch 1 compares runs made under the same conditions; each figure is the median of
    its own runs, and one bandwidth probe comes before each batch's first run."""
    out, log, probes = _measure_fakes(monkeypatch, [1, 10, 30, 3, 2, 20], [4, 40, 60, 6, 5, 50], [], [1, 16])
    assert [(call[0], call[1]) for call in log] == [("quill", "decode 1x8"), ("llama.cpp", "decode 1x8"),
                                                   ("quill", "decode 16x8"), ("llama.cpp", "decode 16x8"),
                                                   ("llama.cpp", "decode 16x8"), ("quill", "decode 16x8"),
                                                   ("llama.cpp", "decode 1x8"), ("quill", "decode 1x8"),
                                                   ("quill", "decode 1x8"), ("llama.cpp", "decode 1x8"),
                                                   ("quill", "decode 16x8"), ("llama.cpp", "decode 16x8")]
    assert out["quill"]["decode_tps"] == {"1x8": 2, "16x8": 20}
    assert out["llama.cpp"]["decode_tps"] == {"1x8": 5, "16x8": 50}
    assert out["quill"]["step_breakdown"] == {"1x8": {"step_ms": 9.0}, "16x8": {"step_ms": 11.0}}
    assert probes == [7.0, 7.0]
