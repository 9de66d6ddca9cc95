"""Flags shared by every command that runs the engine, and how they become an EngineConfig."""

from __future__ import annotations

import argparse
import re

from quill.config import CacheConfig, EngineConfig, SchedulerConfig

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes; a clear error otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 2GiB, 512MiB, 4GB or a byte count")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="a .gguf file or a Hugging Face folder (config.json + *.safetensors); "
                        "default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model, threads, KV cache and scheduler flags."""
    add_model_arg(p)
    g = p.add_argument_group("engine")
    g.add_argument("--threads", type=positive_int, default=None, help="compute threads (default: physical cores)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache budget, e.g. 2GiB (default: 25%% of free RAM, at most 2 GiB)")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences per step (default 64)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=512,
                   help="token budget per step shared by decodes and prefill chunks (default 512)")
    g.add_argument("--max-model-len", type=positive_int, default=None, help="context limit (default: the model's)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn prefix caching off")
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")


def engine_config_from_args(args: argparse.Namespace, max_waiting: int | None = None) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        device=args.device,
        threads=args.threads,
        max_model_len=args.max_model_len,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            enable_prefix_caching=not args.no_prefix_cache,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_waiting=max_waiting,
        ),
    )


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
