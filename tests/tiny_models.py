"""Tiny random Hugging Face models for parity tests (transformers is a test-only dependency)."""

from __future__ import annotations

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5)


def make_hf_model(kind: str):
    """kind: llama-gqa | llama3-tied | qwen2 | mistral -> transformers model in fp32, eval mode."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama-gqa":
        cfg = tf.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "llama3-tied":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 500000.0}
        cfg = tf.LlamaConfig(**TINY, num_key_value_heads=1, tie_word_embeddings=True, rope_scaling=rope,
                             rope_theta=500000.0)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)
        model = tf.MistralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()
