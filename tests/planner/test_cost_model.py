"""Every cost-model formula on hand-computed values (../shared/docs/cost-model.md, docs/planner.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvserve import cost_model as cm

SMOL_FP32 = 46_080  # 2 × 30 layers × 3 kv heads × 64 head_dim × 4 bytes


def test_module_imports_no_torch_or_numpy() -> None:
    tree = ast.parse(Path(cm.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not names & {"torch", "numpy"}


def test_kv_bytes_per_token() -> None:
    assert cm.kv_bytes_per_token(30, 3, 64, 4) == SMOL_FP32
    assert cm.kv_bytes_per_token(30, 3, 64, 2) == 23_040
    assert cm.kv_bytes_per_token(30, 3, 64, 1) == 11_520
    # Llama-3-8B bf16: 2 × 32 × 8 × 128 × 2 = 131,072 B/token
    assert cm.kv_bytes_per_token(32, 8, 128, 2) == 131_072
    with pytest.raises(ValueError, match="num_kv_heads"):
        cm.kv_bytes_per_token(30, 0, 64, 4)


def test_kv_bytes_per_token_8bit_counts_the_scales() -> None:
    """kvserve's 8-bit rows: int8 is head_dim codes + a 2-byte float16 scale per 16 channels, fp8 head_dim codes +
    one 4-byte float32 scale per token and KV head; the last int8 group may be shorter."""
    assert cm.kv_bytes_per_token_8bit(30, 3, 64) == 12_960  # int8 (the default): 2 × 30 × 3 × (64 + 8)
    assert cm.kv_bytes_per_token_8bit(30, 3, 64, "int8") == 12_960
    assert cm.kv_bytes_per_token_8bit(30, 3, 64, "fp8") == cm.kv_bytes_per_token_8bit(30, 3, 64, "fp8_e4m3") == 12_240
    assert cm.kv_bytes_per_token_8bit(28, 2, 128, "int8") == 2 * 28 * 2 * 144
    assert cm.kv_bytes_per_token_8bit(28, 2, 128, "fp8") == 2 * 28 * 2 * 132
    assert [cm.kv8_row_bytes(d) for d in (64, 128, 24, 16, 17, 1)] == [72, 144, 28, 18, 21, 3]
    # against bf16 (2 bytes per element): int8 holds 1.78× the tokens at any multiple of 16, fp8 1.88× / 1.94×
    assert cm.kv_bytes_per_token(30, 3, 64, 2) / cm.kv_bytes_per_token_8bit(30, 3, 64) == pytest.approx(16 / 9)
    assert cm.kv_bytes_per_token(28, 2, 128, 2) / cm.kv_bytes_per_token_8bit(28, 2, 128) == pytest.approx(16 / 9)
    with pytest.raises(ValueError, match="num_layers"):
        cm.kv_bytes_per_token_8bit(0, 3, 64)
    with pytest.raises(ValueError, match="head_dim"):
        cm.kv8_row_bytes(0)
    with pytest.raises(ValueError, match="8-bit"):
        cm.kv_bytes_per_token_8bit(30, 3, 64, "bfloat16")


def test_8bit_bytes_match_the_cache_layout() -> None:
    """The cost model (no torch) and the cache's own layout (``kv_quant``) count the same bytes."""
    import torch

    from kvserve.layers import kv_quant

    for head_dim in (64, 128, 80, 24, 1):
        for name, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            assert cm.kv_bytes_per_token_8bit(30, 3, head_dim, name) == \
                kv_quant.kv_bytes_per_token(30, 3, head_dim, dtype)


def test_kv_bytes() -> None:
    assert cm.kv_bytes(SMOL_FP32, 2048) == 94_371_840  # 46,080 × 2,048 = 90 MiB
    assert cm.kv_bytes(SMOL_FP32, 0) == 0
    with pytest.raises(ValueError):
        cm.kv_bytes(SMOL_FP32, -1)


def test_max_concurrency() -> None:
    gib = 1 << 30
    # 1 GiB / (46,080 × 2,048) = 1,073,741,824 / 94,371,840 = 11.38 -> 11
    assert cm.max_concurrency(gib, SMOL_FP32, 2048) == 11
    assert cm.max_concurrency(94_371_840, SMOL_FP32, 2048) == 1
    assert cm.max_concurrency(94_371_839, SMOL_FP32, 2048) == 0
    with pytest.raises(ValueError, match="seq_len"):
        cm.max_concurrency(gib, SMOL_FP32, 0)


def test_kv_memory_bytes() -> None:
    assert cm.kv_memory_bytes(80e9, 16e9, 0.9, 2e9) == pytest.approx(54e9)  # 72 − 16 − 2
    assert cm.kv_memory_bytes(1e9, 2e9) == 0.0
    with pytest.raises(ValueError, match="utilization"):
        cm.kv_memory_bytes(1e9, 0, 1.5)


def test_decode_step_lower_bound() -> None:
    # 16 GB weights + 4 GB KV over 2 TB/s = 10 ms
    assert cm.decode_step_lower_bound_s(16e9, 4e9, 2e12) == pytest.approx(0.010)
    with pytest.raises(ValueError, match="bandwidth"):
        cm.decode_step_lower_bound_s(1, 1, 0)


def test_decode_throughput_upper_bound() -> None:
    # W = 1 GB, batch 4 × 1,000 tokens × 250,000 B = 1 GB KV; 2 GB at 10 GB/s = 0.2 s/step
    per, total = cm.decode_throughput_upper_bound(1e9, 250_000, 1000, 4, 10e9)
    assert per == pytest.approx(5.0)
    assert total == pytest.approx(20.0)


def test_recompute_and_swap() -> None:
    assert cm.recompute_time_s(2048, 1024.0) == pytest.approx(2.0)
    # 2 × 1,000 × 46,080 / 9.216e9 = 0.01 s
    assert cm.swap_time_s(1000, SMOL_FP32, 9.216e9) == pytest.approx(0.01)
    assert cm.preempt_choice(1000, SMOL_FP32, 1000.0, 9.216e9) == "swap"  # 1 s vs 0.01 s
    assert cm.preempt_choice(1000, SMOL_FP32, 1e9, 9.216e9) == "recompute"  # 1 µs vs 0.01 s
    # tie: swap = 2 × 10 × 1 / 20 = 1 s, recompute = 10 / 10 = 1 s -> recompute
    assert cm.preempt_choice(10, 1, 10.0, 20.0) == "recompute"
    assert cm.preempt_choice(0, SMOL_FP32, 1.0, 1.0) == "recompute"


def test_fetch_and_break_even() -> None:
    assert cm.fetch_time_s(1000, SMOL_FP32, 46.08e6) == pytest.approx(1.0)
    # 25 GB/s PCIe / 46,080 B = 542,534.7 tokens/s
    assert cm.fetch_break_even_prefill_tokens_per_s(25e9, SMOL_FP32) == pytest.approx(542_534.72, rel=1e-6)
    assert cm.fetch_break_even_prefill_tokens_per_s(1.25e9, 11_520) == pytest.approx(108_506.94, rel=1e-6)
    # at the break-even speed, fetch and recompute take the same time
    s = cm.fetch_break_even_prefill_tokens_per_s(3e9, SMOL_FP32)
    assert cm.fetch_time_s(777, SMOL_FP32, 3e9) == pytest.approx(cm.recompute_time_s(777, s))


def test_pd() -> None:
    assert cm.pd_transfer_time_s(2048, SMOL_FP32, 12.5e9) == pytest.approx(94_371_840 / 12.5e9)
    # prefill 2,000 tokens at 10,000 tok/s = 0.2 s; decode 200 tokens at 500 tok/s = 0.4 s -> 1/3
    assert cm.pd_prefill_share(2000, 200, 10_000, 500) == pytest.approx(1 / 3)


def test_spec_decode() -> None:
    assert cm.spec_decode_expected_tokens(0.5, 1) == pytest.approx(1.5)  # 1 + 0.5
    assert cm.spec_decode_expected_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert cm.spec_decode_expected_tokens(1.0, 4) == 5.0
    assert cm.spec_decode_expected_tokens(0.0, 4) == 1.0
    # E(0.8, 4) = 3.3616; cost = 4 × 0.05 + 1 = 1.2 -> 2.80133
    assert cm.spec_decode_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert cm.spec_decode_speedup(0.5, 1, 0.0) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="alpha"):
        cm.spec_decode_expected_tokens(1.1, 2)


def test_spec_decode_best_k() -> None:
    # α = 0.5, c = 0.1: k=1 1.5/1.1 = 1.364, k=2 1.75/1.2 = 1.458, k=3 1.875/1.3 = 1.442 -> 2
    k, s = cm.spec_decode_best_k(0.5, 0.1)
    assert k == 2
    assert s == pytest.approx(1.75 / 1.2)
    # the best k grows with α
    ks = [cm.spec_decode_best_k(a, 0.05)[0] for a in (0.5, 0.6, 0.7, 0.8, 0.9)]
    assert ks == sorted(ks) and ks[-1] > ks[0]


def test_concurrency_gain() -> None:
    assert cm.concurrency_gain(4, 1) == 4.0
    assert cm.concurrency_gain(2, 1) == 2.0
