"""`quill bench soak`: a bounded storm of healthy, abandoned, bad and fault-injected requests
against an OpenAI-compatible server, then its health: 5xx, lost requests, wrong answers,
leaked KV blocks and memory growth, each with a PASS/FAIL line."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import TextIO

import httpx

from quill.bench.client import first_model_id, make_client, normalize_base_url
from quill.bench.serve import positive_int
from quill.cli_args import non_negative_float, positive_float
from quill.bench.soak_cases import BAD_CASES, healthy_pool
from quill.bench.soak_storm import (KINDS, OUTCOMES, SoakConfig, Storm, fault_phases, read_gauges, reference_texts,
                                    tally, wait_idle)


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def register(subparsers) -> argparse.ArgumentParser:
    """Add `soak` to the `quill bench` subcommands."""
    parser = subparsers.add_parser(
        "soak",
        help="storm a server with healthy, abandoned, bad and fault-injected requests, then check its health",
        description="Run a bounded storm against an OpenAI-compatible server (POST /v1/chat/completions) and "
                    "report whether it stayed healthy. Each pool prompt is first run alone to get its reference "
                    "text; then --concurrency workers send requests for --warmup seconds, the server settles "
                    "and its RSS is read, and the workers go on until --duration is over. Afterwards the "
                    "server must become idle, and GET /v1/stats (quill's gauges) gives leaked KV blocks and RSS "
                    "growth since the warm-up. Criteria: no 5xx, no lost request, no healthy request refused, no healthy reply "
                    "different from its reference, no leaked KV block, RSS growth under 5%. Exit code 0 only "
                    "when every criterion passes (one the server cannot report, without /v1/stats, is n/a).",
        epilog="Fault injection needs a quill server started with --enable-fault-injection (without it quill "
               "refuses the X-Quill-Fault header with a 400, counted as refused); other servers ignore the "
               "header, so their faulty requests simply finish.",
    )
    parser.add_argument("--base-url", required=True, metavar="URL",
                        help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    parser.add_argument("--duration", type=positive_float, default=60.0, metavar="SECONDS",
                        help="how long workers keep starting requests; requests in flight then finish "
                             "(default %(default)s)")
    parser.add_argument("--warmup", type=non_negative_float, default=None, metavar="SECONDS",
                        help="a storm of the same mix before the RSS baseline, so memory that a server reserves "
                             "and first touches under load (a lazily mapped KV pool, full-batch buffers) is not "
                             "counted as growth; its requests are checked like the rest; 0 reads the baseline "
                             "right after the reference runs (default: 10, or a quarter of --duration if less)")
    parser.add_argument("--concurrency", type=positive_int, default=8, metavar="N",
                        help="workers, each with one request in flight at a time (default %(default)s)")
    parser.add_argument("--disconnect", type=fraction, default=0.3, metavar="FRACTION",
                        help="share of requests that stream and are abandoned (connection closed) after a random "
                             "number of chunks or a random time under 1 s, possibly before the first byte "
                             "(default %(default)s)")
    parser.add_argument("--bad-input", type=fraction, default=0.1, metavar="FRACTION",
                        help=f"share of requests that are invalid ({len(BAD_CASES)} cases: broken JSON, wrong types, "
                             "bad max_tokens, unknown model, empty messages, a lone surrogate, a prompt over the "
                             "context, bad guided constraints, oversized n, min_tokens > max_tokens, ...); each must "
                             "get a 4xx, a 5xx is a failure, a 2xx is noted (default %(default)s)")
    parser.add_argument("--faulty", type=fraction, default=0.0, metavar="FRACTION",
                        help="share of requests that stream a pool prompt with the header 'X-Quill-Fault: PHASE' "
                             f"(a random phase of {', '.join(fault_phases())}); one must end with an SSE error event "
                             "and [DONE], or finish normally if the phase was never reached (default %(default)s)")
    parser.add_argument("--max-tokens", type=positive_int, default=24, metavar="N",
                        help="max_tokens of every healthy request (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="seeds the request mix, the cut points and the sampled pool prompts (default %(default)s)")
    parser.add_argument("--model", metavar="NAME", help="model name to request (default: the first id from GET /v1/models)")
    parser.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--request-timeout", type=positive_float, default=120.0, metavar="SECONDS",
                        help="a request unanswered after this long is counted lost (default %(default)s)")
    parser.add_argument("--settle", type=positive_float, default=10.0, metavar="SECONDS",
                        help="after the storm, how long the server may take to reach running == waiting == 0 "
                             "(default %(default)s)")
    parser.add_argument("--json", metavar="F", help="write every figure (config, counts, samples, gauges, criteria, "
                                                    "each request) to this file")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress line")
    parser.set_defaults(func=run)
    return parser


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        base_url=normalize_base_url(args.base_url), duration_s=args.duration, concurrency=args.concurrency,
        disconnect=args.disconnect, bad_input=args.bad_input, faulty=args.faulty, max_tokens=args.max_tokens,
        seed=args.seed, model=args.model, api_key=args.api_key, request_timeout_s=args.request_timeout,
        settle_s=args.settle,
        warmup_s=min(10.0, args.duration / 4) if args.warmup is None else args.warmup,
    )


# ---- criteria ----------------------------------------------------------------------------------

def mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f} MiB"


def criteria(counts: dict, before: dict | None, after: dict | None, idle: bool, rss_limit: float) -> list[dict]:
    """One row per health criterion: name, measured value, passed (None: the server cannot tell)."""
    by_kind = ", ".join(f"{kind} {n}" for kind in KINDS if (n := counts["outcomes"][kind].get("server_error")))
    rows = [
        {"name": "no 5xx", "value": f"{counts['server_errors']}" + (f" ({by_kind})" if by_kind else ""),
         "passed": counts["server_errors"] == 0},
        {"name": "no lost requests", "value": counts["lost"], "passed": counts["lost"] == 0},
        {"name": "no healthy request refused (4xx)", "value": counts["refused"], "passed": counts["refused"] == 0},
        {"name": "no healthy mismatches", "value": counts["mismatches"], "passed": counts["mismatches"] == 0},
    ]
    leaked = None if after is None else after.get("kv_blocks_used")
    if leaked is None:
        rows.append({"name": "no leaked KV blocks", "value": "not available", "passed": None})
    else:
        note = "" if idle else f" (not idle: running {after.get('running')}, waiting {after.get('waiting')})"
        rows.append({"name": "no leaked KV blocks", "value": f"{leaked}{note}", "passed": idle and leaked == 0})
    rss_before = None if before is None else before.get("process_rss_bytes")
    rss_after = None if after is None else after.get("process_rss_bytes")
    if not rss_before or rss_after is None:
        rows.append({"name": f"RSS growth < {rss_limit:.0%}", "value": "not available", "passed": None})
    else:
        growth = rss_after / rss_before - 1.0
        rows.append({"name": f"RSS growth < {rss_limit:.0%}", "value": f"{growth:+.2%}", "passed": growth < rss_limit})
    return rows


def rss_growth(before: dict | None, after: dict | None) -> float | None:
    if not before or not after or not before.get("process_rss_bytes") or after.get("process_rss_bytes") is None:
        return None
    return after["process_rss_bytes"] / before["process_rss_bytes"] - 1.0


# ---- the run -----------------------------------------------------------------------------------

async def soak(config: SoakConfig, out: TextIO, progress: bool = False) -> dict:
    """References, storm, settle, gauges; returns the JSON-ready report (printed as it goes)."""
    config.validate()
    client = make_client(config.base_url, config.api_key, config.request_timeout_s)
    try:
        try:
            model = config.model or await first_model_id(client)
        except httpx.HTTPError as exc:
            raise ConnectionError(f"cannot list models at {config.base_url}/v1/models ({type(exc).__name__}: {exc}); "
                                  "is the server up? (--model skips this call)") from None
        pool = healthy_pool(config.seed)
        print(f"quill bench soak: {config.base_url} model {model!r}, {config.duration_s:g} s, concurrency "
              f"{config.concurrency}, disconnect {config.disconnect:g}, bad input {config.bad_input:g}, "
              f"faulty {config.faulty:g}, max_tokens {config.max_tokens}, seed {config.seed}", file=out)
        references, skipped = await reference_texts(client, model, pool, config.max_tokens, config.request_timeout_s)
        pool = [item for item in pool if item.name in references]
        print(f"references: {len(pool)} pool prompts run alone"
              + "".join(f"; {name} left out, the server refused it ({why})" for name, why in skipped.items()), file=out)
        before = await read_gauges(client)
        context = (before or {}).get("max_model_len") or 32768
        storm = Storm(config, model, int(context), pool, references)
        show = progress_printer(storm, config) if progress else None
        warm_seconds = 0.0
        if config.warmup_s > 0:
            # The first minutes under load touch memory that is reserved, not leaked: the KV pool's pages
            # (mapped lazily), buffers sized for full batches, the allocator's per-thread arenas. The
            # baseline is read after a warm-up storm, so RSS growth measures what the storm keeps.
            warm_seconds = await storm.run(client, on_outcome=show, warmup=True)
            warm_gauges, _, _ = await wait_idle(client, config.settle_s)
            before = warm_gauges or before
        seconds = await storm.run(client, on_outcome=show)
        if progress:
            print(file=sys.stderr)
        after, idle, waited = await wait_idle(client, config.settle_s)
    finally:
        await client.aclose()
    counts = tally(storm.outcomes)
    rows = criteria(counts, before, after, idle, config.rss_growth_limit)
    passed = all(row["passed"] is not False for row in rows)
    return {
        "config": {**config.__dict__, "api_key": "***" if config.api_key else None},
        "model": model, "warmup_seconds": round(warm_seconds, 3), "storm_seconds": round(seconds, 3), "references": references, "skipped_pool_items": skipped,
        "counts": counts, "gauges_before": before, "gauges_after": after, "idle": idle,
        "settle_seconds": round(waited, 3), "rss_growth": rss_growth(before, after),
        "criteria": rows, "passed": passed,
        "requests": [o.__dict__ for o in storm.outcomes],
    }


def progress_printer(storm: Storm, config: SoakConfig):
    def show(_outcome) -> None:
        bad = sum(1 for o in storm.outcomes if o.outcome in ("server_error", "lost", "mismatch", "refused"))
        print(f"\r{len(storm.outcomes)} requests, {bad} failed", end="", file=sys.stderr, flush=True)
    return show


def print_report(result: dict, out: TextIO) -> None:
    counts = result["counts"]
    sent = counts["sent"]
    warmup = f" after a {result['warmup_seconds']:.1f} s warm-up" if result["warmup_seconds"] else ""
    print(f"\nstorm: {counts['total']} requests in {result['storm_seconds']:.1f} s{warmup}: "
          + ", ".join(f"{kind} {sent[kind]}" for kind in KINDS)
          + f" ({sum(counts['streaming'].values())} streaming)", file=out)
    for kind in KINDS:
        if not sent[kind]:
            continue
        cells = ", ".join(f"{n} {name}" for name in OUTCOMES if (n := counts["outcomes"][kind].get(name)))
        print(f"  {kind:<11}{sent[kind]:>6} sent: {cells}", file=out)
    if counts["faulty_by_phase"]:
        print("  faulty by phase: " + "; ".join(
            f"{phase} " + ", ".join(f"{n} {name}" for name, n in sorted(tally.items()))
            for phase, tally in counts["faulty_by_phase"].items()), file=out)
    if counts["outcomes"]["faulty"].get("refused"):
        print("  hint: faulty requests were refused; a quill server needs --enable-fault-injection", file=out)
    if counts["accepted_cases"]:
        print(f"  bad inputs answered 2xx (noted, not a failure): {', '.join(counts['accepted_cases'])}", file=out)
    for title, key in (("5xx", "server_error_samples"), ("lost", "lost_samples"),
                       ("refused", "refused_samples"), ("mismatch", "mismatch_samples")):
        for sample in counts[key][:5]:
            print(f"  {title}: {sample['kind']} {sample['case']} ({'stream' if sample['stream'] else 'json'}) "
                  f"at {sample['start_s']:.1f} s{' of the warm-up' if sample['warmup'] else ''}: {sample['detail']}", file=out)
    after, before = result["gauges_after"], result["gauges_before"]
    if after is None:
        print("server gauges: not available (no GET /v1/stats)", file=out)
    else:
        state = "idle" if result["idle"] else "NOT idle"
        print(f"server after the storm: {state} after {result['settle_seconds']:.1f} s (running {after.get('running')}, "
              f"waiting {after.get('waiting')}, in flight {after.get('in_flight')}); KV blocks used "
              f"{after.get('kv_blocks_used')} of {after.get('kv_blocks_total')} (prefix-cached, free: "
              f"{after.get('kv_blocks_cached')})", file=out)
        growth = result["rss_growth"]
        print(f"RSS: {mib((before or {}).get('process_rss_bytes'))} before{' (after the warm-up)' if warmup else ''}, {mib(after.get('process_rss_bytes'))} after"
              + ("" if growth is None else f", {growth:+.2%}"), file=out)
    for row in result["criteria"]:
        verdict = "n/a " if row["passed"] is None else ("PASS" if row["passed"] else "FAIL")
        print(f"{verdict}  {row['name']:<36}{row['value']}", file=out)
    print(f"result: {'PASS' if result['passed'] else 'FAIL'}", file=out)


def run(args: argparse.Namespace) -> int:
    """Entry point of `quill bench soak`: 0 if every criterion passed, 1 if one failed, 2 on bad flags."""
    out = sys.stdout
    try:
        config = config_from_args(args)
        config.validate()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(soak(config, out, progress=args.progress))
    except (ConnectionError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print_report(result, out)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, allow_nan=False))
        print(f"wrote {args.json}", file=out)
    return 0 if result["passed"] else 1
