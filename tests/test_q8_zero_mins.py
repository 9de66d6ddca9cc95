"""Q8_0 (and --quantize int8) without stored mins (issue 15: resident weights <= 1.1x the file).

Q8_0's min is zero for every group, so its PackedWeight has `mins` None and the kernels skip the min
terms (csrc/quant_gemv.c, ZERO_MINS). Checked here: the weights equal gguf's dequantization bit for bit
(sign of zero included on the torch path); the GEMV equals x @ W.T in fp64 within 1e-5 on both ISAs, is
batch-invariant, and gives the very bits the old layout (explicit all-zero mins) gave, on both ISAs and
for every batch tiling; fused projections with and without mins; the AMX tiling of a weight without mins;
a model with Q8_0 (and a Q5_1 part beside Q8_0 parts) decoding on the fused path, bit for bit as with
explicit zero mins; a llama.cpp-recipe Q8_0 file resident within 1.1x its tensor bytes."""

from __future__ import annotations

import collections

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native, tiled
from quill.kernels.options import KernelOptions
from quill.kernels.options import use as use_kernel_options
from quill.kernels.packed import GROUP, PackedLinear, PackedWeight, SplitWeight, Workspace, concat_rows, pack_gguf
from quill.kernels.quantize import quantize_int8

from test_gguf import random_tensor

needs_native = pytest.mark.skipif(native.load() is None, reason="native kernels need x86-64 AVX2/FMA and gcc")


def isas():
    """Both widths: 512 runs the AVX-512 kernels natively or on their emulation (conftest.py's _avx512_kernels)."""
    return [256, 512]


def opts(isa):
    return use_kernel_options(KernelOptions(isa=isa, amx=False, threads=2))


def q8_0(rows, blocks, seed=0):
    raw, shape = random_tensor(Q.Q8_0, rows, blocks, seed)
    return pack_gguf(Q.Q8_0, shape, raw), gguf.quants.dequantize(raw, Q.Q8_0).reshape(shape)


def with_zero_mins(w: PackedWeight) -> PackedWeight:
    """The layout as it was before: the same codes and scales with an explicit all-zero (+0) mins array."""
    return PackedWeight(w.kind, w.codes, w.scale, torch.zeros_like(w.scale))


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.int32)


def test_q8_0_packs_without_mins():
    w, ref = q8_0(24, 5)
    assert isinstance(w, PackedWeight) and w.kind == "q8" and w.mins is None
    assert w.nbytes == 24 * 160 + 24 * 5 * 4  # one byte per code, an fp32 scale per 32: nothing else
    assert w.tensors() == [w.codes, w.scale]
    assert (ref == 0).any() and np.signbit(ref[ref == 0]).any()  # negative scales times code 0: gguf's -0
    # the torch path (embedding lookups, the no-native fallback): d * q as gguf computes it, bit for bit
    np.testing.assert_array_equal(bits(w.dequantize_rows(torch.arange(w.rows)).numpy()), bits(ref))
    ids = torch.tensor([3, 0, 23, 3])
    np.testing.assert_array_equal(bits(w.dequantize_rows(ids).numpy()), bits(ref[ids.numpy()]))
    raw, shape = random_tensor(Q.Q4_0, 4, 2)
    assert pack_gguf(Q.Q4_0, shape, raw).mins is not None  # Q4_0's min is -8 d, not zero: kept


@needs_native
def test_native_dequant_equals_gguf_and_the_zero_min_layout():
    w, ref = q8_0(40, 7, seed=1)
    tile = w.dequantize()
    np.testing.assert_array_equal(tile.numpy(), ref)  # equal values (a zero's sign aside: the FMA adds +0)
    assert torch.equal(tile.view(torch.int32), with_zero_mins(w).dequantize().view(torch.int32))  # the old bits


@needs_native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("batch", [1, 5, 17])
def test_gemv_matches_fp64_reference(isa, batch):
    w, ref = q8_0(37, 9, seed=batch)  # 9 groups: the AVX2 (8) and AVX-512 (16) min loops' tails too
    lin = PackedLinear(w, None, Workspace())
    x = torch.randn(batch, w.cols, generator=torch.Generator().manual_seed(batch))
    expected = x.double() @ torch.from_numpy(ref).double().T
    with opts(isa):
        for rows in (batch, 0):  # the GEMV kernel, then the prefill path (dequantized tile + BLAS)
            got = lin(x, gemv_rows=rows).double()
            assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


@needs_native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("groups", [1, 8, 9, 16, 17, 64])
def test_gemv_gives_the_bits_of_explicit_zero_mins(isa, groups):
    """Skipping the min terms changes no output bit: every batch size through every tiling (AVX2 tiles
    of 4 items, AVX-512 of 8), the strided (_ld) entry point, and group counts around both min loops."""
    w, _ = q8_0(29, groups, seed=groups)
    old = with_zero_mins(w)
    x = torch.randn(19, w.cols, generator=torch.Generator().manual_seed(groups))
    x[3] = 0.0  # an all-zero row: every product +-0, the output must still be +0 as before
    x[4, :GROUP] *= 1e-30  # a tiny group
    lib = native.load()
    scratch = torch.empty(19 * groups)
    for batch in (1, 2, 4, 5, 8, 9, 16, 19):
        outs = []
        for weight in (w, old):
            out = torch.full((batch, 40), 7.0)  # ld = 40 > rows: the columns past 29 must stay untouched
            mins = None if weight.mins is None else weight.mins.data_ptr()
            lib.quill_gemv_q8_ld(weight.codes.data_ptr(), weight.scale.data_ptr(), mins, x.data_ptr(),
                                 scratch.data_ptr(), out.data_ptr(), w.rows, groups, batch, 40, isa, 2)
            outs.append(out)
        assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), (batch, isa)
        assert (outs[0][:, 29:] == 7.0).all()
    assert not torch.signbit(outs[0][3, :29]).any()


@needs_native
@pytest.mark.parametrize("isa", isas())
def test_rows_are_batch_invariant(isa):
    w, _ = q8_0(29, 11, seed=4)
    lin = PackedLinear(w, None, Workspace())
    x = torch.randn(16, w.cols, generator=torch.Generator().manual_seed(5))
    with opts(isa):
        together = lin(x, gemv_rows=16)
        for b in (0, 7, 15):
            assert torch.equal(lin(x[b : b + 1], gemv_rows=1), together[b : b + 1])
        assert torch.equal(lin(x.flip(0), gemv_rows=16).flip(0), together)


@needs_native
@pytest.mark.parametrize("isa", isas())
def test_non_finite_activations_stay_non_finite(isa):
    """The old min term turned an inf or NaN into NaN (0 * inf); without it the codes' products decide,
    which for an inf or NaN in x is never a finite number."""
    w, _ = q8_0(24, 4, seed=6)
    lin = PackedLinear(w, None, Workspace())
    x = torch.randn(3, w.cols, generator=torch.Generator().manual_seed(7))
    x[0, 7], x[1, 40] = float("nan"), float("inf")
    with opts(isa):
        out = lin(x, gemv_rows=3)
    assert out[0].isnan().all() and not out[1].isfinite().any() and out[2].isfinite().all()


def test_concat_rows_with_and_without_mins():
    a, ra = q8_0(8, 4, seed=1)
    b, rb = q8_0(5, 4, seed=2)
    fused = concat_rows([a, b])
    assert isinstance(fused, PackedWeight) and fused.mins is None and fused.rows == 13
    np.testing.assert_array_equal(bits(fused.dequantize_rows(torch.arange(13)).numpy()), bits(np.concatenate([ra, rb])))
    raw, shape = random_tensor(Q.Q5_1, 6, 4, seed=3)  # Q5_1 shares the q8 layout and has real mins
    c, rc = pack_gguf(Q.Q5_1, shape, raw), gguf.quants.dequantize(raw, Q.Q5_1).reshape(shape)
    mixed = concat_rows([a, c, b])
    assert isinstance(mixed, PackedWeight) and mixed.mins is not None
    assert torch.equal(mixed.mins[:8], torch.zeros(8, 4)) and torch.equal(mixed.mins[14:], torch.zeros(5, 4))
    assert torch.equal(mixed.mins[8:14], c.mins)
    np.testing.assert_array_equal(mixed.dequantize_rows(torch.arange(19)).numpy(), np.concatenate([ra, rc, rb]))
    assert not isinstance(mixed, SplitWeight)


def test_tiled_layout_of_a_weight_without_mins():
    """tile_weight is plain torch: the AMX layout of a mins-None weight (Q8_0, int8) on any CPU."""
    w, ref = q8_0(48, 6, seed=8)
    t = tiled.tile_weight(w)
    assert t is not None and t.mins is None and t.scale.dtype == torch.float16  # Q8_0's fp16 scales, exactly
    np.testing.assert_array_equal(t.dequantize_rows(torch.arange(48)).numpy(), ref)
    q = quantize_int8(torch.randn(32, 128, generator=torch.Generator().manual_seed(9)))
    assert q.mins is None
    tq = tiled.tile_weight(q)
    assert tq.mins is None and tq.scale.dtype == torch.float32
    assert torch.equal(tq.dequantize_rows(torch.arange(32)), q.dequantize_rows(torch.arange(32)))


def _zero_mins_everywhere(model) -> int:
    """Give every mins-None packed weight of `model` explicit zero mins (the old layout); how many."""
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        for i, p in enumerate(getattr(w, "parts", None) or []):
            if isinstance(p, PackedWeight) and p.mins is None:
                w.parts[i], n = with_zero_mins(p), n + 1
        if isinstance(w, PackedWeight) and w.mins is None:
            m.weight, n = with_zero_mins(w), n + 1
    return n


# Q8_0 throughout, as llama.cpp's Q8_0 recipe writes; attn_v in Q5_1 so the fused q/k/v is one q8 weight
# whose Q8_0 parts get explicit zeros beside Q5_1's mins, while gate/up stays without mins.
MIX_Q8 = {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q5_1,
          "attn_output": Q.Q8_0, "ffn_gate": Q.Q8_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q8_0}


@needs_native
@pytest.mark.parametrize("isa", isas())
def test_q8_0_model_decodes_on_the_fused_path_as_before(tmp_path, monkeypatch, isa):
    """The fused decode layer (QWeight mins NULL) and the torch path: prefill and 8 decode steps within
    1e-4 of the dense (gguf-dequantized, fp32) model, and bit for bit the logits of the same packed model
    with explicit zero mins; resident weights within 1.1x the file's tensor bytes."""
    import test_kquant
    from test_model_parity import run_chunk

    from quill.engine.block_manager import BlockManager
    from quill.engine.kv_cache import KVCache
    from quill.engine.model_runner import ModelRunner
    from quill.engine.sequence import Sequence
    from quill.models.gguf import GGUFModelFile
    from quill.models.llama import DenseWeights, LlamaForCausalLM
    from quill.models.loader import PackedGGUFWeights
    from quill.sampling_params import SamplingParams

    monkeypatch.setitem(test_kquant.FP16_AT, Q.Q5_1, (0, 4))  # Q5_1's d and m: small, as for the others
    # the q8 rows are what this checks: where the VNNI tiles run, the loader would tile the Q8_0 weights
    # (tests/test_vnni_tiled.py checks those)
    monkeypatch.setattr(tiled, "for_cpu", lambda w: w)
    path = tmp_path / "q8.gguf"
    test_kquant.write_mixed_gguf(path, MIX_Q8)
    gf = GGUFModelFile(path)
    cfg = gf.model_config()
    with opts(isa):
        models = {name: LlamaForCausalLM(cfg, PackedGGUFWeights(gf, "cpu", collections.Counter()))
                  for name in ("packed", "zero_mins")}
        models["dense"] = LlamaForCausalLM(cfg, DenseWeights(gf.dequantize_tensor))
        packed = models["packed"]
        assert packed.embed_tokens.weight.mins is None and packed.lm_head.weight.mins is None
        assert packed.layers[0].mlp.gate_up_proj.weight.mins is None
        assert packed.layers[0].self_attn.qkv_proj.weight.mins is not None  # Q5_1's beside zeros
        assert _zero_mins_everywhere(models["zero_mins"]) == 2 + 3 * cfg.num_layers  # embedding, head; o, gate/up, down
        tensor_bytes = sum(int(t.n_bytes) for t in gf._reader.tensors)
        assert packed.resident_bytes() <= 1.1 * tensor_bytes
        assert models["zero_mins"].resident_bytes() > packed.resident_bytes()

        runs = {}
        for name, model in models.items():
            runner = ModelRunner(model, cfg, KVCache(cfg, 64, 4, torch.float32), sampler=None)
            if name == "dense":
                runner.fused = None
            else:
                assert runner.fused is not None and runner.fused.available
            runs[name] = (runner, BlockManager(64, 4, enable_prefix_caching=False))
        prompt = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(8)).tolist()
        seqs = {name: Sequence(name, prompt, SamplingParams()) for name in runs}
        logits = {name: run_chunk(r, bm, seqs[name], 0, len(prompt)) for name, (r, bm) in runs.items()}

        def check():
            ref = logits["dense"]
            assert ((logits["packed"] - ref).abs().max() / ref.abs().max()).item() < 1e-4
            assert torch.equal(logits["packed"].view(torch.int32), logits["zero_mins"].view(torch.int32))

        check()
        for step in range(8):
            nxt = int(logits["dense"][-1].argmax())
            for name, (r, bm) in runs.items():
                seqs[name].append_token(nxt, 0.0)
                logits[name] = run_chunk(r, bm, seqs[name], len(prompt) + step, 1)
            check()


def test_synth_q8_0_file_is_resident_within_1_1x(tmp_path):
    """llama.cpp's Q8_0 recipe at Llama 3.2 1B's width (one layer): every weight Q8_0 but the norms."""
    from quill.bench.synth import MODELS, write_synth
    from quill.models.loader import load_model

    path = tmp_path / "q8.gguf"
    result = write_synth(path, MODELS["llama-3.2-1b"], "Q8_0", num_layers=1, vocab=512)
    assert set(result.types.values()) == {"Q8_0", "F32"}
    with use_kernel_options(KernelOptions(isa=256, amx=False, threads=2)):
        loaded = load_model(str(path), context_len=64)
    weights = [getattr(m, "weight", None) for m in loaded.model.modules()]
    q8 = [w for w in weights if isinstance(w, PackedWeight)]
    assert q8 and all(w.mins is None for w in q8)
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    resident = loaded.model.resident_bytes()
    assert resident <= 1.1 * tensor_bytes, resident / tensor_bytes
    assert resident <= 1.1 * path.stat().st_size
