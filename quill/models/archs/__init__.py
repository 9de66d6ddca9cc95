"""The architecture seam: one small definition per model family, and the registry that maps a
config.json's `architectures[0]` (or model_type) and a GGUF's `general.architecture` to it.

A definition (`ArchSpec`) says which of the shared blocks its layer uses: q/k/v bias, q/k RMSNorm
(per head or over the whole projection), where the RMSNorms sit (pre-norm, sandwich, post-norm),
the MLP's activation, fused Hugging Face tensors, scalar multipliers; how llama.cpp's converter
names and orders its tensors; and hooks for per-layer rules (windows, RoPE) no shared field holds.
`ModelConfig` is built from the definition; `LlamaForCausalLM` composes its blocks from the
config; the fused decode path checks the same recipe against what it implements. Adding a family
is one file here plus its tests (see docs/ARCHITECTURE.md, "Adding an architecture").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


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
    hf_model_types: tuple[str, ...] = ()  # config.json "model_type" values beyond the spec's name
    gguf_permutes_qk: bool = False  # llama.cpp's converter interleaves q/k rows (its LlamaModel and subclasses)
    qkv_bias: bool = False  # when config.json does not say (attention_bias)
    qk_norm: str | None = None  # RMSNorm on q and k before RoPE: "head" (each head) or "full" (whole projection)
    norm_layout: str = "pre"  # ModelConfig.norm_layout: "pre", "sandwich" (Gemma) or "post" (OLMo 2)
    hf_norm_offset: float = 0.0  # added to RMSNorm weights read from Hugging Face files (Gemma stores w for 1 + w)
    hidden_act: str = "silu"  # when config.json does not say
    fused_qkv: bool = False  # Hugging Face stores self_attn.qkv_proj and mlp.gate_up_proj (Phi-3)
    sliding_window_by_default: bool = False  # when config.json has no use_sliding_window
    gguf_layer_tensors: dict[str, str] = field(default_factory=dict)  # blk.N.<name> -> HF module, over Llama's map
    scalars: tuple[Scalar, ...] = ()
    # Family rules beyond the shared fields: (config.json, fields so far) -> ModelConfig fields to set,
    # and (GGUF metadata lookup by key without the arch prefix, fields so far) -> the same.
    hf_config: Callable[[dict, dict], dict] | None = None
    gguf_config: Callable[[Callable[[str, Any], Any], dict], dict] | None = None

    def qkv_names(self, prefix: str) -> list[str]:
        """Hugging Face module names whose rows, concatenated, are the layer's fused QKV projection."""
        if self.fused_qkv:
            return [prefix + "self_attn.qkv_proj"]
        return [prefix + f"self_attn.{x}_proj" for x in "qkv"]

    def gate_up_names(self, prefix: str) -> list[str]:
        """... and its fused gate/up projection (gate rows first)."""
        if self.fused_qkv:
            return [prefix + "mlp.gate_up_proj"]
        return [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"]

    @property
    def norm_names(self) -> dict[str, str]:
        """The layer's RMSNorms by role (attention in/out, MLP in/out) -> Hugging Face module name."""
        return NORM_LAYOUTS[self.norm_layout]


NORM_LAYOUTS = {
    "pre": {"attn_in": "input_layernorm", "mlp_in": "post_attention_layernorm"},
    "sandwich": {"attn_in": "input_layernorm", "attn_out": "post_attention_layernorm",
                 "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"},
    "post": {"attn_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
}


def _registry() -> dict[str, ArchSpec]:
    from quill.models.archs import gemma3, granite, llama, mistral, olmo2, phi3, qwen2, qwen3, smollm3

    specs = (llama.SPEC, mistral.SPEC, qwen2.SPEC, qwen3.SPEC, granite.SPEC, gemma3.SPEC, phi3.SPEC, olmo2.SPEC,
             smollm3.SPEC)
    return {spec.name: spec for spec in specs}


ARCHITECTURES: dict[str, ArchSpec] = _registry()
_BY_HF_CLASS = {cls: spec for spec in ARCHITECTURES.values() for cls in spec.hf_classes}
_BY_MODEL_TYPE = {t: spec for spec in ARCHITECTURES.values() for t in (spec.name, *spec.hf_model_types)}
_BY_GGUF = {spec.gguf_arch: spec for spec in ARCHITECTURES.values() if spec.gguf_arch}
GGUF_ARCHITECTURES = tuple(_BY_GGUF)
HF_ARCHITECTURES = tuple(_BY_HF_CLASS)


def for_hf(name: str) -> ArchSpec | None:
    """By config.json's architectures[0] (or its model_type, which is the spec's name)."""
    return _BY_HF_CLASS.get(name) or _BY_MODEL_TYPE.get(name)


def for_gguf(name: str) -> ArchSpec | None:
    return _BY_GGUF.get(name)
