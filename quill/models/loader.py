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
        raise FileNotFoundError(f"model path {model!r} does not exist (quill loads local GGUF files, .quill files or HF folders)")
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
    file_format: str  # "gguf" | "safetensors" | "quill"
    tensor_types: dict[str, int] = field(default_factory=dict)
    load_ms: float = 0.0
    file_bytes: int = 0
    origin_format: str = ""  # where the weights came from ("gguf" | "safetensors"; a .quill file's source's)
    quill_file: object = None  # the QuillFile a .quill model views (kept open while the model lives)
    load_phases: dict[str, float] = field(default_factory=dict)  # a .quill load: ms to map, tokenizer, model

    def __post_init__(self):
        self.origin_format = self.origin_format or self.file_format


@dataclass
class ModelSource:
    """A GGUF file or Hugging Face folder opened for building: its config, tokenizer and weight source."""

    config: ModelConfig
    weights: object  # a weight source: tensor / linear / embedding / tied_head (see models/llama.py)
    tokenizer: object
    path: Path
    file_format: str  # "gguf" | "safetensors"
    types: collections.Counter
    file_bytes: int
    generation_config: dict = field(default_factory=dict)


def _progress(total: int, desc: str):
    bar = tqdm(total=total, desc=desc, unit="layer", file=sys.stderr, leave=False, disable=None)
    return bar


def load_model(model: str | None = None, device: str = "cpu", quantize: str | None = None,
               context_len: int | None = None, cache_dir: str | Path | None = None) -> LoadedModel:
    """Load weights (with a progress bar) and the tokenizer; raises UnsupportedModelError clearly.
    context_len: the longest context to serve (default the model's): it sizes the RoPE tables and
    picks LongRoPE's short or long factors, as llama.cpp's context size does.
    cache_dir: convert a GGUF file or folder to a .quill file there on first use, and map that file
    on every later load (quill.models.model_cache)."""
    from quill.models import quillfile

    path = resolve_model_path(model)
    t0 = time.perf_counter()
    quantize = quantize_for(path, quantize)
    if quillfile.is_quill_file(path):
        loaded = load_quill(path, device, context_len)
    elif cache_dir is not None:
        from quill.models.model_cache import load_cached

        loaded = load_cached(path, Path(cache_dir).expanduser(), device, quantize, context_len)
    else:
        loaded = build(open_source(path, device, quantize), device, context_len)
    loaded.load_ms = (time.perf_counter() - t0) * 1000.0
    return loaded


def load_tokenizer(model: str | None = None):
    """The model's tokenizer and chat template without its weights (a GGUF file's metadata, a
    folder's tokenizer files, or a .quill file's stored copy): what a router needs to see a
    prompt's tokens as the engine will."""
    from quill.models import quillfile
    from quill.tokenizer import Tokenizer

    path = resolve_model_path(model)
    if quillfile.is_quill_file(path):
        return quillfile.QuillFile(path).tokenizer()
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf_file(path)


def quantize_for(path: Path, quantize: str | None) -> str | None:
    """--quantize as it applies to `path`: a folder's choice, checked; None for a GGUF or .quill file, whose
    weights are used as they are (with a warning when it was asked for)."""
    if quantize is not None and quantize not in ("int8",):
        raise ValueError(f"--quantize {quantize!r} is not supported; choose int8")
    if quantize is None or path.is_dir():
        return quantize
    why = ("holds converted weights (quill convert --quantize applies it)" if path.suffix == ".quill"
           else "is already quantized (its blocks are used as they are)")
    logger.warning("--quantize %s ignored: %s %s", quantize, path.name, why)
    return None


def open_source(path: Path, device: str = "cpu", quantize: str | None = None) -> ModelSource:
    """A GGUF file or Hugging Face folder, ready for `build` (or `quill convert`); `quantize` as
    `quantize_for` leaves it."""
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path, device)
    if path.is_dir() and (path / "config.json").exists():
        return _hf_source(path, device, quantize)
    raise UnsupportedModelError(f"{path} is neither a .gguf file, a .quill file nor a folder with config.json")


def build(source: ModelSource, device: str = "cpu", context_len: int | None = None, weights=None,
          name: str | None = None) -> LoadedModel:
    """Build the model from a source (layer by layer, with a progress bar); `weights` replaces the
    source's weight source (quill convert records through it)."""
    cfg = source.config
    bar = _progress(cfg.num_layers, f"loading {source.path.name}")
    model = LlamaForCausalLM(cfg, weights or source.weights, device=device, progress=lambda i: bar.update(1),
                             context_len=context_len)
    bar.close()
    return LoadedModel(cfg, model.to(device), source.tokenizer, source.path, name or model_display_name(source.path),
                       source.file_format, dict(source.types), file_bytes=source.file_bytes)


def load_quill(path: Path, device: str = "cpu", context_len: int | None = None, name: str | None = None) -> LoadedModel:
    """A .quill file: the header checked, the tensors viewed where they lie in the mapped file."""
    from quill.models.quillfile import QuillFile, QuillFileError, QuillWeights

    if device != "cpu":
        raise QuillFileError(f"{path.name} holds quill's CPU layouts; device {device!r} needs the source model")
    t0 = time.perf_counter()
    qfile = QuillFile(path)
    cfg = qfile.model_config()
    t1 = time.perf_counter()
    tokenizer = qfile.tokenizer()
    t2 = time.perf_counter()
    model = LlamaForCausalLM(cfg, QuillWeights(qfile), device=device, context_len=context_len)
    errors = model.shape_errors()
    if errors:
        raise QuillFileError(f"{path.name}: weights do not fit the stored config ({'; '.join(errors[:3])}): the file "
                             "is damaged or was not written by quill convert")
    t3 = time.perf_counter()
    source = qfile.json("quill.source", {})
    return LoadedModel(cfg, model, tokenizer, path, name or model_display_name(path), "quill",
                       qfile.json("quill.tensor_types", {}), file_bytes=path.stat().st_size,
                       origin_format=source.get("format", "gguf"), quill_file=qfile,
                       load_phases={"map": (t1 - t0) * 1000, "tokenizer": (t2 - t1) * 1000,
                                    "model": (t3 - t2) * 1000})


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
        from quill.kernels.packed import tied_head

        return tied_head(embedding, self.workspace)


class HalfFolderWeights:
    """A folder's bf16/fp16 matrices kept 16-bit, as GGUF's BF16/F16 blocks (32 values without a scale: the
    safetensors bytes as they lie, viewed, not copied, where one tensor is one linear), run by the block
    kernels (exact fp32 products of the stored weights); fp32 matrices, norms and biases come from the dense
    source as before."""

    def __init__(self, raw, dense):
        from quill.kernels.packed import Workspace

        self.raw, self.dense = raw, dense  # raw(name): the tensor as the file stores it
        self.workspace = Workspace()

    def _blocks(self, name: str):
        from gguf import GGMLQuantizationType as Q

        from quill.kernels.kquant import BlockWeight

        t = self.raw(name)
        qtype = {torch.bfloat16: Q.BF16, torch.float16: Q.F16}.get(t.dtype)
        if qtype is None or t.dim() != 2 or t.shape[1] % 32:
            return None
        return BlockWeight(qtype, t.contiguous().view(torch.uint8))

    def tensor(self, name: str) -> torch.Tensor:
        return self.dense.tensor(name)

    def linear(self, names: list[str], has_bias: bool):
        from quill.kernels.packed import PackedLinear, concat_rows

        blocks = [self._blocks(n + ".weight") for n in names]
        if any(b is None for b in blocks) or len({b.qtype for b in blocks}) != 1:
            return self.dense.linear(names, has_bias)
        bias = torch.cat([self.dense.get(n + ".bias").float() for n in names]) if has_bias else None
        return PackedLinear(concat_rows(blocks), bias, self.workspace)

    def embedding(self, name: str):
        from quill.kernels.packed import PackedEmbedding

        blocks = self._blocks(name)
        return PackedEmbedding(blocks) if blocks is not None else self.dense.embedding(name)

    def tied_head(self, embedding):
        from quill.kernels.packed import tied_head

        return tied_head(embedding, self.workspace)


def _gguf_source(path: Path, device: str) -> ModelSource:
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
    return ModelSource(cfg, weights, tok, path, "gguf", types, path.stat().st_size)


def _hf_source(path: Path, device: str, quantize: str | None = None) -> ModelSource:
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

    def raw(name: str) -> torch.Tensor:
        if name not in index:
            raise UnsupportedModelError(f"{path.name}: tensor {name!r} missing from safetensors")
        t = index[name].get_tensor(name)
        types[str(t.dtype).replace("torch.", "")] += 1
        return t

    def get(name: str) -> torch.Tensor:
        return raw(name).float().to(device)

    from quill.kernels import native

    weights = DenseWeights(get)
    if quantize == "int8":
        from quill.kernels.quantize import Int8Weights

        if device != "cpu" or native.load() is None:
            raise ValueError("--quantize int8 needs the CPU kernels (x86-64 with AVX2/FMA and gcc)")
        weights = Int8Weights(weights)
    elif device == "cpu" and native.load() is not None:  # bf16/fp16 matrices stay 16-bit, on the block kernels
        weights = HalfFolderWeights(raw, weights)
    generation = path / "generation_config.json"
    return ModelSource(cfg, weights, Tokenizer.from_hf_dir(path), path, "safetensors", types,
                       sum(f.stat().st_size for f in files),
                       json.loads(generation.read_text()) if generation.is_file() else {})
