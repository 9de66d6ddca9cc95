"""Linear layers: the one place a weight matrix is multiplied, so faster kernels slot in here."""

from __future__ import annotations

import torch
from torch import nn

from quill.kernels import gemm


class DenseLinear(nn.Module):
    """y = x @ W.T + b with an fp32 (or model-dtype) weight held as one tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # (out,)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor, gemv_rows: int = 0) -> torch.Tensor:  # (T, in) -> (T, out)
        if x.dim() == 2 and x.shape[0] >= gemm.MIN_ROWS and self.weight.dtype == x.dtype == torch.float32:
            out = gemm.matmul_t(x.contiguous(), self.weight, torch.empty(x.shape[0], self.out_features))
            return out if self.bias is None else out.add_(self.bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def resident_bytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())
