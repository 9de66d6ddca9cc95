"""Qwen3 (dense): no bias, RMSNorm over each q and k head before RoPE (attn_q_norm / attn_k_norm)."""

from quill.models.archs import ArchSpec

SPEC = ArchSpec(
    name="qwen3",
    hf_classes=("Qwen3ForCausalLM",),
    gguf_arch="qwen3",
    families="Qwen3",
    qk_norm="head",
    gguf_layer_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
)
