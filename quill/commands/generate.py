"""`quill generate`: one prompt (text on stdout, stats on stderr) or a JSONL batch of prompts."""

from __future__ import annotations

import argparse
import json
import sys

from quill.cli_args import add_engine_args, add_sampling_args, engine_config_from_args, sampling_params_from_args

_PARAM_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "logprobs",
               "logit_bias"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text for a prompt (or a JSONL file of prompts)",
        description="Prints only the generated text on stdout; timings go to stderr.",
    )
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message via the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--prompts-file", default=None,
                   help="JSONL: one object per line with 'prompt' or 'messages' plus sampling params; "
                        "runs them as one batch and writes one JSON line per request to stdout")
    p.add_argument("prompt", nargs="?", help="the prompt text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts_file is None):
        print("error: give a PROMPT or --prompts-file (exactly one)", file=sys.stderr)
        return 2
    from quill import coldstart

    torch_ms = coldstart.import_torch()
    from quill.engine.engine import freeze_heap
    from quill.llm import LLM

    import_ms = coldstart.process_age_ms()
    llm = LLM.from_engine_config(engine_config_from_args(args))
    freeze_heap()  # the command owns its process
    print(coldstart.line(import_ms, llm.engine.cold_start, coldstart.process_age_ms(), torch_ms), file=sys.stderr)
    if tip := coldstart.hint(llm.engine.cold_start):
        print(f"tip: {tip}", file=sys.stderr)
    if args.prompts_file:
        return _run_file(llm, args)
    params = sampling_params_from_args(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}]
        out = llm.chat(messages, params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    completion = out.outputs[0]
    sys.stdout.write(completion.text + "\n")
    sys.stdout.flush()
    print(format_timings(completion.metrics, completion.finish_reason), file=sys.stderr)
    return 0


def format_timings(m: dict, finish_reason: str | None) -> str:
    """llama.cpp-style summary lines."""
    def f(x, unit=""):
        return "n/a" if x is None else f"{x:.2f}{unit}"

    return (
        f"prompt: {m.get('prompt_tokens')} tokens ({m.get('cached_tokens')} cached), "
        f"{f(m.get('prompt_tps'))} tok/s, TTFT {f(m.get('ttft_ms'), ' ms')}\n"
        f"generated: {m.get('output_tokens')} tokens, {f(m.get('generation_tps'))} tok/s, "
        f"TPOT {f(m.get('tpot_ms'), ' ms')}, finish_reason={finish_reason}"
    )


def _run_file(llm, args: argparse.Namespace) -> int:
    from quill.sampling_params import ParamError, SamplingParams

    items = []
    with open(args.prompts_file) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                params = SamplingParams(**{k: v for k, v in obj.items() if k in _PARAM_KEYS})
            except (json.JSONDecodeError, ParamError, TypeError) as e:
                print(f"error: {args.prompts_file}:{lineno}: {e}", file=sys.stderr)
                return 2
            if ("prompt" in obj) == ("messages" in obj):
                print(f"error: {args.prompts_file}:{lineno}: give 'prompt' or 'messages'", file=sys.stderr)
                return 2
            items.append((obj, params))
    outputs = llm.generate_mixed([(o.get("prompt"), o.get("messages")) for o, _ in items], [p for _, p in items])
    for out in outputs:
        for c in out.outputs:
            print(json.dumps({
                "request_id": out.request_id, "index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                "output_tokens": len(c.token_ids), "timings": c.metrics,
            }, ensure_ascii=False))
    return 0
