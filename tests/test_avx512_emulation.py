"""The AVX-512 emulation build (csrc/isa.h, native.load(emulate="avx512-vnni")) that lets every isa=512 test run
on a CPU without AVX-512 (conftest.py's _avx512_kernels): it really runs the 16-lane code, not the AVX2 code
under another name, and where the CPU has AVX-512 with VNNI it computes what the hardware computes."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native, options
from quill.kernels.options import KernelOptions, use
from quill.kernels.packed import PackedLinear, Workspace, pack_gguf

from conftest import use_library
from test_gguf import random_tensor

NATIVE = native.load()
EMULATED = native.load(emulate="avx512-vnni") if NATIVE is not None else None
NO_VNNI = native.load(emulate="avx512") if NATIVE is not None else None  # AVX-512 without VNNI (Skylake-SP)
needs_emulation = pytest.mark.skipif(NATIVE is None, reason="native kernels need x86-64 AVX2/FMA and gcc")
# one type per kernel family: quant_gemv.c's q4 and q8 rows, kquant.c's block rows, 32-groups and f16 rows;
# and the kinds that take kquant_i8.c's VNNI tiles (with x's exact digits on the exact path)
ROW_TYPES = [Q.Q4_0, Q.Q8_0, Q.Q5_1, Q.Q3_K, Q.Q2_K, Q.Q5_0, Q.IQ4_NL, Q.F16, Q.BF16]
TILE_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]
TYPES = ROW_TYPES + TILE_TYPES

def _case(qtype, batch=5):
    raw, shape = random_tensor(qtype, 40, 4 if gguf.GGML_QUANT_SIZES[qtype][0] > 1 else 256, seed=3)
    x = torch.randn(batch, shape[1], generator=torch.Generator().manual_seed(4))
    return raw, shape, x


def _outputs(lib, qtype, isa, int8=False, batch=5):
    """y = x @ W.T through PackedLinear on `lib` (its weights packed while `lib` is native.load(), and for an
    emulation, options.hardware() saying what its probes say)."""
    raw, shape, x = _case(qtype, batch)
    mp = pytest.MonkeyPatch()
    try:
        use_library(mp, lib)
        lin = PackedLinear(pack_gguf(qtype, shape, raw), None, Workspace())
        with use(KernelOptions(isa=isa, amx=False, threads=2, int8=int8)):
            return torch.cat([lin(x, gemv_rows=batch), lin(x[2:3].clone(), gemv_rows=1)]).numpy()
    finally:
        mp.undo()


@needs_emulation
def test_the_emulated_library_reports_and_runs_avx512():
    assert EMULATED is not None, "simde-py is a test dependency: pip install -e '.[test]'"
    assert (EMULATED.quill_hw_avx512(), EMULATED.quill_hw_vnni(), EMULATED.quill_amx_hw()) == (1, 1, 0)
    assert (NO_VNNI.quill_hw_avx512(), NO_VNNI.quill_hw_vnni(), NO_VNNI.quill_amx_hw()) == (1, 0, 0)
    # the probe that picks a call's width inside the library is its own (loaded after the native one)
    assert EMULATED.quill_isa_used(512) == 512 and EMULATED.quill_isa_used(256) == 256


@needs_emulation
@pytest.mark.parametrize("qtype", ROW_TYPES, ids=lambda t: t.name)
def test_emulated_512_rows_are_the_16_lane_code(qtype):
    """Its isa 512 sums in another order than the AVX2 rows (so the outputs differ somewhere in the last
    bits, within fp32 accumulation error), and its isa 256 is the AVX2 code, bit for bit the native library's."""
    wide, narrow = _outputs(EMULATED, qtype, 512), _outputs(EMULATED, qtype, 256)
    np.testing.assert_array_equal(narrow, _outputs(NATIVE, qtype, 256))
    assert not np.array_equal(wide, narrow)
    assert np.abs(wide - narrow).max() <= 1e-5 * np.abs(narrow).max()


@needs_emulation
@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_emulated_512_takes_the_vnni_tiles(qtype):
    """The block kinds go to the VNNI tiles (quill_gemv_tiles_exact takes the call: 0, not -1), exact and int8."""
    kind = {Q.Q4_K: 0, Q.Q6_K: 1, Q.IQ4_XS: 4, Q.Q5_K: 5}[qtype]
    raw, (N, K) = random_tensor(qtype, 16, 1, seed=5)
    blocks = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).copy())
    x, xs, out = torch.randn(2, K), torch.zeros(2 * K // 16), torch.zeros(2, N)
    digits = torch.zeros(NATIVE.quill_gemv_kq_scratch_bytes(2, K), dtype=torch.uint8)
    for lib, taken in ((EMULATED, 0), (NO_VNNI, -1)):
        tiles = lib.quill_gemv_tiles_exact  # kind, blocks, x, xs, digits, out, N, K, B, ld, threads -> 0, or -1
        tiles.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
        assert tiles(kind, blocks.data_ptr(), x.data_ptr(), xs.data_ptr(), digits.data_ptr(), out.data_ptr(),
                     N, K, 2, N, 1) == taken
    for int8 in (False, True):
        wide, narrow = _outputs(EMULATED, qtype, 512, int8), _outputs(EMULATED, qtype, 256, int8)
        assert np.abs(wide - narrow).max() <= (1e-5 if not int8 else 1e-2) * np.abs(narrow).max()


@needs_emulation
@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_avx512_without_vnni_runs_the_16_lane_block_rows(qtype):
    """Without VNNI the block kinds take kquant.c's 16-lane rows: within 1e-5 of the fp64 product with gguf's
    dequantization, a row alone equal to it in the batch, and a different summation from the AVX2 tiles."""
    raw, shape, x = _case(qtype)
    want = (x.double() @ torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(shape)).double().T).numpy()
    got = _outputs(NO_VNNI, qtype, 512)
    assert np.abs(got[:5] - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_array_equal(got[5], got[2])  # batch invariance
    assert not np.array_equal(got, _outputs(NO_VNNI, qtype, 256))


@pytest.mark.skipif(NATIVE is None or not (options.hardware().avx512 and options.hardware().vnni),
                    reason="compares the emulation with a CPU that has AVX-512 with VNNI")
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8"])
def test_emulation_computes_what_the_hardware_computes(int8):
    """Where the CPU runs the 16-lane code itself, the emulation's outputs are the hardware's, bit for bit
    (this is what makes the emulated runs on AVX2-only hosts evidence about the real kernels)."""
    for qtype in TYPES:
        np.testing.assert_array_equal(_outputs(EMULATED, qtype, 512, int8), _outputs(NATIVE, qtype, 512, int8),
                                      err_msg=qtype.name)
