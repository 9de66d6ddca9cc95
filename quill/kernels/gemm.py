"""The prefill matmul, out = x @ w.T in fp32 accuracy: the one place that chooses its kernel.

On a CPU with AMX-BF16 (Intel Sapphire Rapids and later), where the engine's options allow AMX, it runs on
the tile unit with each fp32 operand split into three bf16 parts (csrc/amx_gemm.c: six of the nine part
products, so the result is an fp32 dot product with its own rounding, nothing coarser); elsewhere, and for
shapes the tiles do not take (N or K not a multiple of 32), BLAS (torch.mm).
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
