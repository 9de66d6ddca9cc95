"""Find and load a model: the embedded default GGUF, any GGUF file, or a Hugging Face folder."""

from __future__ import annotations

import collections
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from quill.config import ModelConfig, UnsupportedModelError
from quill.models.default import DEFAULT_MODEL_NAME, default_model_path, default_model_path_or_none
from quill.models.llama import LlamaForCausalLM

logger = logging.getLogger("quill.models")

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


def load_model(model: str | None = None, device: str = "cpu", quantize: str | None = None,
               context_len: int | None = None) -> LoadedModel:
    """Load weights (with a progress bar) and the tokenizer; raises UnsupportedModelError clearly.
    context_len: the longest context to serve (default the model's): it sizes the RoPE tables and
    picks LongRoPE's short or long factors, as llama.cpp's context size does."""
    path = resolve_model_path(model)
    t0 = time.perf_counter()
    if quantize is not None and quantize not in ("int8",):
        raise ValueError(f"--quantize {quantize!r} is not supported; choose int8")
    if path.is_file() and path.suffix == ".gguf":
        if quantize is not None:
            logger.warning("--quantize %s ignored: %s is already quantized (its blocks are used as they are)",
                           quantize, path.name)
        loaded = _load_gguf(path, device, context_len)
    elif path.is_dir() and (path / "config.json").exists():
        loaded = _load_hf_folder(path, device, quantize, context_len)
    else:
        raise UnsupportedModelError(f"{path} is neither a .gguf file nor a folder with config.json")
    loaded.load_ms = (time.perf_counter() - t0) * 1000.0
    return loaded


class PackedGGUFWeights:
    """Layers straight from GGUF blocks: packed where a kernel exists, dense fp32 otherwise."""

    def __init__(self, gf, device: str, types: collections.Counter):
        from quill.kernels.packed import Workspace

        self.gf, self.device, self.types = gf, device, types
        self.workspace = Workspace()

    def _tensor(self, name: str):
        try:
            t = self.gf.tensor(name)
        except KeyError:
            raise UnsupportedModelError(f"{self.gf.path.name}: tensor {name!r} missing") from None
        self.types[t.qtype.name] += 1
        return t

    def _dense(self, t) -> torch.Tensor:
        from quill.kernels.dequant import dequantize

        return dequantize(t.raw, t.qtype, t.shape).to(self.device)

    def tensor(self, name: str) -> torch.Tensor:
        return self._dense(self._tensor(name))

    def linear(self, names: list[str], has_bias: bool):
        from quill.kernels.linear import DenseLinear
        from quill.kernels.packed import PackedLinear, concat_rows, pack_gguf
        from quill.kernels.tiled import for_cpu

        parts = [self._tensor(n + ".weight") for n in names]
        bias = torch.cat([self.tensor(n + ".bias") for n in names]) if has_bias else None
        packs = [pack_gguf(t.qtype, t.shape, t.raw) if self.device == "cpu" else None for t in parts]
        if all(p is not None for p in packs):  # one layout, or a split of the parts' own layouts
            return PackedLinear(for_cpu(concat_rows(packs)), bias, self.workspace)
        return DenseLinear(torch.cat([self._dense(t) for t in parts]).contiguous(), bias)

    def embedding(self, name: str):
        from quill.kernels.packed import DenseEmbedding, PackedEmbedding, pack_gguf
        from quill.kernels.tiled import for_cpu

        t = self._tensor(name)
        packed = pack_gguf(t.qtype, t.shape, t.raw) if self.device == "cpu" else None
        return PackedEmbedding(for_cpu(packed)) if packed is not None else DenseEmbedding(self._dense(t))

    def tied_head(self, embedding):
        from quill.kernels.linear import DenseLinear
        from quill.kernels.packed import PackedEmbedding, PackedLinear

        if isinstance(embedding, PackedEmbedding):
            return PackedLinear(embedding.weight, None, self.workspace)
        return DenseLinear(embedding.weight.data)


def _load_gguf(path: Path, device: str, context_len: int | None = None) -> LoadedModel:
    from quill.kernels import native
    from quill.models.gguf import GGUFModelFile
    from quill.models.llama import DenseWeights
    from quill.tokenizer import Tokenizer

    gf = GGUFModelFile(path)
    cfg = gf.model_config()
    gf.check_tensor_types()
    tok = Tokenizer.from_gguf_metadata(gf.tokenizer_metadata())
    types: collections.Counter = collections.Counter()
    weights = PackedGGUFWeights(gf, device, types)
    if device != "cpu" or native.load() is None:  # no kernels for this device: fp32 weights, torch ops
        weights = DenseWeights(weights.tensor)
    bar = _progress(cfg.num_layers, f"loading {path.name}")
    model = LlamaForCausalLM(cfg, weights, device=device, progress=lambda i: bar.update(1),
                             context_len=context_len)
    bar.close()
    return LoadedModel(cfg, model.to(device), tok, path, model_display_name(path), "gguf", dict(types),
                       file_bytes=path.stat().st_size)


def _load_hf_folder(path: Path, device: str, quantize: str | None = None, context_len: int | None = None) -> LoadedModel:
    from safetensors import safe_open

    from quill.models.llama import DenseWeights
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
    weights = DenseWeights(get)
    if quantize == "int8":
        from quill.kernels import native
        from quill.kernels.quantize import Int8Weights

        if device != "cpu" or native.load() is None:
            raise ValueError("--quantize int8 needs the CPU kernels (x86-64 with AVX2/FMA and gcc)")
        weights = Int8Weights(weights)
    model = LlamaForCausalLM(cfg, weights, device=device, progress=lambda i: bar.update(1),
                             context_len=context_len)
    bar.close()
    tok = Tokenizer.from_hf_dir(path)
    size = sum(f.stat().st_size for f in files)
    return LoadedModel(cfg, model.to(device), tok, path, path.name, "safetensors", dict(types), file_bytes=size)
