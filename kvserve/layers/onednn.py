"""Prefill-sized bfloat16 GEMMs through oneDNN with weights reordered once, and SwiGLU in the GEMM epilogue.

``F.linear`` on CPU already runs oneDNN, but it reorders the ``[N, K]`` weight into oneDNN's blocked layout
on every call; at M = 512 prefill rows on SmolLM2's shapes the reorder is ~5 % of the GEMM. Here each weight
is reordered once (``torch.ops.mkldnn._reorder_linear_weight``) and kept beside the plain one, which the
decode kernels (``cpu_kernels.small_gemm``, ``decode_step.c``) still stream row by row: a second copy of the
projection weights in memory, for prefill only.

The MLP's ``silu(x @ Wg^T) * (x @ Wu^T)`` becomes two GEMMs with oneDNN post-ops: the gate GEMM with a
``swish`` eltwise post-op, then the up GEMM with a binary ``mul`` by the gate, so the ``[M, 2I]`` gate/up
activation is never written and re-read by a separate SiLU·mul pass. Measured on the project's Zen 5 host
(2 threads, M = 512, 30 SmolLM2 MLPs, paired runs): 0.94x the time with reordered weights alone, 0.90x
fused (``docs/performance-log.md``).

Numerics: the plain reordered linear gives the same bits as ``F.linear`` (same oneDNN kernel). The fused
SwiGLU rounds differently from the reference ``silu_mul(F.linear(x, W_gate_up))``: the up product is
multiplied in float32 before its one rounding to bfloat16 (the reference rounds it first), so results differ
by at most about one bfloat16 ulp; hence bfloat16 only (float32 serving keeps the exact reference path).
Used where ``available`` says so: CPU tensors, bfloat16 weights and activations, a CPU with native bf16 dot
products, a torch built with oneDNN, and the native kernels not disabled (``KVSERVE_DISABLE_NATIVE=1``
switches this off too, so that one switch gives the whole reference path).
"""

from __future__ import annotations

import os
from functools import cache

import torch

from kvserve import cpu_features

# oneDNN picks its blocked layout for a batch-size hint; the prefill chunks of a CPU step are up to 512 tokens
# (the default step budget, config.DEFAULT_MAX_NUM_BATCHED_TOKENS), and the layout serves any M.
PACK_HINT_M = 512


@cache
def _supported() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (not os.environ.get("KVSERVE_DISABLE_NATIVE") and torch.backends.mkldnn.is_available()
            and cpu_features.has_native_bf16(cpu_features.host_flags()) and ops is not None
            and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight"))


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight^T`` may take the reordered-weight oneDNN path (see the module doc)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and x.dim() == 2 and _supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bfloat16 weight -> the same values in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT_M)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias``: x ``[M, K]`` bfloat16 contiguous, ``packed`` from ``pack(W)`` -> ``[M, N]`` bfloat16,
    bitwise ``F.linear(x, W, bias)``."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def swiglu(x: torch.Tensor, gate_packed: torch.Tensor, up_packed: torch.Tensor) -> torch.Tensor:
    """``silu(x @ Wg^T) * (x @ Wu^T)``: x ``[M, H]`` bfloat16 -> ``[M, I]`` bfloat16 (two GEMMs with
    post-ops; within about one bfloat16 ulp of ``silu_mul`` over the fused gate/up GEMM)."""
    x = x.contiguous()
    gate = torch.ops.mkldnn._linear_pointwise(x, gate_packed, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, gate, up_packed, None, "mul")


class PackCache:
    """A module's reordered copies of weight tensors, rebuilt when a weight is replaced or written in place
    (keyed by storage address and version counter)."""

    def __init__(self) -> None:
        self._packed: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}

    def get(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` (``[N, K]`` bfloat16, or a row slice of one) under ``name``."""
        key = (weight.data_ptr(), weight._version)
        hit = self._packed.get(name)
        if hit is None or hit[0] != key:
            hit = (key, pack(weight))
            self._packed[name] = hit
        return hit[1]
