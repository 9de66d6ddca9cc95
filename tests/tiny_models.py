"""Tiny random Hugging Face models for parity tests (transformers is a test-only dependency)."""

from __future__ import annotations

import torch

WINDOW = 16  # sliding window of the windowed kinds: the parity prompts are longer
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5)


def make_hf_model(kind: str):
    """kind: llama-gqa | llama3-tied | qwen2 | qwen3 | granite | mistral | mistral-nemo | gemma3 | olmo2 |
    smollm3 | phi3 -> transformers model in fp32, eval mode."""
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
    elif kind == "qwen3":  # q/k RMSNorm per head; head_dim set apart from hidden / heads, as Qwen3 does
        cfg = tf.Qwen3Config(**TINY, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True, rope_theta=1e6)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "qwen3-yarn":  # long context as Qwen3's model card enables it (factor 4 over the original)
        rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e6}
        cfg = tf.Qwen3Config(**TINY, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_parameters=rope)
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "granite":  # the four multipliers, away from 1 so the test sees each one
        cfg = tf.GraniteConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=True, embedding_multiplier=3.0,
                               attention_multiplier=0.09, residual_multiplier=0.5, logits_scaling=2.5)
        model = tf.GraniteForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)
        model = tf.MistralForCausalLM(cfg)
    elif kind == "mistral-nemo":  # head_dim set apart from hidden / heads, as Mistral Nemo's 128 vs 5120 / 32
        cfg = tf.MistralConfig(**TINY, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                               sliding_window=None)
        model = tf.MistralForCausalLM(cfg)
    elif kind == "gemma3":  # Gemma 3's layout: 5 sliding-window layers then a global one, two RoPE bases,
        # linear scaling on the global layers (as the 4B+ models); query_pre_attn_scalar = head_dim as in
        # every Gemma 3 but the 27B (which llama.cpp's loader special-cases)
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        cfg = tf.Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6}, num_key_value_heads=2, head_dim=16,
                                  query_pre_attn_scalar=16, sliding_window=WINDOW, rope_parameters=rope,
                                  tie_word_embeddings=True, attn_implementation="eager")
        model = tf.Gemma3ForCausalLM(cfg)
    elif kind == "olmo2":
        cfg = tf.Olmo2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=False)
        model = tf.Olmo2ForCausalLM(cfg)
    elif kind == "smollm3":  # 4 layers: the 4th has no RoPE
        cfg = tf.SmolLM3Config(**{**TINY, "num_hidden_layers": 4}, num_key_value_heads=2, tie_word_embeddings=True,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = tf.SmolLM3ForCausalLM(cfg)
    elif kind == "phi3":  # Phi-4-mini-style: LongRoPE, 3/4 of each head rotated; and a window on every layer
        rotary_half = 6
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                "long_factor": [1.0 + 0.7 * i for i in range(rotary_half)],
                "original_max_position_embeddings": 64}
        cfg = tf.Phi3Config(**TINY, num_key_value_heads=2, tie_word_embeddings=False, rope_parameters=rope,
                            original_max_position_embeddings=64, sliding_window=WINDOW, pad_token_id=0)
        model = tf.Phi3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


# llama.cpp's tensor names for the Hugging Face ones (the converter's mapping, for the tests).
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Per family, where its converter names a module differently (MODEL_TENSORS in gguf-py's constants).
_GGUF_LAYER_BY_ARCH = {
    "gemma3": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
    "olmo2": {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_PERMUTED = ("llama", "granite", "smollm3")  # the converter's LlamaModel and its subclasses


def llama_cpp_permute(weights, num_heads: int):
    """What llama.cpp's converter does to llama q/k rows (written from its description)."""
    rows = weights.shape[0]
    return weights.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weights.shape)


def _rope_parameters(config) -> dict:
    """RoPE settings with rope_theta, whichever transformers version made the config."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def llama3_rope_freqs(config):
    """The rope_freqs.weight llama.cpp's converter writes for "llama3" scaling (the rule is quill bench
    synth's, which writes it for real-shaped files)."""
    from quill.bench.synth import llama3_rope_freqs as freqs

    rope = _rope_parameters(config)
    return freqs(config.hidden_size // config.num_attention_heads, rope["rope_theta"], rope["factor"],
                 rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0),
                 rope["original_max_position_embeddings"])


def write_llama_gguf(hf_model, path, *, rope_freqs: bool = True, arch: str = "llama") -> None:
    """A GGUF of a tiny transformers model, written as llama.cpp's converter would for `arch`: its
    tensor names and metadata keys, F32 tensors; q/k rows permuted for the LlamaModel family
    (llama, granite, smollm3), rope_freqs for llama3 scaling; Gemma 3's norms with the 1 of (1 + w)
    added and its linear scaling as rope.scaling.*; Phi-3's fused tensors, LongRoPE factor tensors
    and attention factor."""
    import math

    import gguf
    import numpy as np

    cfg = hf_model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = _rope_parameters(cfg)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    writer.add_eos_token_id(cfg.vocab_size - 1)
    if arch == "gemma3":  # rope_parameters by layer type: the base is the global layers'
        full = rope["full_attention"]
        writer.add_rope_freq_base(float(full["rope_theta"]))
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        writer.add_sliding_window(cfg.sliding_window)
        if full.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    else:
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "phi3":  # no key_length; rope dims from the partial factor; LongRoPE as two tensors
        writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // heads)
        writer.add_sliding_window(cfg.sliding_window or 0)
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    else:
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "granite":  # the converter's names for the multipliers
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if rope_freqs and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    names = {**_GGUF_LAYER, **_GGUF_LAYER_BY_ARCH.get(arch, {})}
    for name, tensor in hf_model.state_dict().items():
        if "rotary_emb" in name:
            continue
        array = tensor.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0  # Gemma3RMSNorm scales by (1 + w); the converter stores 1 + w
        if name in _GGUF_GLOBAL:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            writer.add_tensor(_GGUF_GLOBAL[name], array)
            continue
        _, _, layer, *rest = name.split(".")
        module, suffix = ".".join(rest[:-1]), rest[-1]
        if arch in _PERMUTED and module == "self_attn.q_proj":
            array = llama_cpp_permute(array, heads)
        elif arch in _PERMUTED and module == "self_attn.k_proj":
            array = llama_cpp_permute(array, kv_heads)
        writer.add_tensor(f"blk.{layer}.{names[module]}.{suffix}", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
