"""Per-level figures from request timings: throughput, latency percentiles, goodput, A/B ratios."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quill.bench.client import RequestResult

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class Slo:
    """Latency targets in milliseconds; a target that is None counts as met."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft_ms is not None and result.ttft * 1000 > self.ttft_ms:
            return False
        # A single-token reply has no TPOT, so nothing to violate.
        tpot = result.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def distribution(seconds: list[float]) -> dict | None:
    """mean and p50/p90/p99 in milliseconds (linear interpolation); None without samples."""
    if not seconds:
        return None
    values = np.asarray(seconds, dtype=np.float64) * 1000.0
    figures = {"mean": float(values.mean())}
    for q, value in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
        figures[f"p{q}"] = float(value)
    figures["count"] = int(values.size)
    return figures


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Seconds per metric over the successful requests; ITL pools every gap of every request."""
    ok = [r for r in results if r.ok]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok],
    }


def cache_hit_rate(results: list[RequestResult]) -> float | None:
    """Prompt tokens served from the server's prefix cache / prompt tokens, over the requests whose
    usage said both (None when the server reports no cached_tokens)."""
    counted = [r for r in results if r.prompt_tokens and r.cached_tokens is not None]
    if not counted:
        return None
    return sum(r.cached_tokens for r in counted) / sum(r.prompt_tokens for r in counted)


def summarize_level(results: list[RequestResult], start: float, end: float, level: float,
                    mode: str, slo: Slo) -> dict:
    """All figures of one load level (concurrency or request rate) as a JSON-ready dict.

    start and end are the level's perf_counter bounds; throughputs divide by end - start.
    """
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    duration_s = max(end - start, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "mode": mode,
        "level": level,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted({r.error for r in errors})[:5],
        "start_time": start,  # time.perf_counter() (CLOCK_MONOTONIC on Linux) of the level start
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_output_tokens": output_tokens,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "goodput": sum(slo.met(r) for r in ok) / duration_s if slo.given else None,
        "cache_hit_rate": cache_hit_rate(ok),
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
    }
    samples = latency_samples(results)
    for name in LATENCIES:
        summary[f"{name}_ms"] = distribution(samples[name])
    summary["requests"] = [r.to_dict(start) for r in results]
    return summary


def figure(summary: dict, key: str) -> float | None:
    """'ttft_ms.p50' style lookup; None where the figure is missing."""
    value: object = summary
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value if isinstance(value, (int, float)) else None


RATIO_KEYS = ("request_throughput", "output_throughput", "goodput",
              "ttft_ms.p50", "ttft_ms.p99", "tpot_ms.p50", "tpot_ms.p99", "itl_ms.p50", "e2e_ms.p50")


def ratios(summary_a: dict, summary_b: dict) -> dict[str, float | None]:
    """A / B for the main figures; None where B is zero or either side is missing."""
    out = {}
    for key in RATIO_KEYS:
        a, b = figure(summary_a, key), figure(summary_b, key)
        out[key] = a / b if a is not None and b else None
    return out
