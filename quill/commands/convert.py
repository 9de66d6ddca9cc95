"""`quill convert MODEL -o NAME.quill`: the kernels' layout written once, so later loads are an mmap."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="write a .quill file (weights in the kernels' layout; loads as an mmap)",
        description="Convert a GGUF file or Hugging Face folder to quill's own weight file: every weight already in "
                    "the layout the CPU kernels read, with the config, tokenizer and chat template, checksummed. "
                    "Loading it maps the file: nothing is decoded or copied, and processes share its pages.")
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--output", "-o", default=None, help="the .quill file to write (default: ./<model name>.quill)")
    p.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: quantize an fp16/bf16/fp32 folder's linear layers (as quill serve --quantize int8)")
    p.add_argument("--layout", choices=["auto", "portable", "amx", "vnni"], default="auto",
                   help="CPU layout: portable (AVX2/AVX-512 kernels: any x86-64 with AVX2+FMA+F16C), amx (q4/q8 "
                        "and K-quant weights as AMX tiles; loads only on CPUs with AMX-INT8), vnni (K-quant weights "
                        "as the VNNI kernels' tiles; loads only on CPUs with AVX-512 VNNI); auto: amx where this CPU "
                        "has it, else vnni where it has AVX-512 VNNI, else portable")
    p.add_argument("--force", action="store_true", help="overwrite the output if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quill.models.convert import convert
    from quill.models.loader import model_display_name, resolve_model_path
    from quill.memory import fmt_bytes

    source = resolve_model_path(args.model)
    out = Path(args.output) if args.output else Path.cwd() / f"{model_display_name(source)}.quill"
    if out.exists() and not args.force:
        raise ValueError(f"{out} exists; pass --force to overwrite it")
    r = convert(source, out, quantize=args.quantize, layout=args.layout)
    s = r.seconds
    print(f"wrote {r.path} ({fmt_bytes(r.file_bytes)}, {r.file_bytes / r.source_bytes:.2f}x the source's "
          f"{fmt_bytes(r.source_bytes)}; {r.tensors} tensors; layout {r.layout})")
    print(f"source sha256 {r.source_sha256}")
    print(f"data sha256   {r.data_sha256} (verified: checksums, every tensor read back, config, tokenizer)")
    print(f"time: hash {s['hash']:.1f} s, build {s['build']:.1f} s, write {s['write']:.1f} s, "
          f"verify {s['verify']:.1f} s")
    return 0
