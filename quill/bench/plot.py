"""PNG of a serve benchmark: throughput and TTFT/TPOT percentiles against the load level."""

from __future__ import annotations

import math
from pathlib import Path

from quill.bench.stats import figure

MARKERS = ("o", "s", "^", "D")
LINESTYLES = {"p50": "-", "p90": "--", "p99": ":"}
COLORS = {"ttft_ms": "tab:blue", "tpot_ms": "tab:orange"}


def plot_servers(servers: list[dict], mode: str, path: str | Path) -> None:
    """servers: [{"label", "levels": [level summary, ...]}]; writes a 2-subplot PNG to path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    x_label = "concurrency" if mode == "concurrency" else "request rate (req/s)"
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    for server_index, server in enumerate(servers):
        marker = MARKERS[server_index % len(MARKERS)]
        finite = [summary for summary in server["levels"] if math.isfinite(summary["level"])]  # rate "inf" has no x
        levels = [summary["level"] for summary in finite]
        tput = [figure(summary, "output_throughput") for summary in finite]
        ax_tput.plot(levels, tput, marker=marker, label=f"{server['label']} output tok/s")
        for metric, color in COLORS.items():
            for pct, style in LINESTYLES.items():
                values = [figure(summary, f"{metric}.{pct}") for summary in finite]
                points = [(x, y) for x, y in zip(levels, values) if y is not None and y > 0]
                if points:
                    xs, ys = zip(*points)
                    name = metric.split("_")[0].upper()
                    ax_lat.plot(xs, ys, color=color, linestyle=style, marker=marker,
                                label=f"{server['label']} {name} {pct}")
    ax_tput.set(title="Throughput", xlabel=x_label, ylabel="output tokens/s")
    ax_lat.set(title="Latency percentiles", xlabel=x_label, ylabel="ms (log)")
    ax_lat.set_yscale("log")
    ticks = sorted({s["level"] for server in servers for s in server["levels"] if math.isfinite(s["level"])})
    for axis in (ax_tput, ax_lat):
        if mode == "concurrency":
            axis.set_xscale("log", base=2)  # levels like 1, 4, 16 spread evenly
            axis.set_xticks(ticks, [f"{tick:g}" for tick in ticks])
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
