"""quill's own weight file (`.quill`): the kernels' resident layout written once, loaded as an mmap.

The container is safetensors (https://github.com/huggingface/safetensors): an 8-byte header length, a
JSON header (string metadata under `__metadata__`, and each tensor's dtype, shape and byte range), then
the tensor bytes. safetensors' own reader (`safe_open`) checks every byte range against the file's
length and maps the file once; each tensor it gives out is a view of the mapped pages, so loading
copies nothing and two processes reading one file share its page-cache pages.

What quill adds, all inside that format:
  * alignment: tensor data starts on 64 bytes, 4 KiB for tensors of 64 KiB or more. safetensors
    allows no gaps between tensors, so the gaps are `U8` tensors named `__pad__.N` (never loaded);
  * the model as its weight source built it (`RecordingWeights`): each `tensor` / `linear` /
    `embedding` / `tied_head` call of `LlamaForCausalLM` and the object it returned (packed q4/q8,
    GGUF blocks, split projections, AMX tiles, dense fp32), described in `quill.structure` and
    rebuilt from views by `QuillWeights`: the same objects the source's loader makes, no conversion;
  * the RoPE cos/sin tables for the model's whole context (`RopeTables`), viewed instead of computed;
  * metadata: format version, CPU layout and the features it needs, the model config, the
    tokenizer's settings and chat template, the generation config, the source's name and sha256,
    and two checksums: `quill.header_sha256` (the header, with that value zeroed; checked at every
    load) and `quill.data_sha256` (every data byte; checked by `quill convert` after writing and by
    `quill info --verify`, never at load, which would read every page);
  * the tokenizer's tokenizer.json as a `U8` tensor (`tokenizer.json`), with its own sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from quill.config import ModelConfig, UnsupportedModelError

SUFFIX = ".quill"
# Raise when the structure or a layout changes; older readers then refuse, this one reads every version up to
# its own. 2: the vnni layout tiles Q8_0 too (version 1 files keep it packed, which still loads).
FORMAT_VERSION = 2
LAYOUTS = ("portable", "amx", "vnni")  # portable: packed / GGUF blocks / dense (AVX2+FMA+F16C kernels); amx: + 16x64
# tiles; vnni: the K-quants and Q8_0 as the same tiles for the VNNI kernels (kernels/tiled.py), the rest as portable
LAYOUT_FEATURES = {"portable": ("avx2", "fma", "f16c"), "amx": ("avx2", "fma", "f16c", "amx-int8"),
                   "vnni": ("avx2", "fma", "f16c", "avx512vnni")}
SMALL_ALIGN, LARGE_ALIGN, LARGE_TENSOR = 64, 4096, 64 * 1024
PAD_PREFIX = "__pad__."
TOKENIZER_TENSOR = "tokenizer.json"
_CHECKSUM_KEY = "quill.header_sha256"
_ZERO_SUM = "0" * 64
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8",
           torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


class QuillFileError(UnsupportedModelError):
    """A .quill file that this quill or this CPU cannot load: the message names what differs and the fix."""


# ---- recording what a weight source builds ------------------------------------------------------------


class RecordingWeights:
    """Wraps a weight source (PackedGGUFWeights, DenseWeights, Int8Weights) and keeps, in call order,
    each object it hands to the model: what a .quill file stores."""

    def __init__(self, inner):
        self.inner = inner
        self.records: list[tuple[str, object]] = []

    def _keep(self, key: str, obj):
        self.records.append((key, obj))
        return obj

    def tensor(self, name: str):
        return self._keep(_key("tensor", name), self.inner.tensor(name))

    def linear(self, names: list[str], has_bias: bool):
        return self._keep(_key("linear", *names, bias=has_bias), self.inner.linear(names, has_bias))

    def embedding(self, name: str):
        return self._keep(_key("embedding", name), self.inner.embedding(name))

    def tied_head(self, embedding):
        return self._keep(_key("tied_head"), self.inner.tied_head(embedding))


@dataclass
class RopeTables:
    """A model's cos/sin tables for one (base, scaling), for its whole context: stored so a load maps them
    (shared between processes, touched row by row) instead of computing 128k positions at every start."""

    theta: float
    scaling: tuple | None  # ModelConfig's frozen items
    cos: torch.Tensor
    sin: torch.Tensor


def rope_records(cfg: ModelConfig) -> list[tuple[str, RopeTables]]:
    """The tables of every distinct RoPE in a model, computed for its whole context (quill convert)."""
    from quill.models.rope import RotaryEmbedding

    keys = list(dict.fromkeys(k for k in (cfg.layer_rope(i) for i in range(cfg.num_layers)) if k is not None))
    out = []
    for n, (theta, scaling) in enumerate(keys):
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, dict(scaling) if scaling else None,
                               "cpu", cfg.rotary_dim)
        out.append((f"rope {n}", RopeTables(theta, scaling, rope.cos, rope.sin)))
    return out


def _frozen(scaling) -> tuple | None:
    """A scaling as JSON gave it back (lists) -> the config's frozen items (tuples)."""
    return None if scaling is None else tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling)


def _key(kind: str, *names: str, bias: bool = False) -> str:
    return " ".join((kind, ",".join(names), "bias" if bias else "")).strip()


class QuillWeights:
    """The weight source of a .quill file: each call returns the object recorded for it, rebuilt on views
    of the mapped file (a tensor stored once, such as a tied embedding and head, is one tensor)."""

    def __init__(self, qfile: "QuillFile"):
        from quill.kernels.packed import Workspace

        self.qfile = qfile
        self.workspace = Workspace()
        self.specs = qfile.specs
        self.layout = qfile.layout
        self._tensors: dict[str, torch.Tensor] = {}
        self._names = set(qfile.handle.keys())

    def _get(self, name: str | None) -> torch.Tensor | None:
        if name is None:
            return None
        if name not in self._names or name.startswith(PAD_PREFIX):
            raise QuillFileError(f"{self.qfile.path.name}: the structure names a tensor {name!r} the file lacks")
        if name not in self._tensors:
            self._tensors[name] = self.qfile.handle.get_tensor(name)
        return self._tensors[name]

    def _decode(self, key: str):
        return decode(self._spec(key), self._get, self.workspace, self.layout)

    def rope_tables(self, key: tuple, positions: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored cos/sin for a (base, scaling), cut to `positions` rows, where they equal what would be
        computed for that many (models/rope.tables_fit); None: compute them."""
        from quill.models.rope import tables_fit

        theta, scaling = key
        width = self.qfile.config.rotary_width
        for spec_key, spec in self.specs.items():
            if spec.get("t") != "rope" or spec.get("theta") != theta or _frozen(spec.get("scaling")) != scaling:
                continue
            tables = decode(spec, self._get, self.workspace)
            rows = tables.cos.shape[0]
            if tables.cos.shape[1] != width:
                raise QuillFileError(f"{self.qfile.path.name}: RoPE tables {spec_key!r} are {tables.cos.shape[1]} "
                                     f"wide; the model rotates {width} dims")
            if not tables_fit(dict(scaling) if scaling else None, rows, positions):
                return None
            return tables.cos[:positions], tables.sin[:positions]
        return None

    def _spec(self, key: str) -> dict:
        spec = self.specs.get(key)
        if spec is None:
            raise QuillFileError(f"{self.qfile.path.name} has no weights for {key!r}: it was written for another model "
                                 f"structure (format version {self.qfile.version}); re-run `quill convert`")
        return spec

    def tensor(self, name: str):
        return self._decode(_key("tensor", name))

    def linear(self, names: list[str], has_bias: bool):
        return self._decode(_key("linear", *names, bias=has_bias))

    def embedding(self, name: str):
        return self._decode(_key("embedding", name))

    def tied_head(self, embedding):
        return self._decode(_key("tied_head"))


# ---- objects <-> (structure, tensors) -----------------------------------------------------------------


class _TensorTable:
    """Tensors to write, named by where they sit; a tensor met again (a tied head) keeps its first name."""

    def __init__(self, layout: str):
        self.layout = layout  # amx / vnni: weights become tiles where tiled.for_cpu would tile them for that layout
        self.tensors: dict[str, torch.Tensor] = {}
        self._names: dict[tuple, str] = {}
        self._weights: dict[int, dict] = {}  # id(weight object) -> its spec: shared objects stay shared

    def put(self, name: str, t: torch.Tensor | None) -> str | None:
        if t is None:
            return None
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name here")
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if ident in self._names:
            return self._names[ident]
        if name in self.tensors:
            raise ValueError(f"two tensors named {name!r}")
        self.tensors[name] = t.detach().contiguous()
        self._names[ident] = name
        return name


def encode(obj, table: _TensorTable, name: str) -> dict:
    """One object a weight source returned -> its JSON spec (its tensors go into `table`)."""
    from quill.kernels.linear import DenseLinear
    from quill.kernels.packed import DenseEmbedding, PackedEmbedding, PackedLinear

    if isinstance(obj, torch.Tensor):
        return {"t": "tensor", "data": table.put(name, obj)}
    if isinstance(obj, DenseLinear):
        return {"t": "dense_linear", "weight": table.put(name + ".weight", obj.weight.data),
                "bias": table.put(name + ".bias", None if obj.bias is None else obj.bias.data)}
    if isinstance(obj, PackedLinear):
        return {"t": "packed_linear", "weight": _encode_weight(obj.weight, table, name + ".weight"),
                "bias": table.put(name + ".bias", obj.bias)}
    if isinstance(obj, PackedEmbedding):
        return {"t": "packed_embedding", "weight": _encode_weight(obj.weight, table, name + ".weight")}
    if isinstance(obj, DenseEmbedding):
        return {"t": "dense_embedding", "weight": table.put(name + ".weight", obj.weight.data)}
    if isinstance(obj, RopeTables):
        return {"t": "rope", "theta": obj.theta, "scaling": obj.scaling,
                "cos": table.put(name + ".cos", obj.cos), "sin": table.put(name + ".sin", obj.sin)}
    raise TypeError(f"{name}: a {type(obj).__name__} has no .quill encoding")


def _encode_weight(w, table: _TensorTable, name: str) -> dict:
    from quill.kernels.kquant import BlockWeight
    from quill.kernels.packed import PackedWeight, SplitWeight
    from quill.kernels.tiled import TiledWeight, tile_for_vnni, tile_weight

    original = id(w)  # a weight met again (a tied head) reuses its spec, tiled or not
    if original in table._weights:
        return table._weights[original]
    if table.layout == "amx" and isinstance(w, (PackedWeight, BlockWeight)):
        w = tile_weight(w) or w  # exactly tiled.for_cpu's rule, split parts too
    elif table.layout == "vnni" and isinstance(w, (PackedWeight, BlockWeight)):
        w = tile_for_vnni(w) or w  # the K-quants and Q8_0, as tiled.for_cpu without AMX
    if isinstance(w, TiledWeight) or isinstance(w, PackedWeight):
        spec = {"t": "tiled" if isinstance(w, TiledWeight) else "packed", "kind": w.kind,
                "codes": table.put(name + ".codes", w.codes), "scale": table.put(name + ".scale", w.scale),
                "mins": table.put(name + ".mins", w.mins)}
        if isinstance(w, TiledWeight) and w.scale_d is not None:  # K-quant scales: int8 times fp16 factors
            spec.update(scale_d=table.put(name + ".scale_d", w.scale_d), mins_d=table.put(name + ".mins_d", w.mins_d))
        if isinstance(w, TiledWeight) and w.vnni:
            spec["vnni"] = True
    elif isinstance(w, BlockWeight):
        spec = {"t": "blocks", "qtype": w.qtype.name, "blocks": table.put(name + ".blocks", w.blocks)}
    elif isinstance(w, SplitWeight):
        spec = {"t": "split", "parts": [_encode_weight(p, table, f"{name}.{i}") for i, p in enumerate(w.parts)]}
    else:
        raise TypeError(f"{name}: a {type(w).__name__} weight has no .quill encoding")
    table._weights[original] = spec
    return spec


def decode(spec: dict, get: Callable[[str | None], torch.Tensor | None], workspace, layout: str = "amx"):
    """A spec and a tensor getter -> the object the source's weight source had built. Every tensor's dtype and
    shape is checked against its role first (the kernels take raw pointers: a mismatch must be a refusal, not
    a read past an array); tiles must be the file's `layout`'s (a portable file holds none)."""
    from quill.kernels.linear import DenseLinear
    from quill.kernels.packed import DenseEmbedding, PackedEmbedding, PackedLinear

    kind = spec.get("t")
    if kind == "tensor":
        return _checked(get(spec["data"]), torch.float32, 1, "a norm weight")
    if kind == "dense_linear":
        weight = _checked(get(spec["weight"]), torch.float32, 2, "a dense weight")
        return DenseLinear(weight, _bias(get(spec["bias"]), weight.shape[0]))
    if kind == "packed_linear":
        weight = _decode_weight(spec["weight"], get, layout)
        return PackedLinear(weight, _bias(get(spec["bias"]), weight.rows), workspace)
    if kind == "packed_embedding":
        return PackedEmbedding(_decode_weight(spec["weight"], get, layout))
    if kind == "dense_embedding":
        return DenseEmbedding(_checked(get(spec["weight"]), torch.float32, 2, "an embedding"))
    if kind == "rope":
        cos = _checked(get(spec["cos"]), torch.float32, 2, "a RoPE table")
        sin = _checked(get(spec["sin"]), torch.float32, 2, "a RoPE table", tuple(cos.shape))
        return RopeTables(spec["theta"], _frozen(spec.get("scaling")), cos, sin)
    raise QuillFileError(f"unknown object kind {kind!r} in the file's structure")


def _checked(t: torch.Tensor | None, dtypes, ndim: int, role: str, shape: tuple | None = None) -> torch.Tensor:
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    if t is None or t.dtype not in dtypes or t.dim() != ndim or (shape is not None and tuple(t.shape) != shape):
        got = "nothing" if t is None else f"{t.dtype} {tuple(t.shape)}"
        want = "/".join(str(d) for d in dtypes) + (f" {shape}" if shape is not None else f" with {ndim} dims")
        raise QuillFileError(f"the file's structure gives {role} {got}, not {want}: the file is damaged or was not "
                             "written by quill convert")
    return t


def _bias(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    return None if t is None else _checked(t, torch.float32, 1, "a bias", (rows,))


def _decode_weight(spec: dict, get, layout: str = "amx"):
    from gguf import GGMLQuantizationType

    from quill.kernels.kquant import BLOCK_BYTES, KINDS, BlockWeight
    from quill.kernels.packed import GROUP, PackedWeight, SplitWeight
    from quill.kernels.tiled import CHUNK, GROUP_WEIGHTS, ROWS, TILE_BYTES, VNNI_ONLY, TiledWeight

    kind = spec.get("t")
    if kind in ("packed", "tiled"):
        if spec.get("kind") not in (("q4", "q8") if kind == "packed" else TILE_BYTES):
            raise QuillFileError(f"unknown packed layout {spec.get('kind')!r} in the file's structure")
        q8 = spec["kind"] == "q8"
        code_type = torch.int8 if q8 else torch.uint8
        if kind == "packed":
            scale = _checked(get(spec["scale"]), torch.float32, 2, "a group scale")
            rows, groups = scale.shape
            codes = _checked(get(spec["codes"]), code_type, 2, "q4/q8 codes", (rows, groups * (GROUP if q8 else 16)))
            mins = get(spec["mins"])
            return PackedWeight(spec["kind"], codes, scale,
                                None if mins is None else _checked(mins, torch.float32, 2, "group mins", (rows, groups)))
        vnni = bool(spec.get("vnni"))
        if layout != ("vnni" if vnni else "amx"):
            raise QuillFileError(f"the file's structure holds {'VNNI' if vnni else 'AMX'} tiles but its layout is "
                                 f"{layout!r}")
        if not vnni and spec["kind"] in VNNI_ONLY:
            raise QuillFileError(f"AMX {spec['kind']} tiles in the file's structure (only the VNNI tiles read them)")
        if vnni and spec.get("scale_d") is None and spec["kind"] != "q8":
            raise QuillFileError(f"VNNI {spec['kind']} tiles without K-quant scales in the file's structure")
        kscales = spec.get("scale_d") is not None
        if kscales and q8 or not kscales and spec["kind"] not in ("q4", "q8"):  # q4 tiles come either way
            raise QuillFileError(f"{spec['kind']} tiles {'with' if kscales else 'without'} K-quant scales in the "
                                 "file's structure")
        scale = _checked(get(spec["scale"]), torch.int8 if kscales else (torch.float16, torch.float32), 3, "a tile scale")
        blocks, groups, _ = scale.shape
        cols = groups * GROUP_WEIGHTS[spec["kind"]]
        if scale.shape[2] != ROWS or cols % (256 if kscales or vnni else CHUNK):  # the VNNI tiles take 256 at a time
            raise QuillFileError(f"the file's structure gives tile scales of shape {tuple(scale.shape)}")
        codes = _checked(get(spec["codes"]), code_type, 3, "AMX tiles", (blocks, cols // CHUNK, TILE_BYTES[spec["kind"]]))
        mins = get(spec["mins"])
        mins = None if mins is None else _checked(mins, scale.dtype, 3, "tile mins", tuple(scale.shape))
        factors = lambda key: _checked(get(spec[key]), torch.float16, 3, "K-quant scale factors",  # noqa: E731
                                       (blocks, cols // 256, ROWS))
        if vnni and q8 and (mins is not None or scale.dtype != torch.float16):  # tiled.tile_for_vnni's Q8_0
            raise QuillFileError("VNNI q8 tiles with mins or without fp16 scales in the file's structure")
        if not kscales:
            return TiledWeight(spec["kind"], codes, scale, mins, vnni=vnni)
        has_min_factors = mins is not None or spec["kind"] == "q2"  # q2: its mins are the scale bytes' high nibbles
        return TiledWeight(spec["kind"], codes, scale, mins, factors("scale_d"),
                           factors("mins_d") if has_min_factors else None, vnni)
    if kind == "blocks":
        qtype = getattr(GGMLQuantizationType, str(spec.get("qtype")), None)
        if qtype not in KINDS:
            raise QuillFileError(f"block type {spec.get('qtype')!r} in the file's structure has no kernel here")
        blocks = _checked(get(spec["blocks"]), torch.uint8, 2, f"{qtype.name} blocks")
        if blocks.shape[1] == 0 or blocks.shape[1] % BLOCK_BYTES[qtype]:
            raise QuillFileError(f"{qtype.name} rows of {blocks.shape[1]} bytes are not whole blocks")
        return BlockWeight(qtype, blocks)
    if kind == "split":
        parts = [_decode_weight(p, get, layout) for p in spec.get("parts") or []]
        if not parts or len({p.cols for p in parts}) != 1:
            raise QuillFileError("a split projection in the file's structure has no parts or parts of different widths")
        return SplitWeight(parts)
    raise QuillFileError(f"unknown weight kind {kind!r} in the file's structure")


# ---- the CPU a layout needs ---------------------------------------------------------------------------


def cpu_features() -> set[str]:
    """This CPU's features that layouts name (from the kernels' probes and /proc/cpuinfo)."""
    from quill.kernels import native, options

    have: set[str] = set()
    if native.cpu_supported():  # what the kernels are compiled for: AVX2, FMA and F16C
        have |= set(LAYOUT_FEATURES["portable"])
    if options.hardware().amx:
        have.add("amx-int8")
    if options.hardware().vnni:
        have.add("avx512vnni")
    return have


def check_layout(layout: str, required: list[str], path: Path) -> None:
    """Refuse a layout this machine (or these kernel options) cannot run, naming what is missing."""
    from quill.kernels import native, tiled

    if layout not in LAYOUTS:
        raise QuillFileError(f"{path.name} uses CPU layout {layout!r}; this quill knows {', '.join(LAYOUTS)}: "
                             "upgrade quill or re-run `quill convert` here")
    missing = [f for f in required if f not in cpu_features()]
    if missing:
        raise QuillFileError(f"{path.name} was written for the {layout!r} CPU layout, which needs "
                             f"{', '.join(required)}; this CPU lacks {', '.join(missing)}. Re-run `quill convert` "
                             f"from the source model on this machine (or with --layout portable)")
    if native.load() is None:
        raise QuillFileError(f"{path.name} holds packed weights for quill's CPU kernels, which are not available "
                             "here (QUILL_DISABLE_NATIVE=1, or no C compiler); load the source model instead")
    if layout == "amx" and not tiled.available():
        raise QuillFileError(f"{path.name} holds AMX tiles, but AMX is turned off for this engine (QUILL_NO_AMX=1 "
                             "or amx=False); re-run `quill convert --layout portable`")
    if layout == "vnni" and not tiled.vnni_available():
        raise QuillFileError(f"{path.name} holds K-quant tiles for the VNNI kernels, which this engine does not run "
                             "(QUILL_NO_AVX512=1, or isa avx2); re-run `quill convert --layout "
                             "portable`")


def resolve_layout(name: str) -> str:
    """--layout: auto is amx where this machine's kernels would tile weights at load, else portable."""
    from quill.kernels import tiled

    if name == "auto":
        return "amx" if tiled.available() else "vnni" if tiled.vnni_available() else "portable"
    if name not in LAYOUTS:
        raise ValueError(f"--layout must be auto, {' or '.join(LAYOUTS)}; got {name!r}")
    return name


# ---- writing ------------------------------------------------------------------------------------------


@dataclass
class Written:
    bytes: int
    tensors: int
    data_sha256: str


def _align(nbytes: int) -> int:
    return LARGE_ALIGN if nbytes >= LARGE_TENSOR else SMALL_ALIGN


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def write(path: str | Path, records: list[tuple[str, object]], metadata: dict[str, str], tokenizer_json: str,
          layout: str, progress: bool = True, check: Callable[[Path], None] | None = None) -> Written:
    """Write records (from RecordingWeights) and metadata (string values) as one .quill file, atomically:
    a temporary file in the same folder, passed to `check` (which raises to reject it), then renamed, so a
    file at `path` is always complete and checked."""
    from tqdm import tqdm

    path = Path(path)
    table = _TensorTable(layout)
    structure = []
    for key, obj in records:
        kind, _, rest = key.partition(" ")
        name = f"{kind}.{rest}" if kind == "rope" else rest.split(" ")[0].replace(",", "+") or kind
        structure.append({"key": key, "obj": encode(obj, table, name)})
    tok_bytes = tokenizer_json.encode("utf-8")
    tensors = dict(table.tensors)
    tensors[TOKENIZER_TENSOR] = torch.frombuffer(bytearray(tok_bytes), dtype=torch.uint8)
    entries: dict[str, Any] = {}
    plan: list[tuple[int, torch.Tensor | None]] = []  # (pad bytes before, tensor)
    offset = pads = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        pad = (-offset) % _align(nbytes)
        if pad:
            entries[f"{PAD_PREFIX}{pads}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
            pads += 1
            offset += pad
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        plan.append((pad, t))
        offset += nbytes
    data_hash = hashlib.sha256()
    for pad, t in plan:
        data_hash.update(bytes(pad))
        data_hash.update(_raw(t))
    meta = dict(metadata)
    meta.update({
        "format": "quill", "quill.format_version": str(FORMAT_VERSION), "quill.layout": layout,
        "quill.cpu_features": ",".join(LAYOUT_FEATURES[layout]),
        "quill.structure": json.dumps(structure), "quill.tokenizer_sha256": hashlib.sha256(tok_bytes).hexdigest(),
        "quill.data_sha256": data_hash.hexdigest(), _CHECKSUM_KEY: _ZERO_SUM,
    })
    header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    header += b" " * ((-(8 + len(header))) % LARGE_ALIGN)  # data starts on a page boundary
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(f"the .quill header would be {len(header):,} bytes; safetensors reads at most {MAX_HEADER_BYTES:,}")
    header = _with_checksum(header)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    total = 8 + len(header) + offset
    try:
        with open(tmp, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}",
                                         file=sys.stderr, leave=False, disable=None if progress else True) as bar:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            bar.update(8 + len(header))
            for pad, t in plan:
                f.write(bytes(pad))
                f.write(_raw(t))
                bar.update(pad + t.numel() * t.element_size())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return Written(total, len(tensors), data_hash.hexdigest())


def _checksum_span(header: bytes) -> tuple[int, int]:
    marker = f'"{_CHECKSUM_KEY}":"'.encode()
    at = header.find(marker)
    if at < 0:
        return -1, -1
    start = at + len(marker)
    return start, start + 64


def _with_checksum(header: bytes) -> bytes:
    start, end = _checksum_span(header)
    digest = hashlib.sha256(header).hexdigest().encode()  # over the header with the value zeroed
    return header[:start] + digest + header[end:]


# ---- reading ------------------------------------------------------------------------------------------


def is_quill_file(path: Path) -> bool:
    return path.is_file() and path.suffix == SUFFIX


class QuillFile:
    """An opened .quill file: its header checked (length, checksum, version, layout), its tensors mapped."""

    def __init__(self, path: str | Path, check_cpu: bool = True):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        self.meta = self._read_metadata()
        try:  # what every load reads, parsed once; anything malformed is a refusal, never another exception
            self.specs: dict[str, dict] = {r["key"]: r["obj"] for r in json.loads(self.meta["quill.structure"])}
            self.config = ModelConfig.from_dict(json.loads(self.meta["quill.model_config"]))
            if not all(isinstance(s, dict) for s in self.specs.values()):
                raise TypeError("a structure entry is not an object")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise QuillFileError(f"{self.path.name}: unreadable metadata ({type(e).__name__}: {e}); "
                                 "re-run `quill convert`") from e
        try:
            self.handle = safe_open(str(self.path), framework="pt", device="cpu")
        except SafetensorError as e:  # byte ranges past the end, gaps, a bad dtype
            raise QuillFileError(f"{self.path.name} is damaged (truncated or corrupted: {e}); re-run `quill convert`") from e
        if check_cpu:
            check_layout(self.layout, self.required_features, self.path)

    def _read_metadata(self) -> dict[str, str]:
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise QuillFileError(f"{self.path.name} is {size} bytes: too short for a .quill header (truncated)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise QuillFileError(f"{self.path.name}: the header claims {n:,} bytes but the file has {size:,} "
                                     "(truncated or not a .quill file)")
            header = f.read(n)
        self.data_start = 8 + n  # the first tensor byte
        start, end = _checksum_span(header)
        if start < 0:
            raise QuillFileError(f"{self.path.name} has no {_CHECKSUM_KEY}: not a .quill file (quill convert writes one)")
        stored = header[start:end].decode("ascii", "replace")
        actual = hashlib.sha256(header[:start] + _ZERO_SUM.encode() + header[end:]).hexdigest()
        if stored != actual:
            raise QuillFileError(f"{self.path.name}: header checksum mismatch (stored {stored[:12]}…, computed "
                                 f"{actual[:12]}…): the file is corrupted; re-run `quill convert`")
        try:
            meta = json.loads(header)["__metadata__"]
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise TypeError("__metadata__ must map strings to strings")
        except (ValueError, KeyError, TypeError) as e:
            raise QuillFileError(f"{self.path.name}: unreadable header ({e})") from e
        if meta.get("format") != "quill":
            raise QuillFileError(f"{self.path.name} is a safetensors file but not a .quill file")
        text = meta.get("quill.format_version", "")
        version = int(text) if text.isdigit() else 0
        if version > FORMAT_VERSION:
            raise QuillFileError(f"{self.path.name} is .quill format version {version}; this quill reads up to "
                                 f"version {FORMAT_VERSION}: upgrade quill, or re-run `quill convert` with this one")
        if version < 1:
            raise QuillFileError(f"{self.path.name}: format version {meta.get('quill.format_version')!r} is not valid")
        return meta

    @property
    def version(self) -> int:
        return int(self.meta["quill.format_version"])  # checked to be digits when the header was read

    @property
    def layout(self) -> str:
        return self.meta.get("quill.layout", "?")

    @property
    def required_features(self) -> list[str]:
        return [f for f in self.meta.get("quill.cpu_features", "").split(",") if f]

    def json(self, key: str, default: Any = None) -> Any:
        text = self.meta.get(key)
        if text is None:
            return default
        try:
            return json.loads(text)
        except ValueError as e:
            raise QuillFileError(f"{self.path.name}: metadata {key} is not JSON ({e})") from e

    def model_config(self) -> ModelConfig:
        return self.config

    def tokenizer(self):
        from tokenizers import Tokenizer as Backend

        from quill.tokenizer import Tokenizer

        settings = self.json("quill.tokenizer_settings", {})
        if TOKENIZER_TENSOR not in self.handle.keys() or not isinstance(settings, dict):
            raise QuillFileError(f"{self.path.name} lacks its tokenizer; re-run `quill convert`")
        raw = self.handle.get_tensor(TOKENIZER_TENSOR).numpy().tobytes()
        if hashlib.sha256(raw).hexdigest() != self.meta.get("quill.tokenizer_sha256"):
            raise QuillFileError(f"{self.path.name}: the tokenizer's checksum does not match: the file is corrupted")
        return Tokenizer(Backend.from_str(raw.decode("utf-8")), special_tokens=settings.get("special_tokens", {}),
                         extra_eos_token_ids=tuple(settings.get("eos_token_ids", ())),
                         chat_template=settings.get("chat_template"), vocab_size=settings.get("vocab_size"))

    def tensor_names(self) -> list[str]:
        return [n for n in self.handle.keys() if not n.startswith(PAD_PREFIX)]

    def verify_data(self, progress: bool = True) -> str:
        """sha256 of every data byte, compared with the header's; QuillFileError on a mismatch."""
        from tqdm import tqdm

        start = self.data_start
        digest = hashlib.sha256()
        with open(self.path, "rb") as f, tqdm(total=self.path.stat().st_size - start, unit="B", unit_scale=True, file=sys.stderr,
                                             desc=f"verifying {self.path.name}", leave=False,
                                             disable=None if progress else True) as bar:
            f.seek(start)
            while chunk := f.read(1 << 24):
                digest.update(chunk)
                bar.update(len(chunk))
        actual, stored = digest.hexdigest(), self.meta.get("quill.data_sha256")
        if actual != stored:
            raise QuillFileError(f"{self.path.name}: data checksum mismatch (stored {str(stored)[:12]}…, computed "
                                 f"{actual[:12]}…): the weights are corrupted; re-run `quill convert`")
        return actual


def iter_tensors(obj, layout: str = "portable") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor an object (as a weight source returns it) holds, with its place (tiled as `layout`
    writes it): to compare two builds."""
    table = _TensorTable(layout)
    encode(obj, table, "x")
    yield from table.tensors.items()
