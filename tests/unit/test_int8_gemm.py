"""int8 weights (``--quantization int8``): the native kernel (``csrc/int8_gemm.c``) against the torch reference
(``layers/int8.py``) over odd shapes, on every compiled path: the host's build (AVX512-VNNI ``vpdpbusd`` where the
CPU has it), the AVX2 build (``-march=x86-64-v3``: ``vpmaddubsw``) and the portable C build (``-march=x86-64``).

The int32 sums are exact on every path and the float epilogue is the same sequence of float32 operations, so the
kernel must equal the reference bit for bit (not within a tolerance). A path the host cannot run is skipped with
a reason naming the missing CPU flag.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from _isa_builds import library_for

from kvserve.layers import cpu_kernels, int8

pytestmark = pytest.mark.skipif(not cpu_kernels.native_available(), reason="no C compiler: native kernels unbuilt")

X86 = platform.machine() in ("x86_64", "AMD64")
PATHS = {"vnni": ("native", ("avx512_vnni", "avx512bw")), "avx2": ("x86-64-v3", ("avx2", "fma")),
         "portable": ("x86-64", ())}


def _lib_for(path: str) -> object:
    """The library of one int8 path, or skip naming the CPU flags the host lacks."""
    return library_for(path, PATHS, cpu_kernels.int8_features)  # type: ignore[arg-type]


def _int_reference(x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """An independent oracle: int64 sums of each group's int8 products, then the kernel's float32 epilogue."""
    xq, xs = int8.quantize_rows(x)
    m, kp = xq.shape
    qp = F.pad(q, (0, kp - q.shape[1])).long().view(q.shape[0], -1, int8.GROUP)  # [N, G, 32]
    acc = (xq.long().view(m, 1, -1, int8.GROUP) * qp[None]).sum(-1)  # [M, N, G], exact
    out = torch.zeros(m, q.shape[0])
    for g in range(acc.shape[2]):
        out = out + acc[:, :, g].float() * xs[:, g:g + 1]
    out = out * w_scale[None, :]
    return (out if bias is None else out + bias).to(x.dtype)


@pytest.mark.parametrize("path", ["vnni", "avx2", "portable"])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
@pytest.mark.parametrize("n,k", [(33, 37), (7, 100), (130, 576), (67, 1538)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_equals_reference(path: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    """K not a multiple of 4 / 32 / 64, N not a multiple of 16, M past one token group of 8 (2 on AVX2)."""
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(m * 10_000 + n * 10 + k)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    q, scale = int8.quantize_weight(w)
    packed = int8.pack_int8(q, scale)
    for bias in (None, b):
        out = cpu_kernels.int8_gemm(x, packed, n, bias, lib=lib)  # type: ignore[arg-type]
        assert out.dtype == dtype and out.shape == (m, n)
        ref = int8.int8_linear_reference(x, q, scale, bias)
        assert torch.equal(out, ref)
        assert torch.equal(out, _int_reference(x, q, scale, bias))


@pytest.mark.parametrize("path", ["vnni", "avx2", "portable"])
def test_extreme_codes_do_not_saturate(path: str) -> None:
    """Every product at +-127 * +-127 (the AVX2 path's int16 pair sums at their largest, 32,258; the VNNI path's
    unsigned weight bytes at 255 and 1), rows of zeros (scale 0), and K up to the down projection's 1,536."""
    lib = _lib_for(path)
    k, n = 1536, 20
    x = torch.full((3, k), 2.0)
    x[1] = -2.0
    x[2] = 0.0  # an all-zero activation row
    w = torch.ones(n, k)
    w[1::2] = -1.0
    w[5] = 0.0  # an all-zero weight row
    q, scale = int8.quantize_weight(w)
    assert q.abs().max() == 127 and scale[5] == 0
    out = cpu_kernels.int8_gemm(x, int8.pack_int8(q, scale), n, lib=lib)  # type: ignore[arg-type]
    assert torch.equal(out, int8.int8_linear_reference(x, q, scale, None))
    assert out[0, 0] == pytest.approx(2.0 * k, rel=1e-6) and out[1, 1] == pytest.approx(2.0 * k, rel=1e-6)
    assert torch.all(out[2] == 0) and torch.all(out[:, 5] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_matches_torch(dtype: torch.dtype) -> None:
    """``int8_quantize_rows`` (C) and ``int8.quantize_rows`` (torch) give the same codes and scales, including at
    ties of ``x * 127 / amax`` (bf16 inputs hit them often; torch's scalar division would miss some), one scale
    per token and group of 32 features (the last group zero-padded)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(257, 301, generator=g) * torch.rand(257, 1, generator=g) * 10).to(dtype)
    x[3, 64:96] = 0.0  # an all-zero group: scale 0, codes 0
    q, s = cpu_kernels.int8_quantize_rows(x)
    rq, rs = int8.quantize_rows(x)
    assert q.shape == (257, 320) and s.shape == (257, 10)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert s[3, 2] == 0 and torch.all(q[3, 64:96] == 0) and torch.all(q[:, 301:] == 0)
    groups = q.view(257, 10, 32).abs().amax(dim=2)
    assert torch.all((groups == 127) | (s == 0))


def test_pack_unpack_round_trip_and_quantization_error() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(45, 70, generator=g)
    q, scale = int8.quantize_weight(w)
    packed = int8.pack_int8(q, scale)
    assert packed.numel() == int8.packed_nbytes(45, 70) == 48 * 96 + 48 * 4
    q2, s2 = int8.unpack_int8(packed, 45, 70)
    assert torch.equal(q, q2) and torch.equal(scale, s2)
    err = (q.float() * scale[:, None] - w).abs()
    assert torch.all(err <= scale[:, None] / 2 * (1 + 1e-6))  # round to nearest: at most half a step


def test_int8_linear_module_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Int8Linear`` forward: the native kernel and the torch path (library unavailable) agree bitwise, at a
    decode-sized and a prefill-sized M, and both stay close to the float linear."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(50, 96, generator=g), torch.randn(50, generator=g)
    lin = int8.Int8Linear(96, 50, bias=True)
    lin.load_weight(w)
    with torch.no_grad():
        lin.bias.copy_(b)  # type: ignore[union-attr]
    for m in (5, 300):
        x = torch.randn(m, 96, generator=g)
        native = lin(x)
        with monkeypatch.context() as mp:
            mp.setattr(cpu_kernels, "_library", lambda: None)
            torch_path = lin(x)
            assert not cpu_kernels.native_available()
        assert torch.equal(native, torch_path)
        ref = F.linear(x, w, b)
        assert (native - ref).abs().max() < 0.02 * ref.abs().max()
    with pytest.raises(ValueError, match="expected weight shape"):
        lin.load_weight(torch.zeros(96, 50))


def test_quantization_flag_is_validated() -> None:
    from kvserve.config import EngineConfig
    from kvserve.errors import InvalidRequestError

    assert EngineConfig(quantization="int8").quantization == "int8"
    with pytest.raises(InvalidRequestError, match="quantization.*'fp4'"):
        EngineConfig(quantization="fp4")
