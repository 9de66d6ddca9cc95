"""Gemma 3 (text): sandwich norms (RMSNorm before and after each branch) stored as w for (1 + w),
q/k RMSNorm per head, GeGLU with tanh GELU, embeddings times sqrt(hidden), scores scaled by
query_pre_attn_scalar^-1/2, and sliding-window layers (5 of every 6) with their own RoPE base.

llama.cpp's converter writes the norms with the 1 already added, so GGUF weights are used as
stored; it writes no layer pattern, local RoPE base or score scale, which llama.cpp's loader fixes
for gemma3 (every 6th layer global, local base 10000, 1/sqrt(head_dim) but for the 27B model's
1/sqrt(hidden / heads): src/llama-model.cpp, LLM_ARCH_GEMMA3). Newer converters also write the
local base as rope.freq_base_swa, read when present."""

from __future__ import annotations

import math

from quill.config import UnsupportedModelError
from quill.models.archs import ArchSpec

LAYER_PATTERN = 6  # every 6th layer global (config.json's sliding_window_pattern, llama.cpp's swa pattern)
LOCAL_ROPE_BASE = 10000.0


def _common(hidden: int, num_layers: int, sliding: tuple[bool, ...] | None) -> dict:
    if sliding is None:
        sliding = tuple((i + 1) % LAYER_PATTERN != 0 for i in range(num_layers))
    return dict(sliding_layers=sliding, embedding_multiplier=math.sqrt(hidden))


def _hf(config: dict, fields: dict) -> dict:
    if config.get("attn_logit_softcapping"):
        raise UnsupportedModelError(f"Gemma attention logit soft-capping ({config['attn_logit_softcapping']}) "
                                    "is not implemented")
    types = config.get("layer_types")
    pattern = config.get("sliding_window_pattern", LAYER_PATTERN)
    sliding = (tuple(t == "sliding_attention" for t in types) if types
               else tuple((i + 1) % pattern != 0 for i in range(fields["num_layers"])))
    return dict(_common(fields["hidden_size"], fields["num_layers"], sliding),
                sliding_window=config.get("sliding_window"),
                attention_multiplier=float(config.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
                rope_local_theta=fields.get("rope_local_theta") or LOCAL_ROPE_BASE)


def _gguf(key, fields: dict) -> dict:
    heads, layers = fields["num_heads"], fields["num_layers"]
    scalar = fields["hidden_size"] / heads if layers == 62 else fields["head_dim"]  # 62 layers: the 27B model
    pattern = key("attention.sliding_window_pattern", None)  # newer converters: a period, or a flag per layer
    if isinstance(pattern, list):
        sliding = tuple(bool(f) for f in pattern)
    else:
        sliding = tuple((i + 1) % int(pattern or LAYER_PATTERN) != 0 for i in range(layers))
    return dict(_common(fields["hidden_size"], layers, sliding), attention_multiplier=float(scalar) ** -0.5,
                rope_local_theta=float(key("rope.freq_base_swa", LOCAL_ROPE_BASE)))


SPEC = ArchSpec(
    name="gemma3",
    hf_classes=("Gemma3ForCausalLM",),
    gguf_arch="gemma3",
    families="Gemma 3 (text)",
    hf_model_types=("gemma3_text",),
    qk_norm="head",
    norm_layout="sandwich",
    hf_norm_offset=1.0,
    hidden_act="gelu_tanh",
    sliding_window_by_default=True,
    gguf_layer_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                        "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"},
    hf_config=_hf,
    gguf_config=_gguf,
)
