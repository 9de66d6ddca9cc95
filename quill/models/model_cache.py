"""--cache-dir: a GGUF file or Hugging Face folder converted to .quill on first use, mapped afterwards.

A cached file is named `<source name>-<first 16 hex of the source's sha256>-v<format version>-q<quill version>-
<layout>[-int8].quill`, so it is keyed by the source's content, the format and quill versions and the CPU layout
(and --quantize). Hashing a
multi-GB source at every start would cost seconds, so `index.json` in the folder remembers each source's
sha256 under its path, size, mtime and inode; a source that changed is hashed again. Clearing the cache is
deleting the folder (or any of its files); nothing else refers to them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from quill.models import quillfile

logger = logging.getLogger("quill.models")
INDEX = "index.json"


def _stat_key(path: Path) -> str:
    from quill.models.convert import folder_files

    files = [path] if path.is_file() else folder_files(path)
    parts = [str(path.resolve())]
    for f in files:
        st = f.stat()
        parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
    return "|".join(parts)


def _read_index(cache_dir: Path) -> dict:
    try:
        return json.loads((cache_dir / INDEX).read_text())
    except (OSError, ValueError):
        return {}


def _write_index(cache_dir: Path, index: dict) -> None:
    tmp = cache_dir / f".{INDEX}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
    os.replace(tmp, cache_dir / INDEX)  # atomic: a concurrent reader sees the old or the new index


def source_hash(path: Path, cache_dir: Path) -> str:
    """The source's sha256, from the index when its files are unchanged since it was hashed."""
    from quill.models.convert import source_sha256

    key = _stat_key(path)
    index = _read_index(cache_dir)
    if key in index:
        return index[key]
    sha = source_sha256(path)
    index = _read_index(cache_dir)  # re-read: another process may have added entries meanwhile
    index[key] = sha
    _write_index(cache_dir, index)
    return sha


def cached_path(path: Path, cache_dir: Path, sha: str, layout: str, quantize: str | None) -> Path:
    """<source>-<sha256 prefix>-v<format>-q<quill version>-<layout>[-int8].quill: a new quill converts again, so a
    loader fix that leaves the format version alone never serves an old conversion."""
    from quill import __version__

    stem = path.stem if path.is_file() else path.name
    return cache_dir / (f"{stem}-{sha[:16]}-v{quillfile.FORMAT_VERSION}-q{__version__}-{layout}"
                        f"{'-' + quantize if quantize else ''}.quill")


def load_cached(path: Path, cache_dir: Path, device: str, quantize: str | None, context_len: int | None):
    """Map the cached conversion of `path`, converting it first when it is missing or unreadable; `quantize`
    as loader.quantize_for leaves it (None for a GGUF file: one cached file per source, whatever the flag)."""
    from quill.kernels import native
    from quill.models.convert import convert
    from quill.models.loader import build, load_quill, model_display_name, open_source

    if device != "cpu" or native.load() is None:  # nothing to convert to: the source, loaded as without the flag
        logger.warning("--cache-dir ignored: .quill files hold quill's CPU kernels' layouts, and %s",
                       f"device {device!r} was asked for" if device != "cpu" else "the kernels are not available here")
        return build(open_source(path, device, quantize), device, context_len)
    cache_dir.mkdir(parents=True, exist_ok=True)
    sha = source_hash(path, cache_dir)
    target = cached_path(path, cache_dir, sha, quillfile.resolve_layout("auto"), quantize)
    name = model_display_name(path)
    if target.exists():
        try:
            return load_quill(target, device, context_len, name=name)
        except quillfile.QuillFileError as e:
            logger.warning("cached %s is unusable (%s); converting again", target.name, e)
    logger.warning("converting %s to %s (first use of this source with --cache-dir)", path.name, target)
    convert(path, target, quantize=quantize, sha256=sha)
    return load_quill(target, device, context_len, name=name)
