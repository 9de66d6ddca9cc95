"""`quill serve`: flags -> EngineConfig, load the engine behind a live /health, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys

logger = logging.getLogger("quill.server")

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """'2GiB' / '512M' / '1.5GB' / '1048576' -> bytes (single letters are binary, like docker)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 2GiB, 512MiB, 1.5GB or a byte count")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH", help="GGUF file or model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("QUILL_API_KEY"), metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/* (env QUILL_API_KEY)")
    p.add_argument("--served-model-name", default=None, metavar="NAME", help="the model id clients send (default: the model's name)")
    p.add_argument("--kv-cache-memory", type=_size_arg, default=None, metavar="SIZE", help="KV cache budget, e.g. 2GiB (default: derived from free RAM)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=None, metavar="N", help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, metavar="N", help="token budget per engine step")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    p.add_argument("--max-waiting", type=_positive_int, default=None, metavar="N", help="refuse (503 + Retry-After) beyond this many queued requests")
    p.add_argument("--drain-timeout", type=_nonnegative_float, default=30.0, metavar="SECONDS", help="on SIGTERM, how long in-flight requests may finish (default 30)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N", help="CPU threads for the engine (default: physical cores)")
    p.add_argument("--max-model-len", type=_positive_int, default=None, metavar="TOKENS", help="context length (default: the model's)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("--max-body-size", type=_size_arg, default=4 * 1024 * 1024, metavar="SIZE", help="largest request body (default 4MiB)")
    p.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])


DESCRIPTION = (
    "Serve the model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, "
    "/v1/models, plus /health, /metrics (Prometheus), /tokenize and /detokenize. "
    "Binds to 127.0.0.1 unless --host says otherwise."
)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server", description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def engine_config(args):
    """The EngineConfig these flags describe (defaults stay the config's own)."""
    from quill.config import CacheConfig, EngineConfig, SchedulerConfig

    cache = {"enable_prefix_caching": not args.no_prefix_cache}
    if args.kv_cache_memory is not None:
        cache["kv_cache_memory"] = args.kv_cache_memory
    sched = {k: v for k, v in (("max_num_seqs", args.max_num_seqs), ("max_num_batched_tokens", args.max_num_batched_tokens), ("max_waiting", args.max_waiting)) if v is not None}
    return EngineConfig(
        model=args.model,
        device=args.device,
        threads=args.threads,
        max_model_len=args.max_model_len,
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(**sched),
    )


def process_age_ms() -> float | None:
    """Milliseconds since this process started (Linux /proc), for the cold-start line."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / ticks, 0.0) * 1000.0
    except (OSError, ValueError, IndexError):
        return None


def run(args) -> int:
    from quill.server.runner import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config = engine_config(args)
    except (TypeError, ValueError) as exc:
        print(f"quill serve: {exc}", file=sys.stderr)
        return 2
    return serve(args, config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quill serve", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
