"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer"), NeoX/HF layout (rotate halves)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at given positions.

    The cos/sin table ``[max_position, head_dim]`` is computed once in float32, the same way HF computes
    it per forward (``inv_freq = base^(-2i/d)``; ``emb = cat(freqs, freqs)``), so values match exactly.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.base = head_dim, max_position, base
        self.register_buffer("cos", torch.empty(max_position, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 tables on the buffers' device (after ``to_empty`` from meta)."""
        device = self.cos.device
        if device.type == "meta":
            return
        d = self.head_dim
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        t = torch.arange(self.max_position, dtype=torch.int64, device=device).float()
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        self.cos = emb.cos()  # [max_position, head_dim]
        self.sin = emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[T]``; q ``[T, num_heads, head_dim]``; k ``[T, num_kv_heads, head_dim]``.

        The reference path; on CPU the model uses ``cpu_kernels.rope_write_kv``, which fuses this with the
        KV-cache write and is tested against it."""
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
