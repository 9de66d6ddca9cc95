"""`quill bench latency`: bandwidth, prefill and decode tok/s, roofline %, optionally vs llama.cpp."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from quill.config import KV_CACHE_DTYPE_CHOICES, SpeculativeConfig

PREFILL_LENGTHS = (128, 512, 2048)
DECODE_BATCHES = (1, 4, 16)
DECODE_CONTEXTS = (128, 1024)


def register(subparsers) -> None:
    p = subparsers.add_parser("latency", help="engine speed: bandwidth, prefill/decode tok/s, roofline (vs llama.cpp)",
                              description="Every figure is the median of --repeats runs in this one process.")
    p.add_argument("--model", "-m", default=None, help="GGUF file or HF folder (default: the embedded model)")
    p.add_argument("--models", action="append", default=None, metavar="A.gguf,B.gguf",
                   help="several model files, comma-separated and/or the option repeated: each is measured in turn "
                        "with the same options (one model in memory at a time), then a table compares them: file "
                        "and resident weight size, prefill at the longest --prefill, decode b=1 and the largest "
                        "--batches at the smallest --contexts, their ratio, b=1 roofline (and quill / llama.cpp "
                        "with --vs); instead of --model")
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
    p.add_argument("--activations", choices=["exact", "int8"], default=None,
                   help="quill's activations in the quantized linears (see `quill serve --activations`; default "
                        "exact, or QUILL_INT8_ACTIVATIONS=1)")
    p.add_argument("--speculative", action="store_true",
                   help="instead of the figures above: decode tok/s at batch 1 with speculative decoding off and on "
                        "(prompt lookup), on a quoting workload and an open-ended one, with acceptance and a check "
                        "that both give the same tokens")
    p.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_tokens,
                   help="with --speculative: proposed tokens per step, at most (default %(default)s)")
    p.add_argument("--spec-tokens", type=int, default=256,
                   help="with --speculative: tokens generated per run (default 256)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="with --speculative: also measure a draft model's guesses (same tokenizer as --model)")
    p.add_argument("--draft-layers", default=None, metavar="N|RANGES",
                   help="with --speculative: also measure self-speculation with these layers of the model "
                        "(see `quill serve --draft-layers`)")
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
    """GB/s of an all-threads read of a buffer far larger than the caches (quill_read_sum): the roofline's
    bandwidth. The fastest of the reads, over the probe's forms (one stream per thread asked for ahead as
    the kernels ask for theirs; eight streams per thread with and without that), not their median: a
    roofline is what the machine can do, and on a shared host other load only slows a read (a median of 5
    gave 19.9 GB/s in one run and 28.0 in another on the same Intel Xeon, and quill's Q8_0 rows then read
    117% of the lower figure; on an AMD Zen 4 one stream per thread read 31-35 GB/s where the Q8_0 rows,
    several rows at a time, read 38)."""
    import torch

    from quill.kernels import native

    buf = torch.rand(mib * 2**20 // 4)
    lib = native.load()
    forms = [(1, 1), (8, 0), (8, 1)] if lib is not None else [None]
    times = []
    for _ in range(max(repeats, 5)):
        for form in forms:
            t0 = time.perf_counter()
            if form is not None:
                lib.quill_read_sum(buf.data_ptr(), buf.numel(), *form)
            else:
                buf.sum()
            times.append(time.perf_counter() - t0)
    return buf.numel() * 4 / min(times) / 1e9


def run(args: argparse.Namespace) -> int:
    if args.speculative:
        if args.vs or args.models:
            print("quill bench latency: --speculative measures quill alone, on one --model", file=sys.stderr)
            return 2
        from quill.bench.speculative import run_speculative

        return run_speculative(args)
    prefill, batches, contexts = _ints(args.prefill), _ints(args.batches), _ints(args.contexts)
    if args.skip_prefill:
        if args.vs:
            print("quill bench latency: --skip-prefill measures quill alone; drop --vs", file=sys.stderr)
            return 2
        prefill = []
    if args.models is not None:
        if args.model is not None:
            print("quill bench latency: give --model or --models, not both", file=sys.stderr)
            return 2
        try:
            models = model_list(args.models)
        except ValueError as e:
            print(f"quill bench latency: {e}", file=sys.stderr)
            return 2
        return _run_matrix(models, args, prefill, batches, contexts)
    report = measure_model(args.model, args, prefill, batches, contexts)
    _print_report(report, prefill, batches, contexts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def model_list(values: list[str]) -> list[str]:
    """--models, repeated and/or comma-separated -> the paths in order; each must be a file."""
    models = [m.strip() for v in values for m in v.split(",") if m.strip()]
    if not models:
        raise ValueError("--models needs at least one model file")
    missing = [m for m in models if not os.path.isfile(m)]
    if missing:
        raise ValueError(f"--models: not a file: {', '.join(missing)}")
    return models


def measure_model(model: str | None, args: argparse.Namespace, prefill, batches, contexts,
                  bandwidth: float | None = None) -> dict:
    """One model's figures: quill's, and with --vs llama.cpp's from the same file, both engines loaded at once
    and each figure's repeats alternated between them (_measure), so the two run under the same host
    conditions; both are freed before this returns."""
    from quill.bench.quill_runner import QuillRunner

    max_len = max(prefill + [c + args.decode_steps + 8 for c in contexts])
    quill = QuillRunner(model, args.threads, max_len, max(batches), args.kv_cache_dtype, skip_prefill=args.skip_prefill,
                        activations=args.activations)
    ref = None
    try:
        threads = quill.threads
        print(f"quill bench latency: {quill.model_name}, {threads} threads, {quill.activations} activations, median of "
              f"{args.repeats}" + (", alternating with llama.cpp" if args.vs else ""), file=sys.stderr)
        probes = {"start": [measure_bandwidth(args.repeats) if bandwidth is None else bandwidth], "decode": []}
        report = {"model": quill.model_name, "path": str(quill.model_path), "threads": threads,
                  "bandwidth_probes": probes, "weight_bytes": quill.weight_bytes, "file_bytes": quill.file_bytes,
                  "step_weight_bytes": quill.step_weight_bytes,
                  "kv_bytes_per_token": quill.kv_bytes_per_token, "kv_cache_dtype": quill.kv_cache_dtype,
                  "activations": quill.activations}
        runners = {"quill": quill}
        if args.vs == "llama.cpp":
            from quill.bench.llamacpp_ref import LlamaCppRunner

            runners["llama.cpp"] = ref = LlamaCppRunner(report["path"], threads, max(batches), max_len)
        tokens = quill.sample_tokens(max(prefill + contexts))
        report.update(_measure(runners, tokens, prefill, batches, contexts, args, probes["decode"]))
        report["quill"]["gemv_kernel"] = quill.gemv_read_rate(max(args.repeats, 5))
    finally:
        quill.close()
        if ref is not None:
            ref.close()
    report["bandwidth_gbs"] = max(v for side in probes.values() for v in side)
    return report


def _run_matrix(models: list[str], args: argparse.Namespace, prefill, batches, contexts) -> int:
    """Each model in turn with the same options (one model in memory at a time: quill's engine, and llama.cpp's
    with --vs), then the table of ratios. Each
    model's roofline is against the highest bandwidth probed during its own run (measure_model)."""
    bandwidth = measure_bandwidth(args.repeats)
    reports = []
    for i, model in enumerate(models, 1):
        print(f"quill bench latency: model {i} of {len(models)}: {model}", file=sys.stderr)
        reports.append(measure_model(model, args, prefill, batches, contexts, bandwidth))
        print(f"== {os.path.basename(model)} ==")
        _print_report(reports[-1], prefill, batches, contexts)
        print()
    rows = [matrix_row(r, prefill, batches, contexts) for r in reports]
    for line in format_matrix(rows, args.vs == "llama.cpp"):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": reports[0]["threads"], "bandwidth_gbs": max(r["bandwidth_gbs"] for r in reports), "prefill": prefill,
                       "batches": batches, "contexts": contexts, "models": reports, "matrix": rows}, f, indent=2)
    return 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _roofline(r: dict, tps: float, b: int, ctx: int) -> tuple[float, float]:
    """(GB/s, fraction of the measured bandwidth) of decode at batch b, context ctx: each step reads the
    weights once (an untied token embedding aside: only its tokens' rows) plus each row's K/V."""
    step_bytes = r["step_weight_bytes"] + b * ctx * r["kv_bytes_per_token"]
    gbs = tps / b * step_bytes / 1e9
    return gbs, gbs / r["bandwidth_gbs"]


def matrix_row(r: dict, prefill, batches, contexts) -> dict:
    """A model's row of the matrix: sizes, prefill at the longest prompt, decode b=1 and the largest batch at
    the smallest context, their ratio, b=1's roofline, and (with a llama.cpp report) quill / llama.cpp."""
    ctx, top = min(contexts), max(batches)
    n = max(prefill) if prefill else None

    def figures(side: dict) -> dict:
        pf = side["prefill_tps"].get(str(n)) if n else None
        b1, bt = side["decode_tps"].get(f"1x{ctx}"), side["decode_tps"][f"{top}x{ctx}"]
        return {"prefill_tps": pf, "decode_b1_tps": b1, "decode_top_tps": bt, "batch_over_b1": _ratio(bt, b1)}

    q = figures(r["quill"])
    row = {"model": os.path.basename(r["path"]), "file_bytes": r["file_bytes"], "resident_bytes": r["weight_bytes"],
           "resident_over_file": _ratio(r["weight_bytes"], r["file_bytes"]), "prefill_len": n, "context": ctx,
           "top_batch": top, **q,
           "roofline_b1": None if q["decode_b1_tps"] is None else _roofline(r, q["decode_b1_tps"], 1, ctx)[1]}
    if "llama.cpp" in r:
        ref = figures(r["llama.cpp"])
        row["vs_llama.cpp"] = {k: _ratio(q[k], ref[k]) for k in q}
    return row


def format_matrix(rows: list[dict], has_ref: bool) -> list[str]:
    """The compact table, one line per model; '-' for a figure not measured (no prefill, no batch 1)."""
    first = rows[0]
    n, ctx, top = first["prefill_len"], first["context"], first["top_batch"]

    def text(value, fmt: str, unit: str = "", scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, fmt) + unit

    # (title, the cell's text, the key of its quill / llama.cpp ratio or None)
    cols = [("file MiB", lambda r: text(r["file_bytes"], ".1f", scale=2**-20), None),
            ("resident MiB", lambda r: text(r["resident_bytes"], ".1f", scale=2**-20), None),
            ("res/file", lambda r: text(r["resident_over_file"], ".3f"), None),
            (f"prefill {n}" if n else "prefill", lambda r: text(r["prefill_tps"], ".1f"), "prefill_tps"),
            ("decode b=1", lambda r: text(r["decode_b1_tps"], ".1f"), "decode_b1_tps"),
            (f"decode b={top}", lambda r: text(r["decode_top_tps"], ".1f"), "decode_top_tps"),
            (f"b={top}/b=1", lambda r: text(r["batch_over_b1"], ".2f", "x"), "batch_over_b1"),
            ("roofline b=1", lambda r: text(r["roofline_b1"], ".0f", "%", 100), None)]
    table = [["model"], *([r["model"]] for r in rows)]
    for title, cell, key in cols:
        table[0].append(title)
        for line, r in zip(table[1:], rows):
            line.append(cell(r))
        if has_ref and key:
            table[0].append("vs l.cpp")
            for line, r in zip(table[1:], rows):
                line.append(text(r.get("vs_llama.cpp", {}).get(key), ".2f", "x"))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    what = f"prefill at {n} tokens, decode at context {ctx}" if n else f"decode at context {ctx}"
    lines = [f"matrix: tok/s, {what}; res/file = quill's resident weight bytes / the file's bytes"
             + ("; vs l.cpp = quill / llama.cpp" if has_ref else "")]
    for line in table:
        lines.append(f"{line[0]:<{widths[0]}}" + "".join(f"{c:>{w + 2}}" for c, w in zip(line[1:], widths[1:])))
    return lines


def _measure(runners: dict, tokens, prefill, batches, contexts, args, probes: list[float]) -> dict:
    """Each engine's figures ({name: figures}). Every figure's --repeats runs alternate between the engines
    (A B, B A, A B, ...: neither always goes first), and each engine's median is reported: on a shared host
    the read bandwidth moves from minute to minute (an AMD EPYC Zen 4 VM read 36 GB/s, then 64 a few minutes
    later), and measuring one engine after the other compared them under different conditions (a matrix
    had quill's 3B run at 36 GB/s and llama.cpp's at up to 60). For the same reason a context's decode batches
    take turns too, one run of each per round (b1 b16, b16 b1, ...), so a batch's ratio to batch 1 compares
    runs under the same conditions: measured one batch after the other, batch 1 of the same build read 31 to
    44 tok/s on one Zen 4 from run to run, and the ratio moved with it. The bandwidth probed before each
    decode figure's first run is appended to probes; the roofline is taken against the highest probe of the
    model's run."""
    out = {name: {"prefill_tps": {}, "decode_tps": {}, "step_breakdown": {}} for name in runners}

    def alternate(figure) -> dict[str, float]:
        values = {name: [] for name in runners}
        for i in range(args.repeats):
            for name in (list(runners) if i % 2 == 0 else list(reversed(runners))):
                values[name].append(figure(runners[name], i == 0))
        return {name: statistics.median(v) for name, v in values.items()}

    for n in prefill:
        for name, tps in alternate(lambda r, first: r.prefill_tps(tokens[:n], 1, warm=first)).items():
            out[name]["prefill_tps"][str(n)] = tps
    for ctx in contexts:
        runs = {(name, b): [] for b in batches for name in runners}
        for i in range(args.repeats):
            for b in (batches if i % 2 == 0 else list(reversed(batches))):
                if i == 0:
                    probes.append(measure_bandwidth(args.repeats))
                for name in (list(runners) if i % 2 == 0 else list(reversed(runners))):
                    runs[name, b].append(runners[name].decode_tps(tokens[:ctx], b, args.decode_steps, 1))
                    breakdown = getattr(runners[name], "last_breakdown", None)
                    if breakdown:
                        out[name]["step_breakdown"][f"{b}x{ctx}"] = breakdown
        for (name, b), values in runs.items():
            out[name]["decode_tps"][f"{b}x{ctx}"] = statistics.median(values)
    return out


def _print_report(r: dict, prefill, batches, contexts) -> None:
    bw = r["bandwidth_gbs"]
    has_ref = "llama.cpp" in r
    print(f"model {r['model']}, {r['threads']} threads, {r.get('activations', 'exact')} activations; measured read "
          f"bandwidth {bw:.2f} GB/s (the highest probe of this model's run)")
    ranges = [f"{side} {min(v):.1f}-{max(v):.1f}" for side, v in r["bandwidth_probes"].items() if v]
    print(f"read bandwidth probed (GB/s): {', '.join(ranges)}")
    step = r["step_weight_bytes"]
    table = f" ({r['weight_bytes'] / 2**20:.1f} MiB resident, less the untied token embedding)" if step != r["weight_bytes"] else ""
    print(f"bytes per decode step: weights {step / 2**20:.1f} MiB{table} + KV {r['kv_bytes_per_token'] / 1024:.1f} KiB x "
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
            gbs, roof = _roofline(r, tps, b, ctx)
            _row(f"decode b={b} ctx={ctx} tok/s", tps, r, "decode_tps", key, has_ref, gbs, roof)
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
