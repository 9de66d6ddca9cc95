"""GGUF blocks kept as they are (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, IQ4_NL, IQ4_XS, F16, BF16): exact dequantization,
GEMV accuracy on both ISAs, batch invariance, split projections of mixed types, and models whose files mix them
the way llama.cpp's Q4_K_M and Q2_K recipes do, on the fused and the torch decode path."""

from __future__ import annotations

import collections

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native
from quill.kernels.kquant import BlockWeight, block_weight
from quill.kernels.options import KernelOptions
from quill.kernels.options import use as use_kernel_options
from quill.kernels.packed import PackedLinear, PackedWeight, SplitWeight, Workspace, concat_rows, pack_gguf

from test_gguf import random_tensor

needs_native = pytest.mark.skipif(native.load() is None, reason="native kernels need x86-64 AVX2/FMA and gcc")
KQ = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.IQ4_NL, Q.IQ4_XS, Q.F16, Q.BF16]


def isas():
    """Both widths: 512 runs the AVX-512 kernels natively or on their emulation (conftest.py's _avx512_kernels)."""
    return [256, 512]


def blocks(qtype, rows, blocks_per_row, seed=0):
    if gguf.GGML_QUANT_SIZES[qtype][0] == 1:  # float types: "blocks" of 64 weights
        blocks_per_row *= 64
    raw, shape = random_tensor(qtype, rows, blocks_per_row, seed)
    return raw, shape, gguf.quants.dequantize(raw, qtype).reshape(shape)


@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
def test_dequantize_is_exactly_gguf(qtype):
    raw, shape, ref = blocks(qtype, 7, 3)
    w = pack_gguf(qtype, shape, raw)
    assert isinstance(w, BlockWeight) and w.nbytes == raw.nbytes  # as many bytes as the file
    np.testing.assert_array_equal(w.dequantize().numpy(), ref)
    ids = torch.tensor([6, 0, 3, 3])
    np.testing.assert_array_equal(w.dequantize_rows(ids).numpy(), ref[ids.numpy()])


def _block_by_hand(qtype, block: np.ndarray) -> np.ndarray:
    """One Q2_K / Q3_K block's 256 weights, element by element from GGML's block layout (ggml-common.h)."""
    f16 = lambda o: float(block[o:o + 2].view(np.float16)[0])  # noqa: E731
    out = np.empty(256, np.float32)
    for e in range(256):
        chunk, half, field, lane = e // 16, e // 128, (e % 128) // 32, e % 32
        if qtype == Q.Q2_K:  # scales[16] (scale | min << 4), qs[64], d, dmin
            q = int(block[16 + 32 * half + lane]) >> (2 * field) & 3
            dl = np.float32(f16(80)) * np.float32(int(block[chunk]) & 15)
            ml = np.float32(f16(82)) * np.float32(int(block[chunk]) >> 4)
            out[e] = dl * np.float32(q) - ml
        else:  # hmask[32], qs[64], scales[12] (6-bit, minus 32), d
            q = (int(block[32 + 32 * half + lane]) >> (2 * field) & 3) - (0 if int(block[lane]) >> (e // 32) & 1 else 4)
            low = int(block[96 + chunk % 8]) >> (4 * (chunk // 8)) & 15
            high = int(block[104 + chunk % 4]) >> (2 * (chunk // 4)) & 3
            out[e] = np.float32(f16(108)) * np.float32(int(low | high << 4) - 32) * np.float32(q)
    return out


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K], ids=lambda t: t.name)
def test_low_bit_k_blocks_by_hand(qtype):
    """The kernels' Q2_K / Q3_K weights against the layout read byte by byte, not only against gguf-py."""
    raw, shape, _ = blocks(qtype, 2, 2, seed=9)
    w = pack_gguf(qtype, shape, raw)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    by_hand = np.concatenate([_block_by_hand(qtype, b) for b in raw.reshape(-1, size)]).reshape(shape)
    np.testing.assert_array_equal(w.dequantize().numpy(), by_hand)


@needs_native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
@pytest.mark.parametrize("batch", [1, 5, 17])
def test_gemv_matches_fp64_reference(qtype, isa, batch):
    raw, shape, ref = blocks(qtype, 37, 4, seed=batch)
    lin = PackedLinear(pack_gguf(qtype, shape, raw), None, Workspace())
    x = torch.randn(batch, shape[1], generator=torch.Generator().manual_seed(batch))
    expected = x.double() @ torch.from_numpy(ref).double().T
    with use_kernel_options(KernelOptions(isa=isa, amx=False, threads=2)):
        got = lin(x, gemv_rows=batch).double()
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5


@needs_native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("qtype", KQ, ids=lambda t: t.name)
def test_rows_are_batch_invariant(qtype, isa):
    """A row alone and in batches of every way the kernels split one (the block kinds' tiles: on VNNI CPUs
    fused passes of 1-4 items, tiles above, passes of 16 items: 21 ends in a pass of 5; on AVX2 a fused
    pass for one item, pairs of 8-row tiles met by 6 items at a time above (7 ends in a pass of one; 37
    rows: two pairs, then one partial tile alone), passes of 16: 17 ends in a pass of one)."""
    raw, shape, _ = blocks(qtype, 37, 3, seed=4)
    lin = PackedLinear(pack_gguf(qtype, shape, raw), None, Workspace())
    x = torch.randn(21, shape[1], generator=torch.Generator().manual_seed(5))
    with use_kernel_options(KernelOptions(isa=isa, amx=False, threads=2)):
        alone = torch.cat([lin(x[b : b + 1], gemv_rows=1) for b in range(21)])
        for batch in (2, 3, 4, 6, 7, 12, 16, 17, 21):
            assert torch.equal(lin(x[:batch], gemv_rows=batch), alone[:batch]), batch


@needs_native
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS], ids=lambda t: t.name)
def test_nan_zero_and_tiny_inputs(qtype, isa):
    """On the tiles' exact paths (VNNI: x's digits per 32 inputs; AVX2: fp32 FMAs): a NaN in an item's x makes
    all of that item's outputs NaN, as an fp32 product would, and no other item's; an all-zero group, and an
    item of tiny values (2^-125, one group 2^10 larger: each group its own digit unit) give the fp64
    product to fp32 accuracy, alone and in a batch."""
    raw, shape, ref = blocks(qtype, 37, 2, seed=7)
    lin = PackedLinear(pack_gguf(qtype, shape, raw), None, Workspace())
    x = torch.randn(4, shape[1], generator=torch.Generator().manual_seed(8))
    x[1, 100] = float("nan")
    x[2, 32:64] = 0.0
    x[3] *= 2.0**-125
    x[3, 256:288] *= 2.0**10
    expected = x.double() @ torch.from_numpy(ref).double().T
    with use_kernel_options(KernelOptions(isa=isa, amx=False, threads=2)):
        for rows in (4, 1):
            got = torch.cat([lin(x[i : i + rows], gemv_rows=rows) for i in range(0, 4, rows)]).double()
            assert torch.isnan(got[1]).all() and not torch.isnan(got[[0, 2, 3]]).any()
            for i in (0, 2, 3):
                assert ((got[i] - expected[i]).abs().max() / expected[i].abs().max()).item() < 1e-5, i


@needs_native
@pytest.mark.parametrize("isa", isas())
def test_split_projection_of_mixed_types(isa):
    """q (Q4_K), k (Q8_0), v (Q6_K): one SplitWeight, each part through its own kernel into its columns."""
    parts = [blocks(t, rows, n, seed=i) for i, (t, rows, n) in enumerate(((Q.Q4_K, 24, 2), (Q.Q8_0, 8, 16), (Q.Q6_K, 8, 2)))]
    packs = [pack_gguf(t, shape, raw) for t, (raw, shape, _) in zip((Q.Q4_K, Q.Q8_0, Q.Q6_K), parts)]
    w = concat_rows(packs)
    assert isinstance(w, SplitWeight) and w.rows == 40 and w.cols == 512
    assert [type(p) for p in w.parts] == [BlockWeight, PackedWeight, BlockWeight]
    ref = torch.from_numpy(np.concatenate([r for _, _, r in parts])).double()
    lin = PackedLinear(w, None, Workspace())
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(6))
    expected = x.double() @ ref.T
    with use_kernel_options(KernelOptions(isa=isa, amx=False, threads=2)):
        for rows in (6, 0):  # the GEMV kernels, then the prefill path (dequantized tile + BLAS)
            got = lin(x, gemv_rows=rows).double()
            assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    same = concat_rows([pack_gguf(Q.Q6_K, parts[2][1], parts[2][0])] * 2)
    assert isinstance(same, BlockWeight) and same.rows == 16  # one type: one weight, rows stacked


# A Q4_K_M-like mix (llama.cpp's recipe gives attn_v, ffn_down and the output Q6_K in some or all layers).
MIX = {"token_embd": Q.Q4_K, "output": Q.Q6_K, "attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K,
       "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}
# Where rows do not fit 256 (Gemma's 1152) llama.cpp falls back to Q5_0; IQ4_XS recipes write IQ4_NL there.
MIX_32 = {"token_embd": Q.IQ4_NL, "output": Q.Q6_K, "attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0,
          "attn_output": Q.IQ4_XS, "ffn_gate": Q.IQ4_XS, "ffn_up": Q.IQ4_NL, "ffn_down": Q.IQ4_XS}
# Q5_K_M's Q5_K, and 16-bit float tensors (F16 files, BF16 embeddings) kept 16-bit.
MIX_5 = {"token_embd": Q.F16, "output": Q.BF16, "attn_q": Q.Q5_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K,
         "attn_output": Q.BF16, "ffn_gate": Q.F16, "ffn_up": Q.Q5_K, "ffn_down": Q.Q5_K}
# Q2_K's recipe (attn_v, attn_output and ffn_down Q3_K; untied token_embd keeps Q2_K), ffn_up Q3_K for a split gate/up.
MIX_2 = {"token_embd": Q.Q2_K, "output": Q.Q6_K, "attn_q": Q.Q2_K, "attn_k": Q.Q2_K, "attn_v": Q.Q3_K,
         "attn_output": Q.Q3_K, "ffn_gate": Q.Q2_K, "ffn_up": Q.Q3_K, "ffn_down": Q.Q3_K}
FP16_AT = {Q.Q5_K: (0, 4), Q.Q4_K: (0, 4), Q.Q6_K: (208, 210), Q.Q5_0: (0, 2), Q.IQ4_NL: (0, 2), Q.IQ4_XS: (0, 2), Q.Q8_0: (0, 2),
           Q.Q2_K: (80, 84), Q.Q3_K: (108, 110)}


def write_mixed_gguf(path, mix=MIX, hidden=256, inter=512, layers=2, heads=4, kv_heads=2, vocab=300):
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 256),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, inter),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
                       (writer.add_vocab_size, vocab)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    hd = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * hd, hidden), "attn_v": (kv_heads * hd, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    rng = np.random.default_rng(0)

    def add(name, kind, rows, cols, seed):
        if kind in (Q.F16, Q.BF16):
            values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
            data = values.astype(np.float16) if kind == Q.F16 else (values.view(np.uint32) >> 16).astype(np.uint16)
            writer.add_tensor(name, data if kind == Q.F16 else data.view(np.uint8).reshape(rows, 2 * cols), raw_dtype=kind)
            return
        block, size = gguf.GGML_QUANT_SIZES[kind]
        raw, _ = random_tensor(kind, rows, cols // block, seed)
        lo, hi = FP16_AT[kind]  # keep activations sane: small block scales
        fields = raw.reshape(-1, size)[:, lo:hi]
        fields[:] = rng.uniform(-2e-3, 2e-3, (fields.shape[0], (hi - lo) // 2)).astype(np.float16).view(np.uint8)
        writer.add_tensor(name, raw, raw_dtype=kind)

    add("token_embd.weight", mix["token_embd"], vocab, hidden, 1)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    add("output.weight", mix["output"], vocab, hidden, 2)
    for i in range(layers):
        for j, (kind, (rows, cols)) in enumerate(shapes.items()):
            add(f"blk.{i}.{kind}.weight", mix[kind], rows, cols, 10 * i + j + 3)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@needs_native
@pytest.mark.parametrize("mix", [MIX, MIX_32, MIX_5, MIX_2], ids=["q4_k_m", "q5_0-iq4", "q5_k-f16-bf16", "q2_k-q3_k"])
def test_mixed_model_decodes_on_the_fused_path(tmp_path, mix):
    """Packed (blocks as in the file, q/k/v a split of Q4_K and Q6_K) against the same file loaded
    dense (gguf's dequantization, fp32, torch path): prefill and 8 decode steps within 1e-3 of the
    logits' scale (each kernel alone is within 1e-5, test_gemv_matches_fp64_reference), with
    the fused decode path asserted; resident weights within 1.1x the file's tensor bytes."""
    from quill.models.gguf import GGUFModelFile
    from quill.models.llama import DenseWeights, LlamaForCausalLM
    from quill.models.loader import PackedGGUFWeights

    from test_model_parity import run_chunk
    from quill.engine.sequence import Sequence
    from quill.sampling_params import SamplingParams

    path = tmp_path / "mix.gguf"
    write_mixed_gguf(path, mix)
    gf = GGUFModelFile(path)
    packed = LlamaForCausalLM(gf.model_config(), PackedGGUFWeights(gf, "cpu", collections.Counter()))
    dense = LlamaForCausalLM(gf.model_config(), DenseWeights(gf.dequantize_tensor))
    from quill.kernels.tiled import TiledWeight

    def as_file(w) -> bool:  # GGUF's blocks, or (AMX hosts) Q4_K / Q5_K / IQ4_XS / Q6_K tiles with the file's scales
        return isinstance(w, BlockWeight) or (isinstance(w, TiledWeight) and w.scale_d is not None)

    assert isinstance(packed.layers[0].self_attn.qkv_proj.weight, SplitWeight)
    assert as_file(packed.lm_head.weight) and as_file(packed.layers[1].mlp.down_proj.weight)
    gate_up = packed.layers[1].mlp.gate_up_proj.weight
    assert as_file(gate_up) if mix["ffn_gate"] == mix["ffn_up"] else isinstance(gate_up, SplitWeight)
    assert as_file(packed.embed_tokens.weight)  # every type in the file stays as it is
    tensor_bytes = sum(t.n_bytes for t in gf._reader.tensors)
    assert packed.resident_bytes() <= 1.1 * tensor_bytes

    cfg = gf.model_config()
    runs = {}
    for name, model in (("packed", packed), ("dense", dense)):
        from quill.engine.block_manager import BlockManager
        from quill.engine.kv_cache import KVCache
        from quill.engine.model_runner import ModelRunner

        kv = KVCache(cfg, 64, 4, torch.float32)
        runner = ModelRunner(model, cfg, kv, sampler=None)
        if name == "dense":
            runner.fused = None
        else:
            assert runner.fused is not None
        runs[name] = (runner, BlockManager(64, 4, enable_prefix_caching=False))
    prompt = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(8)).tolist()
    seqs = {name: Sequence(name, prompt, SamplingParams()) for name in runs}
    logits = {name: run_chunk(r, bm, seqs[name], 0, len(prompt)) for name, (r, bm) in runs.items()}
    def close(a, b):
        # fp32 sums in other orders, through 2 layers of random weights whose activations reach ~1e4: the
        # dense path alone moves its prefill logits by up to 2.2e-4 of their scale with BLAS instead of the
        # AMX tile GEMM (6 prompts measured on a Xeon), and the packed prefill's K-quant GEMM differs from
        # both (each of its linears is as close to fp64 as either: tests/test_amx_gemm.py)
        return ((a - b).abs().max() / b.abs().max()).item() < 1e-3

    assert close(logits["packed"], logits["dense"])
    for step in range(8):
        nxt = int(logits["dense"][-1].argmax())
        for name, (r, bm) in runs.items():
            seqs[name].append_token(nxt, 0.0)
            logits[name] = run_chunk(r, bm, seqs[name], len(prompt) + step, 1)
        assert close(logits["packed"], logits["dense"])
