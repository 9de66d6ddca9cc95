"""`quill bench latency`: bandwidth, prefill and decode tok/s, roofline %, optionally vs llama.cpp."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from quill.config import KV_CACHE_DTYPE_CHOICES

PREFILL_LENGTHS = (128, 512, 2048)
DECODE_BATCHES = (1, 4, 16)
DECODE_CONTEXTS = (128, 1024)


def register(subparsers) -> None:
    p = subparsers.add_parser("latency", help="engine speed: bandwidth, prefill/decode tok/s, roofline (vs llama.cpp)",
                              description="Every figure is the median of --repeats runs in this one process.")
    p.add_argument("--model", "-m", default=None, help="GGUF file or HF folder (default: the embedded model)")
    p.add_argument("--threads", type=int, default=None, help="threads for quill and llama.cpp (default: physical cores)")
    p.add_argument("--vs", choices=["llama.cpp"], default=None, help="also measure llama-cpp-python on the same GGUF")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported (default 3)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per run (default 32)")
    p.add_argument("--prefill", default=",".join(map(str, PREFILL_LENGTHS)), help="prompt lengths (default 128,512,2048)")
    p.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)), help="decode batch sizes (default 1,4,16)")
    p.add_argument("--contexts", default=",".join(map(str, DECODE_CONTEXTS)), help="decode contexts (default 128,1024)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                   help="quill's KV cache element type (default auto: fp16 for a GGUF file, as llama.cpp keeps it)")
    p.add_argument("--skip-prefill", action="store_true",
                   help="decode figures only, over a KV cache whose context positions are marked computed without "
                        "running the prefill (their K/V are whatever the pool holds): a step reads exactly the bytes a "
                        "real context would, without minutes of prefill at long contexts; not with --vs")
    p.add_argument("--json", default=None, help="write all figures to this file")
    p.set_defaults(func=run)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"error: expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"error: expected positive integers, got {text!r}")
    return values


def measure_bandwidth(repeats: int, mib: int = 512) -> float:
    """GB/s of an all-threads sequential read of a buffer far larger than the caches."""
    import torch

    from quill.kernels import native

    buf = torch.rand(mib * 2**20 // 4)
    lib = native.load()
    times = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        if lib is not None:
            lib.quill_read_sum(buf.data_ptr(), buf.numel())
        else:
            buf.sum()
        times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / statistics.median(times) / 1e9


def run(args: argparse.Namespace) -> int:
    from quill.bench.quill_runner import QuillRunner

    prefill, batches, contexts = _ints(args.prefill), _ints(args.batches), _ints(args.contexts)
    if args.skip_prefill:
        if args.vs:
            print("quill bench latency: --skip-prefill measures quill alone; drop --vs", file=sys.stderr)
            return 2
        prefill = []
    quill = QuillRunner(args.model, args.threads, max(prefill + [c + args.decode_steps + 8 for c in contexts]),
                        max(batches), args.kv_cache_dtype, skip_prefill=args.skip_prefill)
    threads = quill.threads
    print(f"quill bench latency: {quill.model_name}, {threads} threads, median of {args.repeats}", file=sys.stderr)
    bandwidth = measure_bandwidth(args.repeats)
    report = {"model": quill.model_name, "threads": threads, "bandwidth_gbs": bandwidth,
              "weight_bytes": quill.weight_bytes, "kv_bytes_per_token": quill.kv_bytes_per_token,
              "kv_cache_dtype": quill.kv_cache_dtype, "quill": {}}
    tokens = quill.sample_tokens(max(prefill + contexts))
    report["quill"] = _measure(quill, tokens, prefill, batches, contexts, args)
    report["quill"]["gemv_kernel"] = quill.gemv_read_rate(max(args.repeats, 5))
    if args.vs == "llama.cpp":
        from quill.bench.llamacpp_ref import LlamaCppRunner

        ref = LlamaCppRunner(str(quill.model_path), threads, max(batches),
                             max(prefill + [c + args.decode_steps + 8 for c in contexts]))
        report["llama.cpp"] = _measure(ref, tokens, prefill, batches, contexts, args)
        ref.close()
    _print_report(report, prefill, batches, contexts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _measure(runner, tokens, prefill, batches, contexts, args) -> dict:
    out = {"prefill_tps": {}, "decode_tps": {}, "step_breakdown": {}}
    for n in prefill:
        out["prefill_tps"][str(n)] = runner.prefill_tps(tokens[:n], args.repeats)
    for ctx in contexts:
        for b in batches:
            out["decode_tps"][f"{b}x{ctx}"] = runner.decode_tps(tokens[:ctx], b, args.decode_steps, args.repeats)
            breakdown = getattr(runner, "last_breakdown", None)
            if breakdown:
                out["step_breakdown"][f"{b}x{ctx}"] = breakdown
    return out


def _print_report(r: dict, prefill, batches, contexts) -> None:
    bw = r["bandwidth_gbs"]
    has_ref = "llama.cpp" in r
    print(f"model {r['model']}, {r['threads']} threads; measured read bandwidth {bw:.2f} GB/s")
    print(f"bytes per decode step: weights {r['weight_bytes'] / 2**20:.1f} MiB + KV {r['kv_bytes_per_token'] / 1024:.1f} KiB x "
          f"context x batch ({r['kv_cache_dtype']} KV cache)")
    head = f"{'figure':<26}{'quill':>10}" + (f"{'llama.cpp':>12}{'ratio':>8}" if has_ref else "") + f"{'GB/s':>8}{'roofline':>10}"
    print(head)
    q = r["quill"]
    for n in prefill:
        _row(f"prefill {n} tok/s", q["prefill_tps"][str(n)], r, "prefill_tps", str(n), has_ref)
    for ctx in contexts:
        for b in batches:
            key = f"{b}x{ctx}"
            tps = q["decode_tps"][key]
            step_bytes = r["weight_bytes"] + b * ctx * r["kv_bytes_per_token"]
            gbs = tps / b * step_bytes / 1e9
            _row(f"decode b={b} ctx={ctx} tok/s", tps, r, "decode_tps", key, has_ref, gbs, gbs / bw)
    for key, bd in q.get("step_breakdown", {}).items():
        print(f"quill decode step {key}: {bd['step_ms']:.2f} ms = layers {bd['layers_ms']:.2f} + LM head "
              f"{bd['lm_head_ms']:.2f} + outside the model {bd['overhead_ms']:.2f} (scheduling, sampling, detokenizing)")
    kernel = q.get("gemv_kernel")
    if kernel:
        print(f"decode GEMV kernel alone, batch 1 ({kernel['layout']}): {kernel['weight_bytes'] / 2**20:.1f} MiB of "
              f"weights in {kernel['ms']:.2f} ms = {kernel['gbs']:.2f} GB/s, {kernel['gbs'] / bw * 100:.0f}% of the "
              f"measured bandwidth")
    if len(batches) > 1 and 1 in batches:
        for ctx in contexts:
            top = max(batches)
            print(f"batch {top} / batch 1 aggregate at ctx {ctx}: "
                  f"{q['decode_tps'][f'{top}x{ctx}'] / q['decode_tps'][f'1x{ctx}']:.2f}x")
    steps = q.get("step_breakdown", {})
    if len(contexts) > 1:
        short, long = min(contexts), max(contexts)
        for b in batches:
            a, z = steps.get(f"{b}x{short}"), steps.get(f"{b}x{long}")
            if not (a and z):
                continue
            extra = b * (long - short) * r["kv_bytes_per_token"]
            print(f"batch {b}, ctx {long} vs {short}: step +{z['step_ms'] - a['step_ms']:.2f} ms = layers "
                  f"{z['layers_ms'] - a['layers_ms']:+.2f} + LM head {z['lm_head_ms'] - a['lm_head_ms']:+.2f} + outside the "
                  f"model {z['overhead_ms'] - a['overhead_ms']:+.2f}; the extra K/V read ({extra / 2**20:.0f} MiB) takes "
                  f"{extra / bw / 1e6:.2f} ms at the measured bandwidth")


def _row(label, value, r, kind, key, has_ref, gbs=None, roof=None) -> None:
    line = f"{label:<26}{value:>10.1f}"
    if has_ref:
        ref = r["llama.cpp"][kind][key]
        line += f"{ref:>12.1f}{value / ref:>7.2f}x"
    if gbs is not None:
        line += f"{gbs:>8.2f}{roof * 100:>9.0f}%"
    print(line)
