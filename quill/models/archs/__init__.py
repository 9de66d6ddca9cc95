"""The architecture seam: one small definition per model family, and the registry that maps a
config.json's `architectures[0]` and a GGUF's `general.architecture` to it.

A definition (`ArchSpec`) says what differs from the Llama layer every family here shares
(pre-norm RMSNorm, fused QKV, RoPE, grouped-query attention, SwiGLU): q/k/v bias, per-head q/k
RMSNorm, a sliding window, scalar multipliers, how llama.cpp's converter stores its q/k rows and
which extra tensors and metadata keys it writes. `ModelConfig` is built from the definition;
`LlamaForCausalLM` composes its blocks from the config; the fused decode path checks the same
config against what it implements. Adding a family is one file here plus its tests (see
docs/ARCHITECTURE.md, "Adding an architecture").
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Scalar:
    """A number the family's layers use, named in both file formats (Granite's multipliers)."""

    field: str  # ModelConfig field
    hf_key: str  # config.json key
    gguf_key: str  # "{arch}.<gguf_key>" metadata key
    default: float


@dataclass(frozen=True)
class ArchSpec:
    name: str  # ModelConfig.architecture
    hf_classes: tuple[str, ...]  # config.json "architectures"
    gguf_arch: str | None  # GGUF general.architecture; None when llama.cpp writes the family as another arch
    families: str  # what a user knows it as, for `quill info`
    gguf_permutes_qk: bool = False  # llama.cpp's converter interleaves q/k rows (its LlamaModel and subclasses)
    qkv_bias: bool = False  # when config.json does not say (attention_bias)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE
    sliding_window_by_default: bool = False  # when config.json has no use_sliding_window
    gguf_layer_tensors: dict[str, str] = field(default_factory=dict)  # blk.N.<name> -> HF module, beyond Llama's
    scalars: tuple[Scalar, ...] = ()


def _registry() -> dict[str, ArchSpec]:
    from quill.models.archs import granite, llama, mistral, qwen2, qwen3

    specs = (llama.SPEC, mistral.SPEC, qwen2.SPEC, qwen3.SPEC, granite.SPEC)
    return {spec.name: spec for spec in specs}


ARCHITECTURES: dict[str, ArchSpec] = _registry()
_BY_HF_CLASS = {cls: spec for spec in ARCHITECTURES.values() for cls in spec.hf_classes}
_BY_GGUF = {spec.gguf_arch: spec for spec in ARCHITECTURES.values() if spec.gguf_arch}
GGUF_ARCHITECTURES = tuple(_BY_GGUF)
HF_ARCHITECTURES = tuple(_BY_HF_CLASS)


def for_hf(name: str) -> ArchSpec | None:
    """By config.json's architectures[0] (or its model_type, which is the spec's name)."""
    return _BY_HF_CLASS.get(name) or ARCHITECTURES.get(name)


def for_gguf(name: str) -> ArchSpec | None:
    return _BY_GGUF.get(name)
