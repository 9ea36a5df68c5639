"""The native prefill attention kernel (csrc/prefill_attention.c) against float64 attention and the torch path.

Each case is several sequences in one call, with shuffled block tables: query lengths 1, 3, 17, 100, 257,
cached-prefix offsets 0, 5, 16, 300, block size 16 and an odd one (7), head_dim 64 and 128 (compile-time
specialisations) and 80 (the generic variant; not a multiple of 32, so also the portable path under bf16),
GQA groups 1 and 3. Builds: the host's (``-march=native``: the AVX512-BF16 path where the CPU has it),
AVX-512 without BF16 (``x86-64-v4``: the portable path in 512-bit vectors), AVX2 (``x86-64-v3``) and
baseline SSE2 (``x86-64``); a build the CPU cannot run is skipped naming the flag it lacks.

Tolerances:

* float32: 1e-5 relative and absolute. The kernel's float32 sums run in another order than the float64
  reference's and its exp has a relative error < 2e-7; errors seen are ~1e-6 on outputs of size ~1.
* bfloat16 (q, K, V bf16; the reference takes the same bf16 values in float64): the output is rounded
  once to bf16 (half an ulp: 2^-9 relative), and on the AVX512-BF16 path the probabilities are rounded to
  bf16 before p.v (each weight off by at most 2^-9 relative, so the weighted mean moves by at most
  2^-9 max|v|, the sum of weights being float32). Bound: ``|out - ref| <= 2^-8 |ref| + 2^-8 max|v|``,
  twice those roundings to cover the float32 noise. The mean error must also be well below the bound
  (rounding errors average out; a systematic error would not).
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import subprocess
import sys

import pytest
import torch

from kvserve import cpu_features
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.layers import cpu_kernels
from kvserve.layers.attention import paged_attention, reference_attention
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import prepare_inputs

pytestmark = pytest.mark.skipif(not cpu_kernels.native_available(), reason="no C compiler: native kernels unbuilt")

X86 = platform.machine() in ("x86_64", "AMD64")
BF16 = torch.bfloat16
PATHS = ["native", "avx512", "avx2", "sse2"]
BUILDS = {"avx512": ("x86-64-v4", ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")),
          "avx2": ("x86-64-v3", ("avx2", "fma")), "sse2": ("x86-64", ())}

# (query length, offset) per sequence of a call: every required length and offset, mixed.
SEQS_A = [(1, 0), (3, 5), (17, 16), (100, 300), (257, 0)]
SEQS_B = [(257, 5), (1, 300), (17, 0), (3, 16), (100, 0), (1, 5)]


def _lib_for(path: str) -> ctypes.CDLL:
    """The library of one compiled path, or skip naming the CPU flag the host lacks."""
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


class Case:
    """Random paged caches and queries for ``seqs`` = [(q_len, offset)], blocks shuffled across sequences."""

    def __init__(self, seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int, group: int, head_dim: int,
                 dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seqs, self.block_size, self.dtype = seqs, block_size, dtype
        need = [-(-(n + c) // block_size) for n, c in seqs]
        num_blocks = sum(need) + 3  # a few blocks nobody owns
        self.k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
        self.v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
        perm = torch.randperm(num_blocks, generator=g)
        self.block_tables = torch.full((len(seqs), max(need) + 1), 10 ** 9, dtype=torch.int64)  # junk past the end
        used = 0
        for i, nb in enumerate(need):
            self.block_tables[i, :nb] = perm[used:used + nb]
            used += nb
        self.q_len = torch.tensor([n for n, _ in seqs])
        self.offsets = torch.tensor([c for _, c in seqs])
        self.q_start = torch.cumsum(self.q_len, 0) - self.q_len
        self.q = torch.randn(int(self.q_len.sum()), num_kv_heads * group, head_dim, generator=g).to(dtype)
        self.scale = 1 / math.sqrt(head_dim)

    def keys(self, s: int, cache: torch.Tensor) -> torch.Tensor:
        """``[offset + q_len, num_kv_heads, head_dim]`` keys (or values) of sequence s, in position order."""
        n, c = self.seqs[s]
        pos = torch.arange(n + c)
        slots = self.block_tables[s][pos // self.block_size] * self.block_size + pos % self.block_size
        return cache.reshape(-1, cache.shape[2], cache.shape[3])[slots]

    def expected(self) -> torch.Tensor:
        """float64 attention, causal with each sequence's offset, ``[num_tokens, num_heads * head_dim]``."""
        num_heads, head_dim = self.q.shape[1], self.q.shape[2]
        out = torch.empty(self.q.shape[0], num_heads * head_dim, dtype=torch.float64)
        for s, (n, c) in enumerate(self.seqs):
            start = int(self.q_start[s])
            k, v = self.keys(s, self.k_cache).double(), self.keys(s, self.v_cache).double()
            group = num_heads // k.shape[1]
            k, v = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
            q = self.q[start:start + n].double().transpose(0, 1)  # [heads, n, hd]
            scores = q @ k.transpose(1, 2) * self.scale
            allowed = torch.arange(n + c)[None, :] <= torch.arange(n)[:, None] + c
            p = scores.masked_fill(~allowed, -math.inf).softmax(-1)
            out[start:start + n] = (p @ v).transpose(0, 1).reshape(n, -1)
        return out

    def run(self, lib: ctypes.CDLL | None = None, q: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_kernels.paged_prefill_attention(self.q if q is None else q, self.k_cache, self.v_cache,
                                                   self.block_tables, self.q_start, self.q_len, self.offsets,
                                                   self.scale, lib=lib)


def _assert_close(case: Case, out: torch.Tensor) -> None:
    expected = case.expected()
    assert out.dtype == case.dtype and out.shape == expected.shape
    err = (out.double() - expected).abs()
    if case.dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        return
    vmax = case.v_cache.double().abs().max().item()
    bound = 2 ** -8 * expected.abs() + 2 ** -8 * vmax
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g} (max err {err.max().item():.3g})"
    assert err.mean().item() < 0.1 * bound.mean().item()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size,group,seqs", [(16, 3, SEQS_A), (7, 1, SEQS_B), (16, 1, SEQS_B), (7, 3, SEQS_A)],
                         ids=["bs16-g3", "bs7-g1", "bs16-g1", "bs7-g3"])
def test_kernel_matches_float64_attention(path: str, dtype: torch.dtype, head_dim: int, block_size: int, group: int,
                                          seqs: list[tuple[int, int]]) -> None:
    lib = _lib_for(path)
    case = Case(seqs, block_size, 2, group, head_dim, dtype, seed=head_dim + block_size + group)
    _assert_close(case, case.run(lib))


def test_avx512_bf16_path_is_compiled_in_and_matches() -> None:
    """The ``vdpbf16ps`` path: in the host build exactly when the CPU has avx512_bf16; within the bf16 bound."""
    lib = _lib_for("native")
    has = "avx512_bf16" in cpu_features.host_flags()
    assert ("avx512_bf16" in cpu_kernels.prefill_features(lib)) == has
    assert ("avx512" in cpu_kernels.prefill_features(lib)) == ("avx512f" in cpu_features.host_flags())
    if not has:
        pytest.skip("CPU lacks avx512_bf16")
    for head_dim, group in ((64, 3), (128, 1), (96, 7)):  # 96: the runtime-head_dim variant of the path
        case = Case(SEQS_A, 16, 2, group, head_dim, BF16, seed=head_dim)
        _assert_close(case, case.run(lib))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
def test_equals_reference_attention(dtype: torch.dtype) -> None:
    """Per sequence, equal to attention.py's ``reference_attention`` (torch SDPA on contiguous K/V)."""
    case = Case(SEQS_B, 16, 3, 3, 64, dtype, seed=4)
    out = case.run()
    for s, (n, _) in enumerate(case.seqs):
        start = int(case.q_start[s])
        ref = reference_attention(case.q[start:start + n].float(), case.keys(s, case.k_cache).float(),
                                  case.keys(s, case.v_cache).float(), case.scale)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 2 ** -7}
        torch.testing.assert_close(out[start:start + n].float(), ref, **tol)


def test_strided_q_rows_bf16_cache_under_f32_q_and_out_rows() -> None:
    """q as a view into a wider row (the fused QKV output), float32 q over a bf16 cache (exact widening,
    so equal to the float32 kernel on the widened cache), and ``out=`` leaving unowned rows alone."""
    case = Case([(17, 5), (40, 0)], 16, 2, 3, 64, torch.float32, seed=7)
    wide = torch.randn(case.q.shape[0], case.q.shape[1] * 64 + 2 * 2 * 64)
    wide[:, :case.q.shape[1] * 64] = case.q.reshape(case.q.shape[0], -1)
    q_view = wide[:, :case.q.shape[1] * 64].view(case.q.shape)
    assert not q_view.is_contiguous()
    torch.testing.assert_close(case.run(q=q_view), case.run(), rtol=0, atol=0)
    kb, vb = case.k_cache.to(BF16), case.v_cache.to(BF16)
    out = cpu_kernels.paged_prefill_attention(case.q, kb, vb, case.block_tables, case.q_start, case.q_len,
                                              case.offsets, case.scale)
    case.k_cache, case.v_cache = kb.float(), vb.float()
    torch.testing.assert_close(out, case.run(), rtol=1e-6, atol=1e-6)
    sentinel = torch.full((case.q.shape[0] + 3, case.q.shape[1] * 64), 7.0)
    rows = torch.cat([torch.zeros(3, *case.q.shape[1:]), case.q])
    cpu_kernels.paged_prefill_attention(rows, case.k_cache, case.v_cache, case.block_tables, case.q_start + 3,
                                        case.q_len, case.offsets, case.scale, out=sentinel)
    assert bool((sentinel[:3] == 7.0).all())
    torch.testing.assert_close(sentinel[3:], case.run(), rtol=0, atol=0)


def test_results_do_not_depend_on_threads() -> None:
    """Each output row is computed by one work item, the same way on any thread: bitwise equal."""
    case = Case(SEQS_A, 16, 2, 3, 64, BF16, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.run()
        torch.set_num_threads(2)
        two = case.run()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_arguments_raise() -> None:
    case = Case([(5, 3)], 4, 2, 1, 64, torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):  # keys past the block table
        cpu_kernels.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables[:, :1],
                                            case.q_start, case.q_len, case.offsets, case.scale)
    with pytest.raises(RuntimeError, match="out of range"):  # rows past q
        cpu_kernels.paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                            case.q_start + 1, case.q_len, case.offsets, case.scale)
    with pytest.raises(TypeError):
        cpu_kernels.paged_prefill_attention(case.q.half(), case.k_cache, case.v_cache, case.block_tables,
                                            case.q_start, case.q_len, case.offsets, case.scale)
    with pytest.raises(TypeError):
        cpu_kernels.paged_prefill_attention(case.q, case.k_cache, case.v_cache.to(BF16), case.block_tables,
                                            case.q_start, case.q_len, case.offsets, case.scale)
    with pytest.raises(RuntimeError, match="does not fit"):  # 3 query heads over 2 KV heads
        cpu_kernels.paged_prefill_attention(case.q[:, :1].expand(-1, 3, -1), case.k_cache, case.v_cache,
                                            case.block_tables, case.q_start, case.q_len, case.offsets, case.scale)


def _scheduled(num_computed: int, num_new: int, table: list[int]) -> ScheduledRequest:
    req = Request("r", list(range(1, num_computed + num_new + 1)), SamplingParams(), None, 8)
    return ScheduledRequest(req, num_computed, num_new, table, sample=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
def test_paged_attention_native_prefill_equals_torch_groups(dtype: torch.dtype) -> None:
    """A whole step (decodes, continuing chunks, fresh prompts) through ``paged_attention``: the metadata for
    the native kernel gives what the torch prefill groups give; float16 falls back to per-chunk SDPA."""
    g = torch.Generator().manual_seed(3)
    block_size, num_heads, num_kv_heads, head_dim, num_blocks = 16, 9, 3, 64, 200
    shapes = sorted([(40, 1), (7, 1), (300, 60), (16, 17), (5, 3), (0, 257), (0, 100), (0, 2)],
                    key=lambda s: (s[1] != 1, s[0] == 0))  # decodes, continuing chunks, fresh prompts
    perm = torch.randperm(num_blocks, generator=g).tolist()
    order = []
    for c, n in shapes:
        nb = -(-(c + n) // block_size)
        order.append(_scheduled(c, n, perm[:nb]))
        perm = perm[nb:]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(n for _, n in shapes), num_heads, head_dim, generator=g).to(dtype)
    cpu = torch.device("cpu")
    _, _, meta_torch, _ = prepare_inputs(order, 2, block_size, cpu, native_decode=True)
    _, _, meta_native, _ = prepare_inputs(order, 2, block_size, cpu, native_decode=True, native_prefill=True)
    npf = meta_native.native_prefill
    assert npf is not None and not meta_native.prefill_groups and meta_torch.native_prefill is None
    assert (npf.start, npf.end) == (2, q.shape[0])
    assert npf.q_len.tolist() == [n for _, n in shapes[2:]] and npf.offsets.tolist() == [c for c, _ in shapes[2:]]
    ref = paged_attention(q, k_cache, v_cache, meta_torch, 0.125)
    out = paged_attention(q, k_cache, v_cache, meta_native, 0.125)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 2 ** -6}
    torch.testing.assert_close(out, ref, **tol)
    # float16: the kernel does not take it; the same metadata goes through the per-chunk torch fallback
    _, _, meta_half, _ = prepare_inputs(order, 2, block_size, cpu, native_prefill=True)  # (torch decode buckets)
    half = paged_attention(q.half(), k_cache.half(), v_cache.half(), meta_half, 0.125)
    torch.testing.assert_close(half.float(), ref.float(), rtol=2 ** -6, atol=2 ** -5)


_DISABLED_SCRIPT = """
import torch
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.layers.attention import native_prefill_supported, paged_attention
from kvserve.layers.cpu_kernels import native_available
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import prepare_inputs

g = torch.Generator().manual_seed(0)
order = [ScheduledRequest(Request("r", list(range(1, c + n + 1)), SamplingParams(), None, 8), c, n,
                          list(range(b, b + 4)), sample=True) for c, n, b in ((20, 9, 0), (0, 30, 4))]
kc, vc = torch.randn(8, 16, 2, 64, generator=g), torch.randn(8, 16, 2, 64, generator=g)
q = torch.randn(39, 6, 64, generator=g)
cpu = torch.device("cpu")
meta_native = prepare_inputs(order, 0, 16, cpu, native_prefill=True)[2]
meta_torch = prepare_inputs(order, 0, 16, cpu)[2]
err = (paged_attention(q, kc, vc, meta_native, 0.125) - paged_attention(q, kc, vc, meta_torch, 0.125)).abs().max()
print(native_available(), native_prefill_supported(q, kc), float(err) < 1e-5)
"""


def test_disabled_native_serves_the_torch_prefill() -> None:
    """``KVSERVE_DISABLE_NATIVE=1``: no library, so metadata built for the native kernel goes through the
    per-chunk SDPA fallback, equal to the torch prefill groups (the runner builds those then anyway)."""
    env = dict(os.environ, KVSERVE_DISABLE_NATIVE="1")
    out = subprocess.run([sys.executable, "-c", _DISABLED_SCRIPT], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.split() == ["False", "False", "True"]
