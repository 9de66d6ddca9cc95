"""The AVX-512 VNNI tile kernel of csrc/kquant_i8.c, emulated in numpy so its data layout and integer
arithmetic are checked on every CPU (the kernel itself runs only where the CPU has VNNI; there
test_kquant_i8.py checks it against the fp64 product):

- transpose16: the four rounds of unpacks and 128-bit shuffles, instruction by instruction, give
  lane r = row r;
- each format's lane-wise decode (put_dword, decode_layout) turns the transposed bytes of 16 rows into
  codes and per-lane scales that give back gguf-py's dequantized weights exactly;
- the integer dots of those codes with broadcast activations, minus the format's offset, scaled per
  group as the kernel does, give the fp64 product of the weights with the rounded activations;
- the exact path on the same tiles: x as three int8 digits per element (csrc/digits.h), each plane's
  integer dots recombined, give the fp64 product within the digits' rounding, as the kernel computes it.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from quill.bench.synth import random_blocks
from quill.kernels.packed import pack_gguf

from test_kquant_i8 import rounded

BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}
IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int64)
M8 = 0xFF


# ---- one zmm register as 16 uint32 lanes; the instructions the kernel uses, by their definitions ----

def unpack(a: np.ndarray, b: np.ndarray, width: int, high: bool) -> np.ndarray:
    """_mm512_unpack{lo,hi}_epi{32,64}: within each 128-bit lane, interleave the low (high) halves of a
    and b in elements of `width` dwords."""
    out = np.empty(16, np.uint32)
    for lane in range(4):
        x, y = a[4 * lane:4 * lane + 4].reshape(-1, width), b[4 * lane:4 * lane + 4].reshape(-1, width)
        half = slice(len(x) // 2, None) if high else slice(0, len(x) // 2)
        out[4 * lane:4 * lane + 4] = np.stack([x[half], y[half]], 1).reshape(-1)
    return out


def shuffle_i32x4(a: np.ndarray, b: np.ndarray, imm: int) -> np.ndarray:
    """_mm512_shuffle_i32x4: lanes 0, 1 from a, lanes 2, 3 from b, each picked by two bits of imm."""
    pick = [(imm >> (2 * i)) & 3 for i in range(4)]
    src = [a, a, b, b]
    return np.concatenate([src[i][4 * pick[i]:4 * pick[i] + 4] for i in range(4)])


def transpose16(rows: np.ndarray) -> list[np.ndarray]:
    """csrc/kquant_i8.c's transpose16 on (16, 64) bytes, step by step."""
    r = [rows[i].view(np.uint32).copy() for i in range(16)]
    a = [None] * 16
    for i in range(8):
        a[2 * i], a[2 * i + 1] = unpack(r[2 * i], r[2 * i + 1], 1, False), unpack(r[2 * i], r[2 * i + 1], 1, True)
    for i in range(4):
        r[4 * i] = unpack(a[4 * i], a[4 * i + 2], 2, False)
        r[4 * i + 1] = unpack(a[4 * i], a[4 * i + 2], 2, True)
        r[4 * i + 2] = unpack(a[4 * i + 1], a[4 * i + 3], 2, False)
        r[4 * i + 3] = unpack(a[4 * i + 1], a[4 * i + 3], 2, True)
    out = [None] * 16
    for c in range(4):
        lo0, hi0 = shuffle_i32x4(r[c], r[4 + c], 0x44), shuffle_i32x4(r[c], r[4 + c], 0xEE)
        lo1, hi1 = shuffle_i32x4(r[8 + c], r[12 + c], 0x44), shuffle_i32x4(r[8 + c], r[12 + c], 0xEE)
        out[c], out[4 + c] = shuffle_i32x4(lo0, lo1, 0x88), shuffle_i32x4(lo0, lo1, 0xDD)
        out[8 + c], out[12 + c] = shuffle_i32x4(hi0, hi1, 0x88), shuffle_i32x4(hi0, hi1, 0xDD)
    return out


def transposed_dwords(rows: np.ndarray) -> list[np.ndarray]:
    """Every dword of (16, n) bytes, n padded with zeros to whole 64-byte spans (the masked loads)."""
    n = rows.shape[1]
    padded = np.zeros((16, -(-n // 64) * 64), np.uint8)
    padded[:, :n] = rows
    T = []
    for s in range(padded.shape[1] // 64):
        T += transpose16(padded[:, 64 * s:64 * s + 64])
    return T[:-(-n // 4)]


def byte(v: np.ndarray, k: int) -> np.ndarray:
    return ((v >> np.uint32(8 * k)) & np.uint32(M8)).astype(np.int64)


def f16(v: np.ndarray, shift: int) -> np.ndarray:
    return ((v >> np.uint32(shift)) & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float32)


def codes_of(c: list[np.ndarray]) -> np.ndarray:
    """64 registers of four code bytes per lane -> (16 rows, 256) codes in element order."""
    return np.stack([reg.view(np.uint8).reshape(16, 4) for reg in c], 1).reshape(16, 256).astype(np.int64)


def decode_block(kind: str, T: list[np.ndarray]):
    """put_dword's decode of one super-block's transposed dwords: (codes (16, 256), scale per unit
    (units, 16), min per group (8, 16) or None, integer offset of the codes). Mirrors the C lane-wise."""
    u32 = np.uint32
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = f16(T[0], 0), f16(T[0], 16)
        u0, u1, u2 = T[1], T[2], T[3]
        q = [u0 & u32(0x3F3F3F3F), (u2 & u32(0x0F0F0F0F)) | ((u0 >> u32(2)) & u32(0x30303030)),
             u1 & u32(0x3F3F3F3F), ((u2 >> u32(4)) & u32(0x0F0F0F0F)) | ((u1 >> u32(2)) & u32(0x30303030))]
        sc = np.stack([(d * np.float32(0.0625) if kind == "Q4_K" and g % 2 else d) * byte(q[g // 4], g % 4).astype(np.float32)
                       for g in range(8)])
        mn = np.stack([dmin * byte(q[2 + g // 4], g % 4).astype(np.float32) for g in range(8)])
        qs = 12 if kind == "Q5_K" else 4
        c = [None] * 64
        for i in range(32):
            v = T[qs + i]
            j, e = i // 8, i % 8
            lo = v & u32(0x0F0F0F0F)
            hi = v & u32(0xF0F0F0F0) if kind == "Q4_K" else (v >> u32(4)) & u32(0x0F0F0F0F)
            if kind == "Q5_K":
                qh = T[4 + e]
                lo = lo | (((qh >> u32(2 * j)) & u32(0x01010101)) << u32(4))
                hi = hi | (((qh >> u32(2 * j + 1)) & u32(0x01010101)) << u32(4))
            c[16 * j + e], c[16 * j + 8 + e] = lo, hi
        return codes_of(c), sc, mn, 0
    if kind == "Q6_K":
        d = f16(T[52], 0)
        sc = np.stack([d * ((T[48 + cc // 4] << u32(24 - 8 * (cc % 4))).view(np.int32) >> 24).astype(np.float32)
                       for cc in range(16)])
        c = [None] * 64
        for i in range(32):
            h, second, e = i // 16, (i % 16) // 8, i % 8
            v, qh = T[i], T[32 + 8 * h + e]
            lo_hi2 = (qh << u32(2)) if second else (qh << u32(4))
            hi_hi2 = (qh >> u32(2)) if second else qh
            c[32 * h + 8 * second + e] = (v & u32(0x0F0F0F0F)) | (lo_hi2 & u32(0x30303030))
            c[32 * h + 16 + 8 * second + e] = ((v >> u32(4)) & u32(0x0F0F0F0F)) | (hi_hi2 & u32(0x30303030))
        return codes_of(c), sc, None, 32
    # IQ4_XS
    d = f16(T[0], 0)
    sc = np.stack([d * ((((T[1] >> u32(8 * (g // 2) + 4 * (g % 2))) & u32(15)) | (((T[0] >> u32(16 + 2 * g)) & u32(3)) << u32(4)))
                        .astype(np.int64) - 32).astype(np.float32) for g in range(8)])
    table = (IQ4 + 128).astype(np.uint8)
    c = [None] * 64
    for i in range(32):
        v = T[2 + i].view(np.uint8)
        g, e = i // 4, i % 4
        c[8 * g + e] = table[v & 15].view(np.uint32)
        c[8 * g + 4 + e] = table[v >> 4].view(np.uint32)
    return codes_of(c), sc, None, 128


def weights_of(kind: str, codes: np.ndarray, sc: np.ndarray, mn: np.ndarray | None, offset: int) -> np.ndarray:
    """(16, 256) weights the tile's codes and scales stand for, in the kernel's float32 order."""
    per = 16 if kind == "Q6_K" else 32
    unit = np.repeat(np.arange(256 // per), per)
    w = sc[unit].T * (codes - offset).astype(np.float32)
    if mn is not None:
        w = w - mn[unit].T
    return w.astype(np.float32)


def test_transpose16_puts_row_r_in_lane_r():
    rows = np.random.default_rng(1).integers(0, 256, size=(16, 64), dtype=np.uint8)
    T = transpose16(rows)
    for j in range(16):
        assert np.array_equal(T[j], rows.view(np.uint32)[:, j])


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_lane_decode_gives_ggufs_weights(kind):
    """Two super-blocks of 16 random rows: the emulated transpose + decode reproduce gguf-py's
    dequantization bit for bit (Q4_K's odd groups keep their high nibbles in place, 16 times the code,
    with 1/16 of the scale: the same float32 products)."""
    raw = random_blocks(kind, 16, 512, np.random.default_rng(3))
    ref = quants.dequantize(raw, Q[kind]).reshape(16, 512)
    size = BLOCK_BYTES[kind]
    for b in range(2):
        codes, sc, mn, offset = decode_block(kind, transposed_dwords(raw[:, b * size:(b + 1) * size]))
        got = weights_of(kind, codes, sc, mn, offset)
        if kind == "Q4_K":  # the in-place high nibbles: 16 times the code, 1/16 of the scale
            assert (codes[:, 32:64] % 16 == 0).all()
        np.testing.assert_array_equal(got, ref[:, 256 * b:256 * (b + 1)])


def rounded_item(x: np.ndarray):
    """One item's activations as quill_act8_quantize rounds them (test_kquant_i8.rounded): codes, dx per
    32, and the codes' sums per 16 and per 32."""
    q, dx = rounded(x[None])
    q, dx = q[0].astype(np.int64), dx[0]
    s16 = q.reshape(-1, 16).sum(-1)
    return q, dx, s16, s16.reshape(-1, 2).sum(-1)


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_lane_dots_give_the_product(kind):
    """The kernel's arithmetic on the emulated tile: per unit, the integer dot of the codes with the
    activations (vpdpbusd: unsigned codes times signed activations, four per lane), minus the offset
    times the activations' sum, times scale * dx; minus min * dx * sum for Q4_K / Q5_K. It equals the
    fp64 product of gguf's weights with the rounded activations (to 1e-6: gguf rounds each weight
    scale * code - min to float32, where the kernel keeps the two terms apart)."""
    K = 512
    raw = random_blocks(kind, 16, K, np.random.default_rng(5))
    ref_w = quants.dequantize(raw, Q[kind]).reshape(16, K).astype(np.float64)
    x = np.random.default_rng(6).standard_normal(K).astype(np.float32)
    x[7] *= 40
    q, dx, s16, s32 = rounded_item(x)
    size, got = BLOCK_BYTES[kind], np.zeros(16)
    for b in range(K // 256):
        codes, sc, mn, offset = decode_block(kind, transposed_dwords(raw[:, b * size:(b + 1) * size]))
        assert codes.min() >= 0 and codes.max() <= 255  # the unsigned operand
        per = 16 if kind == "Q6_K" else 32
        for u in range(256 // per):
            k0 = 256 * b + per * u
            dot = (codes[:, per * u:per * (u + 1)] * q[k0:k0 + per]).sum(1)  # exact, as int32 lanes
            sums = s16[k0 // 16] if per == 16 else s32[k0 // 32]
            got += (dot - offset * sums) * sc[u].astype(np.float64) * dx[k0 // 32]
            if mn is not None:
                got -= mn[u] * dx[k0 // 32] * s32[k0 // 32]
    want = ref_w @ (q.reshape(-1, 32) * dx[:, None].astype(np.float64)).reshape(-1)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


# ---- the exact path on the same tiles (quill_gemv_tiles_exact): x as three int8 digits per element ----

def digits_item(x: np.ndarray):
    """One item's digits as split_digits makes them (csrc/digits.h): per 32 elements, unit = 2^(e-22) with
    2^(e-1) <= max|x| < 2^e, v = x / unit rounded half to even (an exact power-of-two scaling, then
    vcvtps2dq), and v = d0 + 2^8 d1 + 2^16 d2 with d0, d1 the low bytes taken as signed (balanced)."""
    g = x.reshape(-1, 32).astype(np.float64)
    e = np.frexp(np.abs(g).max(1))[1]  # max|x| = m 2^e, 1/2 <= m < 1
    unit = np.ldexp(1.0, e - 22)
    v = np.rint(g / unit[:, None]).astype(np.int64).reshape(-1)
    d0 = (v + 128) % 256 - 128  # the low byte as a signed int8
    d1 = ((v - d0) // 256 + 128) % 256 - 128
    d2 = (v - d0 - 256 * d1) // 65536
    assert np.abs(v).max() <= 2**22 and np.array_equal(d0 + 256 * d1 + 65536 * d2, v)
    assert d0.min() >= -128 and d1.min() >= -128 and d0.max() <= 127 and d1.max() <= 127 and np.abs(d2).max() <= 64
    return (d0, d1, d2), unit, v


def vnni_library():
    """The VNNI kernels: native where the CPU has AVX-512 VNNI, else isa.h's emulation of them."""
    from quill.kernels import native, options
    hw = options.hardware()
    return native.load() if hw.avx512 and hw.vnni else native.load(emulate="avx512-vnni")


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_digit_planes_give_the_exact_product(kind):
    """The exact path's arithmetic on the emulated tile: each digit plane's integer dot with the unsigned codes,
    starting from -offset times the plane's digit sum (vpdpbusd, four per lane), stays below 2^20, and
    d0 + 2^8 d1 + 2^16 d2 of the three is the integer dot of the format's signed codes with round(x / unit).
    Scaled by scale * unit per group (Q6_K: per 16), minus min * sum(x), it is the fp64 product of gguf's
    weights with x to within half a unit per element (the digits' rounding, 2^-22 of the group's largest |x|)
    and fp32 rounding; the kernel itself (natively or emulated) computes it."""
    K = 512
    raw = random_blocks(kind, 16, K, np.random.default_rng(8))
    ref_w = quants.dequantize(raw, Q[kind]).reshape(16, K).astype(np.float64)
    x = np.random.default_rng(9).standard_normal(K).astype(np.float32)
    x[11] *= 40
    x[320:352] *= np.float32(1e-3)  # a group of small values: its own unit
    planes, unit, v = digits_item(x)
    size, got = BLOCK_BYTES[kind], np.zeros(16)
    for b in range(K // 256):
        codes, sc, mn, offset = decode_block(kind, transposed_dwords(raw[:, b * size:(b + 1) * size]))
        per = 16 if kind == "Q6_K" else 32
        for u in range(256 // per):
            k = slice(256 * b + per * u, 256 * b + per * (u + 1))
            c = codes[:, per * u:per * (u + 1)].astype(np.int64)
            dots = [-offset * d[k].sum() + c @ d[k] for d in planes]
            assert max(np.abs(d).max() for d in dots) < 2**20
            combined = dots[0] + 256 * dots[1] + 65536 * dots[2]
            np.testing.assert_array_equal(combined, (c - offset) @ v[k])
            got += combined * sc[u].astype(np.float64) * unit[k.start // 32]
            if mn is not None:
                got -= mn[u] * x[k].astype(np.float64).sum()
    want = ref_w @ x.astype(np.float64)
    rounding = np.abs(ref_w) @ np.repeat(unit / 2, 32)  # half a unit per element
    assert (np.abs(got - want) <= rounding + 1e-6 * np.abs(want).max()).all()
    lib = vnni_library()
    blocks = np.ascontiguousarray(raw).view(np.uint8)
    scratch = np.zeros(lib.quill_gemv_kq_scratch_bytes(1, K), np.uint8)
    out = np.zeros(16, np.float32)
    kind_id = {"Q4_K": 0, "Q6_K": 1, "IQ4_XS": 4, "Q5_K": 5}[kind]
    lib.quill_gemv_kq(kind_id, blocks.ctypes.data, x.ctypes.data, scratch.ctypes.data, out.ctypes.data, 16, K, 1, 16,
                      512, 1)
    assert np.abs(out - got).max() <= 1e-6 * np.abs(got).max()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q5_1"])
def test_layout_decode_gives_the_packed_weights(name):
    """decode_layout on quill's q4 / q8 layouts (16 rows, eight groups, scales and mins transposed the
    same way): q4's low and high nibbles, q8's codes plus 128, give the packed weight's values."""
    K = 256
    w = pack_gguf(Q[name], (16, K), random_blocks(name, 16, K, np.random.default_rng(7)))
    q8 = w.kind == "q8"
    per = 32 if q8 else 16
    codes_raw = w.codes.numpy().reshape(16, K // 32 * per)
    T = transposed_dwords(codes_raw)
    S = transposed_dwords(w.scale.numpy().reshape(16, -1).view(np.uint8).reshape(16, -1))
    c = [None] * 64
    for g in range(8):
        if q8:
            for e in range(8):
                c[8 * g + e] = T[8 * g + e] ^ np.uint32(0x80808080)
        else:
            for e in range(4):
                c[8 * g + e] = T[4 * g + e] & np.uint32(0x0F0F0F0F)
                c[8 * g + 4 + e] = (T[4 * g + e] >> np.uint32(4)) & np.uint32(0x0F0F0F0F)
    codes = codes_of(c) - (128 if q8 else 0)
    scale = np.stack([S[g].view(np.float32) for g in range(8)])
    unit = np.repeat(np.arange(8), 32)
    got = scale[unit].T * codes.astype(np.float32)
    if w.mins is not None:
        M = transposed_dwords(w.mins.numpy().reshape(16, -1).view(np.uint8).reshape(16, -1))
        got = got + np.stack([M[g].view(np.float32) for g in range(8)])[unit].T
    np.testing.assert_allclose(got, w.dequantize().numpy(), rtol=1e-6, atol=1e-6)
