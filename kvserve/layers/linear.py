"""Linear layers with a native small-M path on CPU (decode), F.linear otherwise.

At M = 1..``SMALL_M_MAX`` tokens a linear is bound by reading its weight; ``cpu_kernels.small_gemm``
streams the weight at the memory bandwidth where ``F.linear`` reaches about half of it
(docs/performance-log.md). Above that, or on CUDA, or without the native kernels, ``F.linear`` (oneDNN/MKL,
cuBLAS) is used: it is also the reference the kernel is tested against. Exception: float32 activations on an
AVX2 build take the native kernel at every M (``small_gemm`` hands M >= 12 to ``panel_gemm``, faster than
``F.linear`` there, and it never widens a bf16 weight in memory).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers import cpu_kernels, onednn

SMALL_M_MAX = 32  # rows; below it the native kernel beat F.linear (fp32 and bf16 weights), docs/performance-log.md
# bf16 x bf16 with AVX512-BF16 (the 4 x 4 vdpbf16ps tiles): 20-40 % faster than F.linear up to M = 64 on
# Zen 4 with 2 threads, even at M = 128, slower from 256 (docs/performance-log.md).
SMALL_M_MAX_BF16 = 64
NATIVE_DTYPES = (torch.float32, torch.bfloat16)


# float32 activations on an AVX2 build (CPUs without bf16 dot products): small_gemm hands 12 rows and more to
# panel_gemm, which beats F.linear at every M measured (1.4x at M = 64, 1.1x at 256 with float32 weights; a bf16
# weight is not widened in memory first) -- every linear takes the native kernel, and the whole-step decode
# paths take batches up to this many rows.
SMALL_M_MAX_PANEL = 64


@cache
def small_m_max(dtype: torch.dtype) -> int:
    """Most rows (tokens) a linear with activations of ``dtype`` sends to the native small-M kernel, and the
    most rows of the native whole-step decode paths."""
    if dtype == torch.bfloat16 and cpu_kernels.native_available() and "avx512_bf16" in cpu_kernels.gemm_features():
        return SMALL_M_MAX_BF16
    if native_any_m(dtype):
        return SMALL_M_MAX_PANEL
    return SMALL_M_MAX


@cache
def native_any_m(dtype: torch.dtype) -> bool:
    """Whether linears with activations of ``dtype`` take the native kernel at every M (float32 on AVX2 builds:
    ``panel_gemm``)."""
    return (dtype == torch.float32 and cpu_kernels.native_available()
            and "avx2_panel" in cpu_kernels.gemm_features())


def use_native(x: torch.Tensor) -> bool:
    """True when the native CPU kernels serve this activation (CPU tensor, float32/bfloat16, built)."""
    return x.device.type == "cpu" and x.dtype in NATIVE_DTYPES and cpu_kernels.native_available()


class Linear(nn.Linear):
    """``nn.Linear`` whose forward takes the native small-M kernel for decode-sized inputs on CPU, and for
    larger bfloat16 inputs oneDNN with the weight reordered once (``onednn.py``; same bits as ``F.linear``).

    The weight stays the plain ``[out_features, in_features]`` parameter (shared with ``F.linear`` for
    large M and with a tied embedding); the kernel takes a float32 bias.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.onednn_weights = onednn.PackCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[M, in_features]`` -> ``[M, out_features]``."""
        if (x.dim() == 2 and (x.shape[0] <= small_m_max(x.dtype) or native_any_m(x.dtype)) and use_native(x)
                and self.weight.dtype in NATIVE_DTYPES):
            bias = None if self.bias is None else self.bias.float()  # no copy for float32
            return cpu_kernels.small_gemm(x, self.weight, bias)
        if onednn.available(x, self.weight):
            return onednn.linear(x, self.onednn_weights.get("weight", self.weight),
                                 None if self.bias is None else self.bias.to(x.dtype))
        # bf16 weights under float32 activations (CPUs without bf16 dot products): widened per call, which
        # costs little next to the GEMM at the M that takes this path.
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

