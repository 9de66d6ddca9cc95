"""One thread count for torch and the kernels, so they never oversubscribe the cores."""

from __future__ import annotations

import os

import torch


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


def configure_threads(threads: int | None) -> int:
    """Set torch's intra-op pool (and numba's, if loaded) to `threads` (default: physical cores)."""
    n = threads or min(physical_cores(), len(os.sched_getaffinity(0)))
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except Exception:  # numba absent or its pool already fixed: torch's setting still holds
        pass
    return n
