"""`quill bench synth`: real-width files of every family and quant load through quill with the real
shape, carry llama.cpp's tensor-type mix, valid blocks, and generate; the recipe's facts by hand."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from quill.bench import synth
from quill.bench.synth import ARCH_DEFAULTS, MODELS, plan_types, tensor_plan, write_synth
from quill.config import UnsupportedModelError
from quill.kernels.dequant import SUPPORTED_TYPES

VOCAB = 512  # the tests' token rows (the real vocabularies make 100-500 MiB tensors)


def _full_types(model: str, quant: str) -> dict[str, str]:
    s = MODELS[model]
    return plan_types(s, tensor_plan(s, s.layers, s.vocab), quant, s.layers)


def _layers_with(types: dict[str, str], suffix: str, type_name: str) -> list[int]:
    return sorted(int(k.split(".")[1]) for k, v in types.items() if k.endswith(suffix) and v == type_name)


# --- the recipe, checked against facts worked out by hand from llama-quant.cpp ----------------

def test_llama_1b_q4_k_m_recipe():
    types = _full_types("llama-3.2-1b", "Q4_K_M")
    # use_more_bits over 16 layers: i < 2, i >= 14, (i - 2) % 3 == 2
    more = [0, 1, 4, 7, 10, 13, 14, 15]
    assert _layers_with(types, "attn_v.weight", "Q6_K") == more
    assert _layers_with(types, "ffn_down.weight", "Q6_K") == more
    assert types["token_embd.weight"] == "Q6_K"  # tied: the output's type
    assert "output.weight" not in types
    assert sum(v == "Q6_K" for v in types.values()) == 17
    assert {types[f"blk.3.{n}.weight"] for n in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert types["blk.3.attn_norm.weight"] == "F32"


def test_llama_8b_untied_q4_k_m_recipe():
    types = _full_types("llama-3.1-8b", "Q4_K_M")
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    more = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert _layers_with(types, "attn_v.weight", "Q6_K") == more


def test_iq4_xs_and_q5_k_m_recipes():
    types = _full_types("llama-3.2-1b", "IQ4_XS")  # n_gqa = 32 / 8 = 4
    assert _layers_with(types, "attn_v.weight", "Q5_K") == list(range(16))
    assert _layers_with(types, "ffn_down.weight", "Q5_K") == [0, 1]  # first eighth, no imatrix
    assert types["blk.5.ffn_down.weight"] == "IQ4_XS" and types["token_embd.weight"] == "Q6_K"
    phi = _full_types("phi-4-mini", "IQ4_XS")  # n_gqa = 3: attn_qkv keeps the default
    assert phi["blk.0.attn_qkv.weight"] == "IQ4_XS"
    q5 = _full_types("llama-3.2-1b", "Q5_K_M")
    assert _layers_with(q5, "attn_v.weight", "Q6_K") == [0, 1, 4, 7, 10, 13, 14, 15]
    assert q5["blk.3.ffn_gate.weight"] == "Q5_K"


def test_q8_0_q4_0_q6_k_recipes():
    assert set(_full_types("llama-3.2-1b", "Q8_0").values()) == {"Q8_0", "F32"}  # output stays Q8_0
    q4 = _full_types("llama-3.2-1b", "Q4_0")
    assert q4["token_embd.weight"] == "Q6_K" and set(q4.values()) == {"Q4_0", "Q6_K", "F32"}
    assert set(_full_types("qwen2.5-1.5b", "Q6_K").values()) == {"Q6_K", "F32"}


def test_q2_k_and_q3_k_m_recipes():
    types = _full_types("llama-3.2-1b", "Q2_K")  # n_gqa = 4: attn_v Q4_K
    assert _layers_with(types, "attn_v.weight", "Q4_K") == list(range(16))
    assert _layers_with(types, "attn_output.weight", "Q3_K") == list(range(16))
    assert _layers_with(types, "ffn_down.weight", "Q3_K") == list(range(16))
    assert {types[f"blk.3.{n}.weight"] for n in ("attn_q", "attn_k", "ffn_gate", "ffn_up")} == {"Q2_K"}
    assert types["token_embd.weight"] == "Q6_K"
    assert _full_types("phi-4-mini", "Q2_K")["blk.0.attn_qkv.weight"] == "Q3_K"  # n_gqa = 3
    assert _full_types("llama-3.1-8b", "Q2_K")["token_embd.weight"] == "Q2_K"  # untied: the default
    q3 = _full_types("llama-3.1-8b", "Q3_K_M")  # 32 layers: n_layer / 16 = 2
    assert _layers_with(q3, "attn_v.weight", "Q5_K") == [0, 1] and _layers_with(q3, "attn_v.weight", "Q4_K") == list(range(2, 32))
    assert _layers_with(q3, "ffn_down.weight", "Q5_K") == [0, 1] and _layers_with(q3, "ffn_down.weight", "Q4_K") == list(range(2, 32))
    assert _layers_with(q3, "attn_output.weight", "Q4_K") == list(range(32))
    assert {q3[f"blk.9.{n}.weight"] for n in ("attn_q", "attn_k", "ffn_gate", "ffn_up")} == {"Q3_K"}
    assert q3["output.weight"] == "Q6_K" and q3["token_embd.weight"] == "Q3_K"
    assert _layers_with(_full_types("llama-3.2-1b", "Q3_K_M"), "ffn_down.weight", "Q5_K") == [0]  # 16 / 16 = 1
    gemma = _full_types("gemma-3-1b", "Q2_K")  # rows of 1152: Q2_K / Q3_K fall back to Q4_0
    assert gemma["blk.2.attn_q.weight"] == "Q4_0" and gemma["blk.2.ffn_down.weight"] == "Q3_K"  # 6912 = 27 x 256
    assert gemma["blk.2.attn_v.weight"] == "Q5_0"  # Q4_K (n_gqa = 4), then its fallback


def _llama_quantize() -> Path | None:
    """llama.cpp's quantizer where the reference build is set up (LLAMA_BIN from ../shared/tools/llamacpp.sh)."""
    tool = Path(os.environ.get("LLAMA_BIN", "/nonexistent")) / "llama-quantize"
    return tool if tool.is_file() else None


@pytest.mark.skipif(_llama_quantize() is None, reason="needs llama.cpp's llama-quantize (LLAMA_BIN)")
def test_recipes_equal_llama_quantize(tmp_path):
    """Every --quant's types equal what llama-quantize writes from the same F16 file: small widths,
    n_gqa 4 and 2, 16 and 18 layers, and rows of 320 (fallbacks, untied output)."""
    env = {**os.environ, "LD_LIBRARY_PATH": os.environ["LLAMA_BIN"]}
    base = MODELS["llama-3.2-1b"]
    for hidden, kv_heads, layers, tied in ((256, 2, 16, True), (256, 4, 18, True), (320, 2, 4, False)):
        s = dataclasses.replace(base, hidden=hidden, heads=hidden // 32, kv_heads=kv_heads, head_dim=32, ffn=768,
                                layers=layers, tied=tied)
        f16 = tmp_path / "f16.gguf"
        write_synth(f16, s, "F16", vocab=VOCAB)
        for quant in (q for q in synth.QUANTS if q != "F16"):
            out = tmp_path / f"{quant}.gguf"
            subprocess.run([str(_llama_quantize()), str(f16), str(out), quant, "1"], check=True, capture_output=True, env=env)
            written = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
            assert written == plan_types(s, tensor_plan(s, layers, VOCAB), quant, layers), (hidden, kv_heads, quant)


def test_gemma_rows_of_1152_fall_back():
    """1152 is not a multiple of 256: llama.cpp's fallbacks (Q4_K->Q5_0, Q6_K->Q8_0, IQ4_XS->IQ4_NL)."""
    types = _full_types("gemma-3-1b", "Q4_K_M")
    assert types["token_embd.weight"] == "Q8_0"  # tied output: Q8_0 when the row does not fit the block
    assert types["blk.2.attn_q.weight"] == "Q5_0" and types["blk.2.ffn_up.weight"] == "Q5_0"
    assert types["blk.0.attn_v.weight"] == "Q8_0"  # Q6_K by use_more_bits, then the fallback
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.2.attn_output.weight"] == "Q4_K"
    assert _full_types("gemma-3-1b", "IQ4_XS")["blk.2.attn_q.weight"] == "IQ4_NL"


def test_parameter_counts_match_the_models():
    """The full plans hold the published sizes (1.23B, 3.21B, 8.03B for Llama; ~1B Gemma 3)."""
    def params(name):
        s = MODELS[name]
        return sum(math.prod(t.shape) for t in tensor_plan(s, s.layers, s.vocab))

    assert abs(params("llama-3.2-1b") / 1e9 - 1.236) < 0.005
    assert abs(params("llama-3.2-3b") / 1e9 - 3.213) < 0.005
    assert abs(params("llama-3.1-8b") / 1e9 - 8.030) < 0.005
    assert abs(params("gemma-3-1b") / 1e9 - 1.000) < 0.01


# --- real-width files through quill -----------------------------------------------------------

CASES = [(arch, "Q4_K_M") for arch in ARCH_DEFAULTS] + \
        [("llama", q) for q in ("Q8_0", "Q4_0", "Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "F16")] + \
        [("gemma3", "Q8_0"), ("gemma3", "Q2_K")]


@pytest.mark.parametrize("arch,quant", CASES)
def test_file_loads_with_the_real_shape_and_generates(tmp_path, arch, quant):
    from quill.config import CacheConfig, EngineConfig, SchedulerConfig
    from quill.llm import LLM
    from quill.models.loader import load_model
    from quill.sampling_params import SamplingParams

    s = MODELS[ARCH_DEFAULTS[arch]]
    path = tmp_path / f"{arch}-{quant}.gguf"
    result = write_synth(path, s, quant, num_layers=1, vocab=VOCAB)
    reader = GGUFReader(path)
    assert {t.name: t.tensor_type.name for t in reader.tensors} == result.types
    assert result.types == plan_types(s, tensor_plan(s, 1, VOCAB), quant, 1)
    assert str(reader.fields["general.architecture"].contents()) == s.arch
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == VOCAB

    unreadable = sorted({t for t in result.types.values() if GGMLQuantizationType[t] not in SUPPORTED_TYPES})
    if unreadable:  # written as llama.cpp would (it reads them); quill must refuse, naming the type
        with pytest.raises(UnsupportedModelError, match=unreadable[0]):
            load_model(str(path), context_len=64)
        return
    loaded = load_model(str(path), context_len=64)
    c = loaded.config
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == \
        (s.hidden, s.heads, s.kv_heads, s.head_dim, s.ffn)
    assert (c.num_layers, c.vocab_size, c.tie_word_embeddings) == (1, VOCAB, s.tied)
    assert c.rope_theta == s.rope_base and c.max_position_embeddings == s.context
    assert c.rms_norm_eps == pytest.approx(s.rms_eps)
    assert c.attention_bias == (s.arch == "qwen2")
    if s.arch == "gemma3":
        assert (c.sliding_window, c.rope_local_theta, c.hidden_act) == (512, 10000.0, "gelu_tanh")
    if s.arch == "phi3":
        assert c.rotary_dim == 96 and dict(c.rope_scaling)["rope_type"] == "longrope"
    if s.arch == "granite":
        assert (c.embedding_multiplier, c.attention_multiplier, c.residual_multiplier, c.logits_scaling) == \
            (12.0, 0.015625, 0.22, 8.0)
    if s.llama3_rope:
        assert dict(c.rope_scaling)["rope_type"] == "freq_factors"
    llm = LLM.from_engine_config(EngineConfig(model=str(path), max_model_len=64,
                                              cache=CacheConfig(16, None, True, 8, "auto"),
                                              scheduler=SchedulerConfig(64, 2)), loaded)
    out = llm.generate("Hello there", SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("quant", [q for q in synth.QUANTS if q != "F16"])
def test_blocks_are_valid(tmp_path, quant):
    """Every quantized tensor dequantizes (gguf's reference) to finite weights of trained-like size."""
    path = tmp_path / "m.gguf"
    write_synth(path, MODELS["gemma-3-1b"] if quant == "Q4_K_M" else MODELS["qwen3-1.7b"], quant,
                num_layers=1, vocab=256)
    seen = set()
    for t in GGUFReader(path).tensors:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            continue
        seen.add(t.tensor_type.name)
        w = dequantize(t.data, t.tensor_type)
        assert np.isfinite(w).all(), t.name
        assert 0.005 < float(w.std()) < 0.1 and float(np.abs(w).max()) < 0.5, (t.name, w.std(), np.abs(w).max())
    assert seen


@pytest.mark.parametrize("quant,low", [("Q2_K", {"Q2_K", "Q3_K"}), ("Q3_K_M", {"Q3_K"})])
def test_low_bit_k_files_stay_in_their_blocks(tmp_path, quant, low):
    """Q2_K and Q3_K tensors load as their own blocks (kquant.c kinds 8 and 9) or, where the VNNI tiles run and
    AMX does not tile (tiled.for_cpu: the AMX tiles have no q2 / q3 kinds, so on an AMX CPU they stay blocks), as
    their q2 / q3 tiles (tiled.py), so the resident weights stay within 1.1x the file's tensor bytes; an
    untied 8B-wide file so token_embd keeps the default type."""
    from quill.kernels import tiled
    from quill.kernels.kquant import BlockWeight
    from quill.models.loader import load_model

    path = tmp_path / f"{quant}.gguf"
    result = write_synth(path, MODELS["llama-3.1-8b"], quant, num_layers=1, vocab=VOCAB)
    assert low <= set(result.types.values())
    loaded = load_model(str(path), context_len=64)
    weights = []
    for m in loaded.model.modules():
        w = getattr(m, "weight", None)
        weights += getattr(w, "parts", [w])
    kept = {w.qtype.name for w in weights if isinstance(w, BlockWeight)}
    tiles = {{"q3": "Q3_K", "q2": "Q2_K"}[w.kind] for w in weights
             if isinstance(w, tiled.TiledWeight) and w.kind in tiled.VNNI_ONLY}
    assert not kept & tiles and bool(tiles) == (tiled.vnni_available() and not tiled.available()), (kept, tiles)
    assert low <= kept | tiles, (kept, tiles)
    tensor_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert loaded.model.resident_bytes() <= 1.1 * tensor_bytes


def test_real_vocab_is_padded_with_unused_tokens(tmp_path):
    """Granite's 49155 rows: the 49152 default tokens plus 3 unused ones, so token count == rows."""
    from quill.models.default import default_model_path
    from quill.models.loader import load_model
    from quill.tokenizer import Tokenizer

    path = tmp_path / "granite.gguf"
    write_synth(path, MODELS["granite-3.2-2b"], "Q8_0", num_layers=1)
    reader = GGUFReader(path)
    tokens, types = reader.fields["tokenizer.ggml.tokens"], reader.fields["tokenizer.ggml.token_type"]
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert len(tokens.data) == 49155 == int(embd.shape[1])
    assert [int(types.parts[i][0]) for i in types.data[-4:]] == [1, 5, 5, 5]  # last default token (normal), then unused
    assert bytes(tokens.parts[tokens.data[-1]]).decode() == "<|synth_unused_2|>"
    assert reader.fields["granite.vocab_size"].contents() == 49155
    loaded = load_model(str(path), context_len=64)
    assert loaded.config.vocab_size == 49155
    default = Tokenizer.from_gguf_file(default_model_path())  # the embedded model's tokenizer
    text = "Hello world, <|im_start|>user"
    assert loaded.tokenizer.encode(text) == default.encode(text)


def test_cli_list_and_errors(tmp_path, capsys):
    from quill.cli import main

    assert main(["bench", "synth", "--list"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in MODELS) and "IQ4_XS" in listing
    assert main(["bench", "synth", "--model", "llama-9b", "-o", str(tmp_path / "x.gguf")]) == 1
    err = capsys.readouterr().err
    assert "llama-9b" in err and "llama-3.2-1b" in err
    assert main(["bench", "synth", "--arch", "gpt2", "-o", str(tmp_path / "x.gguf")]) == 1
    assert "gemma3" in capsys.readouterr().err
    assert main(["bench", "synth", "--arch", "qwen2", "--quant", "Q3_K_S", "-o", str(tmp_path / "x.gguf")]) == 1
    assert "Q4_K_M" in capsys.readouterr().err
    assert main(["bench", "synth", "--arch", "qwen3", "--quant", "Q8_0", "--layers", "1", "--vocab", "300",
                 "-o", str(tmp_path / "q.gguf")]) == 0
    out = capsys.readouterr().out
    assert "qwen3-1.7b" in out and "Q8_0 x" in out and "parameters" in out and (tmp_path / "q.gguf").exists()
