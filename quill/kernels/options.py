"""Per-engine kernel choices: which vector width, whether AMX tiles, int8 activations, how many threads.

Nothing here is process-wide. An engine decides its `KernelOptions` once, when it is built
(`resolve`: the user's arguments, else the environment switches QUILL_NO_AVX512=1,
QUILL_NO_AMX=1 and QUILL_INT8_ACTIVATIONS=1 read at that moment, else what the CPU can do), and every C call it makes gets
them as arguments. The C side only caches what the hardware can run (CPUID), never a choice.

Calls that go through modules shared between engines (a loaded model's linears: prefill tiles,
the LM head) read the options of the engine whose step is running: `use(options)` binds them
for the duration of a block, in a context variable, so it is per thread (and per asyncio task);
outside any `use`, `current()` resolves fresh defaults from the environment.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from functools import lru_cache

ISA_NAMES = {"avx2": 256, "avx512": 512}


@dataclass(frozen=True)
class KernelOptions:
    """isa: 512 = the 16-lane AVX-512 kernels, 256 = AVX2 (8 lanes); amx: weights may take the AMX
    tiled layout (decided when a model is loaded); threads: the OpenMP team of every native call;
    int8: opt-in -- each 32 activations rounded to int8 with their own scale before the GEMV/GEMM of
    every weight type that has an int8 kernel (csrc/kquant_i8.c: Q4_K, Q5_K, Q6_K, IQ4_XS and the
    q4/q8 layouts of Q4_0, Q4_1, Q5_1, Q8_0; AVX-512 VNNI tiles with isa 512 where the CPU has VNNI,
    else csrc/kquant_i8_avx2.c: AVX2 tiles for the K-quants, rows for the layouts); the others, and
    everything outside linears, stay exact; retile: weights loaded now may be rearranged into the tiled
    layout (AMX's, or without it the VNNI tiles' for the K-quants: kernels/tiled.py), False keeping each
    file's own layouts (quill convert's portable objects)."""

    isa: int = 256
    amx: bool = False
    threads: int = 1
    int8: bool = False
    retile: bool = True

    @property
    def isa_name(self) -> str:
        return "avx512" if self.isa == 512 else "avx2"


@dataclass(frozen=True)
class Hardware:
    """What this CPU can run, as the kernels' CPUID probes say (all False without the kernels)."""

    avx512: bool = False
    amx: bool = False
    vnni: bool = False  # AVX-512 VNNI: the int8-activation kernels' VNNI tiles (else their AVX2 kernels)


@lru_cache(maxsize=1)
def hardware() -> Hardware:
    from quill.kernels import native

    return probe(native.load())


def probe(lib) -> Hardware:
    """What a kernel library's CPUID probes report (an emulation build reports what it emulates)."""
    if lib is None:
        return Hardware()
    return Hardware(avx512=bool(lib.quill_hw_avx512()), amx=bool(lib.quill_amx_hw()), vnni=bool(lib.quill_hw_vnni()))


@lru_cache(maxsize=1)
def default_threads() -> int:
    """Physical cores this process may run on (a fact about the machine, probed once)."""
    from quill.kernels.threads import physical_cores

    return max(1, min(physical_cores(), len(os.sched_getaffinity(0))))


def _env_set(name: str) -> bool:
    return os.environ.get(name) == "1"


def resolve(threads: int | None = None, isa: int | str | None = None, amx: bool | None = None,
            int8: bool | None = None) -> KernelOptions:
    """An engine's options: each argument given wins; None means the environment switch
    (QUILL_NO_AVX512=1 -> AVX2, QUILL_NO_AMX=1 -> no tiles, QUILL_INT8_ACTIVATIONS=1 -> int8
    activations), then the hardware's best (int8 activations only when asked for)."""
    hw = hardware()
    if isa is None:
        isa = 512 if hw.avx512 and not _env_set("QUILL_NO_AVX512") else 256
    else:
        isa = ISA_NAMES.get(isa, isa) if isinstance(isa, str) else isa
        if isa not in (256, 512):
            raise ValueError(f"isa must be 'avx2' (256) or 'avx512' (512), got {isa!r}")
        if isa == 512 and not hw.avx512:
            raise ValueError("isa 'avx512' asked for, but this CPU (or build) has no AVX-512 kernels")
    if amx is None:
        amx = hw.amx and not _env_set("QUILL_NO_AMX")
    elif amx and not hw.amx:
        raise ValueError("amx asked for, but this CPU has no AMX-INT8")
    if int8 is None:
        int8 = _env_set("QUILL_INT8_ACTIVATIONS")
    n = default_threads() if threads is None else threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    return KernelOptions(isa=isa, amx=bool(amx), threads=n, int8=bool(int8))


_active: contextvars.ContextVar[KernelOptions | None] = contextvars.ContextVar("quill_kernel_options", default=None)


def current() -> KernelOptions:
    """The options bound by the innermost `use`, else defaults resolved now."""
    opts = _active.get()
    return opts if opts is not None else resolve()


@contextlib.contextmanager
def use(options: KernelOptions):
    """Bind `options` for shared modules' kernel calls inside the block (this thread/task only)."""
    token = _active.set(options)
    try:
        yield options
    finally:
        _active.reset(token)
