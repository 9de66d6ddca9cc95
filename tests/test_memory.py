"""`quill memory`: weight and KV sizes, budget parsing, users per context."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from quill import memory
from quill.config import ModelConfig

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def run_memory(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="quill")
    memory.register(parser.add_subparsers())
    args = parser.parse_args(["memory", *argv])
    return args.func(args)


@pytest.fixture
def llama3_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return path


def table_row(out: str, context: int) -> tuple[str, int]:
    match = re.search(rf"^{context:,} tokens\s+(\S+ \S+)\s+([\d,]+)", out, re.MULTILINE)
    assert match, f"no row for {context:,} tokens in:\n{out}"
    return match.group(1), int(match.group(2).replace(",", ""))


def test_llama3_8b_fp16(llama3_config, capsys):
    assert run_memory("--config", str(llama3_config), "--kv-dtype", "fp16", "--budget", "24GiB",
                      "--contexts", "2k,20000,128k") == 0
    out = capsys.readouterr().out
    assert "128 KiB per token (131,072 bytes" in out
    per_user, users = table_row(out, 20_000)
    assert per_user == "2.44 GiB"  # 20,000 x 128 KiB
    weights = ModelConfig.from_hf_config(LLAMA3_8B).num_parameters * 2  # bfloat16
    assert f"weights     {memory.fmt_bytes(weights)}" in out and "bfloat16" in out
    assert users == (24 * 2**30 - weights) // 131072 // 20_000
    assert table_row(out, 2048) == ("256 MiB", (24 * 2**30 - weights) // 131072 // 2048)
    assert "beyond the model's context of 8,192" in out.split("131,072 tokens")[1]


def test_hf_folder_uses_weight_file_sizes(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    for name, size in (("model-1.safetensors", 3000), ("model-2.safetensors", 1000), ("old.bin", 99999)):
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)
    assert run_memory("--model", str(tmp_path), "--budget", "1GiB") == 0
    out = capsys.readouterr().out
    assert "weights     3.91 KiB (size of 2 weight file(s)" in out  # 4000 bytes; the .bin is ignored
    assert "256 KiB per token" in out and "fp32: the engine's default" in out


def test_default_model_fp16_and_fp32(capsys):
    """A GGUF file gets the engine's default fp16 cache (as llama.cpp); --kv-dtype fp32 doubles it."""
    assert run_memory("--budget", "1GiB") == 0
    out = capsys.readouterr().out
    assert "22.5 KiB per token (23,040 bytes" in out and "fp16: the engine's default" in out
    from quill.models.default import default_model_path

    size = default_model_path().stat().st_size
    assert f"weights     {memory.fmt_bytes(size)} (file size" in out
    capacity = (2**30 - size) // 23040
    assert f"capacity    {capacity:,} tokens" in out
    assert table_row(out, 8192)[1] == capacity // 8192
    assert run_memory("--budget", "1GiB", "--kv-dtype", "fp32") == 0
    assert "45 KiB per token" in capsys.readouterr().out


def test_a_draft_model_adds_its_weights_and_its_kv_per_token(capsys):
    from quill.models.default import default_model_path

    path = str(default_model_path())
    size = default_model_path().stat().st_size
    assert run_memory("--budget", "1GiB", "--draft-model", path) == 0
    out = capsys.readouterr().out
    assert "draft       " in out and "K/V 22.5 KiB per token (30 layers" in out
    capacity = (2**30 - 2 * size) // (2 * 23040)  # the default model drafting for itself: everything twice
    assert f"capacity    {capacity:,} tokens" in out
    assert table_row(out, 8192)[1] == capacity // 8192


def test_bad_inputs_name_the_value(tmp_path, llama3_config, capsys):
    assert run_memory("--config", str(llama3_config), "--budget", "8GX") == 2
    assert "'8GX'" in capsys.readouterr().err
    assert run_memory("--config", str(llama3_config), "--budget", "0") == 2
    assert "positive" in capsys.readouterr().err
    assert run_memory("--config", str(llama3_config), "--contexts", "2k,abc") == 2
    assert "'2k,abc'" in capsys.readouterr().err
    assert run_memory("--model", str(tmp_path / "missing")) == 2
    assert "missing" in capsys.readouterr().err
    llama3_config.write_text(json.dumps(dict(LLAMA3_8B, torch_dtype="float8")))
    assert run_memory("--config", str(llama3_config)) == 2
    assert "'float8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_memory("--kv-dtype", "fp8")


def test_weights_over_budget(llama3_config, capsys):
    assert run_memory("--config", str(llama3_config), "--budget", "8GiB") == 0
    out = capsys.readouterr().out
    assert "exceed" in out and "capacity    0 tokens" in out


@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1000", 1000),
    ("1.5 GiB", 3 * 2**29), ("8G", 8 * 2**30), ("64kb", 64000), ("7b", 7), ("2Ti", 2 * 2**40),
])
def test_parse_size(text, expected):
    assert memory.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "8GX", "GiB", "-1G", "1,5G", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match=re.escape(repr(text))):
        memory.parse_size(text)


def test_contexts_and_format():
    assert memory.parse_contexts("2k,8k,20000") == [2048, 8192, 20000]
    assert memory.fmt_bytes(131072) == "128 KiB" and memory.fmt_bytes(23040) == "22.5 KiB"
    assert memory.fmt_bytes(2_621_440_000) == "2.44 GiB" and memory.fmt_bytes(12) == "12 B"
