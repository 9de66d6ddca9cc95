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
