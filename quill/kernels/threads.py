"""Thread counts: each engine's own for the native kernels; torch's process-wide pool by one rule."""

from __future__ import annotations

import logging
import os
import sys

import torch

logger = logging.getLogger("quill.kernels")


def physical_cores() -> int:
    """Physical cores from /proc/cpuinfo (core ids per socket), else os.cpu_count()."""
    try:
        cores = set()
        phys = core = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                    cores.add((phys, core))
        if cores:
            return len(cores)
    except OSError:
        pass
    return os.cpu_count() or 1


_torch_set = False  # whether an engine in this process has set torch's pool yet


def configure_threads(threads: int | None) -> int:
    """An engine's thread count (`threads`, default: physical cores), and torch's pool by one rule.

    The native kernels take each engine's count per call, so engines never touch each other's.
    torch's intra-op pool (prefill GEMMs, the torch fallbacks) and numba's are process-wide, so
    they are set only when the user asked for a count (threads=N, --threads N: the explicit
    request wins, for the whole process, and is logged when it changes torch's count) or, with
    the default, by the first engine in the process; a later default engine leaves them as found."""
    global _torch_set
    from quill.kernels.options import default_threads

    n = default_threads() if threads is None else threads
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    if threads is None and _torch_set:
        return n
    _torch_set = True
    old = torch.get_num_threads()
    if old != n:
        torch.set_num_threads(n)
        logger.info("torch intra-op threads %d -> %d (process-wide; quill's own kernels use each engine's count)", old, n)
    numba = sys.modules.get("numba")  # only where something already uses it: importing it costs 0.3 s
    if numba is not None:
        try:
            numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        except Exception:  # its pool already fixed: torch's setting still holds
            pass
    return n
