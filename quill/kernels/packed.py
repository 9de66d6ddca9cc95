"""Low-bit weights kept low-bit in memory: the packed layout, and the linear/embedding built on it.

Two layouts cover Q4_0, Q4_1, Q8_0 and Q5_1 (value = scale[n, g] * code + min[n, g], 32-weight groups;
these are also the layouts the AMX tiling converts):
  q4  codes 0..15, two per byte in GGUF's Q4_0/Q4_1 order   <- Q4_0, Q4_1
  q8  one signed byte per code                               <- Q8_0, Q5_1
Q8_0's mins are all zero and are not stored (`mins` None); Q4_0's are -8 * scale and are.
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, IQ4_NL, IQ4_XS, F16 and BF16 keep GGUF's own blocks
(quill.kernels.kquant.BlockWeight). A fused projection whose parts the file stores in different
types is a SplitWeight of its parts. F32 stays on the dense path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import nn

from quill.kernels import gemm, native, options
from quill.kernels.dequant import unpack_blocks

GROUP = 32
SMALL_BATCH = 16  # up to this many rows always go through the GEMV kernel
_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}
PACKABLE = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.Q5_K, Q.Q6_K, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.F16, Q.BF16,
                      Q.Q2_K, Q.Q3_K})


class GroupWeight:
    """What every resident low-bit layout shares: codes, and a scale and min per 32-element group
    (`scale` has the groups on its second axis; `mins` may be None where all are zero)."""

    codes: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor | None

    @property
    def groups(self) -> int:
        return self.scale.shape[1]

    @property
    def cols(self) -> int:
        return self.groups * GROUP

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.mins) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class PackedWeight(GroupWeight):
    """(rows, cols) weight as codes plus per-group fp32 scale and min (no min where all are zero).

    With `mins` None the kernels skip the min terms (csrc/quant_gemv.c's ZERO_MINS: for finite activations
    the same bits as all-zero mins gave); the torch paths compute scale * code alone, which equals gguf's
    d * q bit for bit (a zero weight keeps gguf's sign, where adding a +0 min made every zero +0)."""

    kind: str  # "q4" | "q8"
    codes: torch.Tensor  # q4: (rows, G*16) uint8; q8: (rows, G*32) int8
    scale: torch.Tensor  # (rows, G) float32
    mins: torch.Tensor | None  # (rows, G) float32, or None: every min is zero (Q8_0, --quantize int8)

    @property
    def rows(self) -> int:
        return self.scale.shape[0]

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, cols) float32, written into `out` when given."""
        out = torch.empty(self.rows, self.cols) if out is None else out
        lib = native.load()
        if lib is not None:
            fn = lib.quill_dequant_q4 if self.kind == "q4" else lib.quill_dequant_q8
            fn(self.codes.data_ptr(), self.scale.data_ptr(), _ptr(self.mins), out.data_ptr(), self.rows, self.groups,
               options.current().threads)
            return out
        values = self._codes_float().view(self.rows, self.groups, GROUP).mul(self.scale[..., None])
        if self.mins is not None:
            values = values.add(self.mins[..., None])
        out.copy_(values.view(self.rows, self.cols))
        return out

    def _codes_float(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        codes = self.codes if rows is None else self.codes[rows]
        if self.kind == "q8":
            return codes.float()
        pairs = codes.view(codes.shape[0], self.groups, 16)
        return torch.stack((pairs & 15, pairs >> 4), dim=2).reshape(codes.shape[0], self.cols).float()

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T, cols) float32: an embedding lookup without an fp32 table."""
        values = self._codes_float(ids).view(len(ids), self.groups, GROUP) * self.scale[ids][..., None]
        if self.mins is not None:
            values = values + self.mins[ids][..., None]
        return values.view(len(ids), self.cols)


def _ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's address for a C call, or NULL for an absent one (mins None: all zero)."""
    return None if t is None else t.data_ptr()


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)[..., 0]


def pack_gguf(qtype, shape: tuple[int, ...], raw: np.ndarray) -> GroupWeight | None:
    """A GGUF tensor's raw blocks -> PackedWeight or BlockWeight (exact), or None if the type has no packed layout."""
    from quill.kernels.kquant import block_weight

    qtype = Q(qtype)
    if qtype not in PACKABLE or len(shape) != 2 or shape[1] % GROUP:
        return None
    if (blocks := block_weight(qtype, shape, raw)) is not None:
        return blocks
    rows, cols = shape
    groups = cols // GROUP
    if qtype in _BLOCK_BYTES:
        blocks = np.asarray(raw).view(np.uint8).reshape(rows, groups, _BLOCK_BYTES[qtype])
        d = _f16(blocks[..., 0:2])
        if qtype == Q.Q8_0:
            codes = blocks[..., 2:].view(np.int8).reshape(rows, groups * 32)
            return _make("q8", codes, d, None)  # all-zero mins: not stored
        if qtype == Q.Q4_0:
            return _make("q4", blocks[..., 2:].reshape(rows, groups * 16), d, -8.0 * d)
        return _make("q4", blocks[..., 4:].reshape(rows, groups * 16), d, _f16(blocks[..., 2:4]))
    unpacked = unpack_blocks(raw, qtype, shape)  # Q5_1: codes 0..31, per-32 scale and min
    return _make("q8", unpacked.codes.astype(np.int8), unpacked.scales, unpacked.mins)


def _make(kind: str, codes: np.ndarray, scale: np.ndarray, mins: np.ndarray | None) -> PackedWeight:
    as_t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a, dtype=dt))  # noqa: E731
    return PackedWeight(kind, as_t(codes, np.uint8 if kind == "q4" else np.int8),
                        as_t(scale, np.float32), None if mins is None else as_t(mins, np.float32))


def concat_rows(parts: list[GroupWeight]) -> GroupWeight:
    """Fuse q/k/v or gate/up: stack rows (all parts share the column count). Parts of one layout
    become one weight of it; parts of different layouts a SplitWeight. Packed parts without mins (all zero)
    fuse without them; beside a part that has mins, they get explicit zeros (the same values)."""
    from quill.kernels.kquant import BlockWeight

    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, PackedWeight) and p.kind == parts[0].kind for p in parts):
        mins = None
        if any(p.mins is not None for p in parts):
            mins = torch.cat([torch.zeros_like(p.scale) if p.mins is None else p.mins for p in parts])
        return PackedWeight(parts[0].kind, torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                            mins)
    if all(isinstance(p, BlockWeight) and p.qtype == parts[0].qtype for p in parts):
        return BlockWeight(parts[0].qtype, torch.cat([p.blocks for p in parts]))
    return SplitWeight(list(parts))


class SplitWeight(GroupWeight):
    """The rows of several weights of different layouts, stacked: a fused q/k/v or gate/up whose
    parts the file stores in different types (Q4_K_M files give attn_v Q6_K beside Q4_K q and k).
    Each part keeps its layout and kernel; the GEMV writes each into its columns of the output."""

    def __init__(self, parts: list[GroupWeight]):
        self.parts = parts

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def groups(self) -> int:
        return self.cols // GROUP

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.tensors()]

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.rows, self.cols) if out is None else out
        r = 0
        for p in self.parts:
            p.dequantize(out[r : r + p.rows])
            r += p.rows
        return out


class Workspace:
    """Scratch reused by every packed linear: the prefill dequant tile and the group sums."""

    def __init__(self):
        self._tile = torch.empty(0)
        self._sums = torch.empty(0)

    def tile(self, numel: int) -> torch.Tensor:
        if self._tile.numel() < numel:
            self._tile = torch.empty(numel)
        return self._tile[:numel]

    def scratch(self, nbytes: int) -> torch.Tensor:
        """At least nbytes of raw scratch (the sums' buffer: the prefill GEMM's, between GEMV calls)."""
        return self.sums(-(-nbytes // 4))

    def sums(self, numel: int) -> torch.Tensor:
        """numel floats (also used as raw scratch bytes by the tiled kernel)."""
        if self._sums.numel() < numel:
            self._sums = torch.empty(max(numel, 4096))
        return self._sums[:numel]


class PackedLinear(nn.Module):
    """y = x @ W.T (+ b) on packed weights: GEMV kernel for decode rows, dequant tile + quill.kernels.gemm
    (AMX-BF16 tiles or BLAS) for prefill.

    `weight` is a PackedWeight or its AMX-tiled form (quill.kernels.tiled.TiledWeight)."""

    def __init__(self, weight, bias: torch.Tensor | None, workspace: Workspace):
        super().__init__()
        self.weight, self.bias, self.workspace = weight, bias, workspace
        self.out_features, self.in_features = weight.rows, weight.cols
        self._lib = native.load()

    def resident_bytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.numel() * 4)

    def forward(self, x: torch.Tensor, gemv_rows: int = 0) -> torch.Tensor:
        """x (T, in) -> (T, out). The first `gemv_rows` rows (decodes) always use the row-invariant kernel;
        so does every row where that kernel beats a dequantized tile at any batch (`_kernel_all`)."""
        x = x.contiguous()
        T = x.shape[0]
        out = torch.empty(T, self.out_features)
        kernel_rows = T if T <= SMALL_BATCH or self._kernel_all() else gemv_rows
        if self._lib is None:
            kernel_rows = 0
        if kernel_rows:
            self.gemv(x[:kernel_rows], out[:kernel_rows])
        if kernel_rows < T and not gemm.matmul_quantized(x[kernel_rows:], self.weight, out[kernel_rows:],
                                                         self.workspace.scratch):
            w = self.weight.dequantize(self.workspace.tile(self.out_features * self.in_features).view(
                self.out_features, self.in_features))
            gemm.matmul_t(x[kernel_rows:], w, out[kernel_rows:], self.workspace.scratch)
        if self.bias is not None:
            out += self.bias
        return out

    def gemv(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x (B, in) contiguous -> out (B, out) rows written in place."""
        self.bind_gemv(x, out)()

    def scratch_floats(self, batch: int) -> int:
        """Floats of scratch a GEMV of `batch` rows needs: the sums of x the mins need (B x cols / 32 for
        the packed kernels, a block weight's scratch_bytes), the AMX kernel's digits and scales for a tiled
        weight, the rounded activations for an int8 kernel."""
        need = max(-(-p.scratch_bytes(batch) // 4) if hasattr(p, "scratch_bytes") else batch * p.groups
                   for p in self._parts())
        if self._lib is not None and options.current().int8:
            need = max(need, -(-self._lib.quill_act8_bytes(batch, self.in_features) // 4))
        return need

    def _kernel_all(self) -> bool:
        """Whether every row of a prefill goes through the GEMV kernel: with int8 activations where every part
        has an int8 kernel (no fp32 tile then), and where every part is on the VNNI tiles (tiled.tile_for_vnni),
        whose exact digits reuse each decoded line for many rows (64 per pass over the weights, DCHUNK in
        csrc/kquant_i8.c; 16 when measured here): a 512-token prefill of the 1B
        Q4_K_M, Q8_0 and IQ4_XS files on the AMD EPYC Zen 4 ran 1.28x, 1.22x and 1.34x the tokens per second of
        the dequantized tile through BLAS (fp32 FMAs, one weight per item each), in-process A/Bs; and each
        row is then the same bits as the same token decoded alone. Not the same tiles' AVX2 kernel (tiled.tile_for_avx2):
        without vpdpbusd its three digit planes cost more per item than BLAS's FMAs on the dequantized tile."""
        if self._int8_all():
            return True
        return self._lib is not None and all(getattr(p, "vnni", False) and not getattr(p, "avx2", False)
                                             for p in self._parts())

    def _int8_all(self) -> bool:
        """Whether int8 activations are on and every part of the weight has an int8 kernel."""
        return self._lib is not None and options.current().int8 and all(int8_kind(p, self._lib) is not None
                                                                          for p in self._parts())

    def _parts(self) -> list:
        """The weight's parts (a SplitWeight's), or the weight alone."""
        return self.weight.parts if isinstance(self.weight, SplitWeight) else [self.weight]

    def bind_gemv(self, x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None):
        """The kernel call for x (B, in) -> out (B, out) with its pointers bound: call it to run. It holds
        x, out, scratch (at least scratch_floats(B) floats; default: the shared workspace) and the weight.
        The ISA and thread count are those of the engine running now (`options.current()`)."""
        w = self.weight
        if scratch is None:
            scratch = self.workspace.sums(self.scratch_floats(x.shape[0]))
        if isinstance(w, SplitWeight):
            calls, r = [], 0
            for p in w.parts:
                calls.append(self._call(p, x, out[:, r:], scratch, ld=w.rows))
                r += p.rows
            return functools.partial(_call_each, calls, (x, out, scratch, w))
        fn, args = self._call(w, x, out, scratch)
        return functools.partial(_call_holding, fn, args, (x, out, scratch, w))

    def _call(self, w, x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, ld: int | None = None):
        """(function, arguments) of one weight's kernel writing out's first w.rows columns (row stride ld)."""
        from quill.kernels.kquant import BlockWeight
        from quill.kernels.tiled import TiledWeight

        opts = options.current()
        k8 = int8_kind(w, self._lib) if opts.int8 else None
        if k8 is not None and isinstance(w, TiledWeight):
            return self._lib.quill_tiled_gemv_i8, (*w.native_args(), x.data_ptr(), out.data_ptr(), w.rows, w.cols,
                                                   x.shape[0], ld or w.rows, scratch.data_ptr(), opts.threads)
        if k8 is not None:
            scale, mins = (w.scale.data_ptr(), _ptr(w.mins)) if isinstance(w, PackedWeight) else (None, None)
            codes = w.codes if isinstance(w, PackedWeight) else w.blocks
            return self._lib.quill_gemv_i8, (k8, codes.data_ptr(), scale, mins, x.data_ptr(), scratch.data_ptr(),
                                             out.data_ptr(), w.rows, w.cols, x.shape[0], ld or w.rows, opts.isa,
                                             opts.threads)
        if isinstance(w, BlockWeight):
            return w.bind(x, out, scratch, ld)
        if isinstance(w, PackedWeight):
            fn = self._lib.quill_gemv_q4_ld if w.kind == "q4" else self._lib.quill_gemv_q8_ld
            return fn, (w.codes.data_ptr(), w.scale.data_ptr(), _ptr(w.mins), x.data_ptr(), scratch.data_ptr(),
                        out.data_ptr(), w.rows, w.groups, x.shape[0], ld or w.rows, opts.isa, opts.threads)
        return w.kernel, (x.data_ptr(), out.data_ptr(), w.rows, w.cols, x.shape[0], ld or w.rows, scratch.data_ptr(),
                          opts.threads)


INT8_LAYOUTS = {"q4": 100, "q8": 101}  # csrc/kformat.h's LAYOUT_Q4 / LAYOUT_Q8


def int8_kind(w, lib) -> int | None:
    """kquant_i8.c's kind for a weight (its layouts, or kquant.c's block kind), or None where this CPU has
    no int8 kernel for it: the one place that decides which weights take int8 activations."""
    from quill.kernels.kquant import BlockWeight
    from quill.kernels.tiled import TiledWeight

    if isinstance(w, TiledWeight):  # the digit tiles' int8 kernels (amx_gemv.c decides which tiled kinds have one)
        return w.native_kind if lib.quill_tiled_i8_supported(w.native_kind) else None
    if isinstance(w, BlockWeight):
        kind = w.kind
    elif isinstance(w, PackedWeight):
        kind = INT8_LAYOUTS[w.kind]
    else:
        return None
    return kind if lib.quill_i8_supported(kind) else None


def _call_each(calls, _alive) -> None:
    for fn, args in calls:
        fn(*args)


def _call_holding(fn, args, _alive) -> None:
    fn(*args)  # _alive keeps the tensors behind the pointers in args from being freed


class PackedEmbedding(nn.Module):
    """Token embedding that dequantizes only the rows looked up (PackedWeight or TiledWeight)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        return self.weight.dequantize_rows(ids)

    def resident_bytes(self) -> int:
        return self.weight.nbytes


def tied_head(embedding, workspace: Workspace) -> nn.Module:
    """The LM head that shares the token embedding: the packed kernel over the same weight where the
    embedding is packed (no fp32 copy of the table), else the dense table as a linear."""
    if isinstance(embedding, PackedEmbedding):
        return PackedLinear(embedding.weight, None, workspace)
    from quill.kernels.linear import DenseLinear

    return DenseLinear(embedding.weight.data)


class DenseEmbedding(nn.Module):
    """fp32 embedding table."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (V, H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def resident_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()
