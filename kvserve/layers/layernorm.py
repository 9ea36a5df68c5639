"""RMSNorm (Zhang & Sennrich 2019), computed in float32 like HF's LlamaRMSNorm, optionally fused with the
residual add that precedes it (one native call on CPU; the torch code below is the reference)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.layers import cpu_kernels
from kvserve.layers.linear import use_native


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)``; x: ``[num_tokens, hidden_size]``."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Without ``residual``: the norm of x. With it: ``residual += x`` (in place), then the norm of the
        new residual, as vLLM's fused add-norm (``residual`` then carries the layer's running sum)."""
        if use_native(x) and x.is_contiguous() and self.weight.dtype == x.dtype and (
                residual is None or (residual.is_contiguous() and residual.dtype == x.dtype)):
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        return self.forward_reference(x, residual)

    def forward_reference(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The torch path (any device and dtype); the oracle for the native kernel."""
        if residual is not None:
            residual.add_(x)
            x = residual
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
