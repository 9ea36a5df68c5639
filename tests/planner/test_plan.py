"""``kvserve plan`` on the real SmolLM2-135M config (GGUF header only) against hand-computed values."""

from __future__ import annotations

import json

import pytest

from kvserve.planner.bandwidth import measure_bandwidth
from kvserve.planner.model_info import ModelInfo, load_model_info
from kvserve.planner.plan import GB, GiB, PlanOptions, build_plan

MODEL = "smollm2-135m-instruct"
SMOL_PARAMS = 134_515_008  # elements of every tensor in the GGUF file (tied embedding counted once)


@pytest.fixture(scope="module")
def info() -> ModelInfo:
    return load_model_info(MODEL)


def test_model_info_from_gguf_header(info: ModelInfo) -> None:
    a = info.arch
    assert (a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (30, 9, 3, 64)
    assert info.num_params == SMOL_PARAMS
    assert info.weight_bytes(4) == 538_060_032
    assert info.file_bytes < info.weight_bytes(4) / 4  # stored quantized (Q4_1 mostly)


def test_plan_values_for_smollm2(info: ModelInfo) -> None:
    opts = PlanOptions(dtype="float32", kv_cache_memory_bytes=2 * GiB, bandwidth_bytes_per_s=10 * GB,
                       copy_bytes_per_s=5 * GB, seq_lens=(512, 2048), context_len=2048, prefill_tokens_per_s=300.0)
    plan = build_plan(info, opts)
    kv = plan["kv"]
    assert kv["kv_bytes_per_token"] == 46_080  # 2 × 30 × 3 × 64 × 4
    assert kv["gqa_factor"] == 3
    r512, r2048 = kv["per_seq_len"]
    assert r2048["kv_bytes"] == 94_371_840  # 46,080 × 2,048
    assert r512["max_concurrency"] == 91  # floor(2 GiB / 23,592,960)
    assert r2048["max_concurrency"] == 22  # floor(2,147,483,648 / 94,371,840) = floor(22.76)
    # the 8-bit row (int8, for an fp32 cache) carries a float16 scale per 16 channels:
    # 2 × 30 × 3 × (64 + 8) = 12,960 B/token; × 2,048 = 26,542,080
    assert plan["kv_8bit"]["kv_cache_dtype_8bit"] == "int8"
    assert plan["kv_8bit"]["kv_bytes_per_token_8bit"] == 12_960
    assert r2048["max_concurrency_8bit"] == 80  # floor(2,147,483,648 / 26,542,080) = floor(80.91)
    assert plan["kv_8bit"]["concurrency_gain"] == pytest.approx(46_080 / 12_960)
    rows = {r["batch"]: r for r in plan["roofline"]["rows"]}
    # batch 1: (538,060,032 + 94,371,840) / 1e10 = 63.24 ms
    assert rows[1]["step_s"] == pytest.approx(0.0632431872)
    assert rows[16]["step_s"] == pytest.approx((538_060_032 + 16 * 94_371_840) / 1e10)
    assert rows[16]["total_tok_s"] == pytest.approx(16 / rows[16]["step_s"])
    assert rows[16]["fits"] and not rows[32]["fits"] and plan["roofline"]["max_batch_that_fits"] == 22
    assert plan["roofline"]["best_batch"] == 16
    pre = {r["seq_len"]: r for r in plan["preemption"]["rows"]}
    assert pre[2048]["recompute_s"] == pytest.approx(2048 / 300)
    assert pre[2048]["swap_s"] == pytest.approx(2 * 94_371_840 / 5e9)
    assert pre[2048]["choice"] == "swap"
    fetch = {r["link"]: r for r in plan["fetch_vs_recompute"]["rows"]}
    assert fetch["10 GbE"]["break_even_prefill_tokens_per_s"] == pytest.approx(1.25e9 / 46_080)
    assert fetch["PCIe 4 x16"]["choice"] == "fetch"  # 300 tok/s prefill << 542,535
    sd = {r["alpha"]: r for r in plan["spec_decode"]["rows"]}
    assert sd[0.8]["speedup"][3] == pytest.approx(3.3616 / 1.2)  # k=4, c=0.05
    assert sd[0.5]["best_k"] == 3 and sd[0.9]["best_k"] == 8
    assert plan["pd"]["go"] is False and len(plan["pd"]["checks"]) == 4


def test_pd_go_with_fast_links_many_devices_and_tpot_slo(info: ModelInfo) -> None:
    opts = PlanOptions(bandwidth_bytes_per_s=3000 * GB, copy_bytes_per_s=25 * GB, prefill_tokens_per_s=20_000,
                       num_devices=16, interconnect_bytes_per_s=400 * GB, tpot_slo_s=0.05)
    pd = build_plan(info, opts)["pd"]
    assert pd["go"], pd["checks"]
    assert pd["transfer_s"] == pytest.approx(2048 * 46_080 / 400e9)  # KV of the 2,048-token prompt over 400 GB/s
    assert pd["prefill_s"] == pytest.approx(2048 / 20_000)
    # prefill takes most device time here (fast decode at its best batch): 16 devices split 15 : 1
    assert pd["prefill_share"] > 0.9 and pd["prefill_devices"] == 15


def test_kv_cache_dtype_and_memory_budget(info: ModelInfo) -> None:
    opts = PlanOptions(dtype="bfloat16", kv_cache_dtype="fp8", memory_bytes=8 * GiB, utilization=0.5,
                       bandwidth_bytes_per_s=1e10, copy_bytes_per_s=1e10)
    plan = build_plan(info, opts)
    assert plan["kv"]["kv_bytes_per_token"] == 12_240  # kvserve's fp8 layout: 2 × 30 × 3 × (64 + 4 scale bytes)
    assert plan["kv_8bit"]["kv_cache_dtype_8bit"] == "fp8" and plan["kv_8bit"]["kv_bytes_per_token_8bit"] == 12_240
    int8 = build_plan(info, PlanOptions(dtype="bfloat16", kv_cache_dtype="int8", memory_bytes=8 * GiB,
                                        utilization=0.5, bandwidth_bytes_per_s=1e10, copy_bytes_per_s=1e10))
    assert int8["kv"]["kv_bytes_per_token"] == 12_960  # int8: 2 × 30 × 3 × (64 + 4 float16 scales × 2 bytes)
    assert plan["model"]["weight_bytes"] == SMOL_PARAMS * 2
    assert plan["kv"]["kv_memory_bytes"] == pytest.approx(4 * GiB - SMOL_PARAMS * 2)


def test_measure_bandwidth() -> None:
    bw = measure_bandwidth(size_mib=8, repeats=2)
    assert bw.memory == pytest.approx(2 * bw.copy) and bw.copy > 1e8


def test_cli_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.entrypoints.cli import main

    assert main(["plan", "--model", MODEL, "--json", "--bandwidth-gbs", "10", "--copy-bandwidth-gbs", "5",
                 "--seq-lens", "1024"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv"]["kv_bytes_per_token"] == 46_080 and plan["kv"]["per_seq_len"][0]["kv_bytes"] == 47_185_920
    assert main(["plan", "--model", MODEL, "--bandwidth-gbs", "10", "--copy-bandwidth-gbs", "5"]) == 0
    out = capsys.readouterr().out
    assert "46,080 B/token" in out and "8-bit KV cache (int8): 12,960 B/token" in out


def test_gguf_weight_bytes_are_the_files_blocks(info: ModelInfo) -> None:
    """``--quantization gguf`` serves SmolLM2's blocks as stored: Q4_1 projections (20 B per 32 weights), the tied
    Q8_0 table once (34 B per 32), 35,136 norm weights in the dtype; equal to the file's tensor bytes but for the
    norms' float32. (tests/model/test_gguf_weights.py checks the count against a served model's bytes.)"""
    per_layer = (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536) // 32 * 20
    table = 49152 * 576 // 32 * 34
    norms = 30 * 2 * 576 + 576
    assert info.gguf_weight_bytes(2) == 30 * per_layer + table + 2 * norms == 96_506_496
    assert info.gguf_weight_bytes(4) == info.file_bytes
    opts = PlanOptions(dtype="bfloat16", quantization="gguf", bandwidth_bytes_per_s=10 * GB, copy_bytes_per_s=5 * GB)
    assert build_plan(info, opts)["model"]["weight_bytes"] == 96_506_496
    hf = ModelInfo("hf", "/nowhere", info.arch, info.num_params, info.file_bytes)
    with pytest.raises(ValueError, match="quantization: gguf needs a .gguf model; hf is not one"):
        hf.gguf_weight_bytes(2)


def test_tensor_parallel_section_for_qwen_coder_0_5b() -> None:
    """Qwen2.5-Coder-0.5B (24 layers, hidden 896, 14 / 2 heads, vocabulary 151,936) at 2 ranks, float32."""
    info = load_model_info("qwen2.5-coder-0.5b-instruct")
    opts = PlanOptions(dtype="float32", kv_cache_memory_bytes=1 * GiB, bandwidth_bytes_per_s=20 * GB,
                       copy_bytes_per_s=5 * GB, context_len=1024, prefill_tokens_per_s=300.0, tensor_parallel_size=2,
                       tp_link_bytes_per_s=10 * GB, tp_latency_s=100e-6)
    plan = build_plan(info, opts)
    assert build_plan(info, PlanOptions(**{**opts.__dict__, "tensor_parallel_size": 1}))["tensor_parallel"] is None
    tp = plan["tensor_parallel"]
    assert tp["splits"] and tp["split"] == "7 query and 1 KV head(s) per rank"
    assert tp["collectives_per_step"] == 50  # 2 all-reduces x 24 layers, the embedding's, the logits' gather
    rows = {r["batch"]: r for r in tp["rows"]}
    assert rows[1]["allreduce_bytes"] == 175_616  # (2 x 24 + 1) x 896 x 4
    # ring all-reduce at 2 ranks moves the payload once; rank 0 receives 75,968 float32 logits of the other shard
    assert rows[1]["link_bytes"] == 175_616 + 75_968 * 4 == 479_488
    assert rows[1]["comm_s"] == pytest.approx(479_488 / 1e10 + 50 * 100e-6)
    w, kv_request = info.weight_bytes(4), 24_576 * 1024  # 2 x 24 x 2 x 64 x 4 B/token
    assert rows[1]["step_s_1"] == pytest.approx((w + kv_request) / 20e9)
    assert rows[1]["step_s"] == pytest.approx((w + kv_request) / 2 / 20e9 + rows[1]["comm_s"])
    assert rows[32]["allreduce_bytes"] == 32 * 175_616
    assert rows[1]["speedup"] == pytest.approx(rows[1]["step_s_1"] / rows[1]["step_s"]) and rows[1]["speedup"] > 1.8
    assert tp["kv_memory_bytes"] == 2 * GiB and tp["max_batch_that_fits"] == 85  # floor(2 GiB / 25,165,824)
    shared = build_plan(info, PlanOptions(**{**opts.__dict__, "tp_shares_bandwidth": True}))["tensor_parallel"]
    assert shared["rows"][0]["step_s"] == pytest.approx(rows[1]["step_s_1"] + rows[1]["comm_s"])  # no gain: one socket


def test_cli_plan_tensor_parallel_refusal_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.entrypoints.cli import main

    assert main(["plan", "--model", MODEL, "--json", "--bandwidth-gbs", "10", "--copy-bandwidth-gbs", "5",
                 "--tensor-parallel-size", "3", "--tp-link-gbs", "20", "--tp-latency-us", "40"]) == 0
    tp = json.loads(capsys.readouterr().out)["tensor_parallel"]
    assert tp["splits"] and tp["split"] == "3 query and 1 KV head(s) per rank"  # SmolLM2: 9 and 3 heads
    assert tp["link_bytes_per_s"] == 20e9 and tp["latency_s"] == pytest.approx(40e-6)
    assert main(["plan", "--model", MODEL, "--bandwidth-gbs", "10", "--copy-bandwidth-gbs", "5",
                 "--tensor-parallel-size", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps long captions)
    assert "Tensor parallelism, 2 ranks (tensor_parallel_size: 2 does not divide the model's 9 attention" in out
    assert "kvserve refuses this size" in out
