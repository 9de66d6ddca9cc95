"""Per-engine kernel choices: which vector width, whether AMX tiles, how many threads.

Nothing here is process-wide. An engine decides its `KernelOptions` once, when it is built
(`resolve`: the user's arguments, else the environment switches QUILL_NO_AVX512=1 and
QUILL_NO_AMX=1 read at that moment, else what the CPU can do), and every C call it makes gets
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
    tiled layout (decided when a model is loaded); threads: the OpenMP team of every native call."""

    isa: int = 256
    amx: bool = False
    threads: int = 1

    @property
    def isa_name(self) -> str:
        return "avx512" if self.isa == 512 else "avx2"


@dataclass(frozen=True)
class Hardware:
    """What this CPU can run, as the kernels' CPUID probes say (all False without the kernels)."""

    avx512: bool = False
    amx: bool = False


@lru_cache(maxsize=1)
def hardware() -> Hardware:
    from quill.kernels import native

    lib = native.load()
    if lib is None:
        return Hardware()
    return Hardware(avx512=bool(lib.quill_hw_avx512()), amx=bool(lib.quill_amx_hw()))


@lru_cache(maxsize=1)
def default_threads() -> int:
    """Physical cores this process may run on (a fact about the machine, probed once)."""
    from quill.kernels.threads import physical_cores

    return max(1, min(physical_cores(), len(os.sched_getaffinity(0))))


def _env_off(name: str) -> bool:
    return os.environ.get(name) == "1"


def resolve(threads: int | None = None, isa: int | str | None = None, amx: bool | None = None) -> KernelOptions:
    """An engine's options: each argument given wins; None means the environment switch
    (QUILL_NO_AVX512=1 -> AVX2, QUILL_NO_AMX=1 -> no tiles), then the hardware's best."""
    hw = hardware()
    if isa is None:
        isa = 512 if hw.avx512 and not _env_off("QUILL_NO_AVX512") else 256
    else:
        isa = ISA_NAMES.get(isa, isa) if isinstance(isa, str) else isa
        if isa not in (256, 512):
            raise ValueError(f"isa must be 'avx2' (256) or 'avx512' (512), got {isa!r}")
        if isa == 512 and not hw.avx512:
            raise ValueError("isa 'avx512' asked for, but this CPU (or build) has no AVX-512 kernels")
    if amx is None:
        amx = hw.amx and not _env_off("QUILL_NO_AMX")
    elif amx and not hw.amx:
        raise ValueError("amx asked for, but this CPU has no AMX-INT8")
    n = default_threads() if threads is None else threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    return KernelOptions(isa=isa, amx=bool(amx), threads=n)


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
