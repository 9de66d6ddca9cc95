"""The real default model: greedy parity with transformers (GGUF-loaded), the Paris answer, selftest."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from quill.models.loader import default_model_path
from quill.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "请用一句话介绍一下北京。",
    "List three colors of the rainbow.",
    "Explain what a KV cache is in one paragraph.",
]


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    return model.eval()


def test_greedy_chat_matches_transformers(make_llm, hf_model):
    llm = make_llm()
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=48))
    eos = set(llm.engine.eos_token_ids)
    for conv, out in zip(convs, outs):
        ids = llm.tokenizer.encode_chat(conv)
        assert ids == out.prompt_token_ids
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                                    eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])[0, len(ids):].tolist()
        ours = out.outputs[0].token_ids
        ref = ref[: len(ours)] if ours and ours[-1] in eos else ref
        assert ours == ref, f"{conv[0]['content']!r}: {llm.tokenizer.decode(ours)!r} vs {llm.tokenizer.decode(ref)!r}"
    assert any("北京" in o.outputs[0].text for o in outs[2:3]), outs[2].outputs[0].text


def test_cli_generate_answers_paris():
    proc = subprocess.run(
        [sys.executable, "-m", "quill.cli", "generate", "--chat", "--temperature", "0",
         "--kv-cache-memory", "64MiB", "What is the capital of France? Answer in one sentence."],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tok/s" in proc.stderr and "tok/s" not in proc.stdout  # stats on stderr only


def test_outputs_carry_timings_and_finish_reason(make_llm):
    llm = make_llm()
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5))[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    m = c.metrics
    assert m["ttft_ms"] > 0 and m["tpot_ms"] > 0 and m["prompt_tps"] > 0 and m["generation_tps"] > 0
    assert m["prompt_tokens"] == len(out.prompt_token_ids)


def test_selftest_passes():
    proc = subprocess.run([sys.executable, "-m", "quill.cli", "selftest"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decode path == prefill path" in proc.stdout and "selftest passed" in proc.stdout


def test_cli_info_reports_kv_bytes_by_formula():
    proc = subprocess.run([sys.executable, "-m", "quill.cli", "info"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "46,080 B = 45.0 KiB fp32" in out  # 2 x 30 layers x 3 kv heads x 64 x 4 B
    assert "llama" in out and "Q4_1" in out and "8192" in out
    assert "Qwen3ForCausalLM" in out and "qwen3" in out and "Q6_K" in out  # what quill runs is listed


def test_cli_chat_two_turns_then_exit():
    proc = subprocess.run(
        [sys.executable, "-m", "quill.cli", "chat", "--temperature", "0", "--max-tokens", "12",
         "--kv-cache-memory", "64MiB"],
        input="What is the capital of France?\nAnd of Italy?\n/exit\n", capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert proc.stderr.count("generated:") == 2 and "prompt:" in proc.stderr  # timings after each answer
