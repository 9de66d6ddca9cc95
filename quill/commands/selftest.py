"""`quill selftest`: thread set-up, model load, decode-vs-prefill agreement, and a known answer."""

from __future__ import annotations

import argparse
import os
import sys
import time

from quill.cli_args import add_model_arg

KNOWN_QUESTION = "What is the capital of France? Answer in one sentence."
KNOWN_ANSWER = "Paris"
# decode vs prefill, max |logit diff|: fp32 noise, or with an fp16 cache the fp16 rounding of K/V
# (an fp32-level difference in a key can land it on the other side of an fp16 rounding step)
TOLERANCE = {"fp32": 1e-3, "fp16": 5e-2}


def register(subparsers) -> None:
    p = subparsers.add_parser("selftest", help="check the engine end to end and exit 0 (ok) or 1 (failed)")
    add_model_arg(p)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from quill.config import CacheConfig, EngineConfig
    from quill.engine.consistency import prefill_vs_decode
    from quill.llm import LLM
    from quill.sampling_params import SamplingParams

    checks: list[tuple[str, bool, str]] = []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} CPUs visible, MKL {torch.backends.mkl.is_available()}")
    t0 = time.perf_counter()
    llm = LLM.from_engine_config(EngineConfig(model=args.model, threads=args.threads,
                                              cache=CacheConfig(kv_cache_memory=256 << 20)))
    engine = llm.engine
    print(f"loaded {engine.model_name} in {(time.perf_counter() - t0) * 1000:.0f} ms; "
          f"threads {engine.threads}; KV {engine.kv_cache.capacity_tokens:,} tokens")
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    a, b = prefill_vs_decode(engine, ids, len(ids) // 2)
    diff, tol = (a - b).abs().max().item(), TOLERANCE[engine.kv_cache_dtype]
    checks.append(("decode path == prefill path", diff < tol,
                   f"max |logit diff| {diff:.2e} (tolerance {tol}, {engine.kv_cache_dtype} KV cache)"))
    if args.model is None:
        out = llm.chat([{"role": "user", "content": KNOWN_QUESTION}], SamplingParams(temperature=0, max_tokens=32))[0]
        text = out.outputs[0].text
        checks.append((f"known answer ({KNOWN_ANSWER})", KNOWN_ANSWER in text, repr(text[:80])))
    leaked = engine.block_manager.num_used_blocks
    checks.append(("no KV blocks leaked", leaked == 0, f"{leaked} blocks in use after the checks"))
    for name, ok, detail in checks:
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}")
    failed = [c for c in checks if not c[1]]
    print("selftest passed" if not failed else f"selftest FAILED ({len(failed)} of {len(checks)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(model=None, threads=None)))
