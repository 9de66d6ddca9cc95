"""Text tables for `quill bench serve`: one block per level, a summary, and A/B ratios."""

from __future__ import annotations

from typing import TextIO

from quill.bench.stats import LATENCIES, PERCENTILES, figure

SUMMARY_COLUMNS = (
    ("req/s", "request_throughput"), ("out tok/s", "output_throughput"), ("goodput", "goodput"),
    ("TTFT p50", "ttft_ms.p50"), ("TTFT p99", "ttft_ms.p99"),
    ("TPOT p50", "tpot_ms.p50"), ("TPOT p99", "tpot_ms.p99"), ("E2E p50", "e2e_ms.p50"),
    ("cache hit", "cache_hit_rate"),
)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def level_name(mode: str, level: float) -> str:
    if mode == "concurrency":
        return f"concurrency {int(level)}"
    return "request rate inf" if level == float("inf") else f"request rate {level:g}/s"


def print_level(label: str, summary: dict, out: TextIO) -> None:
    """The figures of one finished level, latencies in milliseconds."""
    goodput = summary["goodput"]
    print(f"\n[{label}] {level_name(summary['mode'], summary['level'])}: "
          f"{summary['completed']}/{summary['num_requests']} ok, {summary['errors']} errors "
          f"in {summary['duration_s']:.2f} s | {summary['request_throughput']:.2f} req/s | "
          f"{summary['output_throughput']:.1f} output tok/s"
          + ("" if goodput is None else f" | goodput {goodput:.2f} req/s")
          + ("" if summary.get("cache_hit_rate") is None else f" | prefix-cache hit rate {summary['cache_hit_rate']:.3f}"),
          file=out)
    for error in summary["error_samples"]:
        print(f"  error: {error}", file=out)
    header = "".join(f"{name:>10}" for name in ["mean", *(f"p{q}" for q in PERCENTILES)])
    print(f"  {'(ms)':<6}{header}", file=out)
    for name in LATENCIES:
        dist = summary[f"{name}_ms"] or {}
        cells = [dist.get("mean"), *(dist.get(f"p{q}") for q in PERCENTILES)]
        print(f"  {name.upper():<6}" + "".join(f"{fmt(value, 2):>10}" for value in cells), file=out)


def print_summary(servers: list[dict], mode: str, out: TextIO) -> None:
    """One row per server and level."""
    level_header = "concurrency" if mode == "concurrency" else "rate/s"
    print("\n" + f"{'server':<8}{level_header:>12}" + "".join(f"{name:>11}" for name, _ in SUMMARY_COLUMNS)
          + f"{'errors':>8}", file=out)
    for server in servers:
        for summary in server["levels"]:
            cells = "".join(f"{fmt(figure(summary, key), 2):>11}" for _, key in SUMMARY_COLUMNS)
            print(f"{server['label']:<8}{summary['level']:>12g}{cells}{summary['errors']:>8}", file=out)


def print_ratios(servers: list[dict], ratio_rows: list[dict], mode: str, out: TextIO) -> None:
    """A/B for the main figures at each level (above 1: A is higher, which for latencies is worse)."""
    a, b = servers[0], servers[1]
    print(f"\nA/B ratios (A = {a['base_url']} {a['model']}, B = {b['base_url']} {b['model']})", file=out)
    level_header = "concurrency" if mode == "concurrency" else "rate/s"
    print(f"{level_header:>12}" + "".join(f"{name:>11}" for name, _ in SUMMARY_COLUMNS), file=out)
    for row in ratio_rows:
        cells = "".join(f"{fmt(row['ratios'].get(key), 3):>11}" for _, key in SUMMARY_COLUMNS)
        print(f"{row['level']:>12g}{cells}", file=out)
