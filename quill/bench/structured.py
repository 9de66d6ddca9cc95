"""`quill bench structured`: decode tok/s of a constrained batch against an unconstrained one."""

from __future__ import annotations

import argparse
import statistics
import time

# Long enough that every request runs to max_tokens inside the grammar.
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 200}},
    "required": ["items"],
}


def register(subparsers) -> None:
    p = subparsers.add_parser("structured", help="decode tok/s with JSON-schema constraints vs without",
                              description="Runs --batch constrained requests, then --batch unconstrained ones "
                                          "of the same length, and prints the decode tok/s of each and the ratio.")
    p.add_argument("--model", "-m", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--batch", type=int, default=8, help="requests per batch (default 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; medians are reported (default 3)")
    p.set_defaults(func=run)


def _decode_tps(engine, prompts, params) -> float:
    """Aggregate tok/s of the decode steps (after every prompt has its first token)."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{time.perf_counter_ns()}-{i}", ids, params)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    first = {s.seq_id: s.num_output_tokens for s in engine.scheduler.running}
    t0 = time.perf_counter()
    decoded = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                decoded += sum(len(c.token_ids) for c in out.outputs)
    elapsed = time.perf_counter() - t0
    return (decoded - sum(first.values())) / elapsed


def run(args: argparse.Namespace) -> int:
    from quill.config import CacheConfig, EngineConfig
    from quill.engine.engine import LLMEngine
    from quill.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, threads=args.threads,
                                    cache=CacheConfig(kv_cache_memory=512 << 20, enable_prefix_caching=False)))
    tok = engine.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": f"List {i + 5} animals as JSON."}]) for i in range(args.batch)]
    constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=args.max_tokens, json_schema=SCHEMA)
    free = SamplingParams(temperature=0.8, seed=1, max_tokens=args.max_tokens, ignore_eos=True)
    results = {"constrained": [], "unconstrained": []}
    _decode_tps(engine, prompts, free)  # warm-up (kernels, grammar cache)
    _decode_tps(engine, prompts, constrained)
    for _ in range(args.repeats):  # interleaved so drift hits both alike
        results["constrained"].append(_decode_tps(engine, prompts, constrained))
        results["unconstrained"].append(_decode_tps(engine, prompts, free))
    c, u = (statistics.median(results[k]) for k in ("constrained", "unconstrained"))
    print(f"batch {args.batch}, {args.max_tokens} tokens each, median of {args.repeats}")
    print(f"constrained (JSON schema) decode   {c:8.1f} tok/s")
    print(f"unconstrained                      {u:8.1f} tok/s")
    print(f"ratio constrained / unconstrained  {c / u:8.2f}x")
    return 0
