"""The AMX tiled layout: packed weights rearranged into 16 x 64 int8 tiles for Intel AMX (TMUL).

Same values as the packed layout (value = scale * code + min), only reordered, so nothing is
lost. Scales and mins stay fp16 where the file had them so (Q4_0, Q4_1, Q8_0) and all-zero mins
(Q8_0's, which the packed layout already leaves out) are dropped, so it is smaller than the packed
layout. The kernel and the byte order are described in csrc/amx_gemv.c. Weights whose shape does not fit
(rows % 16 or cols % 64) and CPUs without AMX keep the packed layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quill.kernels import native, options
from quill.kernels.packed import GROUP, GroupWeight, PackedWeight

ROWS, CHUNK = 16, 64


@dataclass
class TiledWeight(GroupWeight):
    kind: str  # "q4" | "q8"
    codes: torch.Tensor  # q4: (rows/16, cols/64, 512) uint8; q8: (rows/16, cols/64, 1024) int8
    scale: torch.Tensor  # (rows/16, groups, 16) float16 where that is exact (Q4_0, Q4_1, Q8_0), else float32
    mins: torch.Tensor | None  # like scale, or None where every min is zero

    @property
    def rows(self) -> int:
        return self.scale.shape[0] * ROWS

    @property
    def native_kind(self) -> int:
        """The C kernel's kind: bit 0 = q8, bit 1 = fp16 scales and mins."""
        return (0 if self.kind == "q4" else 1) | (2 if self.scale.dtype == torch.float16 else 0)

    def _ptrs(self):
        return (self.native_kind, self.codes.data_ptr(), self.scale.data_ptr(),
                None if self.mins is None else self.mins.data_ptr())

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.rows, self.cols) if out is None else out
        native.load().quill_amx_dequant(*self._ptrs(), out.data_ptr(), self.rows, self.cols, options.current().threads)
        return out

    @property
    def kernel(self):
        """quill_amx_gemv with this weight's arguments bound: (x, out, rows, cols, batch, scratch, threads)."""
        return functools.partial(native.load().quill_amx_gemv, *self._ptrs())

    def scratch_bytes(self, batch: int) -> int:
        return native.load().quill_amx_scratch_bytes(batch, self.cols)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T, cols) float32: an embedding lookup without an fp32 table."""
        block, j = ids // ROWS, ids % ROWS
        tiles = self.codes[block]  # (T, C, 512 | 1024)
        if self.kind == "q4":
            tiles = torch.cat((tiles & 15, tiles >> 4), dim=-1)
        T, C = tiles.shape[:2]
        codes = tiles.view(T, C, 16, ROWS, 4)[torch.arange(T), :, :, j].reshape(T, self.groups, GROUP).float()
        scale = self.scale[block, :, j][..., None].float()
        values = codes * scale if self.mins is None else codes * scale + self.mins[block, :, j][..., None].float()
        return values.reshape(T, self.cols)


def available(opts: options.KernelOptions | None = None) -> bool:
    """Whether weights loaded now take the tiled layout: the options (default: the engine being built,
    else the environment) allow AMX and the OS grants the tile state."""
    lib = native.load()
    opts = opts or options.current()
    return lib is not None and opts.amx and bool(lib.quill_amx_enable())


def _blocked(t: torch.Tensor, rows: int, groups: int, half: bool) -> torch.Tensor:
    t = t.reshape(rows // ROWS, ROWS, groups).transpose(1, 2).contiguous()
    return t.half() if half else t


def _fp16_exact(*ts: torch.Tensor) -> bool:
    return all(torch.equal(t.half().float(), t) for t in ts)


def tile_weight(w: PackedWeight) -> TiledWeight | None:
    """The tiled form of `w`, or None where the shape does not fit the tiles or `w` is not a q4/q8
    PackedWeight (GGUF-block weights keep their own layout)."""
    if not isinstance(w, PackedWeight) or w.rows % ROWS or w.cols % CHUNK:
        return None
    n, k = w.rows, w.cols
    if w.kind == "q4":
        pairs = w.codes.view(n, w.groups, 16)
        codes = torch.stack((pairs & 15, pairs >> 4), dim=2).reshape(n, k)
    else:
        codes = w.codes
    tiles = codes.reshape(n // ROWS, ROWS, k // CHUNK, 16, 4).permute(0, 2, 3, 1, 4).reshape(n // ROWS, k // CHUNK, 1024)
    if w.kind == "q4":
        tiles = tiles[..., :512] | (tiles[..., 512:] << 4)
    half = _fp16_exact(*(t for t in (w.scale, w.mins) if t is not None))  # GGUF's fp16 scales: no loss to keep them so
    mins = None if w.mins is None or not bool(w.mins.any()) else _blocked(w.mins, n, w.groups, half)
    return TiledWeight(w.kind, tiles.contiguous(), _blocked(w.scale, n, w.groups, half), mins)


def for_cpu(w: PackedWeight | None) -> PackedWeight | TiledWeight | None:
    """The layout the fastest kernel on this CPU reads: tiled where AMX is available and the shape fits
    (GGUF-block and split weights keep their own layout)."""
    if not isinstance(w, PackedWeight) or not available():
        return w
    return tile_weight(w) or w
