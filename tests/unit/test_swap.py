"""Swap preemption on the runner side: host pool sizing, exact device <-> host block copies, step ordering,
byte accounting, and the start-up measurements (copy bandwidth, prefill speed) — on a tiny random model."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.core.block_manager import BlockId
from kvserve.core.scheduler_output import SchedulerOutput
from kvserve.models.llama import MODEL_CLASSES
from kvserve.models.registry import ModelArchConfig
from kvserve.worker.kv_cache import GiB, allocate_host_swap_pool, block_bytes, num_host_blocks_for
from kvserve.worker.model_runner import ModelRunner

ARCH = ModelArchConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                       tie_word_embeddings=False, attention_bias=False)
BLOCK_SIZE = 4
NUM_BLOCKS = 24
BLOCK_BYTES = BLOCK_SIZE * 2 * 3 * 2 * 8 * 4  # block_size × 2 (K, V) × layers × kv_heads × head_dim × fp32


def _runner(num_host_blocks: int = 8) -> ModelRunner:
    torch.manual_seed(0)
    model = MODEL_CLASSES["llama"](ARCH, ARCH.max_position_embeddings).eval()
    runner = ModelRunner(model, NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"), num_host_blocks=num_host_blocks)
    for k, v in runner.kv_caches:  # distinct contents in every block of every layer
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    return runner


def _snapshot(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.clone(), v.clone()) for k, v in runner.kv_caches]


def _bid(ids: list[int]) -> list[BlockId]:
    return [BlockId(i) for i in ids]


def test_num_host_blocks_for() -> None:
    assert block_bytes(ARCH, BLOCK_SIZE, torch.float32) == BLOCK_BYTES
    assert num_host_blocks_for(0, ARCH, BLOCK_SIZE, torch.float32) == 0
    assert num_host_blocks_for(1.0, ARCH, BLOCK_SIZE, torch.float32) == GiB // BLOCK_BYTES
    tiny = 10.5 * BLOCK_BYTES / GiB  # floor of 10.5 blocks
    assert num_host_blocks_for(tiny, ARCH, BLOCK_SIZE, torch.float32) == 10
    assert num_host_blocks_for(1.0, ARCH, BLOCK_SIZE, torch.bfloat16) == GiB // (BLOCK_BYTES // 2)
    with pytest.raises(ValueError, match="swap_space"):
        num_host_blocks_for(-1.0, ARCH, BLOCK_SIZE, torch.float32)


def test_host_pool_shape() -> None:
    pool = allocate_host_swap_pool(ARCH, 5, BLOCK_SIZE, torch.bfloat16, torch.device("cpu"))
    assert len(pool) == ARCH.num_hidden_layers
    for k, v in pool:
        for t in (k, v):
            assert t.shape == (5, BLOCK_SIZE, 2, 8) and t.dtype == torch.bfloat16
            assert t.device.type == "cpu" and not t.is_pinned()
    assert allocate_host_swap_pool(ARCH, 0, BLOCK_SIZE, torch.float32, torch.device("cpu")) == []


def test_swap_out_then_in_to_other_blocks_is_exact() -> None:
    runner = _runner()
    before = _snapshot(runner)
    src, host, dst = [3, 5, 7], [0, 6, 2], [10, 11, 12]
    nbytes, secs = runner.swap_blocks(list(zip(_bid(src), host, strict=True)), [])
    assert nbytes == 3 * BLOCK_BYTES and secs >= 0
    nbytes, secs = runner.swap_blocks([], list(zip(host, _bid(dst), strict=True)))
    assert nbytes == 3 * BLOCK_BYTES
    for (k0, v0), (k, v), (hk, hv) in zip(before, runner.kv_caches, runner.host_kv_caches, strict=True):
        assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src])
        assert torch.equal(hk[host], k0[src]) and torch.equal(hv[host], v0[src])
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert torch.equal(k[untouched], k0[untouched]) and torch.equal(v[untouched], v0[untouched])


def test_empty_step_does_swaps_in_order_then_copy() -> None:
    """Swap out first (device block 4 is then reused by the swap-in), swap in second, CoW third."""
    runner = _runner()
    before = _snapshot(runner)
    runner.swap_blocks([(BlockId(9), 0)], [])  # host block 0 <- device block 9
    so = SchedulerOutput(scheduled=[], blocks_to_swap_out=[(BlockId(4), 1), (BlockId(6), 3)],
                         blocks_to_swap_in=[(0, BlockId(4))], blocks_to_copy=[(BlockId(4), BlockId(8))])
    out = runner.execute_model(so)
    assert out.req_ids == [] and out.sampled_token_ids == []
    assert out.swap_bytes == 3 * BLOCK_BYTES  # 2 blocks out + 1 block in
    assert math.isfinite(out.swap_seconds) and out.swap_seconds > 0
    for (k0, v0), (k, v), (hk, hv) in zip(before, runner.kv_caches, runner.host_kv_caches, strict=True):
        assert torch.equal(hk[1], k0[4]) and torch.equal(hv[3], v0[6])  # old block 4 saved before reuse
        assert torch.equal(k[4], k0[9]) and torch.equal(v[4], v0[9])    # then overwritten by the swap-in
        assert torch.equal(k[8], k0[9]) and torch.equal(v[8], v0[9])    # CoW sees the swapped-in data
    assert runner.execute_model(SchedulerOutput(scheduled=[])).swap_bytes == 0


def test_swap_errors() -> None:
    runner = _runner(num_host_blocks=0)
    assert runner.host_kv_caches == []
    with pytest.raises(IndexError, match="host block 0"):
        runner.swap_blocks([(BlockId(1), 0)], [])
    runner = _runner(num_host_blocks=2)
    with pytest.raises(IndexError, match="device block 99"):
        runner.swap_blocks([(BlockId(99), 0)], [])
    with pytest.raises(AssertionError):
        runner.swap_blocks([(BlockId(1), 0)], [(0, BlockId(2))])


@pytest.mark.parametrize("num_host_blocks", [0, 2, 32])
def test_copy_bandwidth_is_positive_and_leaves_cache_unchanged(num_host_blocks: int) -> None:
    runner = _runner(num_host_blocks)
    before = _snapshot(runner)
    bw = runner.measure_copy_bandwidth(num_blocks=8, repeats=3)
    assert math.isfinite(bw) and bw > 0
    for (k0, v0), (k, v) in zip(before, runner.kv_caches, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert len(runner.host_kv_caches) == (ARCH.num_hidden_layers if num_host_blocks else 0)


def test_prefill_speed_is_positive_and_zeroes_its_blocks() -> None:
    runner = _runner()
    before = _snapshot(runner)
    tok_s = runner.measure_prefill_speed(num_tokens=30)
    assert math.isfinite(tok_s) and tok_s > 0
    used = math.ceil(30 / BLOCK_SIZE)
    for (k0, v0), (k, v) in zip(before, runner.kv_caches, strict=True):
        assert not k[:used].any() and not v[:used].any()
        assert torch.equal(k[used:], k0[used:]) and torch.equal(v[used:], v0[used:])
    assert runner.generators == {}
    # capped at the cache size: 24 blocks × 4 tokens = 96 tokens
    assert math.isfinite(runner.measure_prefill_speed(num_tokens=10_000))
