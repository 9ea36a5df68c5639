"""Prefill bfloat16 GEMMs on oneDNN with weights reordered once (``layers/onednn.py``) against their references:
the reordered linear equals ``F.linear`` bit for bit; the SwiGLU with its epilogue post-ops is within one
bfloat16 rounding of ``silu_mul`` over the fused gate/up GEMM; ``Linear`` and ``MLP`` take the path only where
it applies, and the reference path where it does not (forced here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve import cpu_features
from kvserve.layers import cpu_kernels, onednn
from kvserve.layers.linear import Linear
from kvserve.models.llama import MLP
from kvserve.models.registry import ModelArchConfig

_HOST_HAS_BF16 = cpu_features.has_native_bf16(cpu_features.host_flags())
pytestmark = pytest.mark.skipif(
    not onednn._supported(),
    reason="needs torch with oneDNN and a CPU with avx512_bf16 or amx_bf16 "
    + ("(torch without oneDNN, or KVSERVE_DISABLE_NATIVE set)" if _HOST_HAS_BF16 else "(the host has neither)"))


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("m", [65, 100, 513, 1030])
@pytest.mark.parametrize("n,k", [(960, 576), (131, 97), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_reordered_linear_equals_f_linear(m: int, n: int, k: int, bias: bool) -> None:
    x, w = _bf16(m, k, seed=1), _bf16(n, k, seed=2)
    b = _bf16(n, seed=3) if bias else None
    out = onednn.linear(x, onednn.pack(w), b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert torch.equal(out, F.linear(x, w, b))


def _swiglu_exact(x: torch.Tensor, w: torch.Tensor, i: int) -> torch.Tensor:
    """The float64 oracle of silu(x @ Wg^T) * (x @ Wu^T) for bfloat16 inputs."""
    xd, wd = x.double(), w.double()
    return F.silu(xd @ wd[:i].T) * (xd @ wd[i:].T)


@pytest.mark.parametrize("m", [65, 300, 512])
@pytest.mark.parametrize("h,i", [(576, 1536), (96, 160)])
def test_swiglu_as_accurate_as_the_reference(m: int, h: int, i: int) -> None:
    """Against a float64 oracle, the fused epilogue's error is no larger than the reference path's (which
    rounds the gate and up products to bfloat16 before the SiLU and the multiply): both are bfloat16
    roundings of the same value, not bit-identical."""
    x, w = _bf16(m, h, seed=4), _bf16(2 * i, h, seed=5)
    fused = onednn.swiglu(x, onednn.pack(w[:i]), onednn.pack(w[i:]))
    ref = cpu_kernels.silu_mul(F.linear(x, w)) if cpu_kernels.native_available() else \
        (F.silu(F.linear(x, w[:i])) * F.linear(x, w[i:]))
    exact = _swiglu_exact(x, w, i)
    assert fused.dtype == torch.bfloat16 and fused.shape == (m, i)
    err_fused, err_ref = (fused.double() - exact).abs(), (ref.double() - exact).abs()
    assert err_fused.max() <= 1.25 * err_ref.max()
    assert err_fused.mean() <= 1.25 * err_ref.mean()
    # and both within a few bfloat16 roundings of the output's scale
    assert err_fused.max() <= 4 * 2.0 ** -8 * exact.abs().max()


def test_pack_cache_follows_in_place_writes() -> None:
    cache = onednn.PackCache()
    w, x = _bf16(64, 48, seed=6), _bf16(80, 48, seed=7)
    first = cache.get("w", w)
    assert cache.get("w", w) is first  # reused while the weight is unchanged
    with torch.no_grad():
        w.mul_(2)
    second = cache.get("w", w)
    assert second is not first
    assert torch.equal(onednn.linear(x, second, None), F.linear(x, w))


def test_linear_and_mlp_take_the_path_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_linear, real_swiglu = onednn.linear, onednn.swiglu
    monkeypatch.setattr(onednn, "linear", lambda *a: (calls.append("linear"), real_linear(*a))[1])
    monkeypatch.setattr(onednn, "swiglu", lambda *a: (calls.append("swiglu"), real_swiglu(*a))[1])
    lin = Linear(48, 40, bias=True).to(torch.bfloat16)
    big, small = _bf16(200, 48, seed=8), _bf16(4, 48, seed=9)
    assert torch.equal(lin(big), F.linear(big, lin.weight, lin.bias)) and calls == ["linear"]
    lin(small)  # decode-sized: the native small-M kernel (or F.linear), not oneDNN
    lin.float()(big.float())  # float32: F.linear
    assert calls == ["linear"]
    cfg = ModelArchConfig(architecture="llama", vocab_size=64, hidden_size=48, intermediate_size=80,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                          max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
                          attention_bias=False)
    mlp = MLP(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(_bf16(*p.shape, seed=10) * 0.2)
    calls.clear()
    fused = mlp(big)
    assert calls == ["swiglu", "linear"]  # gate/up with the epilogue, then down (reordered)
    mlp.fuse_swiglu = False
    calls.clear()
    ref = mlp(big)
    assert calls == ["linear", "linear"]
    assert (fused.float() - ref.float()).abs().max() <= 4 * 2.0 ** -8 * ref.float().abs().max()


def test_reference_path_when_forced_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without native bf16 dot products (an AVX2-only host, forced here), or with the native kernels disabled,
    ``available`` is False and ``Linear`` runs ``F.linear``; float32 never takes the path."""
    x, w = _bf16(100, 32, seed=11), _bf16(16, 32, seed=12)
    lin = Linear(32, 16, bias=False).to(torch.bfloat16)
    calls: list[int] = []
    monkeypatch.setattr(onednn, "linear", lambda *a: calls.append(1))
    for force in ("flags", "env"):
        with monkeypatch.context() as mp:
            if force == "flags":
                mp.setattr(cpu_features, "host_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
            else:
                mp.setenv("KVSERVE_DISABLE_NATIVE", "1")
            onednn._supported.cache_clear()
            try:
                assert not onednn.available(x, w)
                assert torch.equal(lin(x), F.linear(x, lin.weight)) and not calls
            finally:
                onednn._supported.cache_clear()
    assert onednn.available(x, w)
    assert not onednn.available(x.float(), w.float())
