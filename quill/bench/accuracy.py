"""`quill bench accuracy`: top-1 agreement of a quantized model with its fp32 self over teacher-forced tokens."""

from __future__ import annotations

import argparse

import torch

_TEXT = ("The history of science is full of surprises. Early astronomers tracked the planets by eye, "
         "chemists learned to weigh gases, and engineers built bridges that still stand today. ")


def register(subparsers) -> None:
    p = subparsers.add_parser("accuracy", help="top-1 agreement of --quantize int8 with fp32 (teacher-forced)",
                              description="Runs the same tokens through the fp32 model and the quantized one "
                                          "in one prefill each, and compares the argmax at every position.")
    p.add_argument("--model", "-m", required=True, help="a Hugging Face folder with fp16/bf16/fp32 safetensors")
    p.add_argument("--quantize", choices=["int8"], default="int8")
    p.add_argument("--tokens", type=int, default=512, help="teacher-forced tokens (default 512)")
    p.add_argument("--text-file", default=None, help="text to use (default: built-in English prose)")
    p.set_defaults(func=run)


def position_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """(T, V) logits for every position of one prefill, through the engine's own runner."""
    from quill.config import CacheConfig, EngineConfig, SchedulerConfig
    from quill.engine.consistency import chunk_logits
    from quill.engine.engine import LLMEngine
    from quill.engine.sequence import Sequence
    from quill.sampling_params import SamplingParams

    n = len(token_ids)
    engine = LLMEngine(EngineConfig(cache=CacheConfig(num_blocks_override=n // 16 + 2, enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=max(n, 64))), loaded)
    return chunk_logits(engine, Sequence("accuracy", token_ids, SamplingParams()), 0, n)


def run(args: argparse.Namespace) -> int:
    from quill.models.loader import load_model

    text = open(args.text_file).read() if args.text_file else _TEXT * 40
    reference = load_model(args.model)
    ids = reference.tokenizer.encode(text)[: args.tokens]
    if len(ids) < args.tokens:
        print(f"error: the text has only {len(ids)} tokens, fewer than --tokens {args.tokens}")
        return 2
    ref = position_logits(reference, ids)
    ref_bytes = reference.model.resident_bytes()
    del reference
    quantized = load_model(args.model, quantize=args.quantize)
    got = position_logits(quantized, ids)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    rel = ((got - ref).norm() / ref.norm()).item()
    print(f"{args.quantize} vs fp32 over {len(ids)} teacher-forced tokens: top-1 agreement {agree * 100:.1f}%, "
          f"relative logit error {rel:.4f}")
    print(f"resident weights: fp32 {ref_bytes / 2**20:.1f} MiB, {args.quantize} {quantized.model.resident_bytes() / 2**20:.1f} MiB")
    return 0
