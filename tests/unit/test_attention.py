"""Paged attention (batched decode + padded prefill groups) against plain contiguous SDPA per request."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.layers.attention import paged_attention, reference_attention, write_kv
from kvserve.layers.cpu_kernels import native_available
from kvserve.sampling_params import SamplingParams
from kvserve.worker.input_batch import prepare_inputs


def _scheduled(num_computed: int, num_new: int, table: list[int]) -> ScheduledRequest:
    req = Request("r", list(range(1, num_computed + num_new + 1)), SamplingParams(), None, 8)
    return ScheduledRequest(req, num_computed, num_new, table, sample=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("native,native_prefill", [(False, False), (True, False), (True, True)],
                         ids=["torch", "native", "native+prefill"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (9, 3)])
def test_paged_matches_reference(block_size: int, num_heads: int, num_kv_heads: int, native: bool,
                                 native_prefill: bool) -> None:
    if native and not native_available():
        pytest.skip("no C compiler: the native decode kernel is unavailable")
    g = torch.Generator().manual_seed(block_size * 100 + num_heads)
    head_dim, num_blocks = 8, 128
    # (num_computed, num_new): 3 decodes, then prefills (fresh, chunk after a cached prefix, 1-block exact)
    shapes = [(0, 1), (9, 1), (30, 1), (0, 13), (7, 5), (0, 2 * block_size), (20, 3)]
    # decodes first, then chunks continuing a cached prefix, then fresh prompts: as the runner orders them
    shapes.sort(key=lambda s: (s[1] != 1, s[0] == 0))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    order, seqs = [], []
    for c, n in shapes:
        nb = -(-(c + n) // block_size)
        table, perm = perm[:nb], perm[nb:]
        if not table:
            raise AssertionError("test needs more blocks")
        order.append(_scheduled(c, n, table))
        seqs.append((torch.randn(c + n, num_kv_heads, head_dim, generator=g),
                     torch.randn(c + n, num_kv_heads, head_dim, generator=g),
                     torch.randn(n, num_heads, head_dim, generator=g)))
    num_decodes = sum(1 for _, n in shapes if n == 1)
    _, _, meta, _ = prepare_inputs(order, num_decodes, block_size, torch.device("cpu"), native_decode=native,
                                   native_prefill=native_prefill)
    assert (meta.native_decode is not None) == native and bool(meta.decode_buckets) != native
    if native_prefill:  # every chunk in one native call (csrc/prefill_attention.c)
        assert meta.native_prefill is not None and not meta.prefill_groups
        assert meta.native_prefill.offsets.tolist() == [s.num_computed_tokens for s in order[num_decodes:]]
    else:
        assert [g.mask is None for g in meta.prefill_groups] == [False, True] and meta.native_prefill is None
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    # The cached prefix is written as an earlier step would have; this step's K/V through slot_mapping.
    for s, (k, v, _) in zip(order, seqs, strict=True):
        c = s.num_computed_tokens
        pos = torch.arange(c)
        slots = torch.tensor(s.block_table)[pos // block_size] * block_size + pos % block_size
        write_kv(k[:c], v[:c], k_cache, v_cache, slots)
    new_k = torch.cat([k[s.num_computed_tokens:] for s, (k, _, _) in zip(order, seqs, strict=True)])
    new_v = torch.cat([v[s.num_computed_tokens:] for s, (_, v, _) in zip(order, seqs, strict=True)])
    write_kv(new_k, new_v, k_cache, v_cache, meta.slot_mapping)
    q = torch.cat([q for _, _, q in seqs])
    scale = 1 / math.sqrt(head_dim)
    out = paged_attention(q, k_cache, v_cache, meta, scale)
    expected = torch.cat([reference_attention(q, k, v, scale) for k, v, q in seqs])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_slot_mapping_and_positions_exact() -> None:
    # block_size 4; request A computed 5 (decode), request B fresh prompt of 3 tokens.
    order = [_scheduled(5, 1, [7, 2]), _scheduled(0, 3, [9])]
    ids, positions, meta, logits_idx = prepare_inputs(order, 1, 4, torch.device("cpu"))
    assert positions.tolist() == [5, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 36, 37, 38]
    assert ids.tolist() == [6, 1, 2, 3]
    assert logits_idx.tolist() == [0, 3]
    assert [(a, b, t.tolist()) for a, b, t, _ in meta.decode_buckets] == [(0, 1, [[7, 2]])]
    assert meta.decode_buckets[0][3].view(-1).tolist() == [True] * 6 + [False] * 2
    assert len(meta.prefill_groups) == 1 and meta.prefill_groups[0].mask is None  # fresh prompt: causal
    assert meta.prefill_groups[0].pad_index.tolist() == [0, 1, 2]


def test_many_decodes_split_into_length_buckets() -> None:
    g = torch.Generator().manual_seed(3)
    block_size, num_heads, num_kv_heads, head_dim = 4, 6, 2, 8
    lens = sorted(torch.randint(1, 60, (21,), generator=g).tolist())
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    perm = torch.randperm(num_blocks, generator=g).tolist()
    order, seqs = [], []
    for n in lens:
        nb = -(-n // block_size)
        table, perm = perm[:nb], perm[nb:]
        order.append(_scheduled(n - 1, 1, table))
        seqs.append((torch.randn(n, num_kv_heads, head_dim, generator=g),
                     torch.randn(n, num_kv_heads, head_dim, generator=g),
                     torch.randn(1, num_heads, head_dim, generator=g)))
    _, _, meta, _ = prepare_inputs(order, len(order), block_size, torch.device("cpu"))
    assert [(a, b) for a, b, _, _ in meta.decode_buckets] == [(0, 10), (10, 21)]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    for s, (k, v, _) in zip(order, seqs, strict=True):
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(s.block_table)[pos // block_size] * block_size + pos % block_size
        write_kv(k, v, k_cache, v_cache, slots)
    q = torch.cat([q for _, _, q in seqs])
    out = paged_attention(q, k_cache, v_cache, meta, 0.3)
    expected = torch.cat([reference_attention(q, k, v, 0.3) for k, v, q in seqs])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_native_kernel_matches_torch_for_head_dims(head_dim: int) -> None:
    if not native_available():
        pytest.skip("no C compiler: the native decode kernel is unavailable")
    from kvserve.layers.cpu_kernels import paged_decode_attention

    g = torch.Generator().manual_seed(head_dim)
    num_blocks, block_size, kvh, group = 40, 8, 2, 4
    kc = torch.randn(num_blocks, block_size, kvh, head_dim, generator=g)
    vc = torch.randn(num_blocks, block_size, kvh, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[:30].view(3, 10)
    lens = torch.tensor([1, 37, 80])
    q = torch.randn(3, kvh, group, head_dim, generator=g)
    out = paged_decode_attention(q, kc, vc, tables, lens, 0.2)
    for i in range(3):
        n = int(lens[i])
        pos = torch.arange(n)
        slots = tables[i][pos // block_size] * block_size + pos % block_size
        k = kc.view(-1, kvh, head_dim)[slots]
        v = vc.view(-1, kvh, head_dim)[slots]
        ref = reference_attention(q[i].reshape(1, kvh * group, head_dim), k, v, 0.2)
        torch.testing.assert_close(out[i].reshape(1, -1), ref, rtol=1e-5, atol=1e-5)
