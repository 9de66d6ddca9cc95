"""The prefill GEMM on AMX-BF16 tiles (csrc/amx_gemm.c, quill.kernels.gemm): fp32 accuracy from bf16 parts.

Each test runs the C code natively where the CPU has AMX-BF16 and the OS grants the tile state, else on
isa.h's emulated tile unit (the "amx" emulation build: TDPBF16PS as its definition states), so the layout
and the six-product split are checked on any x86 host. The hardware adds a tile product's terms in its own
order (on a Xeon with AMX, most outputs match summing each instruction's 32 products before adding them to
the accumulator, not the definition's one by one), so the two are compared with the fp64 reference, not
with each other.
"""

from __future__ import annotations

import pytest
import torch

from conftest import use_emulation
from quill.kernels import gemm, native, options

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels need x86-64 AVX2/FMA and gcc")


@pytest.fixture
def lib(monkeypatch):
    """The kernel library whose quill_x3_gemm runs on tiles: native, else the AMX emulation."""
    if not gemm.amx_bf16_usable(options.resolve(amx=options.hardware().amx)):
        use_emulation(monkeypatch, "amx")
    lib = native.load()
    assert lib.quill_amx_bf16_hw() == 1
    return lib


def _run(lib, x, w, ldo=None, threads=2):
    M, K = x.shape
    N = w.shape[0]
    ldo = ldo or N
    out = torch.full((M, ldo), 7.0)
    scratch = torch.empty(lib.quill_x3_scratch_bytes(M, K, threads), dtype=torch.uint8)
    rc = lib.quill_x3_gemm(x.data_ptr(), w.data_ptr(), out.data_ptr(), M, N, K, ldo, scratch.data_ptr(), threads)
    return rc, out


def _error(out, x, w):
    """max |out - x w^T| / sum |x| |w| over the outputs, in fp64."""
    ref = x.double() @ w.double().T
    return ((out.double() - ref).abs() / (x.double().abs() @ w.double().abs().T)).max().item()


# 2^-20 of sum |x| |w|: 16x fp32's unit roundoff, far above the split's 2^-24 per product plus fp32
# accumulation here, far below one bf16 part alone (2^-9): a missing product or a wrong tile byte breaks it
BOUND = 2.0 ** -20


@pytest.mark.parametrize("M,N,K", [(1, 32, 32), (17, 64, 96), (33, 96, 2048 + 96)],
                         ids=["one-row", "odd-blocks", "two-k-blocks"])
def test_matches_fp64_within_fp32_rounding(lib, M, N, K):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, K)  # magnitudes spread over 6 decades
    w = torch.randn(N, K, generator=g) * 0.02
    rc, out = _run(lib, x, w)
    assert rc == 0
    assert _error(out, x, w) < BOUND
    one_part = (x.bfloat16().float() @ w.bfloat16().float().T)  # what bf16 alone would give: the bound can fail
    assert _error(one_part, x, w) > 100 * BOUND


def test_writes_only_its_columns_of_a_wider_output(lib):
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(20, 64, generator=g), torch.randn(32, 64, generator=g)
    rc, out = _run(lib, x, w, ldo=45)
    assert rc == 0 and _error(out[:, :32], x, w) < BOUND
    assert torch.equal(out[:, 32:], torch.full((20, 13), 7.0))


@pytest.mark.parametrize("N,K", [(48, 64), (32, 80)], ids=["rows-not-32", "cols-not-32"])
def test_refuses_shapes_the_tiles_do_not_take(lib, N, K):
    x, w = torch.randn(20, K), torch.randn(N, K)
    rc, out = _run(lib, x, w)
    assert rc == -1 and torch.equal(out, torch.full((20, N), 7.0))  # nothing written: the caller uses BLAS


def test_nan_and_inf_make_their_dots_nan(lib):
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(20, 64, generator=g), torch.randn(32, 64, generator=g)
    x[0, 3], x[1, 10] = float("nan"), float("inf")
    rc, out = _run(lib, x, w)
    assert rc == 0 and out[:2].isnan().all() and out[2:].isfinite().all()
    assert _error(out[2:], x[2:], w) < BOUND


def test_matmul_t_takes_tiles_only_where_allowed(lib):
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(40, 64, generator=g), torch.randn(96, 64, generator=g)
    blas = torch.mm(x, w.T)
    with options.use(options.resolve(amx=False)):  # QUILL_NO_AMX=1's engine: BLAS, exactly
        assert torch.equal(gemm.matmul_t(x, w, torch.empty(40, 96)), blas)
    with options.use(options.resolve(amx=True)):
        assert _error(gemm.matmul_t(x, w, torch.empty(40, 96)), x, w) < BOUND
        few = x[: gemm.MIN_ROWS - 1]  # decode-sized: BLAS
        assert torch.equal(gemm.matmul_t(few, w, torch.empty(len(few), 96)), torch.mm(few, w.T))
        many = torch.randn(gemm.MAX_ROWS + 37, 64, generator=g)  # two kernel calls: every row written
        got = gemm.matmul_t(many, w, torch.full((len(many), 96), float("nan")))
        assert got.isfinite().all() and _error(got, many, w) < BOUND
        odd = torch.randn(96, 48)  # K = 48: refused by the kernel, BLAS
        assert torch.equal(gemm.matmul_t(x[:, :48].contiguous(), odd, torch.empty(40, 96)), torch.mm(x[:, :48], odd.T))


@pytest.mark.skipif(native.load() is None or not native.load().quill_amx_bf16_hw(), reason="no AMX-BF16 on this CPU")
def test_hardware_and_emulation_agree_within_the_bound(monkeypatch):
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(24, 160, generator=g), torch.randn(64, 160, generator=g)
    rc, hw = _run(native.load(), x, w)
    assert rc == 0
    use_emulation(monkeypatch, "amx")
    rc, emu = _run(native.load(), x, w)
    assert rc == 0
    assert _error(hw, x, w) < BOUND and _error(emu, x, w) < BOUND
    assert ((hw - emu).abs() / (x.abs() @ w.abs().T)).max().item() < 2 * BOUND


# The K-quant tile kinds quill_kq_gemm reads straight from the AMX-tiled layout (amx_gemv.c's).
KQ_TYPES = ["Q4_K", "Q5_K", "IQ4_XS", "Q6_K"]


def _kq_weight(name: str, N: int, K: int, seed: int):
    """A K-quant weight of random valid blocks in the tiled layout, and gguf's fp64 values of it."""
    import gguf
    import numpy as np

    from quill.bench.synth import random_blocks
    from quill.kernels.packed import pack_gguf
    from quill.kernels.tiled import tile_weight

    raw = random_blocks(name, N, K, np.random.default_rng(seed))
    qtype = gguf.GGMLQuantizationType[name]
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(N, K)).double()
    t = tile_weight(pack_gguf(qtype, (N, K), raw))
    assert t is not None and t.scale_d is not None  # the file's K-quant scales: int8 per group, fp16 per 256
    return t, ref


def _kq_error(out, x, ref):
    return ((out.double() - x.double() @ ref.T).abs() / (x.double().abs() @ ref.abs().T)).max().item()


@pytest.mark.parametrize("name", KQ_TYPES)
@pytest.mark.parametrize("M", [17, 45], ids=["one-block-pair", "odd-blocks"])
def test_kq_gemm_matches_fp64_within_fp32_rounding(lib, name, M):
    # 96 rows: a turn of 3 row pairs (fewer than a full turn of 4); 768 columns: 3 superblocks
    t, ref = _kq_weight(name, 96, 768, seed=M)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 768, generator=g) * torch.logspace(-3, 3, 768)  # magnitudes spread over 6 decades
    out = torch.full((M, 96), 7.0)
    with options.use(options.resolve(amx=True)):
        assert gemm.matmul_quantized(x, t, out)
    assert _kq_error(out, x, ref) < BOUND
    # the same sum with the weights in one bf16 part would fail the bound: the test can tell
    assert _kq_error(x @ ref.float().bfloat16().float().T, x, ref) > 100 * BOUND


def test_kq_gemm_writes_each_split_part_into_its_columns(lib):
    from quill.kernels.packed import SplitWeight

    (a, ref_a), (b, ref_b) = _kq_weight("Q4_K", 64, 512, 1), _kq_weight("Q6_K", 32, 512, 2)
    x = torch.randn(600, 512, generator=torch.Generator().manual_seed(3))  # two kernel calls of MAX_ROWS and 88
    out = torch.full((600, 96), float("nan"))
    with options.use(options.resolve(amx=True)):
        assert gemm.matmul_quantized(x, SplitWeight([a, b]), out)
    assert _kq_error(out, x, torch.cat([ref_a, ref_b])) < BOUND


def test_kq_gemm_refuses_what_it_does_not_read(lib):
    from quill.kernels.packed import SplitWeight
    from quill.kernels.tiled import tile_weight
    from quill.kernels.quantize import quantize_int8

    t, _ = _kq_weight("Q4_K", 48, 256, 4)  # 48 rows: not whole 32-row pairs
    good, _ = _kq_weight("Q4_K", 32, 256, 5)
    q8 = tile_weight(quantize_int8(torch.randn(32, 256)))  # an AMX tile without K-quant scales
    x = torch.randn(20, 256)
    out = torch.full((20, 48), 7.0)
    with options.use(options.resolve(amx=True)):
        assert not gemm.matmul_quantized(x, t, out)
        assert not gemm.matmul_quantized(x, q8, out[:, :32].contiguous())
        assert not gemm.matmul_quantized(x, SplitWeight([good, q8]), torch.empty(20, 64))  # every part or none
        assert not gemm.matmul_quantized(x[: gemm.MIN_ROWS - 1], good, torch.empty(gemm.MIN_ROWS - 1, 32))
        assert gemm.matmul_quantized(x, good, torch.empty(20, 32))
    with options.use(options.resolve(amx=False)):  # QUILL_NO_AMX=1's engine
        assert not gemm.matmul_quantized(x, good, torch.empty(20, 32))
    assert torch.equal(out, torch.full((20, 48), 7.0))


def test_prefill_rows_of_a_k_quant_linear_take_the_kernel(lib):
    from quill.kernels.packed import PackedLinear, Workspace

    t, ref = _kq_weight("IQ4_XS", 64, 512, 6)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(7))
    with options.use(options.resolve(amx=True)):
        lin = PackedLinear(t, None, Workspace())
        out = lin(x, gemv_rows=3)  # 3 decode rows on the GEMV, 37 prefill rows on quill_kq_gemm
        assert _kq_error(out, x, ref) < BOUND
        assert torch.equal(out[:3], lin(x[:3], gemv_rows=3))


@pytest.mark.skipif(native.load() is None or not native.load().quill_amx_bf16_hw(), reason="no AMX-BF16 on this CPU")
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_kq_hardware_and_emulation_agree_within_the_bound(monkeypatch, name):
    t, ref = _kq_weight(name, 64, 512, 8)
    x = torch.randn(24, 512, generator=torch.Generator().manual_seed(9))
    outs = []
    for emulate in (False, True):
        if emulate:
            use_emulation(monkeypatch, "amx")
        out = torch.empty(24, 64)
        with options.use(options.resolve(amx=True)):
            assert gemm.matmul_quantized(x, t, out)
        outs.append(out)
    assert _kq_error(outs[0], x, ref) < BOUND and _kq_error(outs[1], x, ref) < BOUND
