"""The 8-bit KV cache (``layers/kv_quant.py``: int8 rows of codes and a float16 scale per 16 channels, fp8 rows of
codes and a float32 scale): quantization error bounds and the scale's edges (zero groups, float16 subnormals and
overflow, rounding up), the write through ``slot_mapping``, and the attention paths against their references.

Kernels: ``paged_decode_attention`` (``csrc/paged_attention_kv8.c``) and ``paged_prefill_attention``
(``csrc/prefill_attention.c``'s 8-bit tiles) on 8-bit caches, against float64 attention over the
dequantized cache (the same values the torch path attends), over odd shapes: head_dim 64 and 128 (the
compile-time specialisations, the AVX-512 decode path), 80 (generic) and 40 (generic, an int8 row whose last
scale group has 8 channels), block sizes 16 and 7, sequence
lengths 1 to 513 (past the decode path's 256-key partitions), GQA groups 1 to 4. Builds as the other
kernel tests: the host's, AVX-512 without BF16 (``x86-64-v4``), AVX2 (``x86-64-v3``), SSE2 (``x86-64``).
The kernels compute in float32 from exactly dequantized values, so the tolerance is float32's (2e-5).
"""

from __future__ import annotations

import ctypes
import math
import platform

import pytest
import torch

from kvserve import cpu_features
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.layers import attention, cpu_kernels
from kvserve.layers.attention import paged_attention, write_kv
from kvserve.layers.kv_quant import F16_MAX, dequantize, int8_groups, int8_scales, kv8_head_dim, quantize, row_elems
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import prepare_inputs

X86 = platform.machine() in ("x86_64", "AMD64")
FORMATS = {"int8": torch.int8, "fp8": torch.uint8}
BUILDS = {"avx512": ("x86-64-v4", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")),
          "avx2": ("x86-64-v3", ("avx2", "fma")), "sse2": ("x86-64", ())}
native = pytest.mark.skipif(not cpu_kernels.native_available(), reason="no C compiler: native kernels unbuilt")


def _lib_for(path: str) -> ctypes.CDLL:
    if path == "native":
        lib = cpu_kernels._library()
        assert lib is not None
        return lib
    if not X86:
        pytest.skip(f"the {path} build is x86-only (host: {platform.machine()})")
    arch, need = BUILDS[path]
    missing = [f for f in need if f not in cpu_features.host_flags()]
    if missing:
        pytest.skip(f"CPU lacks {' '.join(missing)}")
    lib = cpu_kernels.build_library(arch)
    assert lib is not None
    return lib


# ---- quantization ------------------------------------------------------------------------------------------
_F16 = torch.arange(1, 0x7C00, dtype=torch.int16).view(torch.float16).float()  # every positive finite float16


def _f16_up(s: torch.Tensor) -> torch.Tensor:
    """The smallest float16 >= s (0 < s <= 65504, float32) by a search over float16's values: the oracle of
    ``int8_scales``."""
    return _F16[torch.searchsorted(_F16, s.contiguous())]


def _int8_scales_of(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    return rows[..., head_dim:].contiguous().view(torch.float16).float()


def test_row_layouts() -> None:
    """int8: head_dim codes + a float16 per 16 channels (64 -> 72 bytes, 128 -> 144, 24 -> 28: a group of 8 last);
    fp8: head_dim codes + one float32 (64 -> 68); ``kv8_head_dim`` inverts the widths and refuses the others."""
    assert [row_elems(d, torch.int8) for d in (64, 128, 24, 16, 17, 1)] == [72, 144, 28, 18, 21, 3]
    assert [row_elems(d, torch.uint8) for d in (64, 128, 24)] == [68, 132, 28]
    assert row_elems(64, torch.float8_e4m3fn) == 68 and row_elems(64, torch.bfloat16) == 64
    for d in range(1, 300):
        assert kv8_head_dim(row_elems(d, torch.int8), torch.int8) == d
        assert kv8_head_dim(row_elems(d, torch.uint8), torch.uint8) == d
    for bad in (19, 20, 2, 37, 38):  # between the widths of head_dim 16 (18) and 17 (21), 32 (36) and 33 (39)
        with pytest.raises(ValueError, match="bytes wide"):
            kv8_head_dim(bad, torch.int8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_bound(fmt: str) -> None:
    """int8: per 16 channels ``|x - x'| <= scale / 2`` (round to nearest) with ``scale`` the smallest float16 >=
    ``amax / 127``; fp8 e4m3: 3 mantissa bits, so half an ulp is ``2^-4 |x|`` for normal codes, and ``2^-10
    scale`` (half the subnormal step ``2^-9``) below them, with ``scale = amax / 448`` per row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]
    x[0, 0] = 0.0  # an all-zero row: scale 1, codes 0, exact
    x[1, 1, :5] = torch.tensor([1e4, -1e4, 3e-6, 0.0, 447.0])  # a wide row never saturates (amax maps to 127 / 448)
    rows = quantize(x, FORMATS[fmt])
    assert rows.shape == (50, 3, row_elems(64, FORMATS[fmt])) and rows.dtype == FORMATS[fmt]
    y = dequantize(rows, torch.float32)
    err = (y - x).abs()
    assert torch.equal(y[0, 0], x[0, 0])
    if fmt == "int8":
        scales = _int8_scales_of(rows, 64)  # [50, 3, 4]
        assert scales.shape == (50, 3, 4) and bool((scales[0, 0] == 1).all())
        amax = x.view(50, 3, 4, 16).abs().amax(-1)
        s = amax / 127
        assert torch.equal(scales[1:], _f16_up(s[1:]))  # (scales 1e-5: float16 subnormals, steps of 2^-24)
        assert bool((rows[..., :64].abs() <= 127).all())
        assert bool((err.view(50, 3, 4, 16) <= scales[..., None] / 2).all())
        # 1e4 / 127 = 78.74 rounds up to the float16 78.75 (steps of 2^-4), and 1e4 / 78.75 = 126.98 to code 127
        assert scales[1, 1, 0].item() == 78.75 and y[1, 1, :2].tolist() == [127 * 78.75, -127 * 78.75]
    else:
        amax = x.abs().amax(-1, keepdim=True)
        scale = rows[..., 64:].contiguous().view(torch.float32)
        assert scale[0, 0].item() == 1.0
        assert torch.allclose(scale[1:], amax[1:] / 448)
        assert bool((err <= torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 1e-5)).all())
        assert bool(torch.isfinite(y).all()) and y[1, 1, :2].tolist() == [1e4, -1e4]  # amax is exact


def test_int8_scale_is_float16_rounded_up_at_every_float16() -> None:
    """For every positive finite float16 h: a group with amax ``127 h`` (exact in float32) gets scale h exactly
    and its largest code is 127; amax one float32 step above it gets the next float16 (round up, never down:
    the codes stay within +-127 unclamped), except above 65504 (float16's largest finite value), where the scale
    stays 65504."""
    h = torch.arange(1, 0x7C00, dtype=torch.int16).view(torch.float16)  # 31,743 values, 2^-24 .. 65504
    amax = h.float() * 127
    assert torch.equal(int8_scales(amax), h)
    above = torch.nextafter(amax, torch.tensor(math.inf))
    nxt = torch.cat([h[1:], h[-1:]])  # the next float16 up; 65504 stays
    assert torch.equal(int8_scales(above), nxt)
    assert int8_scales(torch.tensor([0.0])).item() == 1.0
    # the same through quantize: groups of 16 whose first element is the amax
    x = torch.zeros(len(h), 16)
    x[:, 0] = amax
    rows = quantize(x, torch.int8)
    assert torch.equal(_int8_scales_of(rows, 16)[:, 0], h.float()) and bool((rows[:, 0] == 127).all())


def test_int8_scale_edges() -> None:
    """An all-zero group: scale 1, codes 0. A group below float16's normal range (amax < 127 × 2^-14): a
    subnormal scale, at least 2^-24 for any amax > 0 (the scale never underflows to 0), with the error bound
    still scale / 2. A group over 127 × 65504: scale 65504 and codes clamped to +-127 (finite, saturating at
    +-8.3e6). Other groups of the same row are unaffected."""
    x = torch.zeros(1, 96)
    x[0, 16:32] = torch.linspace(-3e-4, 2e-4, 16)  # amax 3e-4: 3e-4 / 127 = 39.6 x 2^-24, up to 40 x 2^-24
    x[0, 32] = 1e-30  # amax 1e-30: the smallest float16, 2^-24 (round to nearest would give 0)
    x[0, 48:64] = torch.linspace(-1e7, 2e6, 16)  # amax 1e7 > 127 x 65504
    x[0, 64:80] = torch.tensor([1e9] + [-5.0] * 15)
    x[0, 80:96] = torch.randn(16, generator=torch.Generator().manual_seed(3))
    rows = quantize(x, torch.int8)
    scales = _int8_scales_of(rows, 96)[0]
    codes = rows[0, :96].view(6, 16)
    y = dequantize(rows, torch.float32)[0]
    assert scales[0].item() == 1.0 and not codes[0].any()
    assert scales[1].item() == _f16_up(x[0, 16:32].abs().max() / 127).item() == 40 * 2.0 ** -24
    assert bool(((y[16:32] - x[0, 16:32]).abs() <= scales[1] / 2).all())
    assert scales[2].item() == 2.0 ** -24 and codes[2, 0].item() == 0 and y[32].item() == 0.0
    assert scales[3].item() == scales[4].item() == F16_MAX
    assert codes[3, 0].item() == -127 and y[48].item() == -127 * F16_MAX  # saturated, finite
    assert codes[4, 0].item() == 127 and codes[4, 1].item() == 0  # -5 / 65504 rounds to 0
    assert bool(torch.isfinite(y).all())
    amax = x[0, 80:96].abs().max()
    assert scales[5].item() == _f16_up(amax / 127).item() and codes[5].abs().max().item() == 127


@pytest.mark.parametrize("head_dim", [24, 17, 1, 40])
def test_int8_last_group_is_shorter(head_dim: int) -> None:
    """A head_dim 16 does not divide: the last group holds the remaining channels and its scale comes from them
    alone; the round trip keeps the shape."""
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(7, 2, head_dim, generator=g)
    x[..., :16] *= 100  # the full groups are far larger: the short group's scale must not see them
    rows = quantize(x, torch.int8)
    n = int8_groups(head_dim)
    assert rows.shape == (7, 2, head_dim + 2 * n)
    scales = _int8_scales_of(rows, head_dim)
    last = x[..., (n - 1) * 16:].abs().amax(-1)
    assert torch.equal(scales[..., -1], int8_scales(last).float())
    y = dequantize(rows, torch.float32)
    assert y.shape == x.shape
    bound = scales.repeat_interleave(16, -1)[..., :head_dim] / 2
    assert bool(((y - x).abs() <= bound).all())


def test_fp8_codes_are_torch_float8_e4m3fn() -> None:
    x = torch.tensor([[1.0, -0.5, 448.0, 2.0 ** -9, 3 * 2.0 ** -9]])
    rows = quantize(x, torch.uint8)
    codes = rows[:, :5].view(torch.float8_e4m3fn)
    assert codes.float().tolist() == [[1.0, -0.5, 448.0, 2.0 ** -9, 3 * 2.0 ** -9]]  # scale = 448 / 448 = 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_through_slot_mapping(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(5, 2, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    k_cache = torch.zeros(4, 4, 2, row_elems(32, FORMATS[fmt]), dtype=FORMATS[fmt])
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([13, 0, 7, 8, 2])
    write_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(16, 2, -1), v_cache.view(16, 2, -1)
    assert torch.equal(flat_k[slots], quantize(k, FORMATS[fmt]))
    assert torch.equal(flat_v[slots], quantize(v, FORMATS[fmt]))
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert not flat_k[untouched].any()


# ---- kernels against float64 attention over the dequantized cache --------------------------------------------
def _caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, storage: torch.dtype,
            g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g) * torch.rand(shape[:3] + (1,), generator=g) * 4  # per-row magnitudes
    v = torch.randn(shape, generator=g) * torch.rand(shape[:3] + (1,), generator=g) * 4
    return quantize(k, storage), quantize(v, storage)


def _decode_expected(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    kd, vd = dequantize(k_cache, torch.float64), dequantize(v_cache, torch.float64)
    num_kv_heads, head_dim = kd.shape[2], kd.shape[3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, n in enumerate(seq_lens.tolist()):
        k = kd[block_tables[s]].reshape(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)  # [H, n, hd]
        v = vd[block_tables[s]].reshape(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
        p = (q[s].double() @ k.transpose(1, 2) * scale).softmax(-1)  # [H, G, n]
        out[s] = p @ v
    return out


@native
@pytest.mark.parametrize("path", ["native", "avx512", "avx2", "sse2"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("head_dim", "num_kv_heads", "group", "block_size"),
                         [(64, 3, 3, 16), (128, 2, 4, 16), (64, 1, 1, 7), (80, 2, 3, 7), (40, 2, 2, 7),
                          (128, 4, 1, 32)])
def test_decode_kernel_matches_reference(path: str, fmt: str, head_dim: int, num_kv_heads: int, group: int,
                                         block_size: int) -> None:
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(head_dim + 10 * num_kv_heads + group + block_size)
    seq_lens = torch.tensor([1, 17, 256, 300, 513, 5])
    max_blocks = -(-513 // block_size) + 1
    num_blocks = max_blocks + 5
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, FORMATS[fmt], g)
    block_tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in seq_lens])
    q = torch.randn(len(seq_lens), num_kv_heads, group, head_dim, generator=g)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, lib=lib)
    torch.testing.assert_close(out.double(), _decode_expected(q, k_cache, v_cache, block_tables, seq_lens, scale),
                               rtol=2e-5, atol=2e-5)


@native
def test_native_build_has_the_8bit_variants() -> None:
    feats = cpu_kernels.kv8_features()
    assert {"decode", "prefill"} <= feats
    assert ("decode_avx512" in feats) == ("avx512f" in cpu_features.host_flags() and X86)


def _prefill_case(seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int, group: int, head_dim: int,
                  storage: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    need = [-(-(n + c) // block_size) for n, c in seqs]
    num_blocks = sum(need) + 3
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, storage, g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(seqs), max(need) + 1), 10 ** 9, dtype=torch.int64)  # junk past the end
    used = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    q_len = torch.tensor([n for n, _ in seqs])
    return {"k": k_cache, "v": v_cache, "tables": tables, "q_len": q_len, "offsets": torch.tensor([c for _, c in seqs]),
            "q_start": torch.cumsum(q_len, 0) - q_len,
            "q": torch.randn(int(q_len.sum()), num_kv_heads * group, head_dim, generator=g)}


def _prefill_expected(case: dict[str, torch.Tensor], block_size: int, scale: float) -> torch.Tensor:
    kd, vd = dequantize(case["k"], torch.float64), dequantize(case["v"], torch.float64)
    q = case["q"]
    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=torch.float64)
    for s, (n, c, start) in enumerate(zip(case["q_len"].tolist(), case["offsets"].tolist(),
                                          case["q_start"].tolist(), strict=True)):
        pos = torch.arange(n + c)
        slots = case["tables"][s][pos // block_size] * block_size + pos % block_size
        k = kd.reshape(-1, kd.shape[2], head_dim)[slots]
        v = vd.reshape(-1, vd.shape[2], head_dim)[slots]
        grp = num_heads // k.shape[1]
        k, v = k.repeat_interleave(grp, 1).transpose(0, 1), v.repeat_interleave(grp, 1).transpose(0, 1)
        qq = q[start:start + n].double().transpose(0, 1)
        allowed = torch.arange(n + c)[None, :] <= torch.arange(n)[:, None] + c
        p = (qq @ k.transpose(1, 2) * scale).masked_fill(~allowed, -math.inf).softmax(-1)
        out[start:start + n] = (p @ v).transpose(0, 1).reshape(n, -1)
    return out


@native
@pytest.mark.parametrize("path", ["native", "avx512", "avx2", "sse2"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("head_dim", "block_size", "group", "seqs"),
                         [(64, 16, 3, [(1, 0), (3, 5), (17, 16), (100, 300), (129, 0)]),
                          (128, 7, 1, [(129, 5), (1, 300), (17, 0), (3, 16)]),
                          (80, 16, 2, [(33, 7), (65, 0)]), (40, 7, 3, [(20, 9), (40, 0)])])
def test_prefill_kernel_matches_reference(path: str, fmt: str, head_dim: int, block_size: int, group: int,
                                          seqs: list[tuple[int, int]]) -> None:
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(head_dim + block_size + group)
    case = _prefill_case(seqs, block_size, 2, group, head_dim, FORMATS[fmt], g)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_kernels.paged_prefill_attention(case["q"], case["k"], case["v"], case["tables"], case["q_start"],
                                              case["q_len"], case["offsets"], scale, lib=lib)
    torch.testing.assert_close(out.double(), _prefill_expected(case, block_size, scale), rtol=2e-5, atol=2e-5)


# ---- paged_attention: the native metadata against the torch path, and the forced fallback ----------------------
def _step(storage: torch.dtype) -> tuple[list[ScheduledRequest], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decodes, chunks continuing a cached prefix and fresh prompts of one step, over an 8-bit cache."""
    g = torch.Generator().manual_seed(3)
    block_size, num_heads, num_kv_heads, head_dim, num_blocks = 16, 9, 3, 64, 120
    shapes = [(40, 1), (7, 1), (300, 60), (16, 17), (0, 129), (0, 2)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    order = []
    for c, n in shapes:
        nb = -(-(c + n) // block_size)
        req = Request("r", list(range(1, c + n + 1)), SamplingParams(), None, 8)
        order.append(ScheduledRequest(req, c, n, perm[:nb], sample=True))  # type: ignore[arg-type]
        perm = perm[nb:]
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, storage, g)
    q = torch.randn(sum(n for _, n in shapes), num_heads, head_dim, generator=g)
    return order, q, k_cache, v_cache


@native
@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_attention_native_equals_torch_path(fmt: str) -> None:
    order, q, k_cache, v_cache = _step(FORMATS[fmt])
    cpu = torch.device("cpu")
    meta_torch = prepare_inputs(order, 2, 16, cpu)[2]
    meta_native = prepare_inputs(order, 2, 16, cpu, native_decode=True, native_prefill=True)[2]
    assert meta_native.native_decode is not None and meta_native.native_prefill is not None
    ref = paged_attention(q, k_cache, v_cache, meta_torch, 0.125)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta_native, 0.125), ref, rtol=2e-5, atol=2e-5)
    # bf16 queries over the 8-bit cache: the kernels widen q exactly, compute in float32 and round the output
    qb = q.bfloat16()
    ref_b = paged_attention(qb.float(), k_cache, v_cache, meta_torch, 0.125)
    out_b = paged_attention(qb, k_cache, v_cache, meta_native, 0.125)
    assert out_b.dtype == torch.bfloat16
    torch.testing.assert_close(out_b.float(), ref_b, rtol=2 ** -8, atol=2 ** -8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_missing_8bit_variants_fall_back_to_the_torch_path(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library without the 8-bit variants (``kv8_features`` empty): native metadata goes through the torch
    reference (decode: one masked SDPA; prefill: per-chunk SDPA), never the kernels, and equals the torch path."""
    order, q, k_cache, v_cache = _step(FORMATS[fmt])
    cpu = torch.device("cpu")
    ref = paged_attention(q, k_cache, v_cache, prepare_inputs(order, 2, 16, cpu)[2], 0.125)

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a native kernel was called for an 8-bit cache without its variant")

    monkeypatch.setattr(cpu_kernels, "kv8_features", lambda lib=None: set())
    monkeypatch.setattr(attention, "paged_decode_attention", refuse)
    monkeypatch.setattr(attention, "paged_prefill_attention", refuse)
    meta_native = prepare_inputs(order, 2, 16, cpu, native_decode=True, native_prefill=True)[2]
    assert not attention.native_prefill_supported(q, k_cache)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta_native, 0.125), ref, rtol=1e-5, atol=1e-5)


# ---- the native KV write -----------------------------------------------------------------------------------
@native
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_rope_write_kv8_quantizes_as_the_reference(fmt: str, dtype: torch.dtype, head_dim: int) -> None:
    """The fused RoPE + 8-bit write gives q of ``rope_write_kv`` and the rows ``kv_quant.quantize`` makes of its
    k and v, bit for bit; position 0 (no rotation) carries values on e4m3 / int8 rounding ties and subnormals."""
    from kvserve.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(head_dim)
    hq, hk, t = 6, 2, 5
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    qkv = (torch.randn(t, (hq + 2 * hk) * head_dim, generator=g) * 3).to(dtype)
    # row 0, k head 0, scale 1 (amax 127 / 448): ties of int8 rounding, of e4m3's 3-bit mantissa, subnormals
    ties = ([127.0, 0.5, 1.5, 2.5, -2.5, 126.5, -0.0, 3.25] if fmt == "int8" else
            [448.0, 1.0625, 1.1875, 3 * 2.0 ** -10, 2.0 ** -10, 15 * 2.0 ** -10, 0.5, -0.0, 232.0])
    k0 = hq * head_dim
    qkv[0, k0:k0 + head_dim] = 0.0
    qkv[0, k0:k0 + len(ties)] = torch.tensor(ties).to(dtype)
    positions = torch.tensor([0, 7, 100, 511, 3])
    slots = torch.tensor([3, 9, 0, 39, 17])
    kc = torch.zeros(40, 1, hk, row_elems(head_dim, FORMATS[fmt]), dtype=FORMATS[fmt])
    vc = torch.zeros_like(kc)
    kf, vf = torch.zeros(40, 1, hk, head_dim, dtype=dtype), torch.zeros(40, 1, hk, head_dim, dtype=dtype)
    ref_qkv = qkv.clone()
    cpu_kernels.rope_write_kv(ref_qkv, positions, rotary.cos, rotary.sin, kf, vf, slots, hq, hk, head_dim)
    cpu_kernels.rope_write_kv8(qkv, positions, rotary.cos, rotary.sin, kc, vc, slots, hq, hk, head_dim)
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(kc[slots], quantize(kf[slots], FORMATS[fmt]))
    assert torch.equal(vc[slots], quantize(vf[slots], FORMATS[fmt]))
    assert not kc[[s for s in range(40) if s not in slots.tolist()]].any()


@native
@pytest.mark.parametrize("path", ["native", "avx512", "avx2", "sse2"])
def test_native_int8_scales_equal_the_reference_at_every_float16(path: str) -> None:
    """``kv8.h``'s float16 scale (``f16_scale_up``, ``f16_widen``: no F16C needed) through ``rope_write_kv8``
    against ``kv_quant.quantize``, bit for bit: groups whose amax is ``127 h`` for every positive finite float16
    h, one float32 step above it, zero, below 2^-24 × 127 and above 127 × 65504, in V rows (not rotated) of
    head_dim 64 (4 groups per row) and 24 (a group of 16 and one of 8)."""
    lib = _lib_for(path)
    h = torch.arange(1, 0x7C00, dtype=torch.int16).view(torch.float16).float() * 127
    amax = torch.cat([h, torch.nextafter(h, torch.tensor(math.inf)), torch.tensor([0.0, 1e-38, 1e-30, 1e7, 3e38])])
    g = torch.Generator().manual_seed(5)
    for head_dim in (64, 24):
        n = -(-head_dim // 16)
        rows = -(-len(amax) // n)
        groups = torch.zeros(rows * n)
        groups[:len(amax)] = amax
        x = torch.rand(rows, n * 16, generator=g) * 2 - 1  # |x| < 1, then each group scaled to its amax
        x = x * groups.repeat_interleave(16)[None].view(rows, n * 16)
        x.view(rows, n, 16)[..., 0] = groups.view(rows, n) * torch.where(torch.rand(rows, n, generator=g) < 0.5, -1, 1)
        x = x[:, :head_dim].contiguous()
        hq, hk = 1, 1
        qkv = torch.zeros(rows, (hq + 2 * hk) * head_dim)
        qkv[:, 2 * head_dim:] = x  # the V head
        rotary = _rotary(head_dim)
        kc = torch.zeros(rows, 1, hk, row_elems(head_dim, torch.int8), dtype=torch.int8)
        vc = torch.zeros_like(kc)
        slots, positions = torch.arange(rows), torch.zeros(rows, dtype=torch.int64)  # position 0: no rotation
        lib.rope_write_kv8(qkv.data_ptr(), qkv.shape[1], positions.data_ptr(),
                           rotary.cos.data_ptr(), rotary.sin.data_ptr(), kc.data_ptr(), vc.data_ptr(),
                           slots.data_ptr(), rows, hq, hk, head_dim, 0, 2)
        assert torch.equal(vc.view(rows, -1), quantize(x, torch.int8))


def _rotary(head_dim: int) -> object:
    from kvserve.layers.rotary import RotaryEmbedding

    return RotaryEmbedding(head_dim, 16, 10000.0)
