"""Decode rows through one fused C call per layer (quill_decode_layer), reading the paged cache in place.

Per step Python does the embedding lookup, one call per layer and the final norm; everything else
(norms, QKV, q/k norm, RoPE, K/V write, attention, O, the gated MLP, residuals) happens in C. The rows come
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
    pass


QWeight._fields_ = [("kind", I), ("rows", I), ("groups", I), ("codes", P), ("scale", P), ("mins", P), ("bias", P),
                    ("parts", ctypes.POINTER(QWeight)), ("nparts", I), ("amx", I), ("scale_d", P), ("mins_d", P)]


class LayerWeights(ctypes.Structure):
    _fields_ = [("attn_in", P), ("attn_out", P), ("mlp_in", P), ("mlp_out", P), ("qkv", QWeight), ("o", QWeight),
                ("gate_up", QWeight), ("down", QWeight), ("k_cache", P), ("v_cache", P), ("q_norm", P), ("k_norm", P),
                ("qk_norm_full", I), ("window", I), ("cos", P), ("sin", P)]


# The layer quill_decode_layer computes, described per layer (LayerWeights) and per model (ModelShape):
# - each branch: an optional RMSNorm in, the branch, an optional RMSNorm out, times the residual
#   multiplier, added to x (pre-norm, sandwich and post-norm layouts);
# - attention: fused QKV with or without bias; optional q/k RMSNorm, per head or over the whole
#   projection; rotate-half RoPE over the first rotary_dim dims from the layer's own cos/sin tables
#   (any frequency scaling already in them), or none; causal attention over the paged cache, all of
#   it or the last `window` positions, scores scaled by the config's attention_scale; O;
# - MLP: fused gate/up, SiLU or tanh GELU, down.
# The embedding multiplier is applied before the layers, and logit scaling and soft-capping after,
# by the model. An architecture is listed once each of its layers is exactly that.
FUSED_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3", "granite", "gemma3", "olmo2", "smollm3", "phi3"})
FUSED_QK_NORMS = {None: 0, "head": 0, "full": 1}  # ModelConfig.qk_norm -> LayerWeights.qk_norm_full
FUSED_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # MLP.act_name -> ModelShape.act


def refusal(model) -> str | None:
    """Why the fused decode layer cannot compute this model's layers exactly, or None. It reads the
    recipe from the layers themselves (the torch path's modules) and checks each part against the
    config and against what quill_decode_layer implements."""
    from quill.models.llama import MLP, Attention, DecoderLayer, RMSNorm
    from quill.models.rope import RotaryEmbedding

    cfg = model.config
    if cfg.architecture not in FUSED_ARCHITECTURES:
        return f"architecture {cfg.architecture!r} is not one it implements ({', '.join(sorted(FUSED_ARCHITECTURES))})"
    if cfg.head_dim % 8 or cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 16:
        return (f"head_dim {cfg.head_dim} (needs a multiple of 8) or {cfg.num_heads} heads over {cfg.num_kv_heads} "
                "KV heads (needs a whole group of at most 16)")
    for i, layer in enumerate(model.layers):
        parts = (type(layer), type(layer.self_attn), type(layer.mlp))
        if parts != (DecoderLayer, Attention, MLP):
            return f"layer {i} is built from {', '.join(t.__name__ for t in parts)}, not the layer it computes"
        a = layer.self_attn
        norms = [isinstance(n, RMSNorm) for n in (a.q_norm, a.k_norm)]
        if norms != [cfg.qk_norm is not None] * 2 or a.qk_norm != cfg.qk_norm or a.qk_norm not in FUSED_QK_NORMS:
            return f"layer {i}'s q/k norms {norms} ({a.qk_norm}) do not match the config (qk_norm={cfg.qk_norm})"
        if a.window != cfg.layer_window(i):
            return f"layer {i}'s sliding window {a.window} is not the config's {cfg.layer_window(i)}"
        if (a.rope is None) != (cfg.layer_rope(i) is None) or (a.rope is not None and (
                type(a.rope) is not RotaryEmbedding or a.rope.dim != cfg.rotary_width)):
            return f"layer {i}'s RoPE ({type(a.rope).__name__}) is not the config's ({cfg.layer_rope(i)}, {cfg.rotary_width} dims)"
        if layer.mlp.act_name not in FUSED_ACTIVATIONS or layer.mlp.act_name != cfg.hidden_act:
            return f"layer {i}'s activation {layer.mlp.act_name!r} is not one it implements ({', '.join(FUSED_ACTIVATIONS)})"
        branch_norms = (layer.attn_in, layer.attn_out, layer.mlp_in, layer.mlp_out)
        if any(n is not None and type(n) is not RMSNorm for n in branch_norms):
            return f"layer {i} has a norm other than RMSNorm around a branch"
    return None


class ModelShape(ctypes.Structure):
    _fields_ = [("hidden", I), ("heads", I), ("kv_heads", I), ("head_dim", I), ("inter", I), ("eps", F),
                ("scale", F), ("kv16", I), ("kv_slots", ctypes.c_long), ("rotary_dim", I), ("act", I), ("isa", I),
                ("threads", I), ("residual_scale", F), ("int8", I)]


class StepArgs(ctypes.Structure):
    _fields_ = [("batch", I), ("max_ctx", I), ("positions", P), ("block_tables", P), ("max_blocks", I),
                ("block_size", I), ("ctx_lens", P), ("h", P), ("qkv", P), ("attn", P), ("gu", P), ("act", P), ("tmp", P),
                ("scores", P), ("sums", P), ("partials", P)]


def _qweight(linear, keep: list) -> QWeight | None:
    bias = getattr(linear, "bias", None)
    bias_ptr = None if bias is None else bias.data_ptr()
    if isinstance(linear, PackedLinear):
        w = _layout(linear.weight, keep)
        if w is not None:
            w.bias = bias_ptr
        return w
    if isinstance(linear, DenseLinear) and linear.in_features % 32 == 0 and linear.weight.dtype == torch.float32:
        keep.append(linear.weight)
        return QWeight(2, linear.out_features, linear.in_features // 32, linear.weight.data_ptr(), None, None, bias_ptr)
    return None


AMX_KIND, BLOCKS_KIND, SPLIT_KIND = 3, 7, 20  # decode_layer.c's AMX-tiled kind, BLOCKS_FIRST (+ kquant.c's kind), SPLIT


def _layout(w, keep: list) -> QWeight | None:
    """A resident weight as the kernel's QWeight (no bias), or None for a layout it has no code for."""
    from quill.kernels.kquant import BlockWeight
    from quill.kernels.packed import SplitWeight

    keep.append(w)
    if isinstance(w, SplitWeight):
        parts = [_layout(p, keep) for p in w.parts]
        if any(p is None for p in parts):
            return None
        array = (QWeight * len(parts))(*parts)
        keep.append(array)
        return QWeight(SPLIT_KIND, w.rows, w.groups, None, None, None, None, array, len(parts))
    if isinstance(w, BlockWeight):
        return QWeight(BLOCKS_KIND + w.kind, w.rows, w.groups, w.blocks.data_ptr(), None, None, None)
    if isinstance(w, PackedWeight):
        mins = None if w.mins is None else w.mins.data_ptr()  # NULL: all zero, the kernels skip the min terms
        return QWeight(0 if w.kind == "q4" else 1, w.rows, w.groups, w.codes.data_ptr(), w.scale.data_ptr(), mins, None)
    _, codes, scale, mins, scale_d, mins_d = w.native_args()  # AMX tiled
    return QWeight(AMX_KIND, w.rows, w.groups, codes, scale, mins, None, None, 0, w.native_kind, scale_d, mins_d)


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
            self.shape = ModelShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.intermediate_size, cfg.rms_norm_eps, cfg.attention_scale,
                                    int(kv_layers[0][0].dtype == torch.float16), kv_layers[0][0].shape[1],
                                    cfg.rotary_width, FUSED_ACTIVATIONS[cfg.hidden_act], self.options.isa,
                                    self.options.threads, cfg.residual_multiplier, int(self.options.int8))
            self._scratch: dict[str, torch.Tensor] = {}
            self._split = self.lib.quill_attention_split()  # context positions per attention task

    def _build_layers(self, model, kv_layers):
        def ptr(module, attr: str):  # a module's tensor's address, NULL where the layer has no such module
            return None if module is None else getattr(module, attr).data_ptr()

        layers = []
        for layer, (k, v) in zip(model.layers, kv_layers):
            a, m = layer.self_attn, layer.mlp
            ws = [_qweight(x, self._keep) for x in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
            if any(w is None for w in ws) or not (k.is_contiguous() and k.dtype in (torch.float32, torch.float16)):
                return None
            norms = [ptr(n, "weight") for n in (layer.attn_in, layer.attn_out, layer.mlp_in, layer.mlp_out)]
            layers.append(LayerWeights(*norms, *ws, k.data_ptr(), v.data_ptr(), ptr(a.q_norm, "weight"),
                                       ptr(a.k_norm, "weight"), FUSED_QK_NORMS[a.qk_norm], a.window or 0,
                                       ptr(a.rope, "cos"), ptr(a.rope, "sin")))
        return layers

    def _buf(self, name: str, numel: int) -> torch.Tensor:
        t = self._scratch.get(name)
        if t is None or t.numel() < numel:
            t = torch.empty(max(numel, 1))
            self._scratch[name] = t
        return t

    def _scratch_floats(self, batch: int, widest: int) -> int:
        """Group sums and digits for the block kernels, the tiled kernel's digits and scales, or int8 activations."""
        return max(batch * (widest // 16 + 1), -(-self.lib.quill_gemv_kq_scratch_bytes(batch, widest) // 4),
                   -(-self.lib.quill_amx_scratch_bytes(batch, widest) // 4), -(-self.lib.quill_act8_bytes(batch, widest) // 4))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                ctx_lens: torch.Tensor, block_size: int, max_ctx: int | None = None,
                layers: list[int] | tuple[int, ...] | None = None) -> torch.Tensor:
        """input_ids, positions, ctx_lens (B,) int64; block_tables (B, max_blocks) int32, row b = row b's
        physical blocks (entries past its context unread); max_ctx: max(ctx_lens) if known -> hidden (B, H).
        The new token at positions[b] is written to its slot; positions 0 .. ctx_lens[b]-1 are attended.
        layers: run only these layers, in order, then the final norm (a self-speculation draft), else all."""
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
        for layer in self.layers if layers is None else [self.layers[i] for i in layers]:
            fn(shape_ref, ctypes.byref(layer), step_ref, xp)
        return self.model.norm(x)
