"""The AMX tiled path checked on any x86 CPU: an emulation of csrc/amx_gemv.c's arithmetic in numpy.

The tile unit (TDPBSSD / TDPBSUD) cannot run without AMX-INT8; on such hosts the tests in test_kernels.py
that call quill_amx_gemv run the C code on isa.h's emulated tile unit (conftest.py's amx_kernels). Here,
independently of that C code, its arithmetic is restated:

Real (quill's own code, run as is):
  - tiled.tile_weight: every weight under test is quill's TiledWeight (codes, scale, mins, native_kind);
    the emulation reads its bytes through the flat offsets the C kernel uses, not through its shapes.
  - TiledWeight.dequantize_rows (pure torch), compared with gguf's dequantization exactly.
  - TiledWeight.dequantize, i.e. the native quill_tiled_dequant (AVX-512 code, no tile instructions: on a CPU
    without AVX-512, the same code on SIMDe's emulation, conftest.py), and quill_amx_scratch_bytes.

Emulated (a transcription of quill_amx_gemv, which needs the tile unit):
  - split_chunk: per 32-element group, 2^(e-1) <= max|x| < 2^e, v = rint(x * 2^(22-e)), balanced digits
    v = d0 + 2^8 d1 + 2^16 d2 written to A-tile rows 6 item + 3 half + digit (zero outside the half's
    32 bytes), a_rows(B) rows per chunk, the last item's padding zeroed; group sums in fp32.
  - the tile product, by the instruction's definition: C[m][n] += sum_{k<16, r<4} A[m][4k+r] * B[k][4n+r]
    (signed x signed for q8, signed x unsigned for q4 after unpack_tile_q4's nibble split), in int64 with
    a check that int32 holds every result; passes of 16 items, A tiles of 16 rows (6 or 12 when B <= 2). (Q6_K's own GEMV,
    q6_levels_gemv, is checked against fp64 on the emulated tile unit in test_kernels.py.)
  - combine: C0 + 2^8 C1 (+ 2^16 C2 for q4) in int32, q8's top digit added in fp32, times fp32
    scale * 2^(e-22), accumulated in fp32; then mins times the group sums. FMAs are done in fp64 and
    rounded to fp32 (one extra rounding at most, far inside the bounds).

Checked against: x @ W.T in fp64 with W = gguf.quants.dequantize of the same random blocks (Q4_0, Q4_1,
Q5_1, Q8_0) or the exact values of quill's int8 quantization (fp32 scales). The tile products must equal
the plain integer dot products of the packed codes with v exactly; the output must lie within the
digit error (half a unit of 2^(e-22), i.e. <= 2^-22 of the group's largest |x|, per element) plus fp32
accumulation error, and within 1e-5 of the output's largest magnitude, as test_kernels.py asks of the
hardware. A single flipped tile byte or a wrong digit weight breaks the exact check and the bound.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native, tiled
from quill.kernels.options import KernelOptions, use
from quill.kernels.packed import GROUP, PackedWeight, pack_gguf
from quill.kernels.quantize import quantize_int8

from test_gguf import random_tensor

ITEMS, ROWS_PER_ITEM, DIGIT = 16, 6, 256  # as in amx_gemv.c
F32 = np.float32


# ---------------------------------------------------------------- weights under test

def gguf_tiled(qtype, rows=48, blocks=6, seed=0):
    """quill's tiled form of random GGUF blocks, the packed weight it came from, and gguf's values (float32)."""
    raw, shape = random_tensor(qtype, rows, blocks, seed)
    w = pack_gguf(qtype, shape, raw)
    assert isinstance(w, PackedWeight), f"{qtype.name} no longer packs to a PackedWeight"
    return tiled.tile_weight(w), w, gguf.quants.dequantize(raw, qtype).reshape(shape)


def int8_tiled(rows=48, cols=192, seed=0):
    """quill's own int8 quantization (fp32 scales: the kernel's kind without bit 1) and its exact values."""
    dense = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    w = quantize_int8(dense)
    ref = (w.codes.float().view(rows, -1, GROUP) * w.scale[..., None]).view(rows, cols).numpy()
    return tiled.tile_weight(w), w, ref


CASES = {"Q4_0": lambda s: gguf_tiled(Q.Q4_0, seed=s), "Q4_1": lambda s: gguf_tiled(Q.Q4_1, seed=s),
         "Q5_1": lambda s: gguf_tiled(Q.Q5_1, seed=s), "Q8_0": lambda s: gguf_tiled(Q.Q8_0, seed=s),
         "int8": lambda s: int8_tiled(seed=s)}


def activations(batch, cols, seed):
    x = torch.randn(batch, cols, generator=torch.Generator().manual_seed(seed)).numpy()
    x[0, 5] = 300.0  # an outlier: its group loses resolution, its neighbours' groups keep theirs
    if batch > 2:
        x[1, 64:96] *= 1e-6  # a tiny group and an all-zero group
        x[2, 32:64] = 0.0
    return np.ascontiguousarray(x, dtype=F32)


# ---------------------------------------------------------------- the emulation

def a_rows(B: int) -> int:
    return ROWS_PER_ITEM * B if B <= 2 else (ROWS_PER_ITEM * B + 15) & ~15


def sum32(v: np.ndarray) -> F32:
    """simd.h's sum32: the four 8-lane quarters added as (q0 + q1) + (q2 + q3), then hsum8's halves."""
    v = (v[:8] + v[8:16]) + (v[16:24] + v[24:])
    while len(v) > 1:
        v = v[: len(v) // 2] + v[len(v) // 2 :]
    return F32(v[0])


def split_group(x32: np.ndarray):
    """One 32-element group -> (v int64 (32,), digits (3, 32) int64, xscale fp32), as split_chunk."""
    ax = np.abs(x32)
    if np.isnan(x32).any() or np.isinf(ax.max()):
        return None, None, F32(np.nan)
    mx = ax.max()
    if not mx > 0:
        return np.zeros(32, np.int64), np.zeros((3, 32), np.int64), F32(0.0)
    _, e = np.frexp(mx)
    e = int(e)
    xscale = np.ldexp(F32(1.0), e - 22)
    v = np.rint(np.ldexp(x32, 22 - e)).astype(np.int64)  # scalef (exact) then cvtps_epi32 (nearest even)
    digits, i = np.empty((3, 32), np.int64), v.copy()
    for d in range(3):
        digits[d] = ((i + 128) & 255) - 128 if d < 2 else i  # sign-extended low byte; the rest is the top digit
        i = (i - digits[d]) >> 8
    return v, digits, xscale


def split(x: np.ndarray):
    """x (B, K) -> A rows (K/64, a_rows(B), 64) int8, xscale (B, G) and group sums (B, G) fp32."""
    B, K = x.shape
    G, C, R = K // GROUP, K // 64, a_rows(B)
    a = np.random.default_rng(99).integers(-128, 128, (C, R, 64)).astype(np.int8)  # garbage, as uninitialised scratch
    xscale, xs = np.empty((B, G), F32), np.empty((B, G), F32)
    for b in range(B):
        for c in range(C):
            rows = a[c, ROWS_PER_ITEM * b :]
            rows[: (R - ROWS_PER_ITEM * b) if b == B - 1 else ROWS_PER_ITEM] = 0
            for h in range(2):
                g = 2 * c + h
                grp = x[b, GROUP * g : GROUP * (g + 1)]
                xs[b, g] = sum32(grp)
                _, digits, xscale[b, g] = split_group(grp)
                if digits is not None:
                    rows[3 * h : 3 * h + 3, 32 * h : 32 * h + 32] = digits.astype(np.int8)
    return a, xscale, xs


def weight_tile(t: tiled.TiledWeight, tile: int) -> np.ndarray:
    """B tile `tile` (= rb * C + c) as 16 x 64 bytes, read from the flat code buffer like load_weight_tile."""
    flat = t.codes.numpy().reshape(-1)
    if t.native_kind & 1:
        return flat[tile * 1024 : (tile + 1) * 1024].view(np.int8).reshape(16, 64)
    src = flat[tile * 512 : (tile + 1) * 512].view(np.uint8)
    return np.concatenate((src & 15, src >> 4)).reshape(16, 64)  # unpack_tile_q4


def tile_product(a_tile: np.ndarray, b_tile: np.ndarray) -> np.ndarray:
    """TDPBSSD / TDPBSUD into a zeroed C: (m, 64) x (16, 64) -> (m, 16), each result checked to fit int32."""
    c = np.einsum("mkr,knr->mn", a_tile.astype(np.int64).reshape(-1, 16, 4), b_tile.astype(np.int64).reshape(16, 16, 4))
    assert np.abs(c).max(initial=0) < 2**31, "a tile product overflows int32"
    return c


def group_values(t: tiled.TiledWeight, which: str, group: int) -> np.ndarray:
    """load_group: 16 rows' scales (or mins) of flat group `group`, fp16 or fp32 as native_kind says."""
    raw = getattr(t, which).numpy().reshape(-1).view(np.uint8)
    dt = np.float16 if t.native_kind & 2 else np.float32
    return raw.view(dt)[group * 16 : (group + 1) * 16].astype(F32)


def fma32(a, b, c):
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(F32)


def combine(acc, r: np.ndarray, q8: bool, s, m, xsc, xs):
    """acc (16,) fp32 += one item's 6 C rows (r, (6, 16) int64) recombined, times the unit then the scale, then
    the min (m: None without) times the group's sum, for each of the chunk's two groups."""
    for h in range(2):
        c0, c1, c2 = r[3 * h], r[3 * h + 1], r[3 * h + 2]
        lo = c0 + c1 * DIGIT
        if q8:
            f = fma32(c2.astype(F32), F32(65536.0), lo.astype(F32))
        else:
            total = lo + c2 * DIGIT * DIGIT
            assert np.abs(total).max() < 2**31, "q4 recombination overflows int32"
            f = total.astype(F32)
        acc = fma32(f * F32(xsc[h]), s[h], acc)  # a power of two: exact
        if m is not None:
            acc = fma32(m[h], xs[h], acc)
    return acc


def emulated_gemv(t: tiled.TiledWeight, x: np.ndarray, products: list | None = None) -> np.ndarray:
    """out (B, N) as quill_amx_gemv computes it; `products` collects (item, row block, group, exact integer dot)."""
    B, K = x.shape
    N, G, C, R = t.rows, K // GROUP, K // 64, a_rows(B)
    q8, m = bool(t.native_kind & 1), min(R, 16)
    a, xscale, xs = split(x)
    out = np.empty((B, N), F32)
    for rb in range(N // 16):
        g0 = rb * G
        for b0 in range(0, B, ITEMS):
            nb = min(B - b0, ITEMS)
            tiles = (ROWS_PER_ITEM * nb + 15) // 16
            acc = [np.zeros(16, F32) for _ in range(nb)]
            for c in range(C):
                w = weight_tile(t, rb * C + c)
                ac = a[c, ROWS_PER_ITEM * b0 :]
                ctile = np.concatenate([tile_product(ac[16 * q : 16 * q + m], w) for q in range(tiles)])
                s = [group_values(t, "scale", g0 + 2 * c + h) for h in range(2)]
                mn = None if t.mins is None else [group_values(t, "mins", g0 + 2 * c + h) for h in range(2)]
                for i in range(nb):
                    r = ctile[ROWS_PER_ITEM * i : ROWS_PER_ITEM * (i + 1)]
                    if products is not None:
                        for h in range(2):
                            dot = r[3 * h] + r[3 * h + 1] * DIGIT + r[3 * h + 2] * DIGIT * DIGIT
                            products.append((b0 + i, rb, 2 * c + h, dot))
                    acc[i] = combine(acc[i], r, q8, s, mn, xscale[b0 + i, 2 * c : 2 * c + 2], xs[b0 + i, 2 * c : 2 * c + 2])
            for i in range(nb):
                out[b0 + i, 16 * rb : 16 * rb + 16] = acc[i]
    return out


def packed_codes(w: PackedWeight) -> np.ndarray:
    """(rows, cols) int64 codes straight from the packed layout (GGUF nibble order), independent of the tiles."""
    if w.kind == "q8":
        return w.codes.numpy().astype(np.int64)
    pairs = w.codes.numpy().reshape(w.rows, w.groups, 16).astype(np.int64)
    return np.stack((pairs & 15, pairs >> 4), axis=2).reshape(w.rows, w.cols)


# ---------------------------------------------------------------- the digit split

def test_digit_split_reconstructs_each_group_within_half_a_unit():
    rng = np.random.default_rng(5)
    groups = [rng.standard_normal(32) * 10.0 ** rng.integers(-30, 30) for _ in range(200)]
    edge = np.full(32, -0.25, F32)
    edge[3] = np.nextafter(F32(1.0), F32(0.0))  # rounds up to exactly 2^22: the top digit reaches 64
    groups += [edge, -edge, np.full(32, 2.0), np.r_[np.full(31, 1e-3), 300.0]]
    top_seen = set()
    for grp in groups:
        x = np.asarray(grp, F32)
        v, digits, xscale = split_group(x)
        assert digits[:2].min() >= -128 and digits[:2].max() <= 127 and np.abs(digits[2]).max() <= 64
        np.testing.assert_array_equal(digits[0] + DIGIT * digits[1] + DIGIT * DIGIT * digits[2], v)
        assert np.abs(v).max() <= 2**22
        top_seen.update(np.abs(digits[2]).tolist())
        _, e = np.frexp(np.abs(x).max())
        assert np.ldexp(1.0, int(e) - 1) <= np.abs(x).max() < np.ldexp(1.0, int(e))
        err = np.abs(v * np.float64(xscale) - x.astype(np.float64))
        assert err.max() <= np.float64(xscale) / 2  # half a unit of 2^(e-22) ...
        assert err.max() <= 2.0**-22 * np.abs(x).max()  # ... at most 2^-22 of the group's largest |x|
    assert 64 in top_seen  # the edge case reached the top digit's bound


def test_digit_split_of_zero_nan_and_inf_groups():
    v, digits, xscale = split_group(np.zeros(32, F32))
    assert xscale == 0 and not digits.any()
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones(32, F32)
        x[7] = bad
        assert np.isnan(split_group(x)[2])  # the group's xscale is NaN, so every output it touches is NaN


def test_a_tile_rows_keep_items_halves_and_digits_apart():
    x = activations(3, 128, seed=2)
    a, xscale, _ = split(x)
    assert a.shape == (2, a_rows(3), 64) and a_rows(3) == 32 and a_rows(2) == 12
    for b in range(3):
        for c in range(2):
            for h in range(2):
                rows = a[c, ROWS_PER_ITEM * b + 3 * h : ROWS_PER_ITEM * b + 3 * h + 3].astype(np.int64)
                assert not rows[:, : 32 * h].any() and not rows[:, 32 * h + 32 :].any()
                v = rows[0] + DIGIT * rows[1] + DIGIT * DIGIT * rows[2]
                grp = x[b, 64 * c + 32 * h : 64 * c + 32 * h + 32].astype(np.float64)
                rebuilt = v[32 * h : 32 * h + 32] * np.float64(xscale[b, 2 * c + h])
                assert np.abs(rebuilt - grp).max() <= 2.0**-22 * np.abs(grp).max()
    assert not a[:, ROWS_PER_ITEM * 3 :].any()  # the padding rows after the last item are zeroed


# ---------------------------------------------------------------- layout: quill's own tile_weight and dequant

@pytest.mark.parametrize("case", list(CASES))
def test_tiled_layout_reads_back_gguf_values(case):
    t, w, ref = CASES[case](0)
    assert t is not None and (t.rows, t.cols) == (w.rows, w.cols)
    # the C kernel's byte order: tile byte [kk][j][r] is the code of row 16 rb + j, column 64 c + 4 kk + r
    codes, C = packed_codes(w), t.cols // 64
    for rb in range(t.rows // 16):
        for c in range(C):
            tile = weight_tile(t, rb * C + c).astype(np.int64).reshape(16, 16, 4)  # (kk, j, r)
            expected = codes[16 * rb : 16 * rb + 16, 64 * c : 64 * c + 64]
            np.testing.assert_array_equal(tile.transpose(1, 0, 2).reshape(16, 64), expected)
    # scales and mins read through load_group's flat offsets, in the dtype native_kind announces
    assert bool(t.native_kind & 2) == (case != "int8") and bool(t.native_kind & 1) == (w.kind == "q8")
    assert (t.mins is None) == (case in ("Q8_0", "int8"))
    for rb in range(t.rows // 16):
        for g in range(t.groups):
            rows = slice(16 * rb, 16 * rb + 16)
            np.testing.assert_array_equal(group_values(t, "scale", rb * t.groups + g), w.scale[rows, g].numpy())
            if t.mins is not None:
                np.testing.assert_array_equal(group_values(t, "mins", rb * t.groups + g), w.mins[rows, g].numpy())
    np.testing.assert_array_equal(t.dequantize_rows(torch.arange(t.rows)).numpy(), ref)  # pure torch
    ids = torch.tensor([0, 7, 16, 47, 3])
    np.testing.assert_array_equal(t.dequantize_rows(ids).numpy(), ref[ids.numpy()])
    assert t.nbytes <= w.nbytes


@pytest.mark.skipif(native.load() is None, reason="needs the native library")
@pytest.mark.parametrize("case", list(CASES))
def test_native_amx_dequant_equals_gguf(case, avx512_kernels):
    """quill_tiled_dequant (AVX2 code: its tile unpacking gives the bytes the AMX kernels' AVX-512 one does) gives
    gguf's values, under the AVX-512 options and the AVX2 ones alike."""
    t, _, ref = CASES[case](1)
    np.testing.assert_array_equal(t.dequantize().numpy(), ref)  # quill_tiled_dequant, for real
    with use(KernelOptions(isa=256, threads=2)):
        np.testing.assert_array_equal(t.dequantize().numpy(), ref)


def test_shapes_that_do_not_fit_the_tiles_are_refused():
    assert tiled.tile_weight(gguf_tiled(Q.Q4_1, rows=40)[1]) is None  # 40 rows: not whole 16-row blocks
    assert tiled.tile_weight(gguf_tiled(Q.Q4_1, blocks=5)[1]) is None  # 160 columns: not whole 64-column chunks


@pytest.mark.skipif(native.load() is None, reason="needs the native library")
@pytest.mark.parametrize("batch", [1, 2, 3, 16, 19])
def test_scratch_bytes_cover_the_kernel_layout(batch):
    got = native.load().quill_amx_scratch_bytes(batch, 192)
    if got == 0:
        pytest.skip("compiler without AMX intrinsics: the stub reports no scratch and the tiled path is off")
    G, C = 192 // GROUP, 192 // 64
    # xs and xscale (B x G floats each), then up to 63 bytes to align, then C chunks of a_rows(B) x 64 digits
    assert got >= batch * G * 8 + 63 + C * a_rows(batch) * 64


# ---------------------------------------------------------------- the GEMV's arithmetic

@pytest.mark.parametrize("batch", [1, 3, 16, 19])
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_amx_gemv_matches_fp64_reference(case, batch):
    t, w, ref = CASES[case](batch)
    x = activations(batch, t.cols, seed=batch + 10)
    products = []
    got = emulated_gemv(t, x, products).astype(np.float64)

    # 1. every tile product, recombined, is exactly the integer dot product of the packed codes with v
    codes = packed_codes(w)
    assert len(products) == batch * t.rows // 16 * t.groups
    for b, rb, g, dot in products:
        v, _, _ = split_group(x[b, GROUP * g : GROUP * (g + 1)])
        np.testing.assert_array_equal(dot, codes[16 * rb : 16 * rb + 16, GROUP * g : GROUP * (g + 1)] @ v)

    # 2. the output against x @ W.T in fp64
    x64, W = x.astype(np.float64), ref.astype(np.float64)
    expected = x64 @ W.T
    G = t.groups
    xg = x64.reshape(batch, G, GROUP)
    unit = np.array([[split_group(xg[b, g].astype(F32))[2] for g in range(G)] for b in range(batch)], np.float64)
    scale = w.scale.numpy().astype(np.float64)
    mins = np.zeros_like(scale) if w.mins is None else w.mins.numpy().astype(np.float64)  # None: all zero
    abs_sc = np.abs(codes.reshape(t.rows, G, GROUP)) * np.abs(scale)[..., None]  # |scale * code| per weight
    digit_err = np.einsum("bg,ngk->bn", unit / 2, abs_sc)  # half a unit per element
    magnitude = np.einsum("bgk,ngk->bn", np.abs(xg), abs_sc) + np.abs(xg).sum(-1) @ np.abs(mins).T
    fp32_err = (3 * G + 40) * 2.0**-24 * magnitude  # recombination, scaling, 3G fp32 accumulations, group sums
    excess = np.abs(got - expected) - (digit_err + fp32_err)
    assert excess.max() <= 0, f"beyond the bound by {excess.max():.3g}"
    assert (np.abs(got - expected).max() / np.abs(expected).max()) < 1e-5


@pytest.mark.parametrize("case", ["Q4_1", "Q8_0"])
def test_emulated_rows_are_batch_invariant(case):
    t, _, _ = CASES[case](3)
    x = activations(19, t.cols, seed=4)
    full = emulated_gemv(t, x)
    for i in (0, 5, 18):
        np.testing.assert_array_equal(emulated_gemv(t, x[i : i + 1])[0], full[i])


def test_the_amx_emulation_builds_and_runs_on_every_host():
    """The emulated tile unit's library (native.load(emulate="amx"), built at -Og) is built here whatever the
    CPU, so a kernel change that only that build rejects (a prefetch hint -Og does not fold to a constant)
    fails on an AMX host too, not only on the hosts whose tests need it; where the CPU has AMX, its tiled
    GEMV gives the hardware's bits."""
    from quill.bench.synth import random_blocks
    from quill.kernels import native
    from quill.kernels.kquant import block_weight
    from quill.kernels.tiled import tile_weight

    if native.load() is None:
        pytest.skip("native kernels need x86-64 AVX2/FMA and gcc")
    emulated = native.load(emulate="amx")
    assert emulated is not None, "simde-py is a test dependency: pip install -e '.[test]'"
    assert emulated.quill_amx_hw() == 1 and emulated.quill_amx_enable() == 1
    raw = np.ascontiguousarray(random_blocks("Q4_K", 32, 512, np.random.default_rng(2))).view(np.uint8)
    w = tile_weight(block_weight(Q.Q4_K, (32, 512), raw))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    scratch = torch.empty(emulated.quill_amx_scratch_bytes(3, 512) // 4 + 16)
    out = torch.empty(3, 32)
    emulated.quill_tiled_gemv(*w.native_args(), x.data_ptr(), out.data_ptr(), 32, 512, 3, 32, scratch.data_ptr(), 1)
    exact = x.double() @ w.dequantize().double().T
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5
    if native.load().quill_amx_enable():
        hw = torch.empty(3, 32)
        native.load().quill_tiled_gemv(*w.native_args(), x.data_ptr(), hw.data_ptr(), 32, 512, 3, 32, scratch.data_ptr(), 1)
        assert torch.equal(out, hw)
