"""Paged attention over a flat token batch: K/V writes via slot mapping, reads via block tables.

Every step's batch is a flat run of T tokens from several sequences:

    tokens:  [ seq A: q_len 5 (prefill chunk) | seq B: 1 | seq C: 1 ]
    A's queries at positions ctx_A-5 .. ctx_A-1 attend keys 0 .. own position
    B and C (decodes) attend their whole cache, batched with a padding mask.

The runner prepares `AttentionMetadata` (plain tensors); the model only calls `paged_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A sequence that computes q_len > 1 tokens this step (or one token with a custom mask)."""

    q_start: int  # first row in the flat batch
    q_len: int
    ctx_slots: torch.Tensor  # (ctx,) slot index of every position 0..ctx-1
    mask: torch.Tensor | None  # (q_len, ctx) bool, True = attend; None = plain causal (ctx == q_len)
    window_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # the same for each sliding window


@dataclass
class AttentionMetadata:
    """Where this step's K/V go and what each query row attends."""

    slot_mapping: torch.Tensor  # (T,) long: cache slot for each new token
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None  # (Bd,) long: rows of the flat batch that are decodes
    decode_slots: torch.Tensor | None = None  # (Bd, Lmax) long: cache slots of each decode's context
    decode_mask: torch.Tensor | None = None  # (Bd, 1, 1, Lmax) bool, True = attend
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # the same for each sliding window
    gemv_rows: int = 0  # leading rows that are running decodes: linears keep them on the row-invariant kernel


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """k_cache/v_cache (KVH, num_slots, hd); k/v (T, KVH, hd); slots (T,). An fp16 cache stores
    k/v rounded to nearest (as the fused decode kernel does)."""
    k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # (T, H, hd)
    k_cache: torch.Tensor,  # (KVH, num_slots, hd)
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,  # the layer's sliding window: its masks come from the metadata
) -> torch.Tensor:  # (T, H, hd)
    out = torch.empty_like(q)
    num_heads, num_kv = q.shape[1], k_cache.shape[0]
    gqa = num_heads != num_kv
    for span in meta.prefills:
        qs = q[span.q_start : span.q_start + span.q_len].transpose(0, 1).unsqueeze(0)  # (1, H, q, hd)
        ks = k_cache[:, span.ctx_slots].to(q.dtype).unsqueeze(0)  # (1, KVH, ctx, hd)
        vs = v_cache[:, span.ctx_slots].to(q.dtype).unsqueeze(0)
        mask = span.mask if window is None else span.window_masks[window]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )  # (1, H, q, hd)
        out[span.q_start : span.q_start + span.q_len] = o[0].transpose(0, 1)
    if meta.decode_rows is not None:
        qd = q[meta.decode_rows].unsqueeze(2)  # (Bd, H, 1, hd)
        kd = k_cache[:, meta.decode_slots].to(q.dtype).transpose(0, 1)  # (Bd, KVH, Lmax, hd)
        vd = v_cache[:, meta.decode_slots].to(q.dtype).transpose(0, 1)
        mask = meta.decode_mask if window is None else meta.decode_window_masks[window]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[meta.decode_rows] = o.squeeze(2)
    return out
