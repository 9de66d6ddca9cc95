"""Rotary position embeddings (Hugging Face rotate-half layout): plain, partial, and the frequency
scalings the supported families use (llama3, per-frequency factors, linear, longrope, yarn)."""

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


def scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict, context_len: int, theta: float = 10000.0,
                    dim: int | None = None) -> tuple[torch.Tensor, float]:
    """The rotary frequencies under a model's scaling, and the factor on cos/sin:
    - "llama3" from its parameters (transformers' config);
    - "freq_factors": one divisor per frequency (GGUF's rope_freqs tensor);
    - "linear": every frequency divided by `factor` (Gemma 3's global layers);
    - "longrope" (Phi-3.5 / Phi-4-mini): per-frequency divisors, `long_factor` when the context
      served is longer than original_max_position_embeddings, else `short_factor` (llama.cpp
      chooses by its context size the same way), with cos/sin times `attention_factor`, by default
      sqrt(1 + ln(factor) / ln(original)) where factor = max_position_embeddings / original;
    - "yarn" (Qwen2.5 / Qwen3 long context): see yarn_inv_freq."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return yarn_inv_freq(scaling, theta, dim or 2 * inv_freq.numel())
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind in ("freq_factors", "longrope"):
        if kind == "longrope":
            original = int(scaling["original_max_position_embeddings"])
            factors = scaling["long_factor"] if context_len > original else scaling["short_factor"]
        else:
            factors = scaling["factors"]
        factors = torch.tensor(factors, dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"RoPE scaling has {factors.numel()} factors; the rotary dims need {inv_freq.numel()}")
        return inv_freq / factors, longrope_attention_factor(scaling) if kind == "longrope" else 1.0
    raise ValueError(f"unsupported RoPE scaling {kind!r}; quill applies llama3, linear, longrope, yarn and "
                     "per-frequency factors")


def yarn_inv_freq(scaling: dict, theta: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than beta_slow (1) times over the original
    context are divided by `factor` (interpolated), those that turn more than beta_fast (32) times
    are kept (extrapolated), with a linear ramp over the dims between; cos/sin are multiplied by
    0.1 ln(factor) + 1 unless attention_factor is given. Written from the paper's formulas as
    transformers' _compute_yarn_parameters applies them (correction dims floored / ceiled)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return inv_freq, float(attention)


def longrope_attention_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or float(scaling["max_position_embeddings"]) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding:
    """Precomputed cos/sin tables (positions, rotary_dim) indexed by absolute position; the first
    rotary_dim dims of each head rotate (all of them unless the model says fewer), the rest pass."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, device="cpu",
                 rotary_dim: int = 0, context_len: int | None = None):
        dim = rotary_dim or head_dim
        # (base ** (i / dim)) for even i, as transformers computes it (int64 arange, then float)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        factor = 1.0
        if scaling:
            inv_freq, factor = scaled_inv_freq(inv_freq, scaling, context_len or max_positions, theta, dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (P, dim/2)
        # cos/sin of each half once, then both halves side by side (rotate-half layout): the same
        # values as cos of the duplicated (P, dim) angles, in half the time (128k positions: 0.1 s)
        cos, sin = freqs.cos(), freqs.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.cos = torch.cat((cos, cos), dim=-1).to(device)
        self.sin = torch.cat((sin, sin), dim=-1).to(device)
        self.dim = dim
        self.half = dim // 2

    @classmethod
    def from_tables(cls, cos: torch.Tensor, sin: torch.Tensor) -> "RotaryEmbedding":
        """Tables computed before (a .quill file's, mapped): (positions, rotary_dim) each, used as they are."""
        rope = cls.__new__(cls)
        rope.cos, rope.sin = cos, sin
        rope.dim = cos.shape[1]
        rope.half = rope.dim // 2
        return rope

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q (T, H, hd), k (T, KVH, hd), positions (T,) -> rotated q, k."""
        cos = self.cos[positions].unsqueeze(1)  # (T, 1, dim)
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = (x, None) if self.dim == x.shape[-1] else (x[..., : self.dim], x[..., self.dim :])
        x1, x2 = rot[..., : self.half], rot[..., self.half :]
        out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if rest is None else torch.cat((out, rest), dim=-1)


def tables_fit(scaling: dict | None, rows: int, positions: int) -> bool:
    """Whether tables computed for `rows` positions, cut to the first `positions`, are exactly the tables
    computed for `positions`: each row depends on its position alone, except LongRoPE's choice of short or
    long factors, which follows the context served."""
    if positions > rows:
        return False
    if scaling and scaling.get("rope_type") == "longrope":
        original = scaling["original_max_position_embeddings"]
        return (rows > original) == (positions > original)
    return True
