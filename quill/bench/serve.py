"""`quill bench serve`: load an OpenAI-compatible server at set concurrencies or Poisson rates."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from quill.bench import report
from quill.bench.client import normalize_base_url
from quill.bench.loadgen import ServeBenchConfig, bench
from quill.cli_args import positive_float
from quill.bench.stats import Slo


def positive_int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def positive_rate_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or any(not value > 0 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive rates (req/s, or inf) separated by commas, got {text!r}")
    return values


def positive_int(text: str) -> int:
    value = positive_int_list(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return value[0]


def word_range(text: str) -> tuple[int, int]:
    values = positive_int_list(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX words with MIN <= MAX, got {text!r}")
    return values  # type: ignore[return-value]


def register(subparsers) -> argparse.ArgumentParser:
    """Add `serve` to the `quill bench` subcommands."""
    parser = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput, goodput)",
        description="Stream chat completions from an OpenAI-compatible server at fixed concurrency levels "
                    "(closed loop) or Poisson request rates (open loop) and report throughput, latency "
                    "percentiles and goodput per level. Latencies are client-side: they include the network.",
    )
    parser.add_argument("--base-url", required=True, metavar="URL", help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    parser.add_argument("--model", metavar="NAME", help="model name to request (default: the first id from GET /v1/models)")
    parser.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--workload", default="chat-shared-prefix", metavar="NAME",
                        help="chat-shared-prefix (one ~400-token system prompt + short distinct questions), "
                             "chat-multi-prefix (4 such system prompts, one per team, each request picks one), "
                             "random (seeded random-length prompts) or file:F.jsonl (one JSON object per line "
                             "with 'messages' or 'prompt', optional 'max_tokens'); default %(default)s")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=positive_int_list, default=None, metavar="L[,L...]",
                      help="comma-separated levels; each keeps that many requests in flight (default 1)")
    load.add_argument("--request-rate", type=positive_rate_list, default=None, metavar="R[,R...]",
                      help="comma-separated Poisson arrival rates in requests/s ('inf' sends all at once)")
    parser.add_argument("--num-requests", type=positive_int, default=100, metavar="N", help="requests per level (default %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=128, metavar="N", help="output tokens per request (default %(default)s)")
    parser.add_argument("--slo-ttft-ms", type=positive_float, metavar="MS", help="goodput counts requests with TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=positive_float, metavar="MS", help="goodput counts requests with TPOT at most this")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="workload, arrival and sampling seed (default %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; above 0 sends a per-request seed")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos=true (for servers that reject the field)")
    parser.add_argument("--random-words", type=word_range, default=(32, 256), metavar="MIN,MAX",
                        help="MIN,MAX prompt length in words for --workload random (default 32,256)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="uncounted short requests per server before the first level (default %(default)s)")
    parser.add_argument("--timeout", type=positive_float, default=600.0, metavar="S", help="seconds per request (default %(default)s)")
    parser.add_argument("--json", metavar="F", help="write every figure (config, per level, per request) to this file")
    parser.add_argument("--plot", metavar="F.png", help="write a PNG: throughput and TTFT/TPOT p50/p90/p99 against the level")
    parser.add_argument("--vs", metavar="URL2", help="a second server: same workload and seed, levels interleaved, A/B ratios printed")
    parser.add_argument("--vs-model", metavar="NAME", help="model name on the --vs server (default: its first /v1/models id)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    parser.set_defaults(func=run)
    return parser


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    return ServeBenchConfig(
        base_url=normalize_base_url(args.base_url),
        workload=args.workload,
        concurrency=None if args.request_rate else (args.concurrency or (1,)),
        request_rates=args.request_rate,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms),
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout,
        random_words=args.random_words,
        model=args.model,
        api_key=args.api_key,
        vs_url=normalize_base_url(args.vs) if args.vs else None,
        vs_model=args.vs_model,
        warmup_requests=args.warmup,
        progress=args.progress,
    )


def json_safe(value):
    """Rate 'inf' becomes the string "inf": strict JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def run(args: argparse.Namespace) -> int:
    """Entry point of `quill bench serve`; 0 unless setup failed or every request failed."""
    out = sys.stdout
    try:
        config = config_from_args(args)
        if config.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {config.temperature}")
        if config.warmup_requests < 0:
            raise ValueError(f"--warmup must be >= 0, got {config.warmup_requests}")
        result = asyncio.run(bench(config, on_level=lambda label, summary: report.print_level(label, summary, out)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # unreachable server, bad /v1/models answer
        print(f"error: {exc}" if isinstance(exc, ConnectionError) else f"error: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    report.print_summary(result["servers"], result["mode"], out)
    if "ratios" in result:
        report.print_ratios(result["servers"], result["ratios"], result["mode"], out)
    if args.json:
        Path(args.json).write_text(json.dumps(json_safe(result), indent=1, allow_nan=False))
        print(f"\nwrote {args.json}", file=out)
    if args.plot:
        from quill.bench.plot import plot_servers

        plot_servers(result["servers"], result["mode"], args.plot)
        print(f"wrote {args.plot}", file=out)
    completed = sum(level["completed"] for server in result["servers"] for level in server["levels"])
    return 0 if completed else 1
