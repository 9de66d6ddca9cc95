"""Build (once, cached) and load the C kernels with the system compiler; None where that is impossible."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger("quill.kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("quant_gemv.c", "decode_layer.c", "amx_gemv.c", "kquant.c", "kquant_i8.c", "kquant_i8_avx2.c", "tiled_avx2.c", "amx_gemm.c")]
HEADERS = [CSRC / "isa.h", CSRC / "simd.h", CSRC / "attend_kv.h", CSRC / "kformat.h", CSRC / "kquant_i8.h", CSRC / "amx_tiles.h", CSRC / "digits.h", CSRC / "deal.h", CSRC / "tiled_digits.h"]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
P, I = ctypes.c_void_p, ctypes.c_int


def cache_dir() -> Path:
    base = os.environ.get("QUILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "quill")
    return Path(base) / "kernels"


def cpu_supported() -> bool:
    """Whether this CPU runs what FLAGS compile for (x86-64 with AVX2, FMA and F16C)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags and " f16c" in flags  # FLAGS compile for all three


# The emulation builds (tests only, csrc/isa.h): the AVX-512 kernels' own source for any AVX2 CPU, each
# AVX-512 intrinsic done by SIMDe. "avx512-vnni": the CPU probes report AVX-512 F/BW/VL/DQ with VNNI (the
# VNNI tiles run); "avx512": the same without VNNI (the 16-lane rows take every kind); "amx": AVX-512 with
# VNNI and isa.h's emulated AMX tile unit (the tiled GEMV runs).
EMULATIONS = {"avx512-vnni": ["-DQUILL_EMULATE_AVX512"], "avx512": ["-DQUILL_EMULATE_AVX512", "-DQUILL_EMULATE_NO_VNNI"],
              "amx": ["-DQUILL_EMULATE_AVX512", "-DQUILL_EMULATE_AMX"]}


def _emulation_flags(emulate: str) -> list[str]:
    if emulate not in EMULATIONS:
        raise ValueError(f"emulate must be one of {sorted(EMULATIONS)}, got {emulate!r}")
    try:
        import simde_py
    except ImportError as e:
        raise RuntimeError("the AVX-512 emulation needs SIMDe's headers: pip install simde-py") from e
    # -Og (the last -O wins): the emulated tiles take ~25 s to compile instead of minutes at -O2/-O3
    return [*EMULATIONS[emulate], "-Og", "-Wno-psabi", "-I" + simde_py.get_include()]


def _build(target: Path, flags: list[str]) -> None:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the kernels failed: {proc.stderr.strip()[:500]}")
        os.replace(out, target)  # atomic: concurrent builders never load a half-written file


@lru_cache(maxsize=None)
def load(emulate: str | None = None) -> ctypes.CDLL | None:
    """The kernel library, or None (no AVX2/FMA/F16C, no compiler): callers then use torch's dense path.

    emulate ("avx512-vnni", "avx512" or "amx", see EMULATIONS): a separate library for tests, never an engine's,
    running the AVX-512 kernels' code on an AVX2 CPU (slowly); None where it cannot be built (no simde-py)."""
    if os.environ.get("QUILL_DISABLE_NATIVE") == "1" or not cpu_supported():
        return None
    import torch  # noqa: F401  -- load torch's libgomp first so the kernels share its OpenMP pool

    try:
        flags = FLAGS + (_emulation_flags(emulate) if emulate else [])
        digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(flags).encode()).hexdigest()[:16]
        target = cache_dir() / f"quill_kernels{'_' + emulate if emulate else ''}_{digest}.so"
        if not target.exists():
            _build(target, flags)
        lib = ctypes.CDLL(str(target))
    except (RuntimeError, OSError) as e:
        logger.warning("native kernels%s unavailable (%s)%s", f" ({emulate} emulation)" if emulate else "", e,
                       "" if emulate else "; using the dense torch path")
        return None
    # every kernel call takes its caller's choices last: isa (256 | 512) where it has a choice, threads
    for name in ("quill_gemv_q4", "quill_gemv_q8"):
        getattr(lib, name).argtypes = [P, P, P, P, P, P, I, I, I, I, I]
        getattr(lib, name).restype = None
    for name in ("quill_gemv_q4_ld", "quill_gemv_q8_ld"):  # the same, writing into rows of stride ld
        getattr(lib, name).argtypes = [P, P, P, P, P, P, I, I, I, I, I, I]
        getattr(lib, name).restype = None
    for name in ("quill_dequant_q4", "quill_dequant_q8"):
        getattr(lib, name).argtypes = [P, P, P, P, I, I, I]
        getattr(lib, name).restype = None
    lib.quill_decode_layer.argtypes = [P, P, P, P]
    lib.quill_decode_layer.restype = None
    lib.quill_attention_split.argtypes = []
    lib.quill_attention_split.restype = I
    # what the CPU can do (probed once in C: facts, not choices)
    for name in ("quill_hw_avx512", "quill_amx_hw", "quill_amx_enable"):
        getattr(lib, name).argtypes = []
        getattr(lib, name).restype = I
    lib.quill_isa_used.argtypes = [I]
    lib.quill_isa_used.restype = I
    # kind, codes, scale, mins, scale_d, mins_d, x, out, N, K, B, ld, scratch, threads
    lib.quill_amx_gemv.argtypes = [I, P, P, P, P, P, P, P, I, I, I, I, P, I]
    lib.quill_amx_gemv.restype = None
    # the same arguments: AMX, or (kind bit 6) a K-quant weight tiled for the VNNI tiles
    lib.quill_tiled_gemv.argtypes = [I, P, P, P, P, P, P, P, I, I, I, I, P, I]
    lib.quill_tiled_gemv.restype = None
    # the same with int8 activations (scratch: quill_act8_bytes) -> 0, or -1 where quill_tiled_i8_supported(kind) is 0
    lib.quill_tiled_gemv_i8.argtypes = [I, P, P, P, P, P, P, P, I, I, I, I, P, I]
    lib.quill_tiled_gemv_i8.restype = I
    lib.quill_tiled_i8_supported.argtypes = [I]
    lib.quill_tiled_i8_supported.restype = I
    lib.quill_tiled_scratch_bytes.argtypes = [I, I, I]
    lib.quill_tiled_scratch_bytes.restype = ctypes.c_long
    lib.quill_tiled_dequant.argtypes = [I, P, P, P, P, P, P, I, I, I]
    lib.quill_tiled_dequant.restype = None
    lib.quill_amx_scratch_bytes.argtypes = [I, I]
    lib.quill_amx_scratch_bytes.restype = ctypes.c_long
    # the prefill GEMM on AMX-BF16 tiles (amx_gemm.c): x, w, out, M, N, K, ldo, scratch, threads -> 0 or -1
    lib.quill_amx_bf16_hw.argtypes = []
    lib.quill_amx_bf16_hw.restype = I
    lib.quill_x3_scratch_bytes.argtypes = [I, I, I]
    lib.quill_x3_scratch_bytes.restype = ctypes.c_long
    lib.quill_x3_gemm.argtypes = [P, P, P, I, I, I, I, P, I]
    lib.quill_x3_gemm.restype = I
    # the same from a K-quant tiled weight: kind, codes, scale, mins, scale_d, mins_d, x, out, M, N, K, ldo, scratch, threads
    lib.quill_kq_scratch_bytes.argtypes = [I, I, I]
    lib.quill_kq_scratch_bytes.restype = ctypes.c_long
    lib.quill_kq_gemm.argtypes = [I, P, P, P, P, P, P, P, I, I, I, I, P, I]
    lib.quill_kq_gemm.restype = I
    lib.quill_gemv_kq.argtypes = [I, P, P, P, P, I, I, I, I, I, I]  # kind, blocks, x, xs, out, N, K, B, ld, isa, threads
    lib.quill_gemv_kq.restype = None
    lib.quill_gemv_kq_scratch_bytes.argtypes = [I, I]
    lib.quill_gemv_kq_scratch_bytes.restype = ctypes.c_long
    lib.quill_dequant_kq.argtypes = [I, P, P, I, I, I]
    lib.quill_dequant_kq.restype = None
    lib.quill_kq_row_bytes.argtypes = [I, I]
    lib.quill_kq_row_bytes.restype = ctypes.c_long
    # opt-in int8 activations (kquant_i8.c)
    lib.quill_hw_vnni.argtypes = []
    lib.quill_hw_vnni.restype = I
    lib.quill_i8_supported.argtypes = [I]
    lib.quill_i8_supported.restype = I
    lib.quill_act8_bytes.argtypes = [I, I]
    lib.quill_act8_bytes.restype = ctypes.c_long
    lib.quill_act8_quantize.argtypes = [P, P, I, I, I]
    lib.quill_act8_quantize.restype = None
    # kind, codes, scale, mins, x, act, out, N, K, B, ld, isa, threads -> 0, or -1 (no int8 kernel for kind)
    lib.quill_gemv_i8.argtypes = [I, P, P, P, P, P, P, I, I, I, I, I, I]
    lib.quill_gemv_i8.restype = I
    lib.quill_read_sum.argtypes = [P, ctypes.c_long, I, I]  # floats, n, streams per thread, prefetch
    lib.quill_read_sum.restype = ctypes.c_double
    return lib
