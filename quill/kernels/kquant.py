"""Weights kept in GGUF's own blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, IQ4_NL, IQ4_XS, F16, BF16): as many
bytes in memory as in the file.

The C kernels (csrc/kquant.c) compute a GEMV or small GEMM straight from the blocks with fp32
activations, and dequantize rows for prefill tiles and embedding lookups; both give exactly the
weights GGUF defines (the same products as gguf-py's reference dequantization).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from quill.kernels import native, options
from quill.kernels.packed import GroupWeight

# GGUF type -> the kernels' kind; weights and bytes per block (F16/BF16: 32-weight runs of 16-bit floats)
KINDS = {Q.Q4_K: 0, Q.Q6_K: 1, Q.Q5_0: 2, Q.IQ4_NL: 3, Q.IQ4_XS: 4, Q.Q5_K: 5, Q.F16: 6, Q.BF16: 7, Q.Q2_K: 8, Q.Q3_K: 9}
BLOCK_WEIGHTS = {Q.Q4_K: 256, Q.Q6_K: 256, Q.Q5_0: 32, Q.IQ4_NL: 32, Q.IQ4_XS: 256, Q.Q5_K: 256, Q.F16: 32, Q.BF16: 32,
                 Q.Q2_K: 256, Q.Q3_K: 256}
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q6_K: 210, Q.Q5_0: 22, Q.IQ4_NL: 18, Q.IQ4_XS: 136, Q.Q5_K: 176, Q.F16: 64, Q.BF16: 64,
               Q.Q2_K: 84, Q.Q3_K: 110}


@dataclass
class BlockWeight(GroupWeight):
    """(rows, cols) weight as GGUF blocks: `blocks` is (rows, cols / 256 * block bytes) uint8."""

    qtype: Q
    blocks: torch.Tensor

    @property
    def kind(self) -> int:
        return KINDS[self.qtype]

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def cols(self) -> int:  # from the row's bytes: whole blocks of BLOCK_WEIGHTS each
        return self.blocks.shape[1] // BLOCK_BYTES[self.qtype] * BLOCK_WEIGHTS[self.qtype]

    @property
    def groups(self) -> int:  # 32-weight groups per row (what the fused layer's scratch is sized by)
        return self.cols // 32

    def scratch_bytes(self, batch: int) -> int:
        """Scratch a GEMV of `batch` rows needs: sums of x per 16 weights (Q2_K's mins; the others use half),
        then the VNNI tiles' digits of x."""
        lib = native.load()
        return 4 * batch * (self.cols // 16) if lib is None else lib.quill_gemv_kq_scratch_bytes(batch, self.cols)

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks]

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, cols) float32, written into `out` when given."""
        return self._dequant(self.blocks, out)

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (T,) -> (T, cols) float32: an embedding lookup that dequantizes only those rows."""
        return self._dequant(self.blocks[ids].contiguous())

    def _dequant(self, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(blocks.shape[0], self.cols) if out is None else out
        lib = native.load()
        if lib is None:  # no kernels: gguf-py's reference dequantization
            from quill.kernels.dequant import dequantize

            out.copy_(dequantize(blocks.numpy(), self.qtype, (blocks.shape[0], self.cols)))
            return out
        lib.quill_dequant_kq(self.kind, blocks.data_ptr(), out.data_ptr(), blocks.shape[0], self.cols,
                             options.current().threads)
        return out

    def bind(self, x: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor, ld: int | None = None):
        """The GEMV call for x (B, cols) -> out's first `rows` columns (row stride ld, default rows);
        scratch holds at least scratch_bytes(B) (the sums of x the mins need)."""
        opts = options.current()
        return (native.load().quill_gemv_kq,
                (self.kind, self.blocks.data_ptr(), x.data_ptr(), scratch.data_ptr(), out.data_ptr(), self.rows,
                 self.cols, x.shape[0], ld or self.rows, opts.isa, opts.threads))


def block_weight(qtype, shape: tuple[int, ...], raw: np.ndarray) -> BlockWeight | None:
    """A GGUF tensor's raw blocks as a BlockWeight (one copy of the bytes, out of the read-only map), or
    None if the type or shape has no block kernel."""
    qtype = Q(qtype)
    if qtype not in KINDS or len(shape) != 2 or shape[1] % BLOCK_WEIGHTS[qtype]:
        return None
    rows, cols = shape
    blocks = np.asarray(raw).view(np.uint8).reshape(rows, cols // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype])
    return BlockWeight(qtype, torch.from_numpy(np.array(blocks, copy=True)))
