"""The prefill matmul, out = x @ w.T in fp32 accuracy: the one place that chooses its kernel.

On a CPU with AMX-BF16 (Intel Sapphire Rapids and later), where the engine's options allow AMX, it runs on
the tile unit with each fp32 operand split into three bf16 parts (csrc/amx_gemm.c: six of the nine part
products, so the result is an fp32 dot product with its own rounding, nothing coarser); elsewhere, and for
shapes the tiles do not take (N or K not a multiple of 32), BLAS (torch.mm).

matmul_quantized runs the same tile products straight from a K-quant AMX-tiled weight (Q4_K, Q5_K, IQ4_XS,
Q6_K): each code times its int8 scale is an integer two bf16 parts hold exactly, so five part products
instead of six, and no fp32 copy of the weight (csrc/amx_gemm.c's quill_kq_gemm).
"""

from __future__ import annotations

import torch

from quill.kernels import native, options

MIN_ROWS = 17  # fewer rows than this are decode-sized: the GEMV kernels' or BLAS's work
MAX_ROWS = 512  # rows per kernel call: its scratch (6 bytes per element of x) stays bounded for long prompts


def amx_bf16_usable(opts: options.KernelOptions | None = None) -> bool:
    """Whether prefill matmuls run on AMX-BF16 tiles for an engine with these options (default: the
    engine running now): the options allow AMX, the CPU has AMX-BF16 and the OS grants the tile state."""
    lib = native.load()
    opts = opts or options.current()
    return lib is not None and opts.amx and bool(lib.quill_amx_bf16_hw()) and bool(lib.quill_amx_enable())


def matmul_t(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scratch=None) -> torch.Tensor:
    """out (M, N) = x (M, K) @ w (N, K).T, all fp32 and contiguous. scratch: a function of a byte count
    returning a tensor of at least that many bytes to use (default: a fresh one)."""
    M, K = x.shape
    N = w.shape[0]
    opts = options.current()
    if (M >= MIN_ROWS and x.dtype == w.dtype == out.dtype == torch.float32 and x.is_contiguous()
            and w.is_contiguous() and out.is_contiguous() and amx_bf16_usable(opts)):
        lib = native.load()
        rows = min(M, MAX_ROWS)
        nbytes = lib.quill_x3_scratch_bytes(rows, K, opts.threads)
        buf = scratch(nbytes) if scratch is not None else torch.empty(nbytes, dtype=torch.uint8)
        for r in range(0, M, rows):  # each call refuses or runs whole: the shape test is the same for all
            n = min(rows, M - r)
            if lib.quill_x3_gemm(x[r].data_ptr(), w.data_ptr(), out[r].data_ptr(), n, N, K, N, buf.data_ptr(),
                                 opts.threads) != 0:
                break
        else:
            return out
    return torch.mm(x, w.t(), out=out)


def _kq_takes(w) -> bool:
    """Whether quill_kq_gemm reads this weight: a K-quant AMX-tiled weight of whole 32-row pairs."""
    from quill.kernels.tiled import TiledWeight

    return isinstance(w, TiledWeight) and w.scale_d is not None and w.rows % 32 == 0 and w.cols % 256 == 0


def matmul_quantized(x: torch.Tensor, weight, out: torch.Tensor, scratch=None) -> bool:
    """out (M, N) = x (M, K) @ W.T in fp32 accuracy straight from a K-quant tiled weight (or a SplitWeight of
    them, each part into its columns) on AMX-BF16 tiles. Returns False, with nothing written, where that
    kernel does not take the weight, the rows are decode-sized or the engine's options or the CPU rule out
    AMX: the caller then dequantizes and uses matmul_t."""
    from quill.kernels.packed import SplitWeight

    M = x.shape[0]
    parts = weight.parts if isinstance(weight, SplitWeight) else [weight]
    opts = options.current()
    if (M < MIN_ROWS or not all(_kq_takes(p) for p in parts) or x.dtype != torch.float32 or not x.is_contiguous()
            or not out.is_contiguous() or not amx_bf16_usable(opts)):
        return False
    lib = native.load()
    rows = min(M, MAX_ROWS)
    nbytes = lib.quill_kq_scratch_bytes(rows, weight.cols, opts.threads)
    buf = scratch(nbytes) if scratch is not None else torch.empty(nbytes, dtype=torch.uint8)
    N = out.shape[1]
    for r in range(0, M, rows):
        n, col = min(rows, M - r), 0
        for p in parts:
            if lib.quill_kq_gemm(*p.native_args(), x[r].data_ptr(), out[r, col:].data_ptr(), n, p.rows, p.cols, N,
                                 buf.data_ptr(), opts.threads) != 0:
                raise RuntimeError(f"quill_kq_gemm refused a {p.rows}x{p.cols} {p.kind} weight it was checked to take")
            col += p.rows
    return True
