"""OLMo 2: post-norm (each branch's output is RMSNorm'd before the residual add, no norm on its
input) and q/k RMSNorm over the whole q and k projections (not per head)."""

from quill.models.archs import ArchSpec

SPEC = ArchSpec(
    name="olmo2",
    hf_classes=("Olmo2ForCausalLM",),
    gguf_arch="olmo2",
    families="OLMo 2",
    qk_norm="full",
    norm_layout="post",
    gguf_layer_tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                        "post_attention_norm": "post_attention_layernorm",
                        "post_ffw_norm": "post_feedforward_layernorm"},
)
