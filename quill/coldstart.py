"""Cold start, process start -> ready, in the phases quill reports: import (interpreter, torch, quill),
weights (a .quill file's mapping, or reading and packing a GGUF file or folder), engine (KV pool,
runner), warm-up (one short request; `quill serve` only) and ready (time since the process started)."""

from __future__ import annotations

import os
import sys
import time


def process_age_ms() -> float | None:
    """Milliseconds since this process started (Linux /proc)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / ticks, 0.0) * 1000.0
    except (OSError, ValueError, IndexError):
        return None


def import_torch() -> float | None:
    """Import torch now and return the milliseconds it took (None if something imported it already):
    the largest part of every cold start, reported on its own."""
    if "torch" in sys.modules:
        return None
    t0 = time.perf_counter()
    import torch  # noqa: F401

    return (time.perf_counter() - t0) * 1000.0


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1000.0:.2f} s"


def line(import_ms: float | None, phases: dict, ready_ms: float | None, torch_ms: float | None = None) -> str:
    """'cold start: import 2.01 s (torch 1.70 s), weights 0.21 s (quill), engine 0.01 s, warm-up 0.15 s, ready
    2.40 s after process start'; `phases` is an engine's cold_start dict (load_ms, load_format, engine_ms,
    warmup_ms)."""
    fmt = phases.get("load_format")
    inner = ", ".join(f"{k} {_ms(v)}" for k, v in (phases.get("load_phases") or {}).items())
    weights = f"weights {_ms(phases.get('load_ms'))}" + (f" ({fmt}{': ' + inner if inner else ''})" if fmt else "")
    parts = [f"import {_ms(import_ms)}" + (f" (torch {_ms(torch_ms)})" if torch_ms is not None else ""), weights,
             f"engine {_ms(phases.get('engine_ms'))}"]
    if "warmup_ms" in phases:
        parts.append(f"warm-up {_ms(phases['warmup_ms'])}")
    return f"cold start: {', '.join(parts)}, ready {_ms(ready_ms)} after process start"


SLOW_LOAD_MS = 3000.0  # a GGUF or folder load this slow earns the hint below


def hint(phases: dict) -> str | None:
    """A line for a slow GGUF or folder load: the same model as a .quill file maps in well under a second."""
    if phases.get("load_format") in ("gguf", "safetensors") and (phases.get("load_ms") or 0.0) >= SLOW_LOAD_MS:
        return (f"loading the {phases['load_format']} weights took {_ms(phases['load_ms'])}; `quill convert MODEL -o "
                "NAME.quill` (or --cache-dir DIR) writes a file that maps in well under a second")
    return None
