"""Decode rows through one fused C call per layer (quill_decode_layer), reading the paged cache in place.

Per step Python does the embedding lookup, 30 calls and the final norm; everything else
(RMSNorm, QKV, RoPE, K/V write, attention, O, SwiGLU, residuals) happens in C. The rows come
as block tables: C finds the new token's slot and each context position's from them, so what a
step hands over grows with the batch, not with the contexts.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from quill.kernels import native
from quill.kernels import options as kopts
from quill.kernels.linear import DenseLinear
from quill.kernels.packed import PackedLinear, PackedWeight

logger = logging.getLogger("quill.kernels")
P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class QWeight(ctypes.Structure):
    _fields_ = [("kind", I), ("rows", I), ("groups", I), ("codes", P), ("scale", P), ("mins", P), ("bias", P)]


class LayerWeights(ctypes.Structure):
    _fields_ = [("norm1", P), ("norm2", P), ("qkv", QWeight), ("o", QWeight), ("gate_up", QWeight),
                ("down", QWeight), ("k_cache", P), ("v_cache", P), ("q_norm", P), ("k_norm", P)]


# The layer quill_decode_layer computes: pre-norm RMSNorm; fused QKV, with or without bias; per-head
# q/k RMSNorm where the architecture has it; rotate-half RoPE on every layer from the model's
# cos/sin tables (any frequency scaling is already in them); full causal attention over the paged
# cache (scores scaled by the config's attention_scale); O; RMSNorm; SwiGLU; both residuals, each
# branch times residual_multiplier. The embedding multiplier is applied before the layers and the
# logits scaling after, by the model. An architecture is listed once its layer is exactly that.
FUSED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "granite"})


def refusal(model) -> str | None:
    """Why the fused decode layer cannot compute this model's layers exactly, or None."""
    from quill.models.llama import MLP, Attention, DecoderLayer, RMSNorm

    cfg = model.config
    if cfg.architecture not in FUSED_ARCHITECTURES:
        return f"architecture {cfg.architecture!r} is not one it implements ({', '.join(sorted(FUSED_ARCHITECTURES))})"
    if cfg.sliding_window:
        return f"sliding-window attention ({cfg.sliding_window} positions) is not implemented in it"
    if cfg.head_dim % 8 or cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 16:
        return (f"head_dim {cfg.head_dim} (needs a multiple of 8) or {cfg.num_heads} heads over {cfg.num_kv_heads} "
                "KV heads (needs a whole group of at most 16)")
    for i, layer in enumerate(model.layers):
        parts = (type(layer), type(layer.self_attn), type(layer.mlp))
        if parts != (DecoderLayer, Attention, MLP):
            return f"layer {i} is built from {', '.join(t.__name__ for t in parts)}, not the layer it computes"
        norms = [isinstance(n, RMSNorm) for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
        if norms != [cfg.qk_norm] * 2:
            return f"layer {i}'s q/k norms {norms} do not match the config (qk_norm={cfg.qk_norm})"
    return None


class ModelShape(ctypes.Structure):
    _fields_ = [("hidden", I), ("heads", I), ("kv_heads", I), ("head_dim", I), ("inter", I), ("eps", F),
                ("scale", F), ("kv16", I), ("kv_slots", ctypes.c_long), ("cos", P), ("sin", P), ("isa", I),
                ("threads", I), ("residual_scale", F)]


class StepArgs(ctypes.Structure):
    _fields_ = [("batch", I), ("max_ctx", I), ("positions", P), ("block_tables", P), ("max_blocks", I),
                ("block_size", I), ("ctx_lens", P), ("h", P), ("qkv", P), ("attn", P), ("gu", P), ("act", P), ("tmp", P),
                ("scores", P), ("sums", P), ("partials", P)]


def _qweight(linear, keep: list) -> QWeight | None:
    bias = getattr(linear, "bias", None)
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(linear, PackedLinear):
        w = linear.weight
        keep.append(w)
        kind = (0 if w.kind == "q4" else 1) if isinstance(w, PackedWeight) else 3 + w.native_kind  # 3..6: AMX tiled
        mins = None if w.mins is None else w.mins.data_ptr()
        return QWeight(kind, w.rows, w.groups, w.codes.data_ptr(), w.scale.data_ptr(), mins, bias_ptr)
    if isinstance(linear, DenseLinear) and linear.in_features % 32 == 0 and linear.weight.dtype == torch.float32:
        keep.append(linear.weight)
        return QWeight(2, linear.out_features, linear.in_features // 32, linear.weight.data_ptr(), None, None, bias_ptr)
    return None


class FusedDecoder:
    """Built once per engine over the model and its KV cache; `available` says whether it applies.

    `options` (default: those bound by the engine being built, else the environment's) fix the ISA
    and the thread count of every call this decoder makes."""

    def __init__(self, model, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 options: kopts.KernelOptions | None = None):
        self.lib = native.load()
        self.options = options or kopts.current()
        self.model = model
        cfg = model.config
        self.cfg = cfg
        self._keep: list = []
        # The recipe first: a layer it does not compute exactly is refused, never approximated.
        self.refusal = refusal(model) if self.lib is not None else "the native kernels are not built"
        if self.refusal is not None and self.lib is not None:
            logger.warning("fused decode path refused: %s; decode runs on the torch path", self.refusal)
        self.layers = self._build_layers(model, kv_layers) if self.refusal is None else None
        if self.refusal is None and self.layers is None:
            self.refusal = "a weight type or the KV cache layout has no fused kernel"
        self.available = self.refusal is None
        if self.available:
            rope = model.rope
            self.shape = ModelShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.intermediate_size, cfg.rms_norm_eps, cfg.attention_scale,
                                    int(kv_layers[0][0].dtype == torch.float16), kv_layers[0][0].shape[1],
                                    rope.cos.data_ptr(), rope.sin.data_ptr(), self.options.isa, self.options.threads,
                                    cfg.residual_multiplier)
            self._scratch: dict[str, torch.Tensor] = {}
            self._split = self.lib.quill_attention_split()  # context positions per attention task

    def _build_layers(self, model, kv_layers):
        layers = []
        for layer, (k, v) in zip(model.layers, kv_layers):
            a, m = layer.self_attn, layer.mlp
            ws = [_qweight(x, self._keep) for x in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
            if any(w is None for w in ws) or not (k.is_contiguous() and k.dtype in (torch.float32, torch.float16)):
                return None
            qn, kn = a.q_norm, a.k_norm
            layers.append(LayerWeights(layer.input_layernorm.weight.data_ptr(),
                                       layer.post_attention_layernorm.weight.data_ptr(), *ws,
                                       k.data_ptr(), v.data_ptr(), None if qn is None else qn.weight.data_ptr(),
                                       None if kn is None else kn.weight.data_ptr()))
        return layers

    def _buf(self, name: str, numel: int) -> torch.Tensor:
        t = self._scratch.get(name)
        if t is None or t.numel() < numel:
            t = torch.empty(max(numel, 1))
            self._scratch[name] = t
        return t

    def _scratch_floats(self, batch: int, widest: int) -> int:
        """Group sums for the packed kernels, or the tiled kernel's digits and scales."""
        return max(batch * (widest // 32 + 1), -(-self.lib.quill_amx_scratch_bytes(batch, widest) // 4))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                ctx_lens: torch.Tensor, block_size: int, max_ctx: int | None = None) -> torch.Tensor:
        """input_ids, positions, ctx_lens (B,) int64; block_tables (B, max_blocks) int32, row b = row b's
        physical blocks (entries past its context unread); max_ctx: max(ctx_lens) if known -> hidden (B, H).
        The new token at positions[b] is written to its slot; positions 0 .. ctx_lens[b]-1 are attended."""
        cfg = self.cfg
        B, max_blocks = block_tables.shape
        if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
            raise ValueError("block_tables must be a contiguous (B, max_blocks) int32 tensor")
        if positions.dtype != torch.int64 or ctx_lens.dtype != torch.int64 or len(positions) != B or len(ctx_lens) != B:
            raise ValueError("positions and ctx_lens must be (B,) int64 tensors")
        lmax = int(ctx_lens.max()) if max_ctx is None else max_ctx
        if lmax > max_blocks * block_size:
            raise ValueError(f"a context of {lmax} positions does not fit {max_blocks} blocks of {block_size}")
        x = self.model.embed(input_ids).contiguous()  # (B, H), times any embedding multiplier
        qkv_n = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        widest = max(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim)
        step = StepArgs(
            B, lmax, positions.data_ptr(), block_tables.data_ptr(), max_blocks, block_size, ctx_lens.data_ptr(),
            self._buf("h", B * cfg.hidden_size).data_ptr(), self._buf("qkv", B * qkv_n).data_ptr(),
            self._buf("attn", B * cfg.num_heads * cfg.head_dim).data_ptr(),
            self._buf("gu", B * 2 * cfg.intermediate_size).data_ptr(),
            self._buf("act", B * cfg.intermediate_size).data_ptr(), self._buf("tmp", B * cfg.hidden_size).data_ptr(),
            self._buf("scores", B * cfg.num_heads * lmax).data_ptr(), self._buf("sums", self._scratch_floats(B, widest)).data_ptr(),
            self._buf("partials", B * cfg.num_kv_heads * (-(-lmax // self._split))
                      * (cfg.num_heads // cfg.num_kv_heads) * (cfg.head_dim + 2)).data_ptr(),
        )
        shape_ref, step_ref = ctypes.byref(self.shape), ctypes.byref(step)
        fn, xp = self.lib.quill_decode_layer, x.data_ptr()
        for layer in self.layers:
            fn(shape_ref, ctypes.byref(layer), step_ref, xp)
        return self.model.norm(x)
