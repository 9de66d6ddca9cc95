"""IBM Granite 3.x (dense): the Llama layer with four multipliers. Embeddings are scaled by
embedding_multiplier, attention scores by attention_multiplier (instead of 1/sqrt(head_dim)),
each residual branch by residual_multiplier, and the logits divided by logits_scaling. llama.cpp's
converter (a LlamaModel subclass, so q/k rows are interleaved) writes them as embedding_scale,
attention.scale, residual_scale and logit_scale."""

from quill.models.archs import ArchSpec, Scalar

SPEC = ArchSpec(
    name="granite",
    hf_classes=("GraniteForCausalLM",),
    gguf_arch="granite",
    families="Granite 3.x",
    gguf_permutes_qk=True,
    scalars=(
        Scalar("embedding_multiplier", "embedding_multiplier", "embedding_scale", 1.0),
        Scalar("attention_multiplier", "attention_multiplier", "attention.scale", 0.0),  # 0: 1/sqrt(head_dim)
        Scalar("residual_multiplier", "residual_multiplier", "residual_scale", 1.0),
        Scalar("logits_scaling", "logits_scaling", "logit_scale", 1.0),
    ),
)
