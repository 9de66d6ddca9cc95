"""quill's own weight file: `quill convert` round trips (GGUF and HF sources, int8, real-width K-quant
files), outputs bit-identical to the source, weights viewed in the mapped file, refusals of damaged,
newer and wrong-CPU files, `quill info` on a .quill file, and --cache-dir."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from quill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from quill.kernels import native, options
from quill.llm import LLM
from quill.models import quillfile
from quill.models.convert import convert
from quill.models.loader import load_model
from quill.models.quillfile import QuillFile, QuillFileError
from quill.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native.load() is None, reason=".quill files hold the native kernels' layouts")

PROMPTS = [f"Story {i}: the {w} fox" for i, w in enumerate("quick lazy brown red small old young tall wise kind "
                                                         "calm bold shy loud slow fast".split())]


@pytest.fixture(scope="module")
def default_quill(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "default.quill"
    report = convert(None, path, progress=False)
    return path, report


def _llm(loaded, blocks=64):
    cfg = EngineConfig(model=str(loaded.path), cache=CacheConfig(16, None, True, blocks),
                       scheduler=SchedulerConfig(512, 16))
    return LLM.from_engine_config(cfg, loaded)


def _outputs(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _mapped_ranges(path) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def test_model_config_round_trips_through_json(default_loaded):
    cfgs = [default_loaded.config,
            ModelConfig("gemma3", 10, 8, 8, 2, 2, 1, 4, 64, rope_scaling=(("factors", (1.0, 2.5)), ("rope_type", "x")),
                        sliding_window=4, sliding_layers=(True, False), rope_layers=(True, False),
                        eos_token_ids=(1, 2), rope_local_theta=10000.0)]
    for cfg in cfgs:
        assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_default_model_round_trip_is_bit_identical(default_loaded, default_quill):
    """GGUF source: greedy and seeded sampling, batch 1 and 16, identical token for token; every weight a
    view of the mapped file; the tokenizer, template and EOS ids as the source's."""
    path, report = default_quill
    assert report.file_bytes == path.stat().st_size and report.layout in quillfile.LAYOUTS
    loaded = load_model(str(path))
    assert loaded.file_format == "quill" and loaded.origin_format == "gguf"
    assert loaded.config == default_loaded.config
    tok, ref_tok = loaded.tokenizer, default_loaded.tokenizer
    assert tok.chat_template == ref_tok.chat_template and tok.eos_token_ids == ref_tok.eos_token_ids
    assert tok.encode("Hello <|im_end|> wörld\n") == ref_tok.encode("Hello <|im_end|> wörld\n")
    ranges = _mapped_ranges(path.resolve())
    weights = list(loaded.model._weight_tensors())
    assert ranges and weights
    assert all(any(lo <= t.data_ptr() < hi for lo, hi in ranges) for t in weights)  # nothing copied
    assert all(any(lo <= r.cos.data_ptr() < hi for lo, hi in ranges) for r in loaded.model.ropes.values())
    assert loaded.model.resident_bytes() == default_loaded.model.resident_bytes()

    quill_llm, ref_llm = _llm(loaded), _llm(default_loaded)
    assert quill_llm.engine.kv_cache_dtype == ref_llm.engine.kv_cache_dtype == "fp16"  # the GGUF default kept
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i in range(len(PROMPTS)):
        seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        if i < 2:  # batch 1
            for params in (greedy, seeded):
                assert _outputs(quill_llm, PROMPTS[i], params) == _outputs(ref_llm, PROMPTS[i], params)
    for params in (greedy, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)):
        assert _outputs(quill_llm, PROMPTS, params) == _outputs(ref_llm, PROMPTS, params)  # batch 16


def _hf_folder(tmp_path, tied: bool):
    import transformers as tf

    from test_model_parity import _byte_tokenizer_folder

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tied)
    tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    _byte_tokenizer_folder(tmp_path, cfg.vocab_size)
    return tmp_path


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_hf_folder_round_trip_is_bit_identical(tmp_path, quantize):
    """HF source (bf16 safetensors), as loaded and with --quantize int8: identical outputs, the fp32 KV default
    of a folder kept, the generation config stored."""
    folder = _hf_folder(tmp_path / "hf", tied=quantize is None)
    out = tmp_path / "m.quill"
    convert(folder, out, quantize=quantize, progress=False)
    loaded, ref = load_model(str(out)), load_model(str(folder), quantize=quantize)
    assert loaded.origin_format == "safetensors"
    qf = loaded.quill_file
    assert qf.json("quill.generation_config") == json.loads((folder / "generation_config.json").read_text())
    assert qf.json("quill.source")["quantize"] == quantize
    a, b = _llm(loaded), _llm(ref)
    assert a.engine.kv_cache_dtype == "fp32"
    for params in (SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)):
        assert _outputs(a, PROMPTS[:4], params) == _outputs(b, PROMPTS[:4], params)
        assert _outputs(a, PROMPTS[0], params) == _outputs(b, PROMPTS[0], params)


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q4_0"])
def test_real_width_gguf_round_trip(tmp_path, quant):
    """A real-width Llama 3.2 1B layer: Q4_K_M's split q/k/v (Q4_K beside Q6_K) and tied Q6_K embedding and
    head (one tensor in the file, one in memory); Q4_0's q4 layout with its mins."""
    from quill.bench.synth import MODELS, write_synth
    from quill.kernels.packed import SplitWeight

    src = tmp_path / f"{quant}.gguf"
    write_synth(src, MODELS["llama-3.2-1b"], quant, num_layers=1, vocab=512)
    out = tmp_path / f"{quant}.quill"
    convert(src, out, progress=False)
    loaded, ref = load_model(str(out), context_len=64), load_model(str(src), context_len=64)
    model = loaded.model
    if quant == "Q4_K_M":
        assert isinstance(model.layers[0].self_attn.qkv_proj.weight, SplitWeight)
    assert model.lm_head.weight.tensors()[0].data_ptr() == model.embed_tokens.weight.tensors()[0].data_ptr()
    assert model.resident_bytes() == ref.model.resident_bytes()
    assert model.resident_bytes() <= out.stat().st_size
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert _outputs(_llm(loaded, 16), PROMPTS[:3], params) == _outputs(_llm(ref, 16), PROMPTS[:3], params)


def test_amx_layout_needs_amx(tmp_path, monkeypatch, capsys):
    """--layout amx writes q4/q8 weights as AMX tiles (checked tile by tile after writing, on any CPU). A CPU
    without AMX-INT8, or an engine with AMX turned off, refuses the file naming what is missing."""
    from quill.kernels.tiled import TiledWeight

    out = tmp_path / "amx.quill"
    report = convert(None, out, layout="amx", progress=False)
    assert report.layout == "amx"
    qf = QuillFile(out, check_cpu=False)
    assert qf.layout == "amx" and "amx-int8" in qf.required_features
    assert '"t": "tiled"' in qf.meta["quill.structure"]
    amx_tensors = {n for n in qf.tensor_names()}
    portable = QuillFile(convert(None, tmp_path / "p.quill", layout="portable", progress=False).path, check_cpu=False)
    assert len(amx_tensors) == len(portable.tensor_names())  # the tied Q8_0 embedding and head: one tensor, tiled
    if options.hardware().amx:  # this CPU runs it: same outputs as the source
        loaded = load_model(str(out))
        assert isinstance(loaded.model.layers[0].mlp.down_proj.weight, TiledWeight)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert _outputs(_llm(loaded), PROMPTS[:2], params) == _outputs(_llm(load_model(None)), PROMPTS[:2], params)
    else:
        with pytest.raises(QuillFileError, match="lacks amx-int8.*quill convert"):
            load_model(str(out))
    from quill.cli import main

    assert main(["info", "-m", str(out)]) == 0  # described from its header wherever it can or cannot run
    assert ("runs on this CPU" if options.hardware().amx else "does not run here") in capsys.readouterr().out
    monkeypatch.setenv("QUILL_NO_AMX", "1")
    with pytest.raises(QuillFileError, match="amx"):
        load_model(str(out))


def _rewrite_header(path, edit):
    """Rewrite a .quill header through `edit(meta)`, with a valid checksum, keeping the data where it is."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header["__metadata__"])
    header["__metadata__"][quillfile._CHECKSUM_KEY] = quillfile._ZERO_SUM
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    assert len(raw) <= n
    raw = quillfile._with_checksum(raw + b" " * (n - len(raw)))
    path.write_bytes(data[:8] + raw + data[8 + n:])


def _edit_structure(change):
    def edit(meta):
        structure = json.loads(meta["quill.structure"])
        change({r["key"]: r["obj"] for r in structure})
        meta["quill.structure"] = json.dumps(structure)
    return edit


def _first_packed(specs):
    spec = specs["linear model.layers.0.mlp.down_proj"]["weight"]
    return spec


_CRAFTED = {
    "scale-is-codes": _edit_structure(lambda s: _first_packed(s).update(scale=_first_packed(s)["codes"])),
    "q4-as-q8": _edit_structure(lambda s: _first_packed(s).update(kind="q8" if _first_packed(s)["kind"] == "q4" else "q4")),
    # the layout named too: on a CPU with AMX the default conversion is an amx file, whose weights are tiles
    "tiles-in-portable": lambda m: (_edit_structure(lambda s: _first_packed(s).update(t="tiled"))(m),
                                    m.update({"quill.layout": "portable"})),
    "missing-tensor": _edit_structure(lambda s: _first_packed(s).update(codes="nowhere")),
    "wrong-width": _edit_structure(lambda s: s["linear model.layers.0.mlp.down_proj"].update(
        json.loads(json.dumps(s["linear model.layers.0.self_attn.o_proj"])))),  # o_proj's (576, 576) as down's
    "unknown-kind": _edit_structure(lambda s: s["tensor model.norm.weight"].update(t="mystery")),
    "version-1.0": lambda m: m.update({"quill.format_version": "1.0"}),
    "config-from-the-future": lambda m: m.update({"quill.model_config": json.dumps(
        {**json.loads(m["quill.model_config"]), "new_field": 1})}),
    "structure-not-json": lambda m: m.update({"quill.structure": "{"}),
}


def test_damaged_newer_and_foreign_files_are_refused(tmp_path, default_quill):
    src, _ = default_quill
    data = src.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])

    def file(name, content):
        p = tmp_path / name
        p.write_bytes(content)
        return str(p)

    with pytest.raises(QuillFileError, match="damaged|truncated"):
        load_model(file("cut.quill", data[:-1000]))  # truncated in the weights
    with pytest.raises(QuillFileError, match="header claims"):
        load_model(file("cut-header.quill", data[:n // 2]))
    with pytest.raises(QuillFileError, match="too short"):
        load_model(file("tiny.quill", b"\x01\x02"))
    flipped = bytearray(data)
    at = data.index(b'"shape":[', 8) + 9
    flipped[at] = ord("7") if flipped[at] != ord("7") else ord("8")
    with pytest.raises(QuillFileError, match="header checksum mismatch"):
        load_model(file("flipped.quill", bytes(flipped)))

    newer = tmp_path / "newer.quill"
    newer.write_bytes(data)
    _rewrite_header(newer, lambda m: m.update({"quill.format_version": "99"}))
    with pytest.raises(QuillFileError, match=f"format version 99.*reads up to version {quillfile.FORMAT_VERSION}"):
        load_model(str(newer))
    older = tmp_path / "older.quill"  # version 1 (before the vnni layout tiled Q8_0) still loads
    older.write_bytes(data)
    _rewrite_header(older, lambda m: m.update({"quill.format_version": "1"}))
    assert QuillFile(older).version == 1 and load_model(str(older)).model is not None
    foreign = tmp_path / "foreign.quill"
    foreign.write_bytes(data)
    _rewrite_header(foreign, lambda m: m.update({"quill.layout": "sme2"}))
    with pytest.raises(QuillFileError, match="'sme2'.*re-run `quill convert`"):
        load_model(str(foreign))
    from safetensors.torch import save_file

    plain = tmp_path / "plain.quill"
    save_file({"w": torch.zeros(4)}, str(plain))
    with pytest.raises(QuillFileError, match="not a .quill file"):
        load_model(str(plain))

    for label, edit in _CRAFTED.items():  # valid checksums, inconsistent contents: refused, never run
        crafted = tmp_path / f"{label}.quill"
        crafted.write_bytes(data)
        _rewrite_header(crafted, edit)
        with pytest.raises(QuillFileError):
            load_model(str(crafted))

    bad_data = bytearray(data)
    bad_data[-5000] ^= 0xFF  # a weight byte: not read at load (that would touch every page), found by --verify
    path = file("bad-data.quill", bytes(bad_data))
    qf = QuillFile(path)
    with pytest.raises(QuillFileError, match="data checksum mismatch"):
        qf.verify_data(progress=False)


def test_quill_info_and_convert_cli(tmp_path, capsys, default_quill):
    from quill.cli import main

    path, report = default_quill
    assert main(["info", "-m", str(path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "format                 quill" in out and f"{report.source_sha256}" in out
    assert "CPU layout" in out and f"{report.data_sha256} (verified)" in out and f"quill format           version {quillfile.FORMAT_VERSION}" in out
    assert main(["info", "--verify"]) == 1  # the GGUF default: nothing to verify, said so
    assert "not a .quill file" in capsys.readouterr().err
    assert main(["convert", "-o", str(path)]) == 1  # exists
    assert "--force" in capsys.readouterr().err
    assert main(["convert", "-o", str(tmp_path / "x.bin")]) == 1
    assert "must end in .quill" in capsys.readouterr().err
    assert main(["memory", "--model", str(path), "--budget", "1GiB"]) == 0
    assert "fp16: the engine's default" in capsys.readouterr().out


def test_cache_dir_converts_once_and_maps_afterwards(tmp_path, monkeypatch):
    import os

    from quill.bench.synth import MODELS, write_synth
    from quill.models import convert as convert_module

    src = tmp_path / "src.gguf"
    write_synth(src, MODELS["qwen3-1.7b"], "Q8_0", num_layers=1, vocab=512)
    cache = tmp_path / "cache"
    first = load_model(str(src), cache_dir=str(cache), context_len=64)
    files = sorted(cache.glob("*.quill"))
    assert len(files) == 1 and first.file_format == "quill" and first.name == "src"
    assert files[0].name.startswith("src-") and f"-v{quillfile.FORMAT_VERSION}-" in files[0].name

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(convert_module, "convert", no_conversion)
    monkeypatch.setattr(convert_module, "source_sha256", no_conversion)  # the index answers for unchanged files
    again = load_model(str(src), cache_dir=str(cache), context_len=64)
    assert again.path == files[0]
    os.utime(src, ns=(1, 1))  # touched, same bytes: hashed again, the same file reused
    monkeypatch.undo()
    monkeypatch.setattr(convert_module, "convert", no_conversion)
    assert load_model(str(src), cache_dir=str(cache), context_len=64).path == files[0]
    monkeypatch.undo()
    write_synth(src, MODELS["qwen3-1.7b"], "Q4_0", num_layers=1, vocab=512)  # new content: a new file
    assert load_model(str(src), cache_dir=str(cache), context_len=64).path != files[0]
    assert len(list(cache.glob("*.quill"))) == 2
    monkeypatch.setattr(native, "load", lambda: None)  # no kernels: the flag is ignored, the source loads
    assert load_model(str(src), cache_dir=str(cache), context_len=64).file_format == "gguf"


def test_a_file_that_fails_verification_never_appears(tmp_path, monkeypatch):
    from quill.models import convert as convert_module

    def reject(path, *a, **k):
        raise QuillFileError(f"{path.name}: rejected")

    monkeypatch.setattr(convert_module, "verify", reject)
    out = tmp_path / "m.quill"
    with pytest.raises(QuillFileError, match="rejected"):
        convert(None, out, progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def _prefill_and_decode_logits(model, cfg, prompt):
    from test_model_parity import run_chunk

    from quill.engine.block_manager import BlockManager
    from quill.engine.kv_cache import KVCache
    from quill.engine.model_runner import ModelRunner
    from quill.engine.sequence import Sequence

    runner = ModelRunner(model, cfg, KVCache(cfg, 64, 4, torch.float32), sampler=None)
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    seq = Sequence("r", prompt, SamplingParams())
    out = [run_chunk(runner, bm, seq, 0, len(prompt))]
    for _ in range(4):  # decode rows: the fused path
        seq.append_token(int(out[-1][-1].argmax()), 0.0)
        out.append(run_chunk(runner, bm, seq, seq.num_tokens - 1, 1))
    return torch.cat(out)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama3-tied", "qwen2", "qwen3", "gemma3", "olmo2", "smollm3", "phi3",
                                  "granite"])
def test_every_architecture_round_trips(tmp_path, kind):
    """Each family's tiny model as llama.cpp's converter writes it: recorded, written, mapped back; the same
    logits bit for bit through prefill and the fused decode path, and shapes that fit the config."""
    import collections

    from test_model_parity import CONTEXT_LEN, GGUF_KINDS
    from tiny_models import make_hf_model, write_llama_gguf
    from tokenizers import Tokenizer, models

    from quill.models.gguf import GGUFModelFile
    from quill.models.llama import LlamaForCausalLM
    from quill.models.loader import PackedGGUFWeights

    write_llama_gguf(make_hf_model(kind), tmp_path / "m.gguf", arch=GGUF_KINDS[kind])
    gf = GGUFModelFile(tmp_path / "m.gguf")
    cfg, ctx = gf.model_config(), CONTEXT_LEN.get(kind)
    recorder = quillfile.RecordingWeights(PackedGGUFWeights(gf, "cpu", collections.Counter()))
    source = LlamaForCausalLM(cfg, recorder, context_len=ctx)
    meta = {"quill.model_config": json.dumps(cfg.to_dict()), "quill.source": json.dumps({"format": "gguf"})}
    records = recorder.records + quillfile.rope_records(cfg)
    quillfile.write(tmp_path / "m.quill", records, meta, Tokenizer(models.BPE()).to_str(), "portable", progress=False)
    qf = QuillFile(tmp_path / "m.quill")
    mapped = LlamaForCausalLM(qf.model_config(), quillfile.QuillWeights(qf), context_len=ctx)
    assert mapped.shape_errors() == [] and source.shape_errors() == []
    ranges = _mapped_ranges((tmp_path / "m.quill").resolve())
    in_file = [any(lo <= r.cos.data_ptr() < hi for lo, hi in ranges) for r in mapped.ropes.values()]
    # the stored whole-context tables serve every family, but LongRoPE served within its original context
    # (phi3 here: 64 of 256) takes the short factors, so those are computed
    assert in_file == [kind != "phi3"] * len(mapped.ropes)
    prompt = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(_prefill_and_decode_logits(mapped, cfg, prompt), _prefill_and_decode_logits(source, cfg, prompt))


def test_k_quant_tiles_need_their_scale_factors_and_q8_tiles_have_none():
    """A tiled spec whose kind and K-quant scale factors disagree is a damaged file, refused before any shape."""
    get = {"c": torch.zeros(1, 4, 512, dtype=torch.uint8), "s": torch.zeros(1, 8, 16, dtype=torch.int8),
           "d": torch.zeros(1, 1, 16, dtype=torch.float16), None: None}.get
    for kind in ("iq4", "q5", "q6"):
        with pytest.raises(QuillFileError, match=f"{kind} tiles without K-quant scales"):
            quillfile._decode_weight({"t": "tiled", "kind": kind, "codes": "c", "scale": "s", "mins": None}, get)
    with pytest.raises(QuillFileError, match="q8 tiles with K-quant scales"):
        quillfile._decode_weight({"t": "tiled", "kind": "q8", "codes": "c", "scale": "s", "mins": None,
                                  "scale_d": "d"}, get)
    t = quillfile._decode_weight({"t": "tiled", "kind": "iq4", "codes": "c", "scale": "s", "mins": None,
                                  "scale_d": "d"}, get)  # 256 columns of IQ4_XS: one factor per row
    assert (t.kind, t.rows, t.cols, t.native_kind) == ("iq4", 16, 256, 8 | 4)


def test_q3_tiles_load_only_as_vnni_tiles():
    """Q3_K's q3 tiles (tiled.VNNI_ONLY) are refused in an AMX file's structure, where the AMX kernels would get
    codes they have no path for, and load as VNNI tiles with their per-16 scales. (Q2_K's q2 tiles likewise:
    test_q2_tiles_keep_their_min_factors.)"""
    get = {"c": torch.zeros(1, 4, 384, dtype=torch.uint8), "s": torch.zeros(1, 16, 16, dtype=torch.int8),
           "d": torch.zeros(1, 1, 16, dtype=torch.float16), None: None}.get
    spec = {"t": "tiled", "kind": "q3", "codes": "c", "scale": "s", "mins": None, "scale_d": "d"}
    with pytest.raises(QuillFileError, match="AMX q3 tiles"):
        quillfile._decode_weight(spec, get)
    t = quillfile._decode_weight({**spec, "vnni": True}, get, layout="vnni")
    assert (t.kind, t.rows, t.cols, t.vnni, t.native_kind) == ("q3", 16, 256, True, 128 | 64 | 4)


def test_q2_tiles_keep_their_min_factors():
    """Q2_K's q2 tiles hold their mins in the scale bytes' high nibbles, so they have min factors (dmin) without
    a mins tensor: a VNNI file's structure gives them back, and an AMX one is refused."""
    get = {"c": torch.zeros(1, 4, 256, dtype=torch.uint8), "s": torch.zeros(1, 16, 16, dtype=torch.int8),
           "d": torch.zeros(1, 1, 16, dtype=torch.float16), "m": torch.ones(1, 1, 16, dtype=torch.float16),
           None: None}.get
    spec = {"t": "tiled", "kind": "q2", "codes": "c", "scale": "s", "mins": None, "scale_d": "d", "mins_d": "m"}
    with pytest.raises(QuillFileError, match="AMX q2 tiles"):
        quillfile._decode_weight(spec, get)
    t = quillfile._decode_weight({**spec, "vnni": True}, get, layout="vnni")
    assert (t.kind, t.rows, t.cols, t.native_kind) == ("q2", 16, 256, 256 | 64 | 4)
    assert t.mins is None and torch.equal(t.mins_d, torch.ones(1, 1, 16, dtype=torch.float16))


def test_vnni_q8_tiles_must_be_what_tile_for_vnni_makes():
    """VNNI-marked q8 tiles (a vnni file's Q8_0) load as such with fp16 scales, no mins and whole 256-column
    blocks; anything else is a damaged file, refused rather than handed to a kernel that takes 256 columns at a
    time."""
    def decode(cols: int, scale_dtype=torch.float16, mins: bool = False):
        groups = torch.zeros(1, cols // 32, 16, dtype=scale_dtype)
        get = {"c": torch.zeros(1, cols // 64, 1024, dtype=torch.int8), "s": groups, "m": groups, None: None}.get
        return quillfile._decode_weight({"t": "tiled", "kind": "q8", "codes": "c", "scale": "s",
                                         "mins": "m" if mins else None, "vnni": True}, get, layout="vnni")

    t = decode(256)
    assert (t.kind, t.rows, t.cols, t.vnni, t.native_kind) == ("q8", 16, 256, True, 1 | 2 | 64)
    with pytest.raises(QuillFileError, match="tile scales of shape"):
        decode(192)  # whole 64-column tiles, but not whole 256-column blocks
    with pytest.raises(QuillFileError, match="VNNI q8 tiles with mins or without fp16 scales"):
        decode(256, mins=True)
    with pytest.raises(QuillFileError, match="VNNI q8 tiles with mins or without fp16 scales"):
        decode(256, scale_dtype=torch.float32)
