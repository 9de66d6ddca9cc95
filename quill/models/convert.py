"""Convert any model quill loads (GGUF file, Hugging Face folder, optionally --quantize int8) to a .quill
file: build it as the loader does, record what the weight source returned, write, then verify."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quill.models import quillfile


@dataclass
class ConvertReport:
    path: Path
    source: Path
    layout: str
    file_bytes: int
    source_bytes: int
    tensors: int
    source_sha256: str
    data_sha256: str
    seconds: dict  # phase -> seconds: hash, build, write, verify


HASHED_FOLDER_FILES = ("*.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                       "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def folder_files(path: Path) -> list[Path]:
    """The files of a Hugging Face folder that decide what quill builds from it."""
    return sorted({f for pattern in HASHED_FOLDER_FILES for f in path.glob(pattern) if f.is_file()})


def source_sha256(path: Path, progress: bool = True) -> str:
    """sha256 of a GGUF file's bytes; of a folder, over each relevant file's name and sha256."""
    from tqdm import tqdm

    files = [path] if path.is_file() else folder_files(path)
    total = sum(f.stat().st_size for f in files)
    outer = hashlib.sha256()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"hashing {path.name}", file=sys.stderr, leave=False,
              disable=None if progress else True) as bar:
        for f in files:
            digest = hashlib.sha256()
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    digest.update(chunk)
                    bar.update(len(chunk))
            if path.is_file():
                return digest.hexdigest()
            outer.update(f"{f.name}\0{digest.hexdigest()}\n".encode())
    return outer.hexdigest()


def convert(source_path: str | Path | None, output: str | Path, quantize: str | None = None, layout: str = "auto",
            progress: bool = True, sha256: str | None = None) -> ConvertReport:
    """Write `output` (.quill) from a GGUF file or Hugging Face folder; verified before returning."""
    from quill import __version__
    from quill.kernels import native, options
    from quill.models.loader import build, open_source, quantize_for, resolve_model_path

    src = resolve_model_path(None if source_path is None else str(source_path))
    out = Path(output)
    if out.suffix != quillfile.SUFFIX:
        raise ValueError(f"the output must end in {quillfile.SUFFIX}, got {out.name!r}")
    if quillfile.is_quill_file(src):
        raise ValueError(f"{src.name} is already a .quill file; convert its source model instead")
    if native.load() is None:
        raise ValueError("quill convert writes the layouts of quill's CPU kernels, which are not available here "
                         "(x86-64 with AVX2/FMA and a C compiler are needed)")
    layout = quillfile.resolve_layout(layout)
    quantize = quantize_for(src, quantize)
    t = {"start": time.perf_counter()}
    sha = sha256 or source_sha256(src, progress)
    t["hash"] = time.perf_counter()
    # Build the portable objects (the files' own layouts: no tiling at load); the amx and vnni layouts tile
    # them while writing, as tiled.for_cpu would.
    with options.use(dataclasses.replace(options.current(), amx=False, retile=False)):
        source = open_source(src, "cpu", quantize)
        recorder = quillfile.RecordingWeights(source.weights)
        build(source, "cpu", context_len=1, weights=recorder)  # its RoPE tables are not recorded: the shortest
    t["build"] = time.perf_counter()
    tok = source.tokenizer
    metadata = {
        "quill.model_config": json.dumps(source.config.to_dict()),
        "quill.tokenizer_settings": json.dumps({"special_tokens": tok.special_tokens,
                                                "eos_token_ids": list(tok.eos_token_ids),
                                                "chat_template": tok.chat_template,
                                                "vocab_size": tok.vocab_size}),
        "quill.generation_config": json.dumps(source.generation_config),
        "quill.source": json.dumps({"name": src.name, "path": str(src.resolve()), "format": source.file_format,
                                    "sha256": sha, "bytes": source.file_bytes, "quantize": quantize}),
        "quill.tensor_types": json.dumps(dict(source.types)),
        "quill.created_by": f"quill {__version__}",
    }
    records = recorder.records + quillfile.rope_records(source.config)  # whole-context tables: mapped, not computed
    marks = {}

    def check(tmp: Path) -> None:  # before the rename: a file that fails never appears at `out`
        marks["write"] = time.perf_counter()
        verify(tmp, records, source, layout, progress)

    written = quillfile.write(out, records, metadata, tok.hf.to_str(), layout, progress, check=check)
    t["write"], t["verify"] = marks["write"], time.perf_counter()
    phases = ("hash", "build", "write", "verify")
    prev = ("start", *phases)
    return ConvertReport(out, src, layout, written.bytes, source.file_bytes, written.tensors, sha,
                         written.data_sha256, {p: t[p] - t[q] for p, q in zip(phases, prev)})


def verify(path: Path, records: list, source, layout: str, progress: bool = True) -> None:
    """Read the written file back: header and data checksums, then every object rebuilt from it against
    the one in memory (byte for byte), the config and the tokenizer."""
    qf = quillfile.QuillFile(path, check_cpu=False)  # an amx file is checked here, even where it cannot run
    qf.verify_data(progress)
    if qf.model_config() != source.config:
        raise quillfile.QuillFileError(f"{path.name}: the stored model config differs from the source's")

    def get(name):
        return None if name is None else qf.handle.get_tensor(name)

    for key, obj in records:
        rebuilt = quillfile.decode(qf.specs[key], get, None, layout)
        want = dict(quillfile.iter_tensors(obj, layout))
        got = dict(quillfile.iter_tensors(rebuilt))
        if want.keys() != got.keys() or not all(_same(want[k], got[k]) for k in want):
            raise quillfile.QuillFileError(f"{path.name}: {key} does not read back as written")
    tok, back = source.tokenizer, qf.tokenizer()
    probe = "Hello, world! 123 <think>ünïcödé</think>\n\tdone"
    if (back.encode(probe) != tok.encode(probe) or back.eos_token_ids != tok.eos_token_ids
            or back.vocab_size != tok.vocab_size or back.chat_template != tok.chat_template):
        raise quillfile.QuillFileError(f"{path.name}: the tokenizer does not read back as the source's")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
