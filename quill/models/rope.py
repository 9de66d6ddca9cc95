"""Rotary position embeddings (Hugging Face rotate-half layout), with Llama 3 frequency scaling."""

from __future__ import annotations

import math

import torch


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, smooth in between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """The rotary frequencies under a model's scaling: "llama3" from its parameters (transformers'
    config), or "freq_factors", one divisor per frequency (GGUF's rope_freqs tensor)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    if kind == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors; this head_dim needs {inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"unsupported RoPE scaling {kind!r}; quill applies llama3 and per-frequency factors")


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, device="cpu"):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling:
            inv_freq = scaled_inv_freq(inv_freq, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        self.half = head_dim // 2

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q (T, H, hd), k (T, KVH, hd), positions (T,) -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, hd)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin, self.half), _rotate(k, cos, sin, self.half)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
