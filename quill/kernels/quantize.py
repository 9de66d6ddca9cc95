"""Opt-in weight quantization for fp16/bf16/fp32 models: symmetric int8 per 32-element group."""

from __future__ import annotations

import torch

from quill.kernels.packed import GROUP, PackedLinear, PackedWeight, Workspace

QUANTIZE_CHOICES = ("int8",)


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """(N, K) float, K % 32 == 0 -> q8 PackedWeight: code = round(w / s), s = max|w| / 127 per group."""
    rows, cols = weight.shape
    if cols % GROUP:
        raise ValueError(f"int8 quantization needs in_features divisible by {GROUP}, got {cols}")
    groups = weight.float().reshape(rows, cols // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1) / 127.0  # (N, G)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(groups / safe[..., None]).clamp_(-127, 127).to(torch.int8).reshape(rows, cols)
    return PackedWeight("q8", codes.contiguous(), scale.contiguous(), None)  # symmetric: no mins


class Int8Weights:
    """A weight source that quantizes every linear (and an untied or tied LM head) to int8 as it loads."""

    def __init__(self, dense):
        self.dense = dense
        self.workspace = Workspace()

    def tensor(self, name: str) -> torch.Tensor:
        return self.dense.tensor(name)

    def _packed(self, w: torch.Tensor, b: torch.Tensor | None):
        if w.shape[1] % GROUP:
            from quill.kernels.linear import DenseLinear

            return DenseLinear(w.float().contiguous(), b)
        from quill.kernels.tiled import for_cpu

        return PackedLinear(for_cpu(quantize_int8(w)), b, self.workspace)

    def linear(self, names: list[str], has_bias: bool):
        get = self.dense.get
        w = torch.cat([get(n + ".weight").float() for n in names], dim=0)
        b = torch.cat([get(n + ".bias").float() for n in names], dim=0) if has_bias else None
        return self._packed(w, b)

    def embedding(self, name: str):
        return self.dense.embedding(name)  # lookups stay exact; only the matmuls are quantized

    def tied_head(self, embedding):
        return self._packed(embedding.weight.data, None)
