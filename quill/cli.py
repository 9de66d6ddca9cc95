"""The `quill` command: serve, chat, generate, convert, info, selftest, trace, memory, bench."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """The whole command line. with_bench=False leaves out the bench verbs' own flags (their modules import
    httpx, numpy and more, a tenth of a second that every other command would pay at start)."""
    parser = argparse.ArgumentParser(
        prog="quill",
        description="quill: a small, measurable LLM inference engine and OpenAI-compatible server. "
                    "With no --model it runs the embedded SmolLM2-135M-Instruct (Q4_1 GGUF).",
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING; INFO shows per-request lines)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from quill import memory
    from quill.commands import chat, convert, generate, info, selftest, trace
    from quill.server import serve_cmd

    for module in (generate, chat, convert, info, selftest, serve_cmd, trace, memory):
        module.register(sub)
    bench = sub.add_parser("bench", help="benchmarks: serve (load generator), latency (engine vs llama.cpp), "
                                         "structured (constrained vs free decode), soak (storm + health check), "
                                         "synth (a real-shaped GGUF with random weights), coldstart (start-up time "
                                         "and memory)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    if with_bench:
        from quill.bench import accuracy, coldstart, latency, serve, soak, structured, synth

        for module in (serve, latency, structured, accuracy, soak, synth, coldstart):
            module.register(bench_sub)
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(with_bench="bench" in argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    level = getattr(args, "log_level", "WARNING")
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
