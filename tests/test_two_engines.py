"""Two engines in one process keep their own kernel choices: ISA and thread count are per engine,
passed into every C call, never a process-wide setting one engine could change under the other."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native, options
from quill.kernels.packed import PackedLinear, Workspace, pack_gguf

from test_gguf import random_tensor

needs_native = pytest.mark.skipif(native.load() is None, reason="native kernels need x86-64 AVX2/FMA and gcc")
HERE = os.path.dirname(os.path.abspath(__file__))


def _linear_out(isa=None) -> np.ndarray:
    """A Q4_1 linear over 3 rows of input, under options with `isa` (None: the environment's)."""
    raw, shape = random_tensor(Q.Q4_1, 64, 18, 3)
    lin = PackedLinear(pack_gguf(Q.Q4_1, shape, raw), None, Workspace())
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(2))
    with options.use(options.resolve(threads=1, isa=isa)):
        return lin(x, gemv_rows=3).numpy()


def _in_subprocess(code: str, env: dict) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


@needs_native
def test_isa_is_an_argument_and_avx2_per_call_equals_quill_no_avx512(tmp_path):
    lib = native.load()
    hw = options.hardware()
    assert lib.quill_isa_used(256) == 256
    assert lib.quill_isa_used(512) == (512 if hw.avx512 else 256)  # the CPU's facts still bound the choice
    avx2 = _linear_out("avx2")
    # the same weights and input in a process where the user's switch makes AVX2 the default
    out = tmp_path / "env.npy"
    _in_subprocess("import numpy as np, test_two_engines as t; np.save(%r, t._linear_out())" % str(out),
                   {"QUILL_NO_AVX512": "1"})
    assert np.array_equal(np.load(out), avx2)
    if hw.avx512:  # the 16-lane kernel sums in another order: its bits differ, so the choice was honoured
        assert not np.array_equal(_linear_out("avx512"), avx2)
        assert np.array_equal(_linear_out(), _linear_out("avx512"))  # this process's default: the hardware's best
    with pytest.raises(ValueError, match="isa"):
        options.resolve(isa="sse")


def test_env_switches_are_read_when_options_are_resolved(monkeypatch):
    monkeypatch.setenv("QUILL_NO_AVX512", "1")
    monkeypatch.setenv("QUILL_NO_AMX", "1")
    opts = options.resolve(threads=3)
    assert (opts.isa, opts.amx, opts.threads) == (256, False, 3)
    monkeypatch.delenv("QUILL_NO_AVX512")
    assert options.resolve().isa == (512 if options.hardware().avx512 else 256)
    assert opts.isa == 256  # options already decided do not follow the environment
    with options.use(opts):
        assert options.current() is opts
    assert options.current() is not opts


def _engine(loaded, threads, isa=None, explicit=True):
    """An engine over `loaded`; explicit=False: its options from config.threads and the environment."""
    from quill.config import CacheConfig, EngineConfig
    from quill.engine.engine import LLMEngine

    cfg = EngineConfig(model=None, threads=threads, cache=CacheConfig(kv_cache_memory=32 << 20))
    return LLMEngine(cfg, loaded, kernel_options=options.resolve(threads=threads, isa=isa) if explicit else None)


PROMPTS = ["The three laws of robotics are", "Count to ten: one, two,"]


def _run(engines_prompts: list, max_tokens=12) -> list[list[list[int]]]:
    """Greedy outputs of each (engine, prompts), the engines stepped in turn until all are done."""
    from quill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = []
    for k, (engine, prompts) in enumerate(engines_prompts):
        ids = [f"e{k}-{i}-{id(engine)}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, engine.tokenizer.encode(p), params)
        results.append({rid: None for rid in ids})
    while any(None in r.values() for r in results):
        for (engine, _), res in zip(engines_prompts, results):
            if None not in res.values():
                continue
            for out in engine.step():
                if out.finished and out.request_id in res:
                    res[out.request_id] = list(out.outputs[0].token_ids)
    return [list(r.values()) for r in results]


@pytest.mark.slow
@needs_native
def test_two_engines_side_by_side_each_equal_alone(default_loaded):
    a = _engine(default_loaded, threads=1, isa="avx2")
    before = (a.threads, a.kernel_options, a.runner.fused.options, a.runner.fused.shape.isa, a.runner.fused.shape.threads)
    assert before[1:] == (before[1], before[1], 256, 1) and a.threads == 1
    b = _engine(default_loaded, threads=2)
    # building the second engine changed nothing of the first's
    assert (a.threads, a.kernel_options, a.runner.fused.options, a.runner.fused.shape.isa,
            a.runner.fused.shape.threads) == before
    assert b.runner.fused.shape.threads == 2 and b.kernel_options.isa == options.resolve().isa
    assert torch.get_num_threads() == 2  # torch's pool is process-wide: the explicit request last made wins

    alone_a = _run([(a, PROMPTS)])[0]
    alone_b = _run([(b, PROMPTS)])[0]
    together_a, together_b = _run([(a, PROMPTS), (b, PROMPTS)])
    assert together_a == alone_a
    assert together_b == alone_b
    assert a.runner.fused.options == before[1]


def _step_logits(engine) -> np.ndarray:
    """Every step's logits of one greedy request (prefill row, then decode rows)."""
    from quill.sampling_params import SamplingParams

    engine.runner.keep_logits = True
    engine.add_request("r", engine.tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    rows = []
    while engine.has_unfinished_requests():
        engine.step()
        rows.append(engine.runner.last_logits.numpy().copy())
    return np.concatenate(rows)


_ENV_ENGINE = """
import numpy as np, test_two_engines as t
from quill.models.loader import load_model
np.save({path!r}, t._step_logits(t._engine(load_model(None), threads=1, explicit=False)))
"""


@pytest.mark.slow
@needs_native
def test_engine_forced_to_avx2_equals_quill_no_avx512_bit_for_bit(tmp_path, default_loaded):
    """The whole step (fused decode layers, LM head, prefill rows) of an engine given isa avx2 is the
    AVX2 computation: its logits equal, bit for bit, those of a process run with QUILL_NO_AVX512=1."""
    path = str(tmp_path / "env.npy")
    _in_subprocess(_ENV_ENGINE.format(path=path), {"QUILL_NO_AVX512": "1"})
    avx2 = _step_logits(_engine(default_loaded, threads=1, isa="avx2"))
    assert np.array_equal(np.load(path), avx2)
    if options.hardware().avx512:
        assert not np.array_equal(_step_logits(_engine(default_loaded, threads=1, isa="avx512")), avx2)
