"""`quill serve`: flags -> EngineConfig, load the engine behind a live /health, run uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from quill.cli_args import add_engine_args, engine_config_from_args, parse_size, positive_float, positive_int, size_arg  # noqa: F401
from quill.cluster.routing import ROUTERS  # plain Python: the single-process server still never imports Ray

logger = logging.getLogger("quill.server")


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)  # --model, --threads, KV cache and scheduler flags, shared with generate/chat/trace
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--api-key", default=os.environ.get("QUILL_API_KEY"), metavar="KEY", help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/* (env QUILL_API_KEY)")
    g.add_argument("--served-model-name", default=None, metavar="NAME", help="the model id clients send (default: the model's name)")
    g.add_argument("--max-waiting", type=positive_int, default=None, metavar="N", help="refuse (503 + Retry-After) beyond this many queued requests")
    g.add_argument("--drain-timeout", type=_nonnegative_float, default=30.0, metavar="SECONDS", help="on SIGTERM, how long in-flight requests may finish (default 30)")
    g.add_argument("--max-body-size", type=size_arg, default=4 * 1024 * 1024, metavar="SIZE", help="largest request body (default 4MiB)")
    g.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])
    g.add_argument("--reasoning-format", choices=["none", "deepseek"], default=None,
                   help="chat completions: 'deepseek' moves <think>...</think> to message.reasoning_content (streamed as "
                        "delta.reasoning_content), 'none' leaves it in content; a request's reasoning_format overrides it "
                        "(default: deepseek when the model's chat template has think markers, else none)")
    g.add_argument("--tool-parser", choices=["auto", "hermes", "llama3_json", "mistral", "generic"], default="auto",
                   help="chat completions with `tools`: the model family's tool-call format (hermes: <tool_call>{...}</tool_call>; "
                        "llama3_json: {\"name\", \"parameters\"} / <|python_tag|>; mistral: [TOOL_CALLS]; generic: a JSON answer "
                        "quill describes in the system prompt, for templates without tools); default auto: from the chat template")
    c = p.add_argument_group("connections (slow or hostile clients)")
    c.add_argument("--timeout-keep-alive", type=positive_float, default=5.0, metavar="SECONDS",
                   help="close a kept-alive connection idle this long between requests (default 5)")
    c.add_argument("--header-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                   help="the request line and headers must arrive within this, from the connection's opening or the "
                        "request's first byte; 408 and close after it, a silent new connection is just closed (default 10)")
    c.add_argument("--body-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                   help="the whole request body must arrive within this once the headers are in; 408 after (default 30)")
    c.add_argument("--max-header-bytes", type=size_arg, default=64 * 1024, metavar="SIZE",
                   help="largest request line + headers; 431 beyond (default 64KiB)")
    c.add_argument("--max-headers", type=positive_int, default=100, metavar="N", help="most header lines in a request; 431 beyond (default 100)")
    c.add_argument("--limit-concurrency", type=positive_int, default=1000, metavar="N",
                   help="open connections + requests before new requests get 503 (default 1000)")
    r = p.add_argument_group("Ray Serve: several replicas behind one endpoint (needs `pip install 'quill[ray]'`)")
    r.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: each replica is a quill engine, requests routed by prompt prefix "
                        "(docs/SCALING.md)")
    r.add_argument("--replicas", type=positive_int, default=None, metavar="N", help="replicas to run (default 1)")
    r.add_argument("--max-replicas", type=positive_int, default=None, metavar="N",
                   help="autoscale between --replicas and N on ongoing requests per replica (default: no autoscaling)")
    r.add_argument("--target-ongoing-requests", type=positive_float, default=None, metavar="N",
                   help="autoscaling target: ongoing requests per replica (default 8)")
    r.add_argument("--max-ongoing-requests", type=positive_int, default=None, metavar="N",
                   help="requests one replica takes at once; the rest wait in Ray Serve (default 2 x --max-num-seqs)")
    r.add_argument("--router", choices=ROUTERS, default=None,
                   help="replica choice: prefix (quill's KV block hashes, default), pow2 (Ray's power of two choices), "
                        "round-robin, ray-prefix (Ray's PrefixCacheAffinityRouter, needs pyarrow)")
    r.add_argument("--route-imbalance", type=int, default=None, metavar="N",
                   help="prefix router: fall back to power of two choices when ongoing requests differ by more "
                        "than N between replicas (default 4)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join a running Ray cluster (e.g. 'auto' or 'ray://head:10001'; default: start one here)")
    t = p.add_argument_group("testing")
    t.add_argument("--enable-fault-injection", action="store_true",
                   help="for soak/fault tests only: honour the 'X-Quill-Fault: PHASE' request header, which makes "
                        "that request fail at that engine phase (off by default)")


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
    """The EngineConfig these flags describe."""
    config = engine_config_from_args(args, max_waiting=args.max_waiting)
    if getattr(args, "enable_fault_injection", False):
        config = dataclasses.replace(config, fault_injection=True)
    return config


RAY_ONLY_FLAGS = ("replicas", "max_replicas", "target_ongoing_requests", "max_ongoing_requests", "router",
                  "route_imbalance", "ray_address")


def run(args) -> int:
    from quill.server.runner import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not args.ray:
        given = [name for name in RAY_ONLY_FLAGS if getattr(args, name, None) is not None]
        if given:
            print(f"quill serve: --{given[0].replace('_', '-')} needs --ray", file=sys.stderr)
            return 2
    else:
        from quill.cluster.serve_cmd import run_ray  # only here: the single-process server never imports Ray

        return run_ray(args)
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
