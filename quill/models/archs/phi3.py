"""Phi-3 / 3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj (kept fused in the GGUF as attn_qkv
and ffn_up), LongRoPE (short and long per-frequency factors and an attention factor; GGUF
rope_factors_short / rope_factors_long), partial rotary dims (Phi-4-mini rotates 3/4 of each
head), and a sliding window over every layer where config.json sets one."""

from quill.models.archs import ArchSpec

SPEC = ArchSpec(
    name="phi3",
    hf_classes=("Phi3ForCausalLM",),
    gguf_arch="phi3",
    families="Phi-3, Phi-3.5, Phi-4-mini",
    fused_qkv=True,
    sliding_window_by_default=True,
    gguf_layer_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
)
