"""int8 weights (``--quantization int8``): per-output-channel symmetric codes, dynamic per-token activations.

At load every linear of the decoder layers and the LM head is quantized from the checkpoint's float32
tensors: ``w[n, k] ~= q[n, k] * w_scale[n]`` with ``w_scale[n] = max_k |w[n, k]| / 127`` and ``q`` in
``[-127, 127]``. At run time each input row (token) is quantized the same way per group of ``GROUP`` = 32
consecutive input features (one float32 scale per token and group, as llama.cpp's Q8_0 activations), the int8
products of a group are summed exactly in int32, and ``out = (sum_g acc_g * x_scale[m, g]) * w_scale[n]
(+ bias)`` in float32, returned in the activations' dtype. A decode step then reads one byte per weight
instead of bf16's two.

The codes live in one byte buffer per linear, in the blocked layout the native kernel streams
(``csrc/int8_gemm.c``; rows in blocks of 16, 4 consecutive k of each row per 4 bytes, stored as ``q + 128``
for ``vpdpbusd``'s unsigned operand)::

    codes  [Np / 16, Kp / 4, 16, 4] uint8 (q + 128) | w_scale [Np] float32
    (Np = N rounded up to 16, Kp = K rounded up to 32; padding rows and columns hold q = 0)

``int8_linear_reference`` is the torch path (CUDA, no compiler, ``KVSERVE_DISABLE_NATIVE=1``) and the
oracle of the kernel: it quantizes activations exactly as the kernel does and sums the integer products
exactly (float64), so both give the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers import cpu_kernels

BLOCK_ROWS = 16
GROUP = 32  # input features per activation scale
QMAX = 127.0


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _symmetric(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes of ``x`` (float32) scaled by ``max |x| / 127`` along ``dim``: (codes, scales without ``dim``)."""
    amax = x.abs().amax(dim=dim)
    qmax = torch.full_like(amax, QMAX)
    # NOTE: tensor / tensor: correctly rounded IEEE division, as the C kernel's (torch turns a division by or
    # of a Python scalar into a multiplication by a reciprocal, which can differ in the last bit).
    scale = amax / qmax
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    q = torch.round(x * inv.unsqueeze(dim)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 codes of a weight.

    Args:
        w: ``[N, K]`` float tensor (widened to float32 first).
    Returns:
        ``(q, scale)``: ``q`` ``[N, K]`` int8 in ``[-127, 127]``, ``scale`` ``[N]`` float32 with
        ``w ~= q * scale[:, None]`` (an all-zero row gets scale 0 and codes 0).
    """
    return _symmetric(w.float(), dim=1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-group activation quantization, bit for bit the kernel's ``int8_quantize_rows``.

    Args:
        x: ``[M, K]`` float32 or bfloat16 (widened to float32).
    Returns:
        ``(q, scale)``: ``q`` ``[M, Kp]`` int8 (``Kp`` = K rounded up to ``GROUP``, zero-padded), ``scale``
        ``[M, Kp / GROUP]`` float32 (``amax / 127`` of each group).
    """
    m, k = x.shape
    kp = _round_up(k, GROUP)
    xg = F.pad(x.float(), (0, kp - k)).view(m, kp // GROUP, GROUP)
    q, scale = _symmetric(xg, dim=2)
    return q.view(m, kp), scale


def packed_nbytes(n: int, k: int) -> int:
    """Bytes of the packed buffer of an ``[n, k]`` weight: codes plus a float32 scale per row (padded)."""
    np_ = _round_up(n, BLOCK_ROWS)
    return np_ * _round_up(k, GROUP) + np_ * 4


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(q [N, K] int8, scale [N] float32)`` -> the packed ``[packed_nbytes(N, K)]`` uint8 buffer."""
    n, k = q.shape
    np_, kp = _round_up(n, BLOCK_ROWS), _round_up(k, GROUP)
    padded = F.pad(q, (0, kp - k, 0, np_ - n))  # [Np, Kp]
    codes = padded.view(np_ // BLOCK_ROWS, BLOCK_ROWS, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
    codes_u8 = (codes.view(torch.uint8) ^ 0x80).flatten()  # q + 128
    return torch.cat([codes_u8, F.pad(scale.float(), (0, np_ - n)).view(torch.uint8)])


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_int8``: ``(q [n, k] int8, scale [n] float32)`` (copies)."""
    np_, kp = _round_up(n, BLOCK_ROWS), _round_up(k, GROUP)
    codes = (packed[:np_ * kp] ^ 0x80).view(torch.int8).view(np_ // BLOCK_ROWS, kp // 4, BLOCK_ROWS, 4)
    q = codes.permute(0, 2, 1, 3).reshape(np_, kp)[:n, :k].contiguous()
    scale = packed[np_ * kp:np_ * kp + 4 * np_].view(torch.float32)[:n].clone()
    return q, scale


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The torch int8 linear: quantize x per token and group, sum each group's integer products exactly, apply
    the scales in the kernel's order.

    Args:
        x: ``[M, K]`` float32 / bfloat16 / float16; q: ``[N, K]`` int8; w_scale: ``[N]`` float32;
        bias: ``[N]`` or None (added in float32).
    Returns:
        ``[M, N]`` in x's dtype: ``(sum_g float32(acc_g) * x_scale[m, g]) * w_scale[n] + bias[n]``, the native
        kernel's bits (float64 holds a group's int32 sums exactly).
    """
    xq, xs = quantize_rows(x)
    k = q.shape[1]
    qp = F.pad(q, (0, xq.shape[1] - k)).double()
    xd = xq.double()
    out = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float32, device=x.device)
    for g in range(xs.shape[1]):  # NOTE: groups in order, as the kernel sums them
        cols = slice(g * GROUP, (g + 1) * GROUP)
        out = out + (xd[:, cols] @ qp[:, cols].T).float() * xs[:, g:g + 1]
    out = out * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights (see the module doc); same ``forward`` contract as ``nn.Linear``.

    Buffers: ``packed`` (uint8, the kernel's layout); parameter ``bias`` (activation dtype) or None.
    Fill it with ``load_weight`` (float weights, quantized here).
    """

    packed: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("packed", torch.zeros(packed_nbytes(out_features, in_features), dtype=torch.uint8))
        self.bias: nn.Parameter | None = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_weight(self, w: torch.Tensor) -> None:
        """Quantize ``w`` ``[out_features, in_features]`` (any float dtype; float32 from the loaders).

        Raises:
            ValueError: a wrong shape.
        """
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"int8 linear: expected weight shape {(self.out_features, self.in_features)}, "
                             f"got {tuple(w.shape)}")
        packed = pack_int8(*quantize_weight(w.to(self.packed.device)))
        with torch.no_grad():
            self.packed.copy_(packed)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [N, K] int8, scale [N] float32)`` unpacked from the buffer."""
        return unpack_int8(self.packed, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, in_features]`` -> ``[M, out_features]`` in x's dtype."""
        if x.dim() == 2 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) \
                and cpu_kernels.native_available():
            # Every M, prefill included: at 512-2,048 rows the kernel ran 460-800 GOP/s against bf16 F.linear's
            # 300-720 GFLOP/s and dequantizing to bf16 for F.linear's 240-570 (docs/quantization.md).
            return cpu_kernels.int8_gemm(x, self.packed, self.out_features,
                                         None if self.bias is None else self.bias.float())
        shape = x.shape
        q, scale = self.dequantized()
        out = int8_linear_reference(x.reshape(-1, shape[-1]), q, scale, self.bias)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
