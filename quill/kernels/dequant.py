"""Vectorized GGUF dequantization and a packed (codes, scale, min) layout for quantized kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quill.config import UnsupportedModelError

if TYPE_CHECKING:
    import torch

Q = GGMLQuantizationType
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})
PACKED_TYPES = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL,
                          Q.IQ4_XS})
SUPPORTED_TYPES = FLOAT_TYPES | PACKED_TYPES

_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_BIT_SHIFTS = np.arange(8, dtype=np.uint8)


@dataclass(frozen=True)
class PackedBlocks:
    """One code per weight plus per-group float scale and min: value = scale * code + min."""

    codes: np.ndarray  # (*shape) uint8 (int8 for Q8_0)
    scales: np.ndarray  # (*shape[:-1], shape[-1] // group_size) float32
    mins: np.ndarray  # same shape as scales; zeros where the format has no offset
    group_size: int

    def dequantize(self) -> np.ndarray:
        """(*shape) float32, bit-identical to `dequantize` for the same block data."""
        *lead, cols = self.codes.shape
        n_groups = cols // self.group_size
        codes = self.codes.reshape(*lead, n_groups, self.group_size).astype(np.float32)
        values = codes * self.scales[..., None]
        values += self.mins[..., None]
        return values.reshape(self.codes.shape)


def _f16(column: np.ndarray) -> np.ndarray:
    """(B, 2) uint8 -> (B, 1) float32."""
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _low_high_nibbles(packed: np.ndarray) -> np.ndarray:
    """(B, C, 32) uint8 -> (B, C, 2, 32): low nibbles first, then high nibbles of the same bytes."""
    return (packed[:, :, None, :] >> _NIBBLE_SHIFTS[None, None, :, None]) & np.uint8(0x0F)


def _unpack_q8_0(blocks: np.ndarray):
    scale = _f16(blocks[:, 0:2])
    codes = blocks[:, 2:].view(np.int8)
    return codes, scale, np.zeros_like(scale)


def _unpack_q4_0(blocks: np.ndarray):
    scale = _f16(blocks[:, 0:2])
    codes = _low_high_nibbles(blocks[:, None, 2:18]).reshape(-1, 32)
    return codes, scale, scale * np.float32(-8.0)  # stored codes are offset by 8


def _unpack_q4_1(blocks: np.ndarray):
    scale, minimum = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    codes = _low_high_nibbles(blocks[:, None, 4:20]).reshape(-1, 32)
    return codes, scale, minimum


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, 12) uint8 of eight 6-bit scales and eight 6-bit mins -> two (B, 8) uint8."""
    first, second, third = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    # Sub-blocks 0-3 keep their 6 bits in bytes 0-7; sub-blocks 4-7 take their low
    # nibbles from bytes 8-11 and their top 2 bits from the spare bits of bytes 0-7.
    scales_hi = (third & np.uint8(0x0F)) | ((first >> np.uint8(6)) << np.uint8(4))
    mins_hi = (third >> np.uint8(4)) | ((second >> np.uint8(6)) << np.uint8(4))
    scales = np.concatenate([first & np.uint8(0x3F), scales_hi], axis=1)
    mins = np.concatenate([second & np.uint8(0x3F), mins_hi], axis=1)
    return scales, mins


def _k_super_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K header -> per-32 (B, 8) float32 scale and min (min already negated)."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sub_scales, sub_mins = _k4_scales_mins(blocks[:, 4:16])
    return d * sub_scales.astype(np.float32), -(dmin * sub_mins.astype(np.float32))


def _unpack_q4_k(blocks: np.ndarray):
    scale, minimum = _k_super_scales(blocks)
    # Four 32-byte chunks; chunk c holds sub-block 2c in low and 2c+1 in high nibbles.
    codes = _low_high_nibbles(blocks[:, 16:144].reshape(-1, 4, 32)).reshape(-1, 256)
    return codes, scale, minimum


def _unpack_q5_k(blocks: np.ndarray):
    scale, minimum = _k_super_scales(blocks)
    high = blocks[:, 16:48]  # bit u of byte l is the 5th bit of element l of sub-block u
    high_bits = (high[:, None, :] >> _BIT_SHIFTS[None, :, None]) & np.uint8(1)  # (B, 8, 32)
    low = _low_high_nibbles(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    codes = (low | (high_bits << np.uint8(4))).reshape(-1, 256)
    return codes, scale, minimum


def _unpack_q6_k(blocks: np.ndarray):
    # Two halves of 128 elements; quarter k of a half takes its low 4 bits from
    # nibble k // 2 of ql bytes [32 * (k % 2), +32) and its high 2 bits from crumb k of qh.
    low = blocks[:, 0:128].reshape(-1, 2, 2, 32)  # (B, half, byte group, l)
    low = (low[:, :, None] >> _NIBBLE_SHIFTS[None, None, :, None, None]) & np.uint8(0x0F)
    low = low.reshape(-1, 2, 4, 32)  # (B, half, quarter, l)
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32)
    high = (high >> _CRUMB_SHIFTS[None, None, :, None]) & np.uint8(0x03)  # (B, half, quarter, l)
    codes = (low | (high << np.uint8(4))).reshape(-1, 256)
    d = _f16(blocks[:, 208:210])
    scale = d * blocks[:, 192:208].view(np.int8).astype(np.float32)  # (B, 16), one per 16 elements
    return codes, scale, scale * np.float32(-32.0)  # stored codes are offset by 32


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """(B, 64) uint8 of Q2_K / Q3_K low codes -> (B, 8, 32): group g is crumb g % 4 of bytes [32 * (g // 4), +32)."""
    return ((qs.reshape(-1, 2, 1, 32) >> _CRUMB_SHIFTS[None, None, :, None]) & np.uint8(3)).reshape(-1, 8, 32)


def _unpack_q2_k(blocks: np.ndarray):
    # 84 bytes: 16 bytes of (4-bit scale | 4-bit min << 4) per 16 weights, 64 bytes of 2-bit codes, d, dmin
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    packed = blocks[:, 0:16]
    scale = d * (packed & np.uint8(0x0F)).astype(np.float32)  # (B, 16)
    minimum = -(dmin * (packed >> np.uint8(4)).astype(np.float32))
    return _two_bit_codes(blocks[:, 16:80]).reshape(-1, 256), scale, minimum  # (d sc) q - (dmin m)


def _unpack_q3_k(blocks: np.ndarray):
    # 110 bytes: 32 bytes of high bits (bit g of byte l: element l of group g), 64 bytes of 2-bit low codes,
    # 12 bytes of 6-bit scales (low 4 bits: nibbles of bytes 0-7, scales 0-7 low then 8-15 high; top 2 bits:
    # crumb k of byte 8 + i for scale 4k + i), d. Weight d * (scale - 32) * (low - (high bit ? 0 : 4)).
    high = (blocks[:, None, 0:32] >> _BIT_SHIFTS[None, :, None]) & np.uint8(1)  # (B, 8, 32)
    codes = _two_bit_codes(blocks[:, 32:96]).astype(np.int8) - (np.int8(4) * (np.int8(1) - high.astype(np.int8)))
    scale = _f16(blocks[:, 108:110]) * _q3_k_scales(blocks).astype(np.float32)  # (B, 16), one per 16 elements
    return codes.reshape(-1, 256), scale, np.zeros_like(scale)


def _q3_k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q3_K blocks -> (B, 16) int8: each 16 elements' scale - 32."""
    packed = blocks[:, 96:104]
    low4 = np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=1)  # (B, 16)
    high2 = ((blocks[:, None, 104:108] >> _CRUMB_SHIFTS[None, :, None]) & np.uint8(3)).reshape(-1, 16)  # (B, 4k + i)
    return (low4 | (high2 << np.uint8(4))).astype(np.int8) - np.int8(32)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(B, 4) uint8 of a little-endian uint32 -> (B, 32) uint8: bit j is the 5th bit of element j."""
    return (qh[:, :, None] >> _BIT_SHIFTS[None, None, :]).reshape(-1, 32) & np.uint8(1)


def _unpack_q5_0(blocks: np.ndarray):
    scale = _f16(blocks[:, 0:2])
    low = _low_high_nibbles(blocks[:, None, 6:22]).reshape(-1, 32)  # elements j and j + 16 share byte j
    codes = (low | (_fifth_bits(blocks[:, 2:6]) << np.uint8(4))).view(np.int8) - np.int8(16)
    return codes, scale, np.zeros_like(scale)  # d * (q - 16): one product, as gguf computes it


def _unpack_q5_1(blocks: np.ndarray):
    scale, minimum = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    low = _low_high_nibbles(blocks[:, None, 8:24]).reshape(-1, 32)
    return low | (_fifth_bits(blocks[:, 4:8]) << np.uint8(4)), scale, minimum


# IQ4_NL / IQ4_XS: 4-bit indices into this non-linear table of int8 values (ggml-common.h kvalues_iq4nl)
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _unpack_iq4_nl(blocks: np.ndarray):
    scale = _f16(blocks[:, 0:2])
    return IQ4_VALUES[_low_high_nibbles(blocks[:, None, 2:18]).reshape(-1, 32)], scale, np.zeros_like(scale)


def _iq4_xs_ls(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks -> (B, 8) int32 6-bit scales: low 4 bits in scales_l's nibbles, high 2 in scales_h."""
    high = blocks[:, 2:4].copy().view(np.uint16).astype(np.uint32)  # (B, 1)
    low = (blocks[:, 4:8, None] >> _NIBBLE_SHIFTS[None, None, :]).reshape(-1, 8) & np.uint8(0x0F)
    return low.astype(np.int32) | (((high >> (2 * np.arange(8, dtype=np.uint32))) & np.uint32(3)) << np.uint32(4)).astype(np.int32)


def _unpack_iq4_xs(blocks: np.ndarray):
    # 256 weights: d, then a 6-bit scale per 32 (low 4 bits in scales_l nibbles, high 2 bits in scales_h),
    # each sub-block's weights d * (scale - 32) * table[index]
    d = _f16(blocks[:, 0:2])
    scale = d * (_iq4_xs_ls(blocks) - 32).astype(np.float32)  # (B, 8)
    codes = IQ4_VALUES[_low_high_nibbles(blocks[:, 8:136].reshape(-1, 8, 16)).reshape(-1, 256)]
    return codes, scale, np.zeros_like(scale)


@dataclass(frozen=True)
class KScaleBlocks:
    """Q4_K / Q5_K / IQ4_XS / Q6_K / Q3_K blocks split with their scales kept as the format stores them: an integer
    per group (32 weights; Q6_K and Q3_K 16) times an fp16 factor per 256. value = factor * scale * table(code) +
    min_factor * min, where table is IQ4_VALUES for IQ4_XS, code - 32 for Q6_K, code - 4 for Q3_K and the code for
    Q4_K, Q5_K. Q2_K keeps its scale bytes whole (scales: sc | m << 4 per 16 weights, mins None: m is each
    byte's high nibble): value = d * sc * code - dmin * m."""

    codes: np.ndarray  # (rows, cols) uint8: nibbles 0..15 (IQ4_XS: indices into IQ4_VALUES), Q5_K 0..31, Q6_K 0..63,
    #                    Q3_K 0..7, Q2_K 0..3
    scales: np.ndarray  # (rows, groups) int8: Q4_K's / Q5_K's sc, IQ4_XS's ls - 32, Q6_K's per-16 scale, Q3_K's sc - 32
    scale_factor: np.ndarray  # (rows, cols / 256) float16: d
    mins: np.ndarray | None  # (rows, cols / 32) int8: Q4_K's / Q5_K's m; None for IQ4_XS, Q6_K and Q3_K
    min_factor: np.ndarray | None  # (rows, cols / 256) float16: -dmin


def unpack_kscales(raw: np.ndarray, qtype, shape: tuple[int, int]) -> KScaleBlocks:
    """Q4_K, Q5_K, IQ4_XS, Q6_K, Q3_K or Q2_K blocks -> KScaleBlocks (the tiled layout keeps the file's compact
    scales)."""
    qtype = _check_type(qtype)
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.IQ4_XS, Q.Q6_K, Q.Q3_K, Q.Q2_K):
        raise ValueError(f"{qtype.name} has no integer-times-factor scales here (Q4_K, Q5_K, IQ4_XS, Q6_K, Q3_K and "
                         "Q2_K do)")
    rows, cols = (int(n) for n in shape)
    blocks = _as_bytes(raw, qtype, (rows, cols)).reshape(-1, GGML_QUANT_SIZES[qtype][1])
    nb = cols // 256
    if qtype == Q.Q6_K:
        codes, _, _ = _unpack_q6_k(blocks)
        d = blocks[:, 208:210].copy().view(np.float16).reshape(rows, nb)
        return KScaleBlocks(codes.reshape(rows, cols), blocks[:, 192:208].view(np.int8).reshape(rows, nb * 16), d,
                            None, None)
    if qtype == Q.Q2_K:  # codes 0..3 for d * sc * q - dmin * m; sc | m << 4 per 16 weights kept as the file's bytes
        d, dmin = (blocks[:, o:o + 2].copy().view(np.float16).reshape(rows, nb) for o in (80, 82))
        return KScaleBlocks(_two_bit_codes(blocks[:, 16:80]).reshape(rows, cols), blocks[:, 0:16].view(np.int8).reshape(
            rows, nb * 16), d, None, -dmin)
    if qtype == Q.Q3_K:  # codes q + 4 (0..7) for d * (sc - 32) * q, q in -4..3
        codes = (_unpack_q3_k(blocks)[0] + np.int8(4)).view(np.uint8)
        d = blocks[:, 108:110].copy().view(np.float16).reshape(rows, nb)
        return KScaleBlocks(codes.reshape(rows, cols), _q3_k_scales(blocks).reshape(rows, nb * 16), d, None, None)
    d = blocks[:, 0:2].copy().view(np.float16).reshape(rows, nb)
    if qtype in (Q.Q4_K, Q.Q5_K):  # the same 16-byte header: d, dmin, 6-bit scales and mins
        sc, m = _k4_scales_mins(blocks[:, 4:16])
        codes = (_unpack_q4_k if qtype == Q.Q4_K else _unpack_q5_k)(blocks)[0]
        neg_dmin = -blocks[:, 2:4].copy().view(np.float16).reshape(rows, nb)  # -dmin * m == -(dmin * m) exactly
        return KScaleBlocks(codes.reshape(rows, cols), sc.astype(np.int8).reshape(rows, nb * 8), d,
                            m.astype(np.int8).reshape(rows, nb * 8), neg_dmin)
    codes = _low_high_nibbles(blocks[:, 8:136].reshape(-1, 8, 16))
    return KScaleBlocks(codes.reshape(rows, cols), (_iq4_xs_ls(blocks) - 32).astype(np.int8).reshape(rows, nb * 8), d, None, None)


_UNPACKERS = {
    Q.Q5_0: _unpack_q5_0,
    Q.Q5_1: _unpack_q5_1,
    Q.IQ4_NL: _unpack_iq4_nl,
    Q.IQ4_XS: _unpack_iq4_xs,
    Q.Q8_0: _unpack_q8_0,
    Q.Q4_0: _unpack_q4_0,
    Q.Q4_1: _unpack_q4_1,
    Q.Q2_K: _unpack_q2_k,
    Q.Q3_K: _unpack_q3_k,
    Q.Q4_K: _unpack_q4_k,
    Q.Q5_K: _unpack_q5_k,
    Q.Q6_K: _unpack_q6_k,
}
_GROUP_SIZES = {Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32, Q.Q2_K: 16, Q.Q3_K: 16, Q.Q4_K: 32,
                Q.Q5_K: 32, Q.Q6_K: 16,
                Q.IQ4_NL: 32, Q.IQ4_XS: 32}


def _check_type(qtype) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedModelError(f"unknown GGML tensor type {qtype!r}") from None
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedModelError(f"unsupported GGML tensor type {qtype.name}; quill reads {names}")
    return qtype


def _as_bytes(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Check `raw` holds exactly `shape` elements of `qtype`; return it as flat uint8 (no copy if contiguous)."""
    if len(shape) not in (1, 2) or any(int(n) <= 0 for n in shape):
        raise ValueError(f"shape must be (rows, cols) or (n,) with positive sizes, got {shape}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        raise ValueError(f"last dim {shape[-1]} of shape {shape} is not a multiple of the {qtype.name} block size {block_size}")
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    expected = int(np.prod(shape)) // block_size * type_size
    if data.size != expected:
        raise ValueError(f"raw data is {data.size} bytes; {qtype.name} shape {shape} needs {expected}")
    return data


def unpack_blocks(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> PackedBlocks:
    """Split quantized blocks into per-weight codes and per-group scale/min arrays."""
    qtype = _check_type(qtype)
    if qtype not in PACKED_TYPES:
        raise ValueError(f"{qtype.name} is a float type with no packed layout; use dequantize")
    shape = tuple(int(n) for n in shape)
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = _as_bytes(raw, qtype, shape).reshape(-1, type_size)
    codes, scales, mins = _UNPACKERS[qtype](blocks)
    group_size = _GROUP_SIZES[qtype]
    group_shape = (*shape[:-1], shape[-1] // group_size)
    return PackedBlocks(
        codes=np.ascontiguousarray(codes).reshape(shape),
        scales=np.ascontiguousarray(scales, dtype=np.float32).reshape(group_shape),
        mins=np.ascontiguousarray(mins, dtype=np.float32).reshape(group_shape),
        group_size=group_size,
    )


def _dequantize_float(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == Q.F32:
        return data.view(np.float32).copy()  # copy: never alias a read-only memory map
    if qtype == Q.F16:
        return data.view(np.float16).astype(np.float32)
    # bf16 is the top half of an fp32 bit pattern
    return (data.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def dequantize(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> "torch.Tensor":
    """GGUF tensor data -> float32 tensor of `shape` (row-major torch order; blocks along the last dim)."""
    import torch  # lazy: metadata-only users (quill memory) stay torch-free
    qtype = _check_type(qtype)
    shape = tuple(int(n) for n in shape)
    if qtype in FLOAT_TYPES:
        values = _dequantize_float(_as_bytes(raw, qtype, shape), qtype).reshape(shape)
    else:
        values = unpack_blocks(raw, qtype, shape).dequantize()
    return torch.from_numpy(values)  # (*shape) float32
