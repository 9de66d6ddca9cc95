"""Flags shared by every command that runs the engine, and how they become an EngineConfig."""

from __future__ import annotations

import argparse
import re

from quill.config import (KV_CACHE_DTYPE_CHOICES, SPECULATIVE_METHODS, CacheConfig, EngineConfig, SchedulerConfig,
                          SpeculativeConfig)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?)(b?)|b)?\s*$", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str, what: str = "size") -> int:
    """'8GiB', '512MiB', '2GB', '1.5 G' or a byte count; KiB/K/G are 1024-based, KB/GB 1000-based."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{what} must be a size like 8GiB, 512MiB, 2GB or a byte count, got {text!r}")
    number, prefix, binary, bytes_suffix = match.groups()
    multiplier = 1
    if prefix:
        base = 1000 if bytes_suffix and not binary else 1024  # "GB" is decimal; "GiB" and a bare "G" binary
        multiplier = base ** _POWERS[prefix.lower()]
    value = int(float(number) * multiplier)
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return value


def size_arg(text: str) -> int:
    """argparse type for sizes."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _finite_float(text: str, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value if zero_ok else 0 < value) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected {'a number of at least 0' if zero_ok else 'a positive number'}, "
                                         f"got {text!r}")
    return value


def positive_float(text: str) -> float:
    return _finite_float(text, zero_ok=False)


def non_negative_float(text: str) -> float:
    return _finite_float(text, zero_ok=True)


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="a .gguf file, a .quill file (quill convert) or a Hugging Face folder (config.json + "
                        "*.safetensors); default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model, threads, KV cache and scheduler flags."""
    add_model_arg(p)
    g = p.add_argument_group("engine")
    g.add_argument("--threads", type=positive_int, default=None, help="compute threads (default: physical cores)")
    g.add_argument("--kv-cache-memory", type=size_arg, default=None,
                   help="KV cache budget, e.g. 2GiB (default: 25%% of free RAM, at most 2 GiB)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                   help="KV cache element type; auto = fp16 for a GGUF file (as llama.cpp), fp32 for a "
                        "safetensors folder; attention math is fp32 either way (default auto)")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences per step (default 64)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                   help="token budget per step shared by decodes and prefill chunks (default 512)")
    g.add_argument("--max-model-len", type=positive_int, default=None, help="context limit (default: the model's)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")
    g.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="convert a .gguf file or folder to a .quill file in DIR on first use and map that file on "
                        "every later start (keyed by the source's sha256, format version and CPU layout; delete "
                        "DIR to clear it)")
    g.add_argument("--quantize", choices=["int8"], default=None,
                   help="int8: quantize an fp16/bf16/fp32 model's linear layers (per-32 group, symmetric) at load")
    g.add_argument("--activations", choices=["exact", "int8"], default=None,
                   help="int8: round each 32 activations to int8 with their own scale before the quantized "
                        "GEMV/GEMM (AVX-512 VNNI, else AVX2; Q4_K, Q5_K, Q6_K, IQ4_XS, Q4_0, Q4_1, Q5_1, Q8_0 weights; "
                        "as llama.cpp does), faster, not bit-exact: `quill bench accuracy` reports its top-1 "
                        "agreement; exact: fp32 activations (default exact, or QUILL_INT8_ACTIVATIONS=1)")


    g.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                   help="speculative decoding: ngram = propose the tokens that followed the last few tokens earlier "
                        "in the prompt or output; draft = a draft model's guesses (--draft-model or --draft-layers); "
                        "either is verified in one pass, and outputs are identical with it off, only speed changes "
                        f"(default {SpeculativeConfig.method}, or draft when a draft is given)")
    g.add_argument("--num-speculative-tokens", type=positive_int, default=SpeculativeConfig.num_tokens,
                   help="tokens proposed per sequence and step, at most; fewer when they are rarely accepted or "
                        "the batch is large (default %(default)s)")
    g.add_argument("--draft-model", default=None, metavar="PATH",
                   help="a smaller model with the same tokenizer (GGUF, folder or .quill) whose greedy guesses "
                        "are verified; its K/V takes part of --kv-cache-memory")
    g.add_argument("--draft-quantize", choices=["int8"], default=None,
                   help="int8: quantize the draft model's fp16/bf16/fp32 weights at load, so a folder model "
                        "can draft for itself (--draft-model SAME_FOLDER)")
    g.add_argument("--draft-layers", default=None, metavar="N|RANGES",
                   help="self-speculation: guess with the model's own first N layers, or those listed "
                        "(\"0-5,26-29\"), then its LM head; no extra memory")


def engine_config_from_args(args: argparse.Namespace, max_waiting: int | None = None) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        threads=args.threads,
        quantize=args.quantize,
        cache_dir=args.cache_dir,
        activations=args.activations,
        max_model_len=args.max_model_len,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=not args.no_prefix_cache,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_waiting=max_waiting,
        ),
        speculative=speculative_config(args),
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """--speculative, --num-speculative-tokens, --draft-model, --draft-layers, checked (a bad value
    exits naming the limit)."""
    try:
        return SpeculativeConfig.from_options(args.speculative, args.num_speculative_tokens, args.draft_model,
                                              args.draft_layers, args.draft_quantize)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=positive_int, default=256, help="tokens to generate (default 256)")
    g.add_argument("--temperature", "-t", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling (default 0.95)")
    g.add_argument("--top-k", type=int, default=40, help="0 = off (default 40)")
    g.add_argument("--min-p", type=float, default=0.05, help="0 = off (default 0.05)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="Hugging Face semantics (default 1.0 = off)")
    g.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def sampling_params_from_args(args: argparse.Namespace, **overrides):
    from quill.sampling_params import SamplingParams

    values = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=tuple(args.stop),
    )
    values.update(overrides)
    return SamplingParams(**values)
