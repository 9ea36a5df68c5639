"""benchmarks/kv_capacity.py without running the engine: the capacity arithmetic and the table."""

from __future__ import annotations

from bench_script import load_benchmark

kc = load_benchmark("kv_capacity.py", "kv_capacity")


def test_capacity_of_smollm2_at_2_gib() -> None:
    bf16 = kc.capacity("smollm2-135m-instruct", "bfloat16", 2.0, 16, 524)
    # 16 tokens x K and V x 30 layers x 3 KV heads x 64 x 2 bytes = 368,640 bytes a block
    assert bf16["block_bytes"] == 368_640 and bf16["blocks"] == (2 << 30) // 368_640 == 5825
    assert bf16["tokens"] == 5825 * 16 and bf16["max_sequences"] == 5825 // 33  # 524 tokens = 33 blocks
    # int8 rows: 64 codes + 4 float16 scales (one per 16 channels) = 72 bytes; fp8 rows: 64 codes + a float32 = 68
    for kv, row, blocks, ratio in (("int8", 72, 10_356, "1.78"), ("fp8", 68, 10_965, "1.88")):
        cap = kc.capacity("smollm2-135m-instruct", kv, 2.0, 16, 524)
        assert cap["block_bytes"] == 16 * 2 * 30 * 3 * row
        assert cap["blocks"] == (2 << 30) // cap["block_bytes"] == blocks
        # the ratio docs/kv_cache_8bit.md quotes (8-bit codes plus their scales: short of 2x)
        assert f"{cap['blocks'] / bf16['blocks']:.2f}" == ratio
    assert kc.pool_gib("smollm2-135m-instruct", 16384, 16) == 1024 * 368_640 / (1 << 30)


def test_table_rows() -> None:
    caps = {k: kc.capacity("smollm2-135m-instruct", k, 2.0, 16, 524) for k in ("bfloat16", "int8")}
    runs = [dict(kv_dtype="bfloat16", output_tok_s=100.0, preemptions=12, other_cpu_frac=0.01),
            dict(kv_dtype="bfloat16", output_tok_s=120.0, preemptions=10, other_cpu_frac=0.03),
            dict(kv_dtype="int8", output_tok_s=150.0, preemptions=0, other_cpu_frac=0.02)]
    rows = kc.summarize(runs, caps)
    assert rows[0][0] == "bfloat16" and rows[0][3] == "1.00x" and rows[0][5] == "110.0" and rows[0][6] == "12/10"
    assert rows[0][7] == 0.03
    assert rows[1][5] == "150.0" and rows[1][6] == "0" and rows[1][3] == f"{caps['int8']['blocks'] / 5825:.2f}x"
