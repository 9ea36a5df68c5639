"""GGUF blocks (``--quantization gguf``): repacking and dequantization against the ``gguf`` package, and the native
kernel (``csrc/gguf_gemm.c``) against a float64 reference over odd shapes, on every compiled path: the host's build
(AVX512-VNNI ``vpdpbusd`` where the CPU has it), the AVX2 build (``-march=x86-64-v3``: ``vpmaddubsw``) and the
portable C build (``-march=x86-64``).

Tolerance of the kernel: the reference multiplies the exactly dequantized weights (float64) with the activations
quantized exactly as the kernel does (``int8.quantize_rows``), so the only differences are the kernel's float32
roundings: each group's term (about 3 roundings) and the sum over the G groups of K. Recursive summation keeps the
error within ``(G + 4) * 2^-24 * sum_k |w_k x_k|`` (Higham, "Accuracy and Stability of Numerical Algorithms",
3.1); bfloat16 outputs add their own rounding, ``2^-8 |ref|``. A single wrong code moves an output by about
``|w_k x_k|``, far above that bound.
"""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
import torch
from _isa_builds import library_for

from kvserve.layers import cpu_kernels, int8
from kvserve.layers.gguf_blocks import dequantize, gguf_linear_reference, pack, unpack_rows
from kvserve.layers.gguf_formats import FORMATS, packed_nbytes

X86 = platform.machine() in ("x86_64", "AMD64")
PATHS = {"vnni": ("native", ("avx512_vnni", "avx512bw")), "avx2": ("x86-64-v3", ("avx2", "fma", "f16c")),
         "portable": ("x86-64", ())}
CODES = {f.name: f.code for f in FORMATS.values()}
NAMES = list(CODES)


def _lib_for(path: str) -> object:
    """The library of one path, or skip naming the CPU flags the host lacks."""
    return library_for(path, PATHS, cpu_kernels.gguf_features)  # type: ignore[arg-type]


def random_blocks(name: str, n: int, k: int, gen: torch.Generator, scale: float = 0.02) -> torch.Tensor:
    """``[n, row bytes]`` of valid blocks: random code and scale bytes, f16 fields of either sign in
    ``[scale / 20, scale]``."""
    f = FORMATS[CODES[name]]
    nb = k // f.elems
    raw = torch.randint(0, 256, (n, nb, f.nbytes), dtype=torch.uint8, generator=gen)
    for _, off, _, unit in f.fields:
        if unit == 2:
            mag = scale * (0.05 + 0.95 * torch.rand(n, nb, generator=gen))
            sign = torch.randint(0, 2, (n, nb), generator=gen) * 2 - 1
            raw[..., off:off + 2] = (mag * sign).to(torch.float16).view(torch.uint8).view(n, nb, 2)
    return raw.view(n, -1)


def _table(segments: list[tuple[int, torch.Tensor]], k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    packed = [pack(data, code) for code, data in segments]
    rows = [(code, data.shape[0], p.data_ptr()) for (code, data), p in zip(segments, packed, strict=True)]
    table = torch.tensor([len(rows)] + [v for r in rows for v in r], dtype=torch.int64)
    return table, packed  # (the packed buffers must outlive the call)


def _check(out: torch.Tensor, x: torch.Tensor, segments: list[tuple[int, torch.Tensor]],
           bias: torch.Tensor | None) -> None:
    ref = gguf_linear_reference(x.double(), segments, bias, dtype=torch.float64)  # (x.double(): no final rounding)
    xq, xs = int8.quantize_rows(x)
    m, k = xq.shape
    xd = (xq.double().view(m, -1, 32) * xs.double()[..., None]).view(m, k)
    w = torch.cat([dequantize(data, code, torch.float64) for code, data in segments])
    bound = (k // 32 + 4) * 2.0 ** -24 * (xd.abs() @ w.abs().T)
    if bias is not None:
        bound = bound + 2.0 ** -24 * bias.double().abs()
    if out.dtype == torch.bfloat16:  # the output's rounding: at most 2^-8 of the float32 value
        bound = bound + 2.0 ** -8 * (ref.abs() + bound)
    err = (out.double() - ref).abs()
    assert torch.all(err <= bound), f"max err {err.max():.3g}, at bound ratio {(err / bound).max():.3g}"


@pytest.mark.parametrize("path", ["vnni", "avx2", "portable"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m,n,blocks", [(1, 130, 5), (3, 7, 3), (8, 33, 1), (17, 130, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_gemm_equals_reference(path: str, name: str, m: int, n: int, blocks: int, dtype: torch.dtype) -> None:
    """N not a multiple of 16 (a partial row block), M past a token group (8 on VNNI, 2 on AVX2, 4 portable),
    K an odd number of blocks (of 32 or 256)."""
    lib = _lib_for(path)
    k = blocks * FORMATS[CODES[name]].elems
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    x[:, :7] *= 30  # an outlier channel, as in real models
    segments = [(CODES[name], random_blocks(name, n, k, g))]
    table, _packed = _table(segments, k)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        out = cpu_kernels.gguf_gemm(x, table, n, b, lib=lib)  # type: ignore[arg-type]
        assert out.dtype == dtype and out.shape == (m, n)
        _check(out, x, segments, b)


@pytest.mark.parametrize("path", ["vnni", "avx2", "portable"])
def test_mixed_segments_and_real_sizes(path: str) -> None:
    """One table with every format in turn (a fused projection whose parts differ, as Qwen's q/k Q5_0 and v
    Q8_0), K = 1,536 (SmolLM2's MLP width, 6 K-blocks), rows not multiples of 16 in the middle."""
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(7)
    k = 1536
    segments = [(CODES[name], random_blocks(name, rows, k, g)) for name, rows in
                zip(NAMES, [20, 16, 9, 33, 48, 5], strict=True)]
    n = sum(s[1].shape[0] for s in segments)
    table, _packed = _table(segments, k)
    for m in (1, 9):
        x = torch.randn(m, k, generator=g)
        _check(cpu_kernels.gguf_gemm(x, table, n, lib=lib), x, segments, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["vnni", "avx2", "portable"])
@pytest.mark.parametrize("name", NAMES)
def test_extreme_codes_do_not_saturate(path: str, name: str) -> None:
    """All code bytes 0xFF or 0x00 (Q8_0: q = -1 or 0 ... and 0x7F / 0x80: q = 127 / -128; Q6_K: q = 63) against
    activations at +-127: the AVX2 path's int16 pair sums at their largest."""
    lib = _lib_for(path)
    f = FORMATS[CODES[name]]
    k, n = 2 * f.elems, 16
    g = torch.Generator().manual_seed(3)
    raw = random_blocks(name, n, k, g).view(n, 2, f.nbytes)
    for _, off, size, unit in f.fields:
        if unit == 4:
            raw[: n // 2, :, off:off + size] = 0xFF
            raw[n // 2:, :, off:off + size] = 0x80 if name == "Q8_0" else 0x00
    if name == "Q8_0":
        raw[0, :, 2:34] = 0x7F
    x = torch.full((3, k), 5.0)
    x[1] = -5.0
    x[2, ::2] = -5.0
    segments = [(f.code, raw.view(n, -1))]
    table, _packed = _table(segments, k)
    _check(cpu_kernels.gguf_gemm(x, table, n, lib=lib), x, segments, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_is_gguf_bit_for_bit_and_pack_round_trips(name: str) -> None:
    """Any bytes (NaN, infinite and subnormal scales included): our float32 dequantization has the gguf package's
    bits (NaNs where it has NaNs), and ``unpack_rows(pack(blocks))`` gives the blocks back, for all rows and for a
    gather of some."""
    f = FORMATS[CODES[name]]
    g = torch.Generator().manual_seed(11)
    n, k = 37, 3 * f.elems
    raw = torch.randint(0, 256, (n, k // f.elems * f.nbytes), dtype=torch.uint8, generator=g)
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(f.code)).reshape(n, k)
    got = dequantize(raw, f.code)
    assert got.dtype == torch.float32
    nan = np.isnan(want)  # (a NaN scale: torch's f16 -> f32 conversion drops the payload numpy keeps)
    assert np.array_equal(np.isnan(got.numpy()), nan)
    assert np.array_equal(got.numpy()[~nan].view(np.uint32), want[~nan].view(np.uint32))
    packed = pack(raw, f.code)
    assert packed.numel() == packed_nbytes(f.code, n, k) == 48 * k // f.elems * f.nbytes
    assert torch.equal(unpack_rows(packed, f.code, k)[:n], raw)
    rows = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(unpack_rows(packed, f.code, k, rows), raw[rows])
    exact = dequantize(raw, f.code, torch.float64)  # the formats' exact values: float32's within an ulp
    finite = torch.isfinite(exact) & (exact.abs() < 6e4)
    assert torch.all((exact[finite] - got.double()[finite]).abs() <= 2.0 ** -23 * exact[finite].abs() + 1e-30)


def test_real_file_blocks_dequantize_as_gguf() -> None:
    """The catalog files' own blocks of each format they use: the same bits as the gguf package."""
    from kvserve.errors import ModelNotFoundError
    from kvserve.models.catalog import resolve_model_path

    seen: set[str] = set()
    for model in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"):
        try:
            reader = gguf.GGUFReader(str(resolve_model_path(model)))
        except ModelNotFoundError:
            continue
        for t in reader.tensors:
            code = int(t.tensor_type)
            if code not in FORMATS or FORMATS[code].name in seen or t.name.startswith(("token_embd", "output")):
                continue
            seen.add(FORMATS[code].name)
            rows = np.asarray(t.data)[:64]
            want = gguf.quants.dequantize(rows, t.tensor_type)
            got = dequantize(torch.from_numpy(rows.copy()), code)
            assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), t.name
    if not seen:
        pytest.skip("no catalog GGUF file installed")
