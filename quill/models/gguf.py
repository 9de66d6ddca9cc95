"""GGUF metadata, tokenizer fields and tensors (Hugging Face names, HF row order) via the gguf package."""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from quill.config import ModelConfig, UnsupportedModelError
from quill.kernels.dequant import SUPPORTED_TYPES, dequantize
from quill.models.archs import GGUF_ARCHITECTURES, ArchSpec, for_gguf

if TYPE_CHECKING:
    import torch


# Arrays this long (vocabularies, merges) stay out of the generic metadata dict.
MAX_GENERIC_ARRAY_LEN = 1024

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors that describe the model rather than hold weights: read into ModelConfig, never loaded as layers.
ROPE_FREQS = "rope_freqs.weight"  # per-dimension RoPE frequency divisors (llama.cpp's Llama 3.1+ converter)
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"  # LongRoPE (Phi-3.5 / Phi-4-mini)
_CONFIG_TENSORS = {ROPE_FREQS, ROPE_LONG, ROPE_SHORT}


class GGUFTensor(NamedTuple):
    """One tensor as stored: raw block data in Hugging Face row order, shape in torch order."""

    hf_name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # (out_features, in_features) or (n,)
    raw: np.ndarray  # memory-mapped where possible; rows of blocks for quantized types


def hf_tensor_name(gguf_name: str, spec: ArchSpec | None = None) -> str:
    """Map a llama.cpp tensor name (blk.3.attn_q.weight) to its Hugging Face name; `spec` adds
    its family's own layer tensors (Qwen3's attn_q_norm, ...)."""
    if m := _LAYER_NAME.fullmatch(gguf_name):
        layer, kind, suffix = m.groups()
        module = (spec.gguf_layer_tensors.get(kind) if spec else None) or _LAYER_TENSORS.get(kind)
        if module:
            return f"model.layers.{layer}.{module}.{suffix}"
    else:
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL_TENSORS and suffix in ("weight", "bias"):
            return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def rope_unpermute_index(num_rows: int, num_heads: int) -> np.ndarray:
    """(num_rows,) int64: hf_rows = gguf_rows[index] undoes llama.cpp's q/k row interleave."""
    if num_heads <= 0 or num_rows % (2 * num_heads):
        raise UnsupportedModelError(f"cannot un-permute {num_rows} rows into {num_heads} heads of even size")
    half = num_rows // num_heads // 2
    # llama.cpp wrote HF row (h, j, i) (j = rotary half, i < head_dim/2) to GGUF row (h, i, j).
    return np.arange(num_rows).reshape(num_heads, half, 2).transpose(0, 2, 1).reshape(-1)


def _decode(part: np.ndarray) -> str:
    return part.tobytes().decode("utf-8", errors="replace")


def _field_value(field: ReaderField) -> Any:
    """Python value of one metadata field: str, int, float, bool or a (flat) list of them."""
    main, leaf = field.types[0], field.types[-1]
    if main == GGUFValueType.ARRAY:
        if leaf == GGUFValueType.STRING:
            return [_decode(field.parts[i]) for i in field.data]
        if not field.data:
            return []
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    if main == GGUFValueType.STRING:
        return _decode(field.parts[field.data[0]])
    value = field.parts[field.data[0]][0]
    if main == GGUFValueType.FLOAT32:
        return float(str(value))  # shortest decimal for the float32: 1e-05, not 9.99999974e-06
    return value.item()


def _array_len(field: ReaderField) -> int:
    return len(field.data) if field.types[0] == GGUFValueType.ARRAY else 0


class GGUFModelFile:
    """A memory-mapped GGUF file: metadata, tokenizer fields, ModelConfig and HF-named tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self._reader = GGUFReader(self.path, "r")
        except ValueError as e:  # bad magic, truncated header, unknown version
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from e

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key/value except long arrays (see tokenizer_metadata for the vocabulary)."""
        return {
            name: _field_value(field)
            for name, field in self._reader.fields.items()
            if _array_len(field) <= MAX_GENERIC_ARRAY_LEN
        }

    def get(self, key: str, default: Any = None) -> Any:
        """One metadata value of any length (long arrays included)."""
        field = self._reader.fields.get(key)
        return default if field is None else _field_value(field)

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "?")

    def tokenizer_metadata(self) -> dict[str, Any]:
        """All tokenizer.* keys: tokenizer.ggml.{model,pre,tokens,merges,token_type,scores,*_id,...}, chat
        template; and general.name, on which llama.cpp keys Phi-3's whitespace-swallowing special tokens."""
        return {
            name: _field_value(field)
            for name, field in self._reader.fields.items()
            if name.startswith("tokenizer.") or name == "general.name"
        }

    @cached_property
    def _tensors_by_hf_name(self) -> dict[str, Any]:
        spec = self.spec
        return {hf_tensor_name(t.name, spec): t for t in self._reader.tensors if t.name not in _CONFIG_TENSORS}

    @property
    def tensor_names(self) -> list[str]:
        """Hugging Face names of every tensor, in file order."""
        return list(self._tensors_by_hf_name)

    def _arch_key(self, name: str, default: Any = ...) -> Any:
        key = f"{self.architecture}.{name}"
        value = self.metadata.get(key, default)
        if value is ...:
            raise UnsupportedModelError(f"GGUF metadata lacks required key {key!r}")
        return value

    @property
    def spec(self) -> ArchSpec:
        """This file's family definition (quill.models.archs); UnsupportedModelError if none."""
        self._check_architecture()
        return for_gguf(self.architecture)

    def _check_architecture(self) -> str:
        if self.architecture not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {self.architecture!r}; quill runs {', '.join(GGUF_ARCHITECTURES)}"
            )
        return self.architecture

    def _vocab_size(self) -> int:
        vocab = self._arch_key("vocab_size", None)
        if vocab is None and "tokenizer.ggml.tokens" in self._reader.fields:
            vocab = _array_len(self._reader.fields["tokenizer.ggml.tokens"])
        if vocab is None:
            raise UnsupportedModelError(f"GGUF has neither {self.architecture}.vocab_size nor tokenizer.ggml.tokens")
        return int(vocab)

    def _f32_tensor(self, name: str) -> tuple[float, ...] | None:
        t = next((t for t in self._reader.tensors if t.name == name), None)
        if t is None:
            return None
        if GGMLQuantizationType(t.tensor_type) != GGMLQuantizationType.F32:
            raise UnsupportedModelError(f"{name} is {GGMLQuantizationType(t.tensor_type).name}; "
                                        "quill reads it as F32, as llama.cpp writes it")
        return tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))

    def _rope_scaling(self) -> tuple[tuple[str, object], ...] | None:
        factors = self._f32_tensor(ROPE_FREQS)
        if factors is not None:
            # llama.cpp's converter writes Llama 3.1+ "llama3" scaling as one divisor per rotary
            # frequency (1 for short wavelengths, the factor for long ones, smooth in between), and
            # llama.cpp divides each frequency by it: the same inv_freq as transformers' llama3 rule.
            return (("factors", factors), ("rope_type", "freq_factors"))
        long, short = self._f32_tensor(ROPE_LONG), self._f32_tensor(ROPE_SHORT)
        if long is not None or short is not None:
            if long is None or short is None:
                raise UnsupportedModelError(f"GGUF has only one of {ROPE_LONG} and {ROPE_SHORT}; LongRoPE needs both")
            # Phi-3.5 / Phi-4-mini: llama.cpp picks the long factors when its context is longer than
            # rope.scaling.original_context_length, and multiplies cos/sin by rope.scaling.attn_factor.
            original = self._arch_key("rope.scaling.original_context_length", None)
            if original is None:
                raise UnsupportedModelError("GGUF LongRoPE factors without rope.scaling.original_context_length")
            scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                       "original_max_position_embeddings": int(original),
                       "max_position_embeddings": int(self._arch_key("context_length", original))}
            attn = self._arch_key("rope.scaling.attn_factor", None)
            if attn is not None:
                scaling["attention_factor"] = float(attn)
            return tuple(sorted(scaling.items()))
        scaling_type = self._arch_key("rope.scaling.type", None)
        if scaling_type in (None, "none"):
            return None
        if scaling_type == "linear":
            return (("factor", float(self._arch_key("rope.scaling.factor"))), ("rope_type", "linear"))
        if scaling_type == "yarn":  # Qwen2.5 / Qwen3 long context, as the converter writes it
            scaling = {"rope_type": "yarn", "factor": float(self._arch_key("rope.scaling.factor")),
                       "original_max_position_embeddings": int(self._arch_key("rope.scaling.original_context_length"))}
            for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
                if self._arch_key(key, None) is not None:
                    scaling[name] = float(self._arch_key(key))
            return tuple(sorted(scaling.items()))
        raise UnsupportedModelError(f"unsupported GGUF rope scaling type {scaling_type!r}; quill applies none, "
                                    f"linear, yarn, Llama 3's {ROPE_FREQS} and LongRoPE's {ROPE_LONG} / {ROPE_SHORT}")

    def _eos_token_ids(self) -> tuple[int, ...]:
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        ids: list[int] = []
        for key in keys:
            token_id = self.metadata.get(key)
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
        return tuple(ids)

    def model_config(self) -> ModelConfig:
        """ModelConfig from the {arch}.* keys, tokenizer ids, which tensors exist and the family's definition."""
        spec = self.spec
        hidden = int(self._arch_key("embedding_length"))
        num_heads = int(self._arch_key("attention.head_count"))
        head_dim = int(self._arch_key("attention.key_length", None) or hidden // num_heads)
        rotary = int(self._arch_key("rope.dimension_count", head_dim))
        tensor_names = {t.name for t in self._reader.tensors}
        fields = dict(
            architecture=spec.name,
            vocab_size=self._vocab_size(),
            hidden_size=hidden,
            intermediate_size=int(self._arch_key("feed_forward_length")),
            num_layers=int(self._arch_key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(self._arch_key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(self._arch_key("context_length", 2048)),
            rms_norm_eps=float(self._arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._arch_key("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            rotary_dim=0 if rotary == head_dim else rotary,
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
            sliding_window=int(self._arch_key("attention.sliding_window", 0)) or None,  # 0: none (Phi-4's converter writes 0)
            qk_norm=spec.qk_norm,
            norm_layout=spec.norm_layout,
            hidden_act=spec.hidden_act,
            final_logit_softcapping=self._arch_key("final_logit_softcapping", None),
            **{s.field: float(self._arch_key(s.gguf_key, s.default)) for s in spec.scalars},
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=self._eos_token_ids(),
        )
        if spec.gguf_config is not None:
            fields.update(spec.gguf_config(self._arch_key, fields))
        return ModelConfig(**fields)

    def check_tensor_types(self) -> None:
        """Raise UnsupportedModelError naming the first tensor whose type quill cannot dequantize."""
        for t in self._reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
                raise UnsupportedModelError(
                    f"tensor {t.name!r} has unsupported type {t.tensor_type.name}; quill reads {names}"
                )

    def _row_heads(self, gguf_name: str) -> int | None:
        """Heads to un-permute by for llama q/k tensors; None for tensors stored in HF order."""
        if not self.spec.gguf_permutes_qk:
            return None  # stored in Hugging Face row order (qwen2, qwen3)
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        num_heads, num_kv_heads = self._head_counts
        return {"attn_q": num_heads, "attn_k": num_kv_heads}.get(kind)

    @cached_property
    def _head_counts(self) -> tuple[int, int]:
        num_heads = int(self._arch_key("attention.head_count"))
        return num_heads, int(self._arch_key("attention.head_count_kv", num_heads))

    def _load(self, reader_tensor) -> GGUFTensor:
        shape = tuple(int(n) for n in reversed(reader_tensor.shape.tolist()))  # GGUF lists ne0 first
        raw = reader_tensor.data
        heads = self._row_heads(reader_tensor.name)
        if heads is not None:
            # Blocks run along columns, so whole rows (even of packed data) can be moved.
            rows = shape[0]
            raw = raw.reshape(rows, -1)[rope_unpermute_index(rows, heads)].reshape(raw.shape)
        qtype = GGMLQuantizationType(reader_tensor.tensor_type)
        return GGUFTensor(hf_tensor_name(reader_tensor.name, self.spec), qtype, shape, raw)

    def iter_tensors(self) -> Iterator[GGUFTensor]:
        """Every weight tensor in file order, renamed and (llama q/k) row-reordered to Hugging Face
        layout (tensors read into the config, such as rope_freqs, are left out)."""
        self._check_architecture()
        for reader_tensor in self._reader.tensors:
            if reader_tensor.name not in _CONFIG_TENSORS:
                yield self._load(reader_tensor)

    def tensor(self, hf_name: str) -> GGUFTensor:
        """One tensor by Hugging Face name."""
        self._check_architecture()
        reader_tensor = self._tensors_by_hf_name.get(hf_name)
        if reader_tensor is None:
            raise KeyError(f"no tensor {hf_name!r} in {self.path.name}")
        return self._load(reader_tensor)

    def dequantize_tensor(self, hf_name: str) -> "torch.Tensor":
        """(*shape) float32 copy of one tensor in Hugging Face layout."""
        t = self.tensor(hf_name)
        return dequantize(t.raw, t.qtype, t.shape)
