"""Qwen2 / 2.5 and DeepSeek-R1-Distill-Qwen: q/k/v bias; GGUF rows in Hugging Face order."""

from quill.models.archs import ArchSpec

SPEC = ArchSpec(
    name="qwen2",
    hf_classes=("Qwen2ForCausalLM",),
    gguf_arch="qwen2",
    families="Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen",
    qkv_bias=True,
)
