"""Weights and KV cache in transparent huge pages (kvserve/worker/host_memory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kvserve.models.registry import ModelArchConfig
from kvserve.worker import host_memory
from kvserve.worker.kv_cache import allocate_kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    text = THP.read_text() if THP.exists() else "[never]"
    return text.split("[", 1)[1].split("]", 1)[0]


def _anon_huge_kib(start: int, nbytes: int) -> int:
    """AnonHugePages (KiB) of the mappings of this process overlapping ``[start, start + nbytes)``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < start + nbytes and start < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_region_is_aligned_zeroed_and_backed_by_huge_pages() -> None:
    if not host_memory.hugepages_enabled(torch.device("cpu")):
        pytest.skip("no MADV_HUGEPAGE on this platform")
    region = host_memory.empty_hugepages(8 << 20)
    assert region.dtype == torch.uint8 and region.numel() == 8 << 20
    assert region.data_ptr() % host_memory.HUGE_PAGE == 0
    assert int(region.count_nonzero()) == 0
    region.fill_(7)  # first touch: the kernel backs the advised range with 2 MiB pages
    if _thp_mode() == "never":
        pytest.skip("transparent huge pages are disabled on this host (enabled = never)")
    assert _anon_huge_kib(region.data_ptr(), region.numel()) >= 2048


def test_pack_tensors_keeps_values_and_aligns_each() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, 2).bfloat16()]
    packed = host_memory.pack_tensors(tensors)
    for src, dst in zip(tensors, packed, strict=True):
        assert dst.dtype == src.dtype and dst.shape == src.shape and torch.equal(dst, src)
        assert dst.data_ptr() % 64 == 0 and dst.data_ptr() != src.data_ptr()


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.Parameter(torch.ones(4))


def test_move_parameters_keeps_ties_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    if not host_memory.hugepages_enabled(torch.device("cpu")):
        pytest.skip("no MADV_HUGEPAGE on this platform")
    model = _Tied()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = host_memory.move_parameters_to_hugepages(model)
    assert moved == (10 * 4 + 4) * 4  # the tied weight counted once
    assert model.head.weight is model.embed.weight
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    # one region in parameters() order (the module's own norm first), each slot 64-byte aligned: 16 -> 64 bytes
    assert model.embed.weight.data_ptr() - model.norm.data_ptr() == 64
    assert model.norm.data_ptr() % host_memory.HUGE_PAGE == 0
    monkeypatch.setenv("KVSERVE_HUGEPAGES", "0")
    assert host_memory.move_parameters_to_hugepages(_Tied()) == 0


def test_kv_cache_in_one_region_zero_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    arch = ModelArchConfig(architecture="llama", vocab_size=32, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                           rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                           tie_word_embeddings=True, attention_bias=False)
    caches = allocate_kv_cache(arch, 5, 4, torch.bfloat16, torch.device("cpu"))
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, 4, 1, 8) and k.dtype == torch.bfloat16
        assert int(k.count_nonzero()) == int(v.count_nonzero()) == 0
    ptrs = sorted(t.data_ptr() for kv in caches for t in kv)
    assert len(set(ptrs)) == 6
    if host_memory.hugepages_enabled(torch.device("cpu")):
        assert ptrs[0] % host_memory.HUGE_PAGE == 0  # one region: the six caches back to back
        assert [b - a for a, b in zip(ptrs, ptrs[1:], strict=False)] == [5 * 4 * 1 * 8 * 2] * 5
    monkeypatch.setenv("KVSERVE_HUGEPAGES", "0")
    plain = allocate_kv_cache(arch, 5, 4, torch.float32, torch.device("cpu"))
    assert plain[0][0].shape == (5, 4, 1, 8) and int(plain[0][0].count_nonzero()) == 0
