"""`quill memory`: weight bytes, KV bytes per token and how many users fit in a memory budget."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from quill.cli_args import parse_size
from quill.config import ModelConfig, resolve_kv_dtype

KV_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
TORCH_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}
DEFAULT_CONTEXTS = "2k,8k,32k,128k"
WEIGHT_SUFFIXES = ((".safetensors",), (".bin", ".pt", ".pth"))  # safetensors wins when both exist



@dataclass(frozen=True)
class ModelFootprint:
    """A model's shape and how many bytes its weights take, with where that figure came from."""

    name: str
    config: ModelConfig
    weight_bytes: int
    weight_source: str  # e.g. "file size" or "estimate: parameters x 2 bytes, bfloat16 from torch_dtype"
    file_format: str = "safetensors"  # "gguf" for a .gguf file: decides the engine's default KV dtype


def parse_contexts(text: str) -> list[int]:
    """'2k,8k,20000' -> [2048, 8192, 20000] (k = 1024 tokens)."""
    contexts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(k?)\s*", part, re.IGNORECASE)
        if not match or int(match.group(1)) == 0:
            raise ValueError(f"--contexts must be positive token counts like 2k,8k,20000, got {text!r}")
        contexts.append(int(match.group(1)) * (1024 if match.group(2) else 1))
    return contexts


def fmt_bytes(num_bytes: float) -> str:
    """Binary units with at most two decimals: '128 KiB', '2.44 GiB'."""
    value, unit = float(num_bytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"


def total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def dtype_bytes(hf_config: dict, source: str) -> tuple[int, str]:
    name = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if name is None:
        return 4, "float32 (no torch_dtype in the config: assumed)"
    name = str(name).removeprefix("torch.")
    if name not in TORCH_DTYPE_BYTES:
        raise ValueError(f"torch_dtype {name!r} in {source} is not one of {sorted(TORCH_DTYPE_BYTES)}")
    return TORCH_DTYPE_BYTES[name], f"{name} from torch_dtype"


def from_config_file(path: Path, folder: Path | None = None) -> ModelFootprint:
    """From config.json: weights are the folder's weight files, else parameters x torch_dtype bytes."""
    hf_config = json.loads(path.read_text())
    config = ModelConfig.from_hf_config(hf_config)
    for suffixes in WEIGHT_SUFFIXES if folder else ():
        files = [f for f in folder.iterdir() if f.is_file() and f.suffix in suffixes]
        if files:
            return ModelFootprint(folder.name, config, sum(f.stat().st_size for f in files),
                                  f"size of {len(files)} weight file(s)")
    size, dtype_note = dtype_bytes(hf_config, str(path))
    source = f"estimate: parameters x {size} bytes, {dtype_note}"
    return ModelFootprint(folder.name if folder else str(path), config, config.num_parameters * size, source)


def load_footprint(model: str | None, config_path: str | None) -> ModelFootprint:
    """Resolve --model (a .gguf or .quill file or an HF folder) or --config; neither means the default model."""
    if config_path is not None:
        path = Path(config_path).expanduser()
        if not path.is_file():
            raise ValueError(f"--config {config_path!r} is not a file")
        return from_config_file(path)
    from quill.models.default import default_model_path  # importlib.metadata: only when it is needed

    path = Path(model).expanduser() if model else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        from quill.models.gguf import GGUFModelFile

        return ModelFootprint(path.name, GGUFModelFile(path).model_config(), path.stat().st_size, "file size", "gguf")
    if path.is_file() and path.suffix == ".quill":
        from quill.models.quillfile import QuillFile

        qf = QuillFile(path, check_cpu=False)  # its config and resident bytes, wherever it can run
        origin = qf.json("quill.source", {}).get("format", "gguf")
        return ModelFootprint(path.name, qf.model_config(), path.stat().st_size, "file size (.quill: as resident)", origin)
    if path.is_file() and path.suffix == ".json":
        return from_config_file(path)
    if path.is_dir() and (path / "config.json").is_file():
        return from_config_file(path / "config.json", folder=path)
    raise ValueError(f"--model {str(path)!r} is neither a .gguf file, a .quill file nor a folder with config.json")


def report_lines(fp: ModelFootprint, budget: int, budget_source: str, kv_dtype: str,
                 kv_dtype_note: str, contexts: list[int], draft: ModelFootprint | None = None) -> list[str]:
    """The printed report: weights, KV per token, tokens in budget and users per context. A draft
    model (--draft-model) adds its weights, and its K/V to every token (the engine keeps both
    models' K/V in each block)."""
    cfg = fp.config
    kv_per_token = cfg.kv_bytes_per_token(KV_DTYPE_BYTES[kv_dtype])
    lines = [
        f"model       {fp.name} ({cfg.architecture}): {cfg.num_layers} layers, {cfg.num_heads} heads, "
        f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}, context {cfg.max_position_embeddings:,}",
        f"weights     {fmt_bytes(fp.weight_bytes)} ({fp.weight_source}; {cfg.num_parameters:,} parameters)",
        f"KV cache    {fmt_bytes(kv_per_token)} per token ({kv_per_token:,} bytes = 2 x {cfg.num_layers} layers x "
        f"{cfg.num_kv_heads} KV heads x {cfg.head_dim} head_dim x {KV_DTYPE_BYTES[kv_dtype]} bytes, {kv_dtype_note})",
    ]
    weight_bytes = fp.weight_bytes
    if draft is not None:
        d = draft.config
        draft_kv = d.kv_bytes_per_token(KV_DTYPE_BYTES[kv_dtype])
        weight_bytes += draft.weight_bytes
        kv_per_token += draft_kv
        lines.append(f"draft       {draft.name}: weights {fmt_bytes(draft.weight_bytes)} ({draft.weight_source}), K/V "
                     f"{fmt_bytes(draft_kv)} per token ({d.num_layers} layers x {d.num_kv_heads} KV heads x "
                     f"{d.head_dim} head_dim); below, both models' weights and K/V together")
    kv_budget = budget - weight_bytes
    capacity = max(kv_budget, 0) // kv_per_token
    if cfg.sliding_window:
        lines.append(f"windows     {cfg.window_layers} of {cfg.num_layers} layers attend only the last "
                     f"{cfg.sliding_window:,} positions; the paged cache still keeps their whole context "
                     "(blocks outside a window are not freed), so the figures below count every layer in full")
    if kv_budget < 0:
        lines.append(f"budget      {fmt_bytes(budget)} ({budget_source}): the weights exceed it by "
                     f"{fmt_bytes(-kv_budget)}, no room for a KV cache")
    else:
        lines.append(f"budget      {fmt_bytes(budget)} ({budget_source}), {fmt_bytes(kv_budget)} left after the weights")
    lines.append(f"capacity    {capacity:,} tokens of KV cache (activations and the runtime need some memory too)")
    lines += ["", f"{'context':<18}{'KV per user':>14}{'users in budget':>18}"]
    for context in contexts:
        per_user = kv_per_token * context
        note = f"   beyond the model's context of {cfg.max_position_embeddings:,}" \
            if context > cfg.max_position_embeddings else ""
        lines.append(f"{f'{context:,} tokens':<18}{fmt_bytes(per_user):>14}{capacity // context:>18,}{note}")
    return lines


def register(subparsers) -> argparse.ArgumentParser:
    """Add `memory` to the top-level `quill` subcommands."""
    parser = subparsers.add_parser(
        "memory",
        help="how much memory the weights and the KV cache need, and how many users fit",
        description="Print weight bytes, KV cache bytes per token (2 x layers x kv_heads x head_dim x bytes), "
                    "tokens that fit in a budget after the weights, and concurrent users per context length. "
                    "Without --model or --config it sizes the embedded default model.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="a .gguf or .quill file or a Hugging Face folder with config.json "
                                        "(weights: file sizes)")
    source.add_argument("--config", help="a config.json (weights: parameter count x torch_dtype bytes)")
    parser.add_argument("--budget", help="memory budget, e.g. 8GiB, 512MiB, 2GB or bytes (default: total RAM)")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPE_BYTES),
                        help="KV cache element type (default: what the engine's --kv-cache-dtype auto picks, "
                             "fp16 for a GGUF file and fp32 otherwise)")
    parser.add_argument("--draft-model", default=None, metavar="PATH",
                        help="a draft model for speculative decoding (quill serve --draft-model): its weights, and "
                             "its K/V for every token, are counted too")
    parser.add_argument("--contexts", default=DEFAULT_CONTEXTS,
                        help="context lengths for the users table, k = 1024 tokens (default %(default)s)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Entry point of `quill memory`; 2 on bad input."""
    try:
        budget = parse_size(args.budget) if args.budget else total_ram()
        contexts = parse_contexts(args.contexts)
        footprint = load_footprint(args.model, args.config)
        draft = load_footprint(args.draft_model, None) if args.draft_model else None
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    budget_source = f"--budget {args.budget}" if args.budget else "total RAM"
    kv_dtype = args.kv_dtype or resolve_kv_dtype("auto", footprint.file_format)
    kv_note = kv_dtype if args.kv_dtype else f"{kv_dtype}: the engine's default for this model, --kv-dtype to change"
    if kv_dtype == "int8":
        kv_note += "; per-block scales not counted"
    for line in report_lines(footprint, budget, budget_source, kv_dtype, kv_note, contexts, draft):
        print(line)
    return 0
