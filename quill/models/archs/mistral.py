"""Mistral (Hugging Face folders): the Llama layer with an optional sliding window."""

from quill.models.archs import ArchSpec

SPEC = ArchSpec(
    name="mistral",
    hf_classes=("MistralForCausalLM",),
    gguf_arch=None,  # llama.cpp's converter writes Mistral as "llama"
    families="Mistral",
    sliding_window_by_default=True,
)
