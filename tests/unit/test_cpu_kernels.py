"""Native CPU kernels against their torch references, over odd shapes, each compiled path, and the fallbacks.

Paths: the host's own build (``-march=native``: AVX-512 and AVX512-BF16 where the CPU has them), the AVX2
build (``-march=x86-64-v3``, forced on any AVX2 host) and the baseline SSE2 build (``-march=x86-64``). A
path the host cannot run is skipped with a reason naming the missing CPU flag.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve import cpu_features
from kvserve.layers import cpu_kernels
from kvserve.layers.attention import write_kv
from kvserve.layers.layernorm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(not cpu_kernels.native_available(), reason="no C compiler: native kernels unbuilt")

X86 = platform.machine() in ("x86_64", "AMD64")
BF16 = torch.bfloat16


def _lib_for(path: str) -> object:
    """The library for one compiled path, or skip naming the CPU flag the host lacks."""
    flags = cpu_features.host_flags()
    if path == "native":
        return cpu_kernels._library()
    if not X86:
        pytest.skip(f"the {path} build is x86-only (host: {platform.machine()})")
    need = {"avx2": ("avx2", "fma"), "sse2": ()}[path]
    missing = [f for f in need if f not in flags]
    if missing:
        pytest.skip(f"CPU lacks {' '.join(missing)}")
    lib = cpu_kernels.build_library({"avx2": "x86-64-v3", "sse2": "x86-64"}[path])
    assert lib is not None
    return lib


def _ref_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("path", ["native", "avx2", "sse2"])
# (AVX2 builds: 1-11 the row loop, in groups of 4 tokens; 12 and up panel_gemm's tiles)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11, 12, 17, 40])
@pytest.mark.parametrize("n,k", [(130, 576), (5, 100), (1, 37), (67, 1536)])
def test_small_gemm_f32_matches_linear(path: str, m: int, n: int, k: int) -> None:
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for bias in (None, b):
        out = cpu_kernels.small_gemm(x, w, bias, lib=lib)  # type: ignore[arg-type]
        assert out.dtype == torch.float32 and out.shape == (m, n)
        torch.testing.assert_close(out.double(), _ref_linear(x, w, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("path", ["native", "avx2"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 11, 17, 40])
@pytest.mark.parametrize("n,k", [(130, 576), (5, 100), (9, 64)])
def test_small_gemm_bf16_matches_linear(path: str, m: int, n: int, k: int) -> None:
    """bf16 activations and weights: float32 accumulation, the output rounded once to bf16, so the
    error is within bf16 rounding of the exact product of the bf16 inputs."""
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x, w = torch.randn(m, k, generator=g).to(BF16), torch.randn(n, k, generator=g).to(BF16)
    out = cpu_kernels.small_gemm(x, w, lib=lib)  # type: ignore[arg-type]
    assert out.dtype == BF16
    exact = _ref_linear(x, w, None)
    # one bf16 rounding of the result (2^-8 relative) plus float32 accumulation noise
    torch.testing.assert_close(out.double(), exact, rtol=2 ** -8, atol=1e-4 * k ** 0.5)
    # mixed: float32 activations over bf16 weights (exact widening, float32 output)
    out32 = cpu_kernels.small_gemm(x.float(), w, lib=lib)  # type: ignore[arg-type]
    torch.testing.assert_close(out32.double(), exact, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_small_gemm_avx512_bf16_dot_products() -> None:
    """The ``vdpbf16ps`` path runs only where the CPU has it (the native build then compiles it in)."""
    if "avx512_bf16" not in cpu_features.host_flags():
        pytest.skip("CPU lacks avx512_bf16")
    assert cpu_kernels.gemm_features() == {"avx512", "avx512_bf16"}
    g = torch.Generator().manual_seed(5)
    # M >= 10 takes the 4 x 4 tiles: row remainders 1-3 (N % 4), token remainders 1-3 (M % 4), K tails
    for m, n, k in [(1, 130, 576), (3, 7, 100), (8, 64, 33), (17, 9, 1536), (12, 130, 577), (13, 67, 64),
                    (14, 66, 37), (15, 131, 100), (32, 5, 576)]:
        x, w = torch.randn(m, k, generator=g).to(BF16), torch.randn(n, k, generator=g).to(BF16)
        b = torch.randn(n, generator=g) if m % 2 else None
        torch.testing.assert_close(cpu_kernels.small_gemm(x, w, b).double(), _ref_linear(x, w, b),
                                   rtol=2 ** -8, atol=1e-4 * k ** 0.5)


def test_row_prefetch_threshold_builds_give_equal_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row loop with and without its software prefetch (``ROW_PREFETCH_MIN_M`` 1: always, 9: never below
    the tiles) computes the same bits at every M of the row loop, with both activation dtypes."""
    if "avx512_bf16" not in cpu_features.host_flags():
        pytest.skip("CPU lacks avx512_bf16")
    libs = []
    for min_m in ("1", "9"):
        monkeypatch.setenv("KVSERVE_ROW_PREFETCH_MIN_M", min_m)
        assert f"-DROW_PREFETCH_MIN_M={min_m}" in cpu_kernels._source_flags()["small_gemm.c"]
        libs.append(cpu_kernels.build_library("native"))
    assert libs[0] is not None and libs[1] is not None and libs[0]._name != libs[1]._name  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(11)
    for m in range(1, 10):
        x, w = torch.randn(m, 577, generator=g).to(BF16), torch.randn(131, 577, generator=g).to(BF16)
        for xx in (x, x.float()):
            a, b = (cpu_kernels.small_gemm(xx, w, lib=lib) for lib in libs)  # type: ignore[arg-type]
            assert torch.equal(a, b)
            torch.testing.assert_close(a.double(), _ref_linear(x, w, None), rtol=2 ** -8, atol=1e-4 * 577 ** 0.5)


def test_row_prefetch_min_m_per_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Zen 4 (AMD family 19h with AVX-512) skips the prefetch below M = 4; other CPUs always prefetch; the
    environment variable overrides; a bad value is an error naming it."""
    monkeypatch.delenv("KVSERVE_ROW_PREFETCH_MIN_M", raising=False)
    monkeypatch.setattr(cpu_features, "is_zen4", lambda: True)
    assert cpu_kernels.row_prefetch_min_m() == 4
    monkeypatch.setattr(cpu_features, "is_zen4", lambda: False)
    assert cpu_kernels.row_prefetch_min_m() == 1
    monkeypatch.setenv("KVSERVE_ROW_PREFETCH_MIN_M", "2")
    assert cpu_kernels.row_prefetch_min_m() == 2
    monkeypatch.setenv("KVSERVE_ROW_PREFETCH_MIN_M", "x")
    with pytest.raises(ValueError, match="KVSERVE_ROW_PREFETCH_MIN_M"):
        cpu_kernels.row_prefetch_min_m()


def test_is_zen4_reads_the_cpu_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_features, "host_flags", lambda: frozenset({"avx512f"}))
    for sig, want in [(("AuthenticAMD", 25, 17), True), (("AuthenticAMD", 25, 1), True),
                      (("AuthenticAMD", 26, 2), False), (("GenuineIntel", 6, 143), False)]:
        monkeypatch.setattr(cpu_features, "cpu_signature", lambda sig=sig: sig)
        assert cpu_features.is_zen4() is want
    monkeypatch.setattr(cpu_features, "host_flags", lambda: frozenset({"avx2"}))  # Zen 3: family 19h, no AVX-512
    monkeypatch.setattr(cpu_features, "cpu_signature", lambda: ("AuthenticAMD", 25, 1))
    assert cpu_features.is_zen4() is False


def test_native_build_has_the_paths_the_cpu_allows() -> None:
    flags = cpu_features.host_flags()
    feats = cpu_kernels.gemm_features()
    assert ("avx512" in feats) == ("avx512f" in flags)
    assert ("avx512_bf16" in feats) == ("avx512_bf16" in flags)
    assert ("avx2_panel" in feats) == ({"avx2", "fma"} <= flags and "avx512f" not in flags)


@pytest.mark.parametrize("path", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("wdtype", [torch.float32, BF16])
@pytest.mark.parametrize("m,n,k", [(1, 7, 5), (16, 6, 64), (17, 13, 33), (33, 100, 576), (70, 49, 1536)])
def test_panel_gemm_matches_linear(path: str, wdtype: torch.dtype, m: int, n: int, k: int) -> None:
    """Partial tiles in both directions (n not a multiple of 6, m of 16), bf16 weights widened exactly: float32
    dot products, equal to float64 math to float32 accumulation noise; the AVX2 build's features name it."""
    lib = _lib_for(path)
    if path == "avx2":
        assert "avx2_panel" in cpu_kernels.gemm_features(lib)  # type: ignore[arg-type]
    if path == "sse2":
        assert cpu_kernels.gemm_features(lib) == set()  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(m * 31 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(wdtype), torch.randn(n, generator=g)
    for bias in (None, b):
        out = cpu_kernels.panel_gemm(x, w, bias, lib=lib)  # type: ignore[arg-type]
        assert out.shape == (m, n)
        torch.testing.assert_close(out.double(), _ref_linear(x, w, bias), rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("path", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [100, 576])
def test_add_rms_norm_matches_reference(path: str, dtype: torch.dtype, with_residual: bool, hidden: int) -> None:
    """Each build's rows (AVX-512 16 lanes, AVX2 8 lanes with a scalar tail at H = 100, the scalar loop)."""
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(2)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    x, r = torch.randn(5, hidden, generator=g).to(dtype), torch.randn(5, hidden, generator=g).to(dtype)
    r_native, r_ref = r.clone(), r.clone()
    out = cpu_kernels.add_rms_norm(x, r_native if with_residual else None, norm.weight, norm.eps,
                                   lib=lib)  # type: ignore[arg-type]
    ref = norm.forward_reference(x, r_ref if with_residual else None)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(r_native, r_ref, rtol=0, atol=0)  # the residual add is exact in both


@pytest.mark.parametrize("path", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("width", [77, 1536])
def test_silu_mul_matches_reference(path: str, dtype: torch.dtype, width: int) -> None:
    lib = _lib_for(path)
    gate_up = (torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up, lib=lib), F.silu(gate) * up,  # type: ignore[arg-type]
                               **tol)


@pytest.mark.parametrize("path", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_silu_mul_edge_values_match_torch(path: str, dtype: torch.dtype) -> None:
    """The vectorized exps (range-reduced polynomial, clamped to +-104, times 2^n: vscalefps on AVX-512, two exact
    power-of-two factors on AVX2) at the extremes: underflow to -0, a denormal product, overflow to inf, +-inf and
    NaN, exactly as torch's silu gives them. 24 values: two full 8-lane vectors, then the scalar tail."""
    lib = _lib_for(path)
    g = torch.tensor([-200.0, -104.5, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 100.0, 200.0,
                      float("inf"), float("-inf"), float("nan"), 0.5, -3.0, 7.25, -87.5, -89.0, 87.0, 103.9, -103.9,
                      -60.0, 15.0])
    gate_up = torch.cat([g, torch.ones_like(g)]).reshape(1, -1).to(dtype)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up, lib=lib)[0],  # type: ignore[arg-type]
                               F.silu(g.to(dtype)), rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_prefill_mlp_takes_the_native_silu_where_it_is_vectorised(monkeypatch: pytest.MonkeyPatch,
                                                                    dtype: torch.dtype) -> None:
    """Prefill-sized rows (above the small-M limit) take ``silu_mul`` where its loop is vectorised for the dtype
    (AVX-512 builds: both; AVX2 builds: float32), torch's SiLU elsewhere; both give the reference's values."""
    from kvserve.models import llama
    from kvserve.models.registry import ModelArchConfig

    features = cpu_kernels.gemm_features()
    expect_native = "avx512" in features or (dtype == torch.float32 and "avx2_panel" in features)
    assert llama._vector_silu(dtype) == expect_native
    cfg = ModelArchConfig(architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=80,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                          max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
                          attention_bias=False)
    mlp = llama.MLP(cfg).to(dtype)
    mlp.fuse_swiglu = False  # (the bf16 oneDNN epilogue path is tests/unit/test_onednn.py's)
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(200, 48, generator=g).to(dtype)
    calls: list[int] = []
    real = cpu_kernels.silu_mul
    monkeypatch.setattr(cpu_kernels, "silu_mul", lambda gu: (calls.append(gu.shape[0]), real(gu))[1])
    with torch.no_grad():
        out = mlp(x)
        gate, up = F.linear(x.float(), mlp.gate_up_proj.weight.float()).chunk(2, dim=-1)
        ref = F.linear(F.silu(gate) * up, mlp.down_proj.weight.float())
    assert calls == ([200] if expect_native else [])
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    else:  # bf16 roundings of the inputs to each op (as test_onednn.py bounds them)
        assert (out.float() - ref).abs().max() <= 4 * 2.0 ** -8 * ref.abs().max()


@pytest.mark.parametrize("path", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_rope_write_kv_matches_reference(path: str, dtype: torch.dtype, head_dim: int) -> None:
    """Each build (8-lane rotation where head_dim / 2 is a multiple of 8; 40: the scalar loop in every build)."""
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(head_dim)
    hq, hk, t, num_slots = 6, 2, 5, 40
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 7, 100, 511, 3])
    slots = torch.tensor([3, 9, 0, 39, 17])
    kc, vc = torch.zeros(num_slots, 1, hk, head_dim, dtype=dtype), torch.zeros(num_slots, 1, hk, head_dim, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q, k, v = qkv.clone().split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    q_ref, k_ref = rotary(positions, q.reshape(t, hq, head_dim), k.reshape(t, hk, head_dim))
    write_kv(k_ref, v.reshape(t, hk, head_dim), kc_ref, vc_ref, slots)
    cpu_kernels.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, kc, vc, slots, hq, hk, head_dim,
                              lib=lib)  # type: ignore[arg-type]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    torch.testing.assert_close(qkv[:, :hq * head_dim].reshape(t, hq, head_dim), q_ref, **tol)
    torch.testing.assert_close(kc, kc_ref, **tol)
    torch.testing.assert_close(vc, vc_ref, rtol=0, atol=0)  # v is copied, not computed


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rope_write_kv_vector_rows_equal_the_scalar_loop_bitwise(dtype: torch.dtype) -> None:
    """The 8-lane rotation rounds as the scalar loop does, op for op: the native and AVX2 builds give the SSE2
    build's bits (q, k rotated; k, v in the cache), at head_dim 64 and 128."""
    libs = [_lib_for(p) for p in ("native", "avx2", "sse2")]
    for head_dim in (64, 128):
        g = torch.Generator().manual_seed(7 + head_dim)
        rotary = RotaryEmbedding(head_dim, 4096, 10000.0)
        qkv = (torch.randn(9, 8 * head_dim, generator=g) * 3).to(dtype)
        positions = torch.tensor([0, 1, 5, 100, 511, 1000, 2047, 3000, 4095])
        slots = torch.arange(9) * 2
        results = []
        for lib in libs:
            q = qkv.clone()
            kc, vc = torch.zeros(18, 1, 2, head_dim, dtype=dtype), torch.zeros(18, 1, 2, head_dim, dtype=dtype)
            cpu_kernels.rope_write_kv(q, positions, rotary.cos, rotary.sin, kc, vc, slots, 4, 2, head_dim,
                                      lib=lib)  # type: ignore[arg-type]
            results.append((q, kc, vc))
        for q, kc, vc in results[:-1]:
            for a, b in zip((q, kc, vc), results[-1], strict=True):
                assert torch.equal(a.view(torch.int16 if dtype == BF16 else torch.int32),
                                   b.view(torch.int16 if dtype == BF16 else torch.int32))


@pytest.mark.parametrize("act,cache", [(torch.float32, BF16), (BF16, torch.float32)])
def test_rope_write_kv_converts_to_the_cache_dtype(act: torch.dtype, cache: torch.dtype) -> None:
    """A cache of another dtype than the activations (a bf16 cache under float32 activations, as on AVX2 hosts
    serving bf16 weights): q and k rotate in the activations' dtype exactly as with a same-dtype cache, and the
    rows the cache receives are that k and v converted by ``Tensor.to`` (float32 -> bf16 rounds to nearest even;
    bf16 -> float32 is exact), bit for bit."""
    g = torch.Generator().manual_seed(5)
    hq, hk, t, d, num_slots = 6, 2, 5, 64, 40
    rotary = RotaryEmbedding(d, 512, 10000.0)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(act)
    positions, slots = torch.tensor([0, 7, 100, 511, 3]), torch.tensor([3, 9, 0, 39, 17])
    same_k, same_v = torch.zeros(num_slots, 1, hk, d, dtype=act), torch.zeros(num_slots, 1, hk, d, dtype=act)
    kc, vc = torch.zeros(num_slots, 1, hk, d, dtype=cache), torch.zeros(num_slots, 1, hk, d, dtype=cache)
    ref_qkv = qkv.clone()
    cpu_kernels.rope_write_kv(ref_qkv, positions, rotary.cos, rotary.sin, same_k, same_v, slots, hq, hk, d)
    cpu_kernels.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, kc, vc, slots, hq, hk, d)
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(kc, same_k.to(cache)) and torch.equal(vc, same_v.to(cache))
    assert kc[slots].abs().sum() > 0 and kc[1].abs().sum() == 0  # written slots only
    with pytest.raises(TypeError, match="v_cache"):
        cpu_kernels.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, kc, same_v, slots, hq, hk, d)


@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_paged_attention_bf16_cache_matches_float32_math(head_dim: int) -> None:
    """A bf16 cache is widened exactly, so the kernel equals the float32 kernel on the widened cache."""
    g = torch.Generator().manual_seed(head_dim)
    kc = torch.randn(20, 4, 2, head_dim, generator=g).to(BF16)
    vc = torch.randn(20, 4, 2, head_dim, generator=g).to(BF16)
    tables = torch.randperm(20, generator=g)[:18].view(3, 6)
    lens = torch.tensor([1, 9, 24])
    q = torch.randn(3, 2, 3, head_dim, generator=g)
    out = cpu_kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    ref = cpu_kernels.paged_decode_attention(q, kc.float(), vc.float(), tables, lens, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert cpu_kernels.paged_decode_attention(q.to(BF16), kc, vc, tables, lens, 0.125).dtype == BF16


def _ref_decode_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                          lens: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v per sequence, keys gathered through the block table."""
    bs = kc.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s in range(q.shape[0]):
        n = int(lens[s])
        k = kc[tables[s]].reshape(-1, *kc.shape[2:])[:n].double()  # [n, H, D]
        v = vc[tables[s]].reshape(-1, *vc.shape[2:])[:n].double()
        assert k.shape[0] == n and tables.shape[1] * bs >= n
        p = torch.softmax(torch.einsum("hgd,nhd->hgn", q[s].double(), k) * scale, dim=-1)
        out[s] = torch.einsum("hgn,nhd->hgd", p, v)
    return out


@pytest.mark.parametrize("path", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize(("head_dim", "num_kv_heads", "group", "block_size"),
                         [(64, 3, 3, 16), (64, 2, 7, 5), (128, 2, 6, 16), (128, 1, 4, 7), (80, 2, 3, 16),
                          (64, 9, 8, 16)])
def test_paged_decode_attention_long_sequences(path: str, dtype: torch.dtype, head_dim: int, num_kv_heads: int,
                                               group: int, block_size: int) -> None:
    """Decode attention equals float64 math at lengths across the kernel's 16-key tiles and 256-key
    partitions (1, 15, 16, 17, 255, 256, 257, 700), for scattered block tables; q both bf16-exact (the
    AVX512-BF16 `vdpbf16ps` scores) and not. (64, 9, 8): 72 query heads, past the AVX-512 path's limit.
    Tolerance: float32 accumulation over <= 700 keys (1e-5 relative, 1e-5 absolute on O(1) outputs)."""
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(head_dim * 31 + group)
    lens = torch.tensor([1, 15, 16, 17, 255, 256, 257, 700])
    per = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * per + 3
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * per].view(len(lens), per)
    for q in (torch.randn(len(lens), num_kv_heads, group, head_dim, generator=g),
              torch.randn(len(lens), num_kv_heads, group, head_dim, generator=g).to(BF16).float()):
        out = cpu_kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125, lib=lib)
        ref = _ref_decode_attention(q, kc, vc, tables, lens, 0.125)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("num_seqs", [1, 3, 9])
@pytest.mark.parametrize("layout", ["in_order", "runs", "scattered"])
def test_paged_decode_attention_item_splits_and_block_layouts(path: str, dtype: torch.dtype, num_seqs: int,
                                                               layout: str) -> None:
    """The AVX2 path's two item splits (below 4 sequences per thread, partitions of each sequence's blocks merged
    afterwards, some sequences in one partition and some in several; whole sequences from there, and on one
    thread) and its prefetch rule (only blocks that do not follow the current one in memory) over block tables
    in memory order, in runs of 2 blocks, and scattered; 1 and 2 threads. Equal to float64 math (1e-5)."""
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(num_seqs)
    bs, hk, grp, d = 16, 3, 3, 64
    lens = torch.randint(1, 150, (num_seqs,), generator=g)
    lens[0] = 150  # 9 full blocks and a partial one
    per = 10
    nb = num_seqs * per
    ids = torch.arange(nb)
    if layout == "runs":
        ids = torch.cat([r for i in torch.randperm(nb // 2, generator=g) for r in [ids[2 * i:2 * i + 2]]])
    elif layout == "scattered":
        ids = torch.randperm(nb, generator=g)
    tables = ids.view(num_seqs, per).contiguous()
    kc = torch.randn(nb, bs, hk, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hk, d, generator=g).to(dtype)
    q = torch.randn(num_seqs, hk, grp, d, generator=g)
    ref = _ref_decode_attention(q, kc, vc, tables, lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = cpu_kernels.paged_decode_attention(q, kc, vc, tables, lens, 0.125, lib=lib)
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)


def test_no_compiler_means_no_library_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert cpu_kernels.build_library("native", compiler="/nonexistent/cc") is None
    assert "no C compiler" in caplog.text


def test_disabled_native_path_serves_the_torch_kernels() -> None:
    """KVSERVE_DISABLE_NATIVE=1 (as with no compiler) switches every native path off; the model-level
    equality of both paths is in tests/model/test_native_paths.py."""
    env = dict(os.environ, KVSERVE_DISABLE_NATIVE="1")
    out = subprocess.run([sys.executable, "-c",
                          "from kvserve.layers import cpu_kernels, linear; import torch;"
                          "x = torch.randn(2, 8);"
                          "print(cpu_kernels.native_available(), linear.use_native(x))"],
                         capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fused_ops_split_rows_over_threads_bitwise(dtype: torch.dtype) -> None:
    """Prefill-sized inputs (above PARALLEL_MIN elements) are split over OpenMP threads by row: the results
    are bitwise those of one thread (each row is computed the same way), for norm, SiLU·mul and RoPE."""
    g = torch.Generator().manual_seed(11)
    m, h, f, hq, hk, d = 300, 576, 1536, 9, 3, 64
    weight = torch.randn(h, generator=g).to(dtype)
    x, r = torch.randn(m, h, generator=g).to(dtype), torch.randn(m, h, generator=g).to(dtype)
    gate_up = torch.randn(m, 2 * f, generator=g).to(dtype)
    rotary = RotaryEmbedding(d, 512, 10000.0)
    qkv = torch.randn(m, (hq + 2 * hk) * d, generator=g).to(dtype)
    positions, slots = torch.arange(m) % 512, torch.randperm(m, generator=g)

    def run() -> list[torch.Tensor]:
        res = r.clone()
        normed = cpu_kernels.add_rms_norm(x, res, weight, 1e-5)
        q = qkv.clone()
        kc, vc = torch.zeros(m, 1, hk, d, dtype=dtype), torch.zeros(m, 1, hk, d, dtype=dtype)
        cpu_kernels.rope_write_kv(q, positions, rotary.cos, rotary.sin, kc, vc, slots, hq, hk, d)
        return [normed, res, cpu_kernels.silu_mul(gate_up), q, kc, vc]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        two = run()
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)
    gate, up = gate_up.chunk(2, dim=-1)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    torch.testing.assert_close(two[2], F.silu(gate) * up, **tol)
