"""Llama 2 / 3.x, SmolLM 1-2 and Mistral-as-llama GGUFs: the base layer, nothing added."""

from quill.models.archs import ArchSpec

SPEC = ArchSpec(
    name="llama",
    hf_classes=("LlamaForCausalLM",),
    gguf_arch="llama",  # llama.cpp also writes Mistral 7B files as "llama"
    families="Llama 2, Llama 3.x (rope_freqs), SmolLM 1-2, Mistral 7B, Nemo and Small 3 (GGUF)",
    gguf_permutes_qk=True,
)
