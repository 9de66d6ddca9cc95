"""The decoder every supported family composes (quill.models.archs), over a paged KV cache.

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
    """Grouped-query self-attention with fused QKV: optional q/k RMSNorm (per head or over the whole
    projection), RoPE or none (NoPE layers), full or sliding-window."""

    def __init__(self, cfg: ModelConfig, qkv: nn.Module, o_proj: nn.Module, rope: RotaryEmbedding | None,
                 q_norm: "RMSNorm | None" = None, k_norm: "RMSNorm | None" = None, window: int | None = None):
        super().__init__()
        self.qkv_proj, self.o_proj, self.rope = qkv, o_proj, rope
        self.q_norm, self.k_norm = q_norm, k_norm
        self.qk_norm = cfg.qk_norm if q_norm is not None else None  # "head" | "full" | None
        self.window = window  # a query attends keys less than this many positions back; None = all
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale  # 1/sqrt(head_dim), or the family's own (Granite, Gemma)

    def forward(self, x, positions, kv_cache, meta: AttentionMetadata):  # x (T, H)
        T = x.shape[0]
        qkv = self.qkv_proj(x, meta.gemv_rows)  # (T, q + 2 kv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":  # over the whole projection, before the heads are split (OLMo 2)
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":  # over each head (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope.apply(q, k, positions)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale, self.window)  # (T, H, hd)
        return self.o_proj(o.reshape(T, self.q_size), meta.gemv_rows)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _distinct_bytes(tensors) -> dict[int, int]:
    """{data pointer: bytes} of the tensors, each storage counted once."""
    return {t.data_ptr(): t.numel() * t.element_size() for t in tensors}


class MLP(nn.Module):
    """Gated MLP with fused gate_up: down(act(gate) * up); act is SiLU (SwiGLU) or tanh GELU (GeGLU)."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, act: str = "silu"):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up, down
        self.act_name, self.act = act, ACTIVATIONS[act]

    def forward(self, x, gemv_rows: int = 0):  # (T, H)
        gate, up = self.gate_up_proj(x, gemv_rows).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, gemv_rows)


class DecoderLayer(nn.Module):
    """Attention and MLP branches, each: [norm in] -> branch -> [norm out] -> times the residual
    multiplier -> added to x. Which norms exist is the family's layout (ModelConfig.norm_layout):
    pre (in only: Llama), sandwich (both: Gemma), post (out only: OLMo 2)."""

    def __init__(self, attn: Attention, mlp: MLP, norms: dict[str, "RMSNorm"], residual_multiplier: float = 1.0):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.attn_in, self.attn_out = norms.get("attn_in"), norms.get("attn_out")
        self.mlp_in, self.mlp_out = norms.get("mlp_in"), norms.get("mlp_out")
        self.residual_multiplier = residual_multiplier  # each branch scaled before it is added (Granite)

    def forward(self, x, positions, kv_cache, meta):
        a = self.self_attn(x if self.attn_in is None else self.attn_in(x), positions, kv_cache, meta)
        x = x + self._out(a, self.attn_out)
        m = self.mlp(x if self.mlp_in is None else self.mlp_in(x), meta.gemv_rows)
        return x + self._out(m, self.mlp_out)

    def _out(self, branch, norm):
        if norm is not None:
            branch = norm(branch)
        r = self.residual_multiplier
        return branch if r == 1.0 else branch * r


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head."""

    def __init__(self, cfg: ModelConfig, weights, device: str | torch.device = "cpu",
                 progress: Callable[[int], None] | None = None, context_len: int | None = None):
        """weights: DenseWeights, or any source with tensor/linear/embedding/tied_head (packed GGUF).
        context_len: the longest context this model will serve (default the model's own): it sizes
        the RoPE tables and picks LongRoPE's factors."""
        super().__init__()
        from quill.models.archs import ARCHITECTURES

        self.config = cfg
        self.spec = ARCHITECTURES[cfg.architecture]
        if callable(weights):
            weights = DenseWeights(weights)
        max_pos = max(min(context_len or cfg.max_position_embeddings, cfg.max_position_embeddings), 1)
        self.context_len = max_pos  # positions the RoPE tables cover: the engine serves no longer context
        self.ropes: dict[tuple, RotaryEmbedding] = {}  # one table per distinct (base, scaling)
        stored = getattr(weights, "rope_tables", None)  # a .quill file's, computed when it was written
        for i in range(cfg.num_layers):
            key = cfg.layer_rope(i)
            if key is not None and key not in self.ropes:
                theta, scaling = key
                tables = stored(key, max_pos) if stored is not None else None
                self.ropes[key] = RotaryEmbedding.from_tables(*tables) if tables else RotaryEmbedding(
                    cfg.head_dim, max_pos, theta, dict(scaling) if scaling else None, device, cfg.rotary_dim)
        self.embed_tokens = weights.embedding("model.embed_tokens.weight")
        layers = []
        for i in range(cfg.num_layers):
            layers.append(self._build_layer(cfg, i, weights))
            if progress:
                progress(i)
        self.layers = nn.ModuleList(layers)
        self.norm = self._norm(weights, "model.norm.weight")
        if cfg.tie_word_embeddings:
            self.lm_head = weights.tied_head(self.embed_tokens)
        else:
            self.lm_head = weights.linear(["lm_head"], False)

    def _norm(self, weights, name: str) -> RMSNorm:
        w = weights.tensor(name).float()
        return RMSNorm(w + self.config.norm_offset if self.config.norm_offset else w, self.config.rms_norm_eps)

    def _build_layer(self, cfg: ModelConfig, i: int, weights) -> DecoderLayer:
        p = f"model.layers.{i}."
        rope = cfg.layer_rope(i)
        qk_norms = ((self._norm(weights, p + "self_attn.q_norm.weight"), self._norm(weights, p + "self_attn.k_norm.weight"))
                    if cfg.qk_norm else (None, None))
        attn = Attention(
            cfg,
            weights.linear(self.spec.qkv_names(p), cfg.attention_bias),
            weights.linear([p + "self_attn.o_proj"], False),
            None if rope is None else self.ropes[rope],
            *qk_norms,
            window=cfg.layer_window(i),
        )
        mlp = MLP(weights.linear(self.spec.gate_up_names(p), False), weights.linear([p + "mlp.down_proj"], False),
                  cfg.hidden_act)
        norms = {role: self._norm(weights, p + name + ".weight") for role, name in self.spec.norm_names.items()}
        return DecoderLayer(attn, mlp, norms, cfg.residual_multiplier)

    def shape_errors(self) -> list[str]:
        """Each weight whose shape the config contradicts (a .quill file is checked with this before it runs:
        the kernels read activations by the weights' widths)."""
        c = self.config
        h, i, hd = c.hidden_size, c.intermediate_size, c.head_dim
        q, kv = c.num_heads * hd, c.num_kv_heads * hd
        linears, vectors = [("lm_head", self.lm_head, (None, h))], [("model.norm", self.norm, h)]
        emb = self.embed_tokens.weight
        emb_cols = emb.cols if isinstance(emb, GroupWeight) else emb.shape[1]
        errors = [] if emb_cols == h else [f"the embedding is {emb_cols} wide, the config needs {h}"]
        for n, layer in enumerate(self.layers):
            a, m = layer.self_attn, layer.mlp
            linears += [(f"layer {n} qkv", a.qkv_proj, (q + 2 * kv, h)), (f"layer {n} o_proj", a.o_proj, (h, q)),
                        (f"layer {n} gate_up", m.gate_up_proj, (2 * i, h)), (f"layer {n} down_proj", m.down_proj, (h, i))]
            vectors += [(f"layer {n} {role}", getattr(layer, role), h)
                        for role in ("attn_in", "attn_out", "mlp_in", "mlp_out") if getattr(layer, role) is not None]
            if a.q_norm is not None:
                full = c.qk_norm == "full"
                vectors += [(f"layer {n} q_norm", a.q_norm, q if full else hd), (f"layer {n} k_norm", a.k_norm, kv if full else hd)]
        for name, mod, (rows, cols) in linears:
            got = (mod.out_features, mod.in_features)
            if got[1] != cols or (rows is not None and got[0] != rows):
                errors.append(f"{name} is {got}, the config needs ({rows or 'any'}, {cols})")
        errors += [f"{name} has {tuple(norm.weight.shape)}, the config needs ({size},)"
                   for name, norm, size in vectors if tuple(norm.weight.shape) != (size,)]
        return errors

    def resident_bytes(self) -> int:
        """Bytes of weights held in memory: every distinct tensor counted once (tied heads share)."""
        return sum(_distinct_bytes(self._weight_tensors()).values())

    def decode_read_bytes(self) -> int:
        """Weight bytes one decode step reads (the roofline's, `quill bench latency`): all of them but an
        untied token embedding, of which a step reads only its tokens' rows (a tied one is the LM head)."""
        head = _distinct_bytes(self._weight_tensors(self.lm_head))
        table = _distinct_bytes(self._weight_tensors(self.embed_tokens))
        return self.resident_bytes() - sum(n for ptr, n in table.items() if ptr not in head)

    def _weight_tensors(self, module: nn.Module | None = None):
        """The weight tensors of `module` (this model by default), packed layouts' parts included."""
        module = self if module is None else module
        yield from module.parameters()
        for m in module.modules():
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
        s, cap = self.config.logits_scaling, self.config.final_logit_softcapping
        if s != 1.0:
            logits = logits / s
        return logits if not cap else torch.tanh(logits / cap) * cap
