"""`quill bench accuracy`: top-1 agreement over teacher-forced tokens of a quantized model with its fp32 self
(--quantize int8), or of int8 activations with exact ones on the same weights (--activations int8)."""

from __future__ import annotations

import argparse

import torch

_TEXT = ("The history of science is full of surprises. Early astronomers tracked the planets by eye, "
         "chemists learned to weigh gases, and engineers built bridges that still stand today. ")


def register(subparsers) -> None:
    p = subparsers.add_parser("accuracy", help="top-1 agreement of --quantize int8 with fp32, or of --activations "
                                               "int8 with exact activations (teacher-forced)",
                              description="Runs the same tokens through the reference and the rounded model in one "
                                          "prefill each, and compares the argmax at every position. --quantize int8: "
                                          "the fp32 model against its int8-quantized weights. --activations int8: the "
                                          "same weights (any GGUF or folder) with exact fp32 activations against "
                                          "activations rounded to int8 per 32 (the opt-in `--activations int8`).")
    p.add_argument("--model", "-m", default=None,
                   help="--quantize: a Hugging Face folder with fp16/bf16/fp32 safetensors; --activations: any "
                        "model (default: the embedded one)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--quantize", choices=["int8"], default=None, help="compare int8 weights with fp32 (the default)")
    how.add_argument("--activations", choices=["int8"], default=None,
                     help="compare int8 activations with exact ones, on the same weights")
    p.add_argument("--tokens", type=int, default=512, help="teacher-forced tokens (default 512)")
    p.add_argument("--text-file", default=None, help="text to use (default: built-in English prose)")
    p.set_defaults(func=run)


def position_logits(loaded, token_ids: list[int], activations: str | None = None) -> torch.Tensor:
    """(T, V) logits for every position of one prefill, through the engine's own runner (activations: the
    engine's, see EngineConfig)."""
    from quill.config import CacheConfig, EngineConfig, SchedulerConfig
    from quill.engine.consistency import chunk_logits
    from quill.engine.engine import LLMEngine
    from quill.engine.sequence import Sequence
    from quill.sampling_params import SamplingParams

    n = len(token_ids)
    engine = LLMEngine(EngineConfig(activations=activations,
                                    cache=CacheConfig(num_blocks_override=n // 16 + 2, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=max(n, 64))), loaded)
    return chunk_logits(engine, Sequence("accuracy", token_ids, SamplingParams()), 0, n)


def run(args: argparse.Namespace) -> int:
    from quill.models.loader import load_model

    text = open(args.text_file).read() if args.text_file else _TEXT * 40
    if args.activations is None and args.model is None:
        print("error: --quantize compares a Hugging Face folder's fp32 weights with int8 ones: give --model")
        return 2
    reference = load_model(args.model)
    ids = reference.tokenizer.encode(text)[: args.tokens]
    if len(ids) < args.tokens:
        print(f"error: the text has only {len(ids)} tokens, fewer than --tokens {args.tokens}")
        return 2
    if args.activations:
        ref = position_logits(reference, ids, activations="exact")
        got = position_logits(reference, ids, activations=args.activations)
        _report(f"{args.activations} activations vs exact ({reference.name})", ref, got, len(ids))
        return 0
    quantize = args.quantize or "int8"
    ref = position_logits(reference, ids)
    ref_bytes = reference.model.resident_bytes()
    del reference
    quantized = load_model(args.model, quantize=quantize)
    got = position_logits(quantized, ids)
    _report(f"{quantize} vs fp32", ref, got, len(ids))
    print(f"resident weights: fp32 {ref_bytes / 2**20:.1f} MiB, {quantize} {quantized.model.resident_bytes() / 2**20:.1f} MiB")
    return 0


def _report(label: str, ref: torch.Tensor, got: torch.Tensor, n: int) -> None:
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    rel = ((got - ref).norm() / ref.norm()).item()
    print(f"{label} over {n} teacher-forced tokens: top-1 agreement {agree * 100:.1f}%, relative logit error {rel:.4f}")
