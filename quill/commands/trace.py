"""`quill trace`: one request through the engine, printed step by step (and optionally as HTML)."""

from __future__ import annotations

import argparse

from quill.cli_args import add_engine_args, engine_config_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "trace", help="walk one request through the engine step by step",
        description="Prints tokenization, each prefill/decode step (positions, top-3, ms), the stop "
                    "condition and what happened to the KV blocks.")
    add_engine_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message via the chat template")
    p.add_argument("--max-tokens", "-n", type=int, default=16, help="tokens to generate (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--html", default=None, help="also write a self-contained HTML timeline to this file")
    p.add_argument("prompt", help="the prompt text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quill.llm import LLM
    from quill.sampling_params import SamplingParams
    from quill.trace import trace_request

    llm = LLM.from_engine_config(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    trace = trace_request(llm, args.prompt, params, chat=args.chat)
    print("\n".join(format_trace(trace)))
    if args.html:
        from quill.trace_html import render_html

        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_html(trace))
        print(f"\nwrote {args.html}")
    return 0


def _top(step) -> str:
    return ", ".join(f"{piece!r} {p:.2f}" for _, piece, p in step.top)


def format_trace(t) -> list[str]:
    lines = [f"== queue + tokenize: {len(t.prompt_tokens)} tokens, tokenize {t.tokenize_ms:.1f} ms, queue {t.queue_ms:.1f} ms"]
    lines.append("   " + " ".join(f"{piece!r}:{i}" for i, piece in t.prompt_tokens))
    for s in t.steps:
        start, end = s.positions
        if s.kind == "prefill":
            lines.append(f"== step {s.index} prefill: positions {start}..{end - 1} computed ({end - start}), "
                         f"{s.cached_positions} from the prefix cache, {s.ms:.1f} ms")
            if s.token_id is not None:
                lines.append(f"   first token {s.piece!r}:{s.token_id}   top-3: {_top(s)}")
            else:
                lines.append("   (chunk of a longer prompt: no token yet)")
        elif s.proposed:
            tok_id, piece = s.input_token
            guesses = " ".join(f"{p!r}" for _, p in s.proposed)
            lines.append(f"== step {s.index} decode + verify: input {piece!r}:{tok_id} and {len(s.proposed)} proposed "
                         f"tokens [{guesses}] at positions {start}..{start + len(s.proposed)}, one decode row each; "
                         f"{s.ms:.1f} ms")
            kept = " ".join(f"{p!r}:{t}" for t, p in s.tokens)
            rolled = "; the rejected positions' K/V rolled back" if s.accepted < len(s.proposed) else ""
            lines.append(f"   accepted {s.accepted} of {len(s.proposed)}, then its own pick -> {kept}   "
                         f"top-3 of the last: {_top(s)}{rolled}")
        else:
            tok_id, piece = s.input_token
            lines.append(f"== step {s.index} decode: input {piece!r}:{tok_id} gets its K/V now at position {start}; "
                         f"attention over {s.kv_positions} KV positions, {s.ms:.1f} ms")
            lines.append(f"   -> {s.piece!r}:{s.token_id}   top-3: {_top(s)}   (its K/V is written next step)")
    lines.append(f"== stop: {t.stop} -> finish_reason={t.finish_reason}")
    lines.append(f"== release: {t.blocks_freed} blocks freed, {t.blocks_cached} kept in the prefix cache "
                 f"({t.block_size} tokens per block)")
    lines.append(f"== text: {t.text!r}")
    return lines
