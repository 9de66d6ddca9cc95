"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over a paged KV cache.

The model sees only flat token tensors and AttentionMetadata; it never sees a Sequence.
Weights arrive already fused (qkv_proj, gate_up_proj) through a `make_linear` factory so a
quantized kernel can replace the dense one without touching this file.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quill.config import ModelConfig
from quill.kernels.attention import AttentionMetadata, paged_attention, write_kv
from quill.kernels.linear import DenseLinear
from quill.models.rope import RotaryEmbedding

# name -> tensor getter; the loader supplies fp32 tensors (or packed ones for its factory)
WeightGetter = Callable[[str], torch.Tensor]
LinearFactory = Callable[[list[str], bool, tuple[int, ...]], nn.Module]


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H)
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


class Attention(nn.Module):
    """Grouped-query self-attention with fused QKV and RoPE."""

    def __init__(self, cfg: ModelConfig, qkv: nn.Module, o_proj: nn.Module, rope: RotaryEmbedding):
        super().__init__()
        self.qkv_proj, self.o_proj, self.rope = qkv, o_proj, rope
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata):  # x (T, H)
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, q + 2 kv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        q, k = self.rope.apply(q, k, positions)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)  # (T, H, hd)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate) * up) with fused gate_up."""

    def __init__(self, gate_up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down

    def forward(self, x):  # (T, H)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP with residuals."""

    def __init__(self, attn: Attention, mlp: MLP, in_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = in_norm, post_norm

    def forward(self, x, positions, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def dense_factory(get: WeightGetter) -> LinearFactory:
    """Concatenate the named weights along the output dim into one DenseLinear."""

    def make(names: list[str], has_bias: bool, _shape=()) -> nn.Module:
        w = torch.cat([get(n + ".weight") for n in names], dim=0) if len(names) > 1 else get(names[0] + ".weight")
        b = torch.cat([get(n + ".bias") for n in names], dim=0) if has_bias else None
        return DenseLinear(w.float().contiguous(), None if b is None else b.float())

    return make


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, get: WeightGetter, make_linear: LinearFactory | None = None,
                 device: str | torch.device = "cpu", progress: Callable[[int], None] | None = None):
        super().__init__()
        self.config = cfg
        make_linear = make_linear or dense_factory(get)
        max_pos = max(cfg.max_position_embeddings, 1)
        self.rope = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling_dict, device)
        self.embed_tokens = nn.Parameter(get("model.embed_tokens.weight").float(), requires_grad=False)  # (V, H)
        layers = []
        for i in range(cfg.num_layers):
            layers.append(self._build_layer(cfg, i, get, make_linear))
            if progress:
                progress(i)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(get("model.norm.weight"), cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = DenseLinear(self.embed_tokens.data)
        else:
            self.lm_head = make_linear(["lm_head"], False, (cfg.vocab_size, cfg.hidden_size))

    def _build_layer(self, cfg: ModelConfig, i: int, get: WeightGetter, make_linear: LinearFactory) -> DecoderLayer:
        p = f"model.layers.{i}."
        qkv = make_linear([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"], cfg.attention_bias, ())
        o = make_linear([p + "self_attn.o_proj"], False, ())
        gate_up = make_linear([p + "mlp.gate_proj", p + "mlp.up_proj"], False, ())
        down = make_linear([p + "mlp.down_proj"], False, ())
        attn = Attention(cfg, qkv, o, self.rope)
        return DecoderLayer(
            attn,
            MLP(gate_up, down),
            RMSNorm(get(p + "input_layernorm.weight"), cfg.rms_norm_eps),
            RMSNorm(get(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps),
        )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata):
        """input_ids, positions (T,) -> hidden (T, H) after the final norm."""
        x = F.embedding(input_ids, self.embed_tokens)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, positions, kv, meta)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, H) -> (B, V)
        return self.lm_head(hidden)
