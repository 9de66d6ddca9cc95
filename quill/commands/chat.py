"""`quill chat`: an interactive multi-turn chat streamed to the terminal, with llama.cpp-style timings."""

from __future__ import annotations

import argparse
import sys

from quill.cli_args import add_engine_args, add_sampling_args, engine_config_from_args, sampling_params_from_args
from quill.commands.generate import format_timings


def register(subparsers) -> None:
    p = subparsers.add_parser("chat", help="interactive multi-turn chat in the terminal",
                              description="Type a message and press Enter. /reset clears the history, /exit quits.")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quill.engine.engine import freeze_heap
    from quill.llm import LLM

    llm = LLM.from_engine_config(engine_config_from_args(args))
    freeze_heap()  # the command owns its process
    params = sampling_params_from_args(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    print(f"quill chat — {llm.engine.model_name}. /reset clears, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(base)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        answer = _stream_answer(llm, history, params)
        if answer is None:
            history.pop()
            continue
        history.append({"role": "assistant", "content": answer})


def _stream_answer(llm, history: list[dict], params) -> str | None:
    last = None
    try:
        for out in llm.stream_chat(history, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            last = out
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return None
    except ValueError as e:  # admission / template errors: say so, keep the session
        print(f"error: {e}", file=sys.stderr)
        return None
    c = last.outputs[0]
    print()
    print(format_timings(c.metrics, c.finish_reason), file=sys.stderr)
    return c.text
