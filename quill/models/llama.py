"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3) over a paged KV cache.

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
from quill.kernels.packed import DenseEmbedding, GroupWeight
from quill.models.rope import RotaryEmbedding

# name -> tensor getter; the loader supplies fp32 tensors
WeightGetter = Callable[[str], torch.Tensor]


class DenseWeights:
    """Builds fp32 layers from a tensor getter (safetensors, or a dequantized GGUF)."""

    def __init__(self, get: WeightGetter):
        self.get = get

    def tensor(self, name: str) -> torch.Tensor:
        return self.get(name)

    def linear(self, names: list[str], has_bias: bool) -> nn.Module:
        w = torch.cat([self.get(n + ".weight").float() for n in names], dim=0)
        b = torch.cat([self.get(n + ".bias").float() for n in names], dim=0) if has_bias else None
        return DenseLinear(w.contiguous(), b)

    def embedding(self, name: str) -> nn.Module:
        return DenseEmbedding(self.get(name).float().contiguous())

    def tied_head(self, embedding: nn.Module) -> nn.Module:
        return DenseLinear(embedding.weight.data)


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

    def __init__(self, cfg: ModelConfig, qkv: nn.Module, o_proj: nn.Module, rope: RotaryEmbedding,
                 q_norm: "RMSNorm | None" = None, k_norm: "RMSNorm | None" = None):
        super().__init__()
        self.qkv_proj, self.o_proj, self.rope = qkv, o_proj, rope
        self.q_norm, self.k_norm = q_norm, k_norm  # per-head RMSNorm before RoPE (Qwen3), or None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale  # 1/sqrt(head_dim), or the family's own (Granite)

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata):  # x (T, H)
        T = x.shape[0]
        qkv = self.qkv_proj(x, meta.gemv_rows)  # (T, q + 2 kv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope.apply(q, k, positions)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)  # (T, H, hd)
        return self.o_proj(o.reshape(T, self.q_size), meta.gemv_rows)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate) * up) with fused gate_up."""

    def __init__(self, gate_up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down

    def forward(self, x, gemv_rows: int = 0):  # (T, H)
        gate, up = self.gate_up_proj(x, gemv_rows).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, gemv_rows)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP with residuals."""

    def __init__(self, attn: Attention, mlp: MLP, in_norm: RMSNorm, post_norm: RMSNorm, residual_multiplier: float = 1.0):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = in_norm, post_norm
        self.residual_multiplier = residual_multiplier  # each branch scaled before it is added (Granite)

    def forward(self, x, positions, kv_cache, meta):
        r = self.residual_multiplier
        attn = self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        x = x + (attn if r == 1.0 else attn * r)
        mlp = self.mlp(self.post_attention_layernorm(x), meta.gemv_rows)
        return x + (mlp if r == 1.0 else mlp * r)


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, weights, device: str | torch.device = "cpu",
                 progress: Callable[[int], None] | None = None):
        """weights: DenseWeights, or any source with tensor/linear/embedding/tied_head (packed GGUF)."""
        super().__init__()
        self.config = cfg
        if callable(weights):
            weights = DenseWeights(weights)
        max_pos = max(cfg.max_position_embeddings, 1)
        self.rope = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling_dict, device)
        self.embed_tokens = weights.embedding("model.embed_tokens.weight")
        layers = []
        for i in range(cfg.num_layers):
            layers.append(self._build_layer(cfg, i, weights))
            if progress:
                progress(i)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(weights.tensor("model.norm.weight"), cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = weights.tied_head(self.embed_tokens)
        else:
            self.lm_head = weights.linear(["lm_head"], False)

    def _build_layer(self, cfg: ModelConfig, i: int, weights) -> DecoderLayer:
        p = f"model.layers.{i}."
        attn = Attention(
            cfg,
            weights.linear([p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"], cfg.attention_bias),
            weights.linear([p + "self_attn.o_proj"], False),
            self.rope,
            *((RMSNorm(weights.tensor(p + "self_attn.q_norm.weight"), cfg.rms_norm_eps),
               RMSNorm(weights.tensor(p + "self_attn.k_norm.weight"), cfg.rms_norm_eps)) if cfg.qk_norm else ()),
        )
        mlp = MLP(weights.linear([p + "mlp.gate_proj", p + "mlp.up_proj"], False),
                  weights.linear([p + "mlp.down_proj"], False))
        return DecoderLayer(
            attn,
            mlp,
            RMSNorm(weights.tensor(p + "input_layernorm.weight"), cfg.rms_norm_eps),
            RMSNorm(weights.tensor(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps),
            cfg.residual_multiplier,
        )

    def resident_bytes(self) -> int:
        """Bytes of weights held in memory: every distinct tensor counted once (tied heads share)."""
        seen: dict[int, int] = {}
        for t in self._weight_tensors():
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    def _weight_tensors(self):
        yield from self.parameters()
        for m in self.modules():
            w = getattr(m, "weight", None)
            if isinstance(w, GroupWeight):  # a PackedWeight or TiledWeight
                yield from w.tensors()
            b = getattr(m, "bias", None)
            if isinstance(b, torch.Tensor) and not isinstance(b, nn.Parameter):
                yield b

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata):
        """input_ids, positions (T,) -> hidden (T, H) after the final norm."""
        x = self.embed(input_ids)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, positions, kv, meta)
        return self.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, times the family's embedding multiplier (Granite) where it has one."""
        x = self.embed_tokens(input_ids)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * m

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, H) -> (B, V)
        logits = self.lm_head(hidden, hidden.shape[0])  # every row: logits stay batch-invariant
        s = self.config.logits_scaling
        return logits if s == 1.0 else logits / s
