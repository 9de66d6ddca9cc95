"""`quill info`: architecture, parameters, tensor types, context and KV bytes per token."""

from __future__ import annotations

import argparse

from quill.cli_args import add_model_arg


def register(subparsers) -> None:
    p = subparsers.add_parser("info", help="describe a model: shape, tensor types, KV bytes per token")
    add_model_arg(p)
    p.add_argument("--verify", action="store_true", help="a .quill file: also check the sha256 of every data byte")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from quill.models.loader import resolve_model_path
    from quill.models.quillfile import is_quill_file

    path = resolve_model_path(args.model)
    loaded = _quill_file_model(path) if is_quill_file(path) else None
    if loaded is None:
        from quill.models.loader import load_model

        loaded = load_model(args.model)
    info = describe(loaded)
    if getattr(args, "verify", False):
        if loaded.quill_file is None:
            raise ValueError("--verify checks a .quill file's data checksum; this model is not a .quill file")
        info["data sha256"] = f"{loaded.quill_file.verify_data()} (verified)"
    for key, value in info.items():
        print(f"{key:<22} {value}")
    return 0


def _quill_file_model(path):
    """A .quill file described from its header alone, on any CPU (an amx file too, where it cannot run)."""
    from types import SimpleNamespace

    from quill.models.loader import model_display_name
    from quill.models.quillfile import QuillFile

    qf = QuillFile(path, check_cpu=False)
    return SimpleNamespace(config=qf.model_config(), name=model_display_name(path), path=path, file_format="quill",
                           tensor_types=qf.json("quill.tensor_types", {}), file_bytes=path.stat().st_size,
                           quill_file=qf)


def describe(loaded) -> dict:
    c = loaded.config
    kv = c.kv_bytes_per_token(4)
    types = ", ".join(f"{k} x{v}" for k, v in sorted(loaded.tensor_types.items()))
    info = {
        "model": loaded.name,
        "path": str(loaded.path),
        "format": loaded.file_format,
        "architecture": c.architecture,
        "layer recipe": c.recipe_summary(),
        "parameters": f"{c.num_parameters:,} ({c.num_parameters / 1e6:.1f} M)",
        "file size": f"{loaded.file_bytes / 2**20:.1f} MiB",
        "tensor types": types,
        "layers": c.num_layers,
        "hidden size": c.hidden_size,
        "heads / kv heads": f"{c.num_heads} / {c.num_kv_heads} (head_dim {c.head_dim})",
        "vocab size": c.vocab_size,
        "context length": c.max_position_embeddings,
        "rope": f"theta {c.rope_theta:g}" + (f", scaling {_scaling(c.rope_scaling_dict)}" if c.rope_scaling else ""),
        "tied embeddings": c.tie_word_embeddings,
        "KV bytes per token": f"{kv:,} B = {kv / 1024:.1f} KiB fp32 "
                              f"(2 x {c.num_layers} layers x {c.num_kv_heads} kv heads x {c.head_dim} x 4 B); "
                              f"{c.kv_bytes_per_token(2) / 1024:.1f} KiB fp16",
        "quill runs": supported_summary(),
    }
    if loaded.quill_file is not None:
        info.update(quill_file_lines(loaded.quill_file))
    return info


def quill_file_lines(qf) -> dict:
    """What a .quill file says about itself: version, layout, source and checksums."""
    from quill.models.quillfile import QuillFileError, check_layout

    source = qf.json("quill.source", {})
    quantized = f", --quantize {source['quantize']}" if source.get("quantize") else ""
    try:
        check_layout(qf.layout, qf.required_features, qf.path)
        runs = "runs on this CPU"
    except QuillFileError as e:
        runs = f"does not run here: {e}"
    return {
        "quill format": f"version {qf.version}, written by {qf.meta.get('quill.created_by', '?')}",
        "CPU layout": f"{qf.layout} (needs {', '.join(qf.required_features)}; {runs})",
        "source": f"{source.get('name', '?')} ({source.get('format', '?')}{quantized}, "
                  f"{source.get('bytes', 0) / 2**20:.1f} MiB)",
        "source sha256": source.get("sha256", "?"),
        "header sha256": f"{qf.meta.get('quill.header_sha256')} (checked at load)",
    }


def supported_summary() -> str:
    """The architectures and tensor types quill loads, for `quill info` and refusals."""
    from quill.kernels.dequant import SUPPORTED_TYPES
    from quill.models.archs import ARCHITECTURES, GGUF_ARCHITECTURES, HF_ARCHITECTURES

    return (f"{'; '.join(spec.families for spec in ARCHITECTURES.values())} "
            f"(config.json {', '.join(HF_ARCHITECTURES)}; GGUF {', '.join(GGUF_ARCHITECTURES)}); "
            f"tensor types {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")


def _scaling(scaling: dict) -> str:
    """RoPE scaling in one line: per-frequency factors are summarized, not listed."""
    if scaling.get("rope_type") == "freq_factors":
        f = scaling["factors"]
        return f"per-frequency divisors from rope_freqs ({len(f)}, {min(f):g}..{max(f):g})"
    return str(scaling)
