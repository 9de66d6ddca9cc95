"""The opt-in int8-activation kernels (csrc/kquant_i8.c): the activations' rounding against a numpy
statement of it, every weight type's GEMV/GEMM against the fp64 product of the dequantized weights with
the rounded activations, batch invariance, which types take the path, and the options that turn it on.
The AVX2 kernels (8-row tiles for the block kinds, rows for the q4 / q8 layouts) run on every CPU the
kernels build for; the AVX-512 VNNI tiles (isa 512) natively where the CPU has VNNI, else their own C
source on SIMDe's emulation of each intrinsic (conftest.py). Both compute the same integer dots; the
fp64 reference checks both. test_kquant_i8_tiles.py also restates the VNNI tiles' layout and arithmetic
in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from quill.bench.synth import random_blocks
from quill.kernels import native
from quill.kernels.options import KernelOptions, hardware, resolve
from quill.kernels.options import use as use_kernel_options
from quill.kernels.packed import PackedLinear, Workspace, concat_rows, int8_kind, pack_gguf

LIB = native.load()
VNNI = LIB is not None and hardware().vnni
needs_kernels = pytest.mark.skipif(LIB is None, reason="native kernels unavailable (no AVX2/FMA or no compiler)")
ISAS = [256, 512]  # 512: the VNNI tiles, natively or emulated (conftest.py's _avx512_kernels)

# the types with an int8 kernel: kquant.c's block kinds and quant_gemv.c's q4 / q8 layouts
INT8_TYPES = ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0", "Q4_0", "Q4_1", "Q5_1"]
EXACT_ONLY = ["Q5_0", "IQ4_NL", "Q2_K", "Q3_K", "F16"]


def int8(isa: int = 512 if VNNI else 256) -> KernelOptions:
    return KernelOptions(isa=isa, threads=2, int8=True)


def rounded(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' rounding: per 32 inputs d = max|x| / 127, q = round-half-even(x * (1 / d))."""
    B, K = x.shape
    g = x.reshape(B, K // 32, 32).astype(np.float32)
    d = (np.abs(g).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    return np.rint(g * inv[..., None]).astype(np.int8).reshape(B, K), d


def fp64_product(lin: PackedLinear, x: torch.Tensor) -> np.ndarray:
    """x rounded as the kernels round it, times the dequantized weight, in fp64: what an int8 kernel's
    rows must equal within fp32 summation error."""
    B, K = x.shape
    q, d = rounded(x.numpy())
    xq = (q.reshape(B, K // 32, 32).astype(np.float64) * d[..., None]).reshape(B, K)
    return xq @ lin.weight.dequantize().double().numpy().T


def activations(B: int, K: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(B, K, generator=torch.Generator().manual_seed(seed))
    x[:, 3] *= 30  # an outlier channel, as real activations have
    x[:, 40:72] = 0  # an all-zero group: its scale is 0
    return x


def linear(name: str, N: int, K: int, seed: int = 0) -> PackedLinear:
    raw = random_blocks(name, N, K, np.random.default_rng(seed))
    return PackedLinear(pack_gguf(Q[name], (N, K), raw), None, Workspace())


@needs_kernels
@pytest.mark.parametrize("B", [1, 5, 64])
def test_activation_rounding_is_the_stated_one(B):
    K = 512
    x = activations(B, K)
    buf = torch.empty(LIB.quill_act8_bytes(B, K), dtype=torch.uint8)
    LIB.quill_act8_quantize(x.data_ptr(), buf.data_ptr(), B, K, 2)
    q, d = rounded(x.numpy())
    per = K + K // 8 + K // 8 + K // 4 + K // 8
    for b in range(B):
        item = buf[b * per:(b + 1) * per].numpy()
        assert np.array_equal(item[:K].view(np.int8), q[b])
        assert np.array_equal(item[K:K + K // 8].view(np.float32), d[b])
        s16 = q[b].astype(np.int64).reshape(-1, 16).sum(-1)
        s32 = s16[0::2] + s16[1::2]
        assert np.array_equal(item[K + K // 8:K + K // 4].view(np.float32), d[b] * s32.astype(np.float32))
        # the offset terms: Q6_K's -32 per 16 codes' sum, IQ4_XS's and Q8_0's -128 per group's
        assert np.array_equal(item[K + K // 4:K + K // 2].view(np.int32), -32 * s16)
        assert np.array_equal(item[K + K // 2:].view(np.int32), -128 * s32)


# every type at K = 768 (quad-order stretches throughout); the q4 / q8 layouts, which allow any K % 32 == 0,
# also at K = 576: no quad-order activations (576 % 128 != 0) and two groups left after the 8-group stretches
SHAPES = [(name, 768) for name in INT8_TYPES] + [(name, 576) for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_1")]


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name,K", SHAPES)
@pytest.mark.parametrize("B", [1, 3, 16])
def test_gemv_matches_fp64_on_rounded_activations(name, K, B, isa):
    lin = linear(name, 40, K)
    assert int8_kind(lin.weight, LIB) is not None
    x = activations(B, K)
    with use_kernel_options(int8(isa)):
        got = lin(x).double().numpy()
    want = fp64_product(lin, x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # and the rounding is real: the exact path differs
    with use_kernel_options(KernelOptions(isa=isa, threads=2)):
        exact = lin(x).double().numpy()
    assert not np.array_equal(exact, got)


# The byte range that holds the codes, and the byte that makes every code the largest in magnitude (ggml-common.h's
# block layouts): Q4_K nibbles 15, Q5_K 31 (nibbles and fifth bits set), Q6_K 63, IQ4_XS index 0 (-127).
EXTREME_CODES = {"Q4_K": (16, 144, 0xFF), "Q5_K": (16, 176, 0xFF), "Q6_K": (0, 192, 0xFF), "IQ4_XS": (8, 136, 0x00)}


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", sorted(EXTREME_CODES))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_codes_do_not_overflow(name, sign, isa):
    """Every code at its largest magnitude and every activation at +-127: the AVX2 tiles sum runs of
    vpmaddubsw pairs in int16 right up to the bound (Q4_K 30480, Q5_K 31496, Q6_K 32004); a saturated
    sum would be far from the fp64 product."""
    raw = random_blocks(name, 24, 512, np.random.default_rng(3))
    lo, hi, byte = EXTREME_CODES[name]
    blocks = raw.reshape(24, 2, GGML_QUANT_SIZES[Q[name]][1])
    blocks[:, :, lo:hi] = byte
    lin = PackedLinear(pack_gguf(Q[name], (24, 512), blocks.reshape(24, -1)), None, Workspace())
    x = torch.full((3, 512), sign)
    x[1] = -x[1]
    x[2, ::2] = -x[2, ::2]
    with use_kernel_options(int8(isa)):
        got = lin(x).double().numpy()
    want = fp64_product(lin, x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("N", [1, 5, 17])
def test_fewer_rows_than_a_tile(name, N, isa):
    """Row counts that leave a tile partly empty (the VNNI tiles repeat the last row and store only the
    real ones): every written row is right, and nothing past N is touched."""
    K = 512
    lin = linear(name, N, K, seed=N)
    x = activations(3, K, seed=N)
    out = torch.full((3, N + 7), 7.0)  # rows of stride N + 7: the kernel writes columns [0, N) only
    with use_kernel_options(int8(isa)):
        scratch = torch.empty(lin.scratch_floats(3))  # held here: args carry only its address
        fn, args = lin._call(lin.weight, x, out, scratch, ld=N + 7)
        fn(*args)
        got = lin(x)
    assert (out[:, N:] == 7.0).all() and torch.equal(out[:, :N], got)
    got = got.double().numpy()
    want = fp64_product(lin, x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name,K", [(name, 512) for name in INT8_TYPES] + [("Q8_0", 544), ("Q4_1", 544)])
def test_rows_are_batch_invariant(name, K, isa):
    """A row alone (the VNNI kernel's one-item pass, codes decoded straight into the dot) equals the row in
    a batch (decoded tiles shared by the items); K = 544 ends the layouts on a stretch of one group."""
    lin = linear(name, 24, K, seed=1)
    x = activations(16, K, seed=2)
    with use_kernel_options(int8(isa)):
        batch = lin(x)
        for i in (0, 3, 4, 7, 8, 15):  # first and last of the passes' groups of four (AVX2) and eight (VNNI) items
            alone = lin(x[i:i + 1].clone())
            assert torch.equal(alone[0], batch[i])


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_rows_take_the_int8_kernel_too(isa):
    """With int8 activations a long prompt goes through the same kernel (no fp32 tile): its rows equal
    the rows computed one at a time."""
    lin = linear("Q4_K", 40, 512)
    for T in (70, 65):  # past one chunk of 64 items (both tiles' pass over the weights); 65: a last chunk of one
        x = activations(T, 512)
        with use_kernel_options(int8(isa)):
            whole = lin(x)
            assert all(torch.equal(whole[i], lin(x[i:i + 1].clone())[0]) for i in (0, 17, 63, 64, T - 1))


@needs_kernels
@pytest.mark.parametrize("name", EXACT_ONLY)
def test_types_without_an_int8_kernel_stay_exact(name):
    K = 512
    lin = linear(name, 16, K)
    assert int8_kind(lin.weight, LIB) is None
    x = activations(3, K)
    with use_kernel_options(KernelOptions(isa=int8().isa, threads=2)):
        exact = lin(x)
    with use_kernel_options(int8()):
        assert torch.equal(lin(x), exact)


@needs_kernels
def test_split_projection_mixes_int8_and_exact_parts():
    K = 512
    parts = [pack_gguf(Q[n], (16, K), random_blocks(n, 16, K, np.random.default_rng(i)))
             for i, n in enumerate(["Q4_K", "Q5_0", "Q6_K"])]
    lin = PackedLinear(concat_rows(parts), None, Workspace())
    x = activations(4, K)
    with use_kernel_options(int8()):
        got = lin(x)
        for i, p in enumerate(parts):
            alone = PackedLinear(p, None, Workspace())(x)
            assert torch.equal(got[:, 16 * i:16 * (i + 1)], alone)


@needs_kernels
def test_int8_is_opt_in(monkeypatch):
    monkeypatch.delenv("QUILL_INT8_ACTIVATIONS", raising=False)
    assert resolve(threads=1).int8 is False
    assert resolve(threads=1, int8=True).int8 is True
    assert resolve(threads=1, isa="avx2", int8=True).int8 is True
    monkeypatch.setenv("QUILL_INT8_ACTIVATIONS", "1")
    assert resolve(threads=1).int8 is True
    assert resolve(threads=1, int8=False).int8 is False


@needs_kernels
@pytest.mark.slow
def test_default_model_agrees_with_exact_activations(monkeypatch):
    """The opt-in path on the real default model (Q4_1: the q4 layout; Q8_0 head): top-1 agreement with
    exact activations over teacher-forced tokens (one prefill each). With AMX off: on a CPU with AMX the
    q4/q8 weights load as AMX tiles, whose kernel keeps exact activations with or without int8."""
    from quill.bench.accuracy import _TEXT, position_logits
    from quill.models.loader import load_model

    monkeypatch.setenv("QUILL_NO_AMX", "1")

    loaded = load_model(None)
    ids = loaded.tokenizer.encode(_TEXT * 4)[:160]
    exact = position_logits(loaded, ids, activations="exact")
    rounded_ = position_logits(loaded, ids, activations="int8")
    assert not torch.equal(exact, rounded_)
    agree = (exact.argmax(-1) == rounded_.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree


@needs_kernels
@pytest.mark.slow
def test_fused_decode_takes_int8_and_agrees_with_prefill(monkeypatch):
    """The fused decode layer takes the int8 kernels, and its rows agree with the prefill's over the same
    tokens. Not bit for bit: attention sums in another order there, and an input that moves by 1e-7 can
    round to the neighbouring int8 step, so the two paths differ by about as much as int8 differs from
    exact (measured: 3% relative logit error either way); the argmax agrees. With AMX off, as in
    test_default_model_agrees_with_exact_activations: AMX tiles keep exact activations."""
    from quill.config import CacheConfig, EngineConfig
    from quill.engine.consistency import prefill_vs_decode
    from quill.engine.engine import LLMEngine

    def engine(activations):
        return LLMEngine(EngineConfig(activations=activations, cache=CacheConfig(num_blocks_override=16)))

    monkeypatch.setenv("QUILL_NO_AMX", "1")
    int8 = engine("int8")
    assert int8.runner.fused is not None and int8.runner.fused.options.int8
    ids = int8.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it rests in the sun.")
    a, b = prefill_vs_decode(int8, ids, len(ids) // 2)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert ((a - b).norm() / a.norm()).item() < 0.1
    _, exact = prefill_vs_decode(engine("exact"), ids, len(ids) // 2)
    assert not torch.equal(exact, b)
