"""The AMX tiled layout: packed weights rearranged into 16 x 64 int8 tiles for Intel AMX (TMUL).

Same values as the packed layout (value = scale * code + min), only reordered, so nothing is
lost. Scales and mins stay fp16 where the file had them so (Q4_0, Q4_1, Q8_0) and all-zero mins
(Q8_0's, which the packed layout already leaves out) are dropped, so it is smaller than the packed
layout. Q4_K, Q5_K, IQ4_XS and Q6_K blocks tile too, their codes as nibbles (IQ4_XS's indices into its
table; Q5_K's top bit and Q6_K's top 2 bits in planes of their own) and their scales as the file
stores them: an int8 per 32 weights (Q6_K: 16) times an fp16 factor per 256, so the tiles take 1.03x
(Q4_K), 1.023x (Q5_K), 1.015x (IQ4_XS) and 1.0x (Q6_K) the file's bytes. Q3_K tiles for the VNNI tiles only
(the AMX kernels have no such codes): its codes q + 4 (0..7) as a plane of their low 2 bits and one of their
top bit, its scales - 32 as an int8 per 16 weights times the fp16 d per 256, 1.036x the file's bytes; and
Q2_K (q2), its codes as a 2-bit plane and its scale bytes (sc | m << 4) as the file keeps them, with d and
-dmin per 256, 1.0x. The kernel and the byte order are described in csrc/amx_gemv.c. Weights whose shape
does not fit (rows % 16 or cols % 64) and the other GGUF block types keep their layout; so does every weight on a CPU without AMX, except the K-quants and
Q8_0 where the VNNI tiles read the same layout (tile_for_vnni, csrc/kquant_i8.c).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native, options
from quill.kernels.dequant import IQ4_VALUES, unpack_kscales
from quill.kernels.kquant import BlockWeight
from quill.kernels.packed import GROUP, GroupWeight, PackedWeight, SplitWeight

ROWS, CHUNK = 16, 64
KSCALE_TYPES = {Q.Q4_K: "q4", Q.Q5_K: "q5", Q.IQ4_XS: "iq4", Q.Q6_K: "q6", Q.Q3_K: "q3", Q.Q2_K: "q2"}  # block types that tile
VNNI_ONLY = {"q3", "q2"}  # code kinds only the VNNI tiles read (the AMX kernels have no path for them)
_NATIVE = {"q4": 0, "q8": 1, "iq4": 8, "q6": 16, "q5": 32, "q3": 128, "q2": 256}  # amx_gemv.c's kind bits for the codes
TILE_BYTES = {"q4": 512, "iq4": 512, "q5": 640, "q6": 768, "q8": 1024, "q3": 384, "q2": 256}
GROUP_WEIGHTS = {"q4": 32, "iq4": 32, "q5": 32, "q6": 16, "q8": 32, "q3": 16, "q2": 16}  # weights per scale


@dataclass
class TiledWeight(GroupWeight):
    kind: str  # "q4" | "q8" | "iq4" | "q5" | "q6" | "q3" | "q2"
    codes: torch.Tensor  # (rows/16, cols/64, TILE_BYTES[kind]): uint8, q8 int8
    scale: torch.Tensor  # (rows/16, groups, 16) float16 where that is exact (Q4_0, Q4_1, Q8_0), else float32,
    #                      or int8 times scale_d (K-quant scales); q2: the file's bytes sc | m << 4 (as int8)
    mins: torch.Tensor | None  # like scale, or None where every min is zero
    scale_d: torch.Tensor | None = None  # K-quant scales: (rows/16, cols/256, 16) float16 factors, else None
    mins_d: torch.Tensor | None = None  # the mins' factors, likewise (q2: its mins are scale's high nibbles)
    vnni: bool = False  # run on the digit tiles (kquant_i8.c), not AMX: a K-quant weight tiled without AMX
    avx2: bool = False  # with vnni: their AVX2 kernel (csrc/tiled_avx2.c) instead of the VNNI one, the same bits

    @property
    def rows(self) -> int:
        return self.scale.shape[0] * ROWS

    @property
    def cols(self) -> int:
        return self.codes.shape[1] * CHUNK

    @property
    def groups(self) -> int:  # 32-weight groups per row (q6's scales are per 16)
        return self.cols // GROUP

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.mins, self.scale_d, self.mins_d) if t is not None]

    @property
    def native_kind(self) -> int:
        """The C kernel's kind: bit 0 = q8, bit 1 = fp16 scales and mins, bit 2 = K-quant scales, bits 3-5 =
        iq4, q6, q5 codes, bit 6 = the digit tiles' weight, bits 7-8 = q3, q2 codes, bit 9 = their AVX2 kernel."""
        return (_NATIVE[self.kind] | (2 if self.scale.dtype == torch.float16 else 0)
                | (4 if self.scale_d is not None else 0) | (64 if self.vnni else 0) | (512 if self.avx2 else 0))

    def native_args(self) -> tuple:
        """(kind, codes, scale, mins, scale_d, mins_d): the C kernels' leading arguments (NULL for absent tensors)."""
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        return (self.native_kind, self.codes.data_ptr(), self.scale.data_ptr(), ptr(self.mins), ptr(self.scale_d),
                ptr(self.mins_d))

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.rows, self.cols) if out is None else out
        native.load().quill_tiled_dequant(*self.native_args(), out.data_ptr(), self.rows, self.cols,
                                          options.current().threads)
        return out

    @property
    def kernel(self):
        """quill_tiled_gemv (AMX, or the VNNI tiles for a `vnni` weight) with this weight's arguments bound:
        (x, out, rows, cols, batch, ld, scratch, threads)."""
        return functools.partial(native.load().quill_tiled_gemv, *self.native_args())

    def scratch_bytes(self, batch: int) -> int:
        return native.load().quill_tiled_scratch_bytes(self.native_kind, batch, self.cols)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T, cols) float32: an embedding lookup without an fp32 table."""
        block, j = ids // ROWS, ids % ROWS
        tiles = self.codes[block]  # (T, C, TILE_BYTES)
        if self.kind == "q2":  # codes four to a byte
            tiles = _unpack_bits(tiles, 2)
        elif self.kind == "q3":  # the low 2 bits' plane (4 codes a byte), then the top bit's (8 a byte); codes - 4
            tiles = (_unpack_bits(tiles[..., :256], 2) | (_unpack_bits(tiles[..., 256:], 1) << 2)).to(torch.int16) - 4
        elif self.kind in ("q5", "q6"):  # the nibbles, then the top bits' plane: 1 bit (q5) or 2 (q6) per code
            low, high, width = tiles[..., :512], tiles[..., 512:], 1 if self.kind == "q5" else 2
            top = _unpack_bits(high, width)
            tiles = (torch.cat((low & 15, low >> 4), dim=-1) | (top << 4)).to(torch.int16) - (32 if width == 2 else 0)
        elif self.kind != "q8":
            tiles = torch.cat((tiles & 15, tiles >> 4), dim=-1)
        T, C = tiles.shape[:2]
        size = GROUP_WEIGHTS[self.kind]
        codes = tiles.view(T, C, 16, ROWS, 4)[torch.arange(T), :, :, j].reshape(T, self.cols // size, size)
        if self.kind == "iq4":
            codes = torch.from_numpy(IQ4_VALUES)[codes.long()]
        scale, mins = self.scale, self.mins
        if self.kind == "q2":  # the file's scale bytes: sc in the low nibble, m in the high one
            scale, mins = self.scale.view(torch.uint8) & 15, self.scale.view(torch.uint8) >> 4
        values = codes.float() * self._group_values(scale, self.scale_d, block, j)
        if mins is not None:
            values = values + self._group_values(mins, self.mins_d, block, j)
        return values.reshape(T, self.cols)

    @staticmethod
    def _group_values(v: torch.Tensor, d: torch.Tensor | None, block: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """(T, groups, 1) fp32 scales (or mins) of rows 16 block + j: d * v for K-quant scales (exact)."""
        values = v[block, :, j].float()
        if d is not None:
            values = d[block, :, j].float().repeat_interleave(values.shape[1] // d.shape[1], dim=1) * values
        return values[..., None]


def available(opts: options.KernelOptions | None = None) -> bool:
    """Whether weights loaded now take the tiled layout: the options (default: the engine being built,
    else the environment) allow AMX and the OS grants the tile state."""
    lib = native.load()
    opts = opts or options.current()
    return lib is not None and opts.amx and bool(lib.quill_amx_enable())


AVX2_KINDS = {"q4", "q5", "q3", "q2"}  # the digit tiles' AVX2 kernel (csrc/tiled_avx2.c): codes below 32
AVX2_INT8_KINDS = AVX2_KINDS | {"q6"}  # with int8 activations Q6_K too: one plane, whose two-line runs cost little


def avx2_available(opts: options.KernelOptions | None = None) -> bool:
    """Whether the K-quant weights whose codes stay below 32 (AVX2_KINDS) take the tiled layout for the digit
    tiles' AVX2 kernel: the VNNI tiles do not run (an AVX2-only CPU, or an engine with the AVX2 kernels forced).
    With int8 activations Q6_K takes them too (AVX2_INT8_KINDS), and Q4_K, Q5_K and Q6_K run those tiles' int8
    kernel (the VNNI tiles' int8 bits), Q3_K and Q2_K their exact digits."""
    lib = native.load()
    opts = opts or options.current()
    return lib is not None and not vnni_available(opts)


def vnni_available(opts: options.KernelOptions | None = None) -> bool:
    """Whether K-quant and Q8_0 weights loaded now take the tiled layout for the VNNI tiles instead (where AMX
    does not tile them): the options ask for the AVX-512 kernels and the CPU has AVX-512 VNNI. With int8
    activations too: the tiles then run their int8 kernel where the kind has one (packed.int8_kind), the same
    bits as the blocks' int8 kernel, and the exact digits where it has none (Q3_K, Q2_K)."""
    lib = native.load()
    opts = opts or options.current()
    return lib is not None and opts.isa >= 512 and bool(lib.quill_hw_vnni())


def _blocked(t: torch.Tensor, rows: int, groups: int, half: bool) -> torch.Tensor:
    t = t.reshape(rows // ROWS, ROWS, groups).transpose(1, 2).contiguous()
    return t.half() if half else t


def _fp16_exact(*ts: torch.Tensor) -> bool:
    return all(torch.equal(t.half().float(), t) for t in ts)


def _tiles(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """(n, k) codes -> (n/16, k/64, TILE_BYTES[kind]) tiles in the kernel's byte order: q8 1024 bytes,
    q4 / iq4 512 bytes of nibble pairs, q5 (codes 0..31) and q6 (0..63) those for the low 4 bits, then
    the top bits: byte b holds those of tile bytes b + (1024 / planes) k, 1 bit (q5) or 2 (q6) each; q3
    (codes 0..7) 256 bytes of their low 2 bits (byte b: those of tile bytes b + 256 k at bits 2k, 2k + 1),
    then 128 of their top bit (byte b: tile bytes b + 128 k at bit k)."""
    n, k = codes.shape
    tiles = codes.reshape(n // ROWS, ROWS, k // CHUNK, 16, 4).permute(0, 2, 3, 1, 4).reshape(n // ROWS, k // CHUNK, 1024)
    if kind == "q8":
        return tiles.contiguous()
    if kind == "q2":  # codes 0..3
        return _pack_bits(tiles, 2)
    if kind == "q3":
        return torch.cat((_pack_bits(tiles & 3, 2), _pack_bits(tiles >> 2, 1)), dim=-1).contiguous()
    low = tiles & 15
    packed = low[..., :512] | (low[..., 512:] << 4)
    if kind in ("q5", "q6"):
        packed = torch.cat((packed, _pack_bits(tiles >> 4, 1 if kind == "q5" else 2)), dim=-1)
    return packed.contiguous()


def _pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """(..., 1024) values of `width` bits -> (..., 128 * width) bytes: byte b holds values b + span k at bits
    width k .. width k + width - 1 (span = 128 * width, the plane's bytes)."""
    parts = values.split(values.shape[-1] * width // 8, dim=-1)
    plane = parts[0].clone()
    for k in range(1, len(parts)):
        plane |= parts[k] << (width * k)
    return plane.contiguous()


def _unpack_bits(plane: torch.Tensor, width: int) -> torch.Tensor:
    """_pack_bits undone: (..., n) bytes -> (..., 8 n / width) values."""
    return torch.cat([(plane >> (width * k)) & (2**width - 1) for k in range(8 // width)], dim=-1)


def tile_weight(w) -> TiledWeight | None:
    """The tiled form of `w`, or None where the shape does not fit the tiles or `w` is neither a q4/q8
    PackedWeight nor a Q4_K / Q5_K / IQ4_XS / Q6_K BlockWeight (other GGUF-block weights keep their own layout)."""
    if isinstance(w, BlockWeight):
        return _tile_kscales(w)
    if not isinstance(w, PackedWeight) or w.rows % ROWS or w.cols % CHUNK:
        return None
    n, k = w.rows, w.cols
    if w.kind == "q4":
        pairs = w.codes.view(n, w.groups, 16)
        codes = torch.stack((pairs & 15, pairs >> 4), dim=2).reshape(n, k)
    else:
        codes = w.codes
    half = _fp16_exact(*(t for t in (w.scale, w.mins) if t is not None))  # GGUF's fp16 scales: no loss to keep them so
    mins = None if w.mins is None or not bool(w.mins.any()) else _blocked(w.mins, n, w.groups, half)
    return TiledWeight(w.kind, _tiles(codes, w.kind), _blocked(w.scale, n, w.groups, half), mins)


def tile_for_vnni(w) -> TiledWeight | None:
    """A weight's tiled form for the VNNI tiles (None for other types or shapes): for_cpu's rule where AMX does
    not tile. They take the K-quants (Q4_K, Q5_K, IQ4_XS, Q6_K, Q3_K, Q2_K) and Q8_0: a q8 PackedWeight without
    mins whose scales are fp16 (the file's), 256 columns to a block of the tiles' digits."""
    if isinstance(w, BlockWeight):
        return _tile_kscales(w, vnni=True)
    if not isinstance(w, PackedWeight) or w.kind != "q8" or w.cols % 256:
        return None
    t = tile_weight(w)  # the AMX q8 tiles' rules: rows in 16s, all-zero mins dropped, fp16 scales where exact
    if t is None or t.mins is not None or t.scale.dtype != torch.float16:
        return None
    return dataclasses.replace(t, vnni=True)


def tile_for_avx2(w) -> TiledWeight | None:
    """A weight's tiled form for the digit tiles' AVX2 kernel: the K-quants of AVX2_KINDS (Q4_K, Q5_K, Q3_K, Q2_K)
    in 16-row blocks, and with int8 activations Q6_K too (AVX2_INT8_KINDS); None for the others, which keep their
    layouts: IQ4_XS and Q8_0 (codes up to 255, whose int16 pairs would overflow), and Q6_K with exact activations
    (its three digit planes in 2-line int16 runs took 1.7x the time of its blocks' FMAs at batch 16, one thread in
    L2; with int8 activations the tiles took 0.74-1.0x the blocks' int8 kernel's time at batches 1-64 there).

    On the AMD EPYC Zen 4 with the AVX2 kernels forced, against the blocks' AVX2 kernels (8192 x 2048 from memory,
    two threads, GB/s of the weights, medians of 7 interleaved rounds): batch 1 Q4_K 16.3 -> 22.0, Q5_K 16.5 ->
    22.7, Q3_K 5.0 -> 10.1, Q2_K 6.4 -> 12.9; batch 16 Q4_K 1.94 -> 2.50, Q5_K 2.83 -> 2.31, Q3_K 1.11 -> 1.09,
    Q2_K 0.79 -> 0.96. In the engine, 1B files, tokens per second at batch 1 (batch 16): Q4_K_M 20.1 -> 23.5
    (48.6 -> 51.5), Q5_K_M 14.7 -> 23.2 (46.5 -> 44.3), Q3_K_M 15.1 -> 23.7 (35.6 -> 36.2), Q2_K 15.4 -> 23.4
    (29.2 -> 34.8)."""
    kinds = AVX2_INT8_KINDS if options.current().int8 else AVX2_KINDS
    if not isinstance(w, BlockWeight) or KSCALE_TYPES.get(w.qtype) not in kinds:
        return None
    t = _tile_kscales(w, vnni=True)
    return None if t is None else dataclasses.replace(t, avx2=True)


def _tile_kscales(w: BlockWeight, vnni: bool = False) -> TiledWeight | None:
    if w.qtype not in KSCALE_TYPES or w.rows % ROWS or (KSCALE_TYPES[w.qtype] in VNNI_ONLY and not vnni):
        return None
    n, k, kind = w.rows, w.cols, KSCALE_TYPES[w.qtype]
    g, f = k // GROUP_WEIGHTS[kind], k // 256
    parts = unpack_kscales(w.blocks.numpy(), w.qtype, (n, k))
    as_t = lambda a: None if a is None else torch.from_numpy(a.copy())  # noqa: E731
    blocked = lambda a, groups: None if a is None else _blocked(as_t(a), n, groups, False)  # noqa: E731
    return TiledWeight(kind, _tiles(as_t(parts.codes), kind), blocked(parts.scales, g), blocked(parts.mins, g),
                       blocked(parts.scale_factor, f), blocked(parts.min_factor, f), vnni)


def for_cpu(w):
    """The layout the fastest kernel on this CPU reads: tiled where AMX is available and the shape fits;
    without AMX, where the VNNI tiles run (vnni_available), the K-quant weights (Q4_K, Q5_K, IQ4_XS, Q6_K, Q3_K,
    Q2_K) and Q8_0's tiled for them (tile_for_vnni): the same layout, each 16 rows' super-block one contiguous read
    with its codes already in the tiles' order; without VNNI (avx2_available), the K-quants of AVX2_KINDS tiled
    for the same tiles' AVX2 kernel (tile_for_avx2). The other weights keep their own layout; a split weight's parts are each tiled
    or not. Options with retile=False (quill convert's portable objects) keep every weight as it is."""
    if w is None or not options.current().retile:
        return w
    if available():
        tile = tile_weight
    elif vnni_available():
        tile = tile_for_vnni
    elif avx2_available():
        tile = tile_for_avx2
    else:
        return w
    if isinstance(w, SplitWeight):
        return SplitWeight([tile(p) or p for p in w.parts])
    return tile(w) or w
