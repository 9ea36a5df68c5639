"""benchmarks/vs_peers.py without servers: workloads pinned to anchor_bench's, request extras, the table."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from bench_script import load_benchmark

from kvserve.bench.client import RequestResult
from kvserve.bench.offline import make_mixed_workload

vp = load_benchmark("vs_peers.py", "vs_peers")


def _sha(reqs: list[Any]) -> str:
    return hashlib.sha256(json.dumps(reqs).encode()).hexdigest()[:16]


# Expected values: computed once by hand from shared/bench/anchor_bench.make_workload (not imported here).
def test_mixed_matches_anchor() -> None:
    reqs = vp.make_workload("mixed", 64, 0)
    assert [len(p) for p, _ in reqs[:5]] == [444, 637, 191, 632, 309]
    assert [o for _, o in reqs[:5]] == [16, 256, 64, 32, 64]
    assert reqs[0][0][:3] == [28562, 3653, 17968]
    assert reqs[1][0][:3] == [6940, 34947, 6004]
    assert (sum(len(p) for p, _ in reqs), sum(o for _, o in reqs)) == (26383, 6048)
    assert _sha(reqs) == "225c4775ed588cda"
    small = vp.make_workload("mixed", 3, 7)
    assert [len(p) for p, _ in small] == [381, 457, 373] and [o for _, o in small] == [16, 64, 64]
    assert small[2][0][-3:] == [9418, 24499, 29219]
    # the project's own definition of workload A agrees
    assert reqs == make_mixed_workload(64, 0)


def test_shared_prefix_matches_anchor() -> None:
    reqs = vp.make_workload("shared-prefix", 16, 0)
    assert len(reqs) == 16 and all(len(p) == 1060 and o == 64 for p, o in reqs)
    assert reqs[0][0][:3] == [26247, 28562, 3653]
    assert reqs[0][0][1000:1003] == [26205, 24164, 39733]
    assert reqs[1][0][1000:1003] == [9903, 15190, 30423]
    assert reqs[15][0][-3:] == [29926, 3156, 16923]
    assert all(p[:1000] == reqs[0][0][:1000] for p, _ in reqs)
    assert len({tuple(p[1000:]) for p, _ in reqs}) == 16
    assert _sha(reqs) == "b92f2903f0afd238"


def test_decode_matches_anchor() -> None:
    reqs = vp.make_workload("decode", 8, 0)
    assert all(len(p) == 32 and o == 128 for p, o in reqs)
    assert reqs[0][0][:3] == [26247, 28562, 3653] and reqs[7][0][-3:] == [1154, 35625, 7408]
    assert _sha(reqs) == "48703181a39b87f7"


@pytest.mark.parametrize("kind", ["mixed", "shared-prefix", "decode"])
def test_workloads_deterministic_and_in_range(kind: str) -> None:
    a, b = vp.make_workload(kind, 10, 3), vp.make_workload(kind, 10, 3)
    assert a == b and a != vp.make_workload(kind, 10, 4)
    assert all(1000 <= t <= 40000 for p, _ in a for t in p)
    if kind == "mixed":
        assert all(50 <= len(p) <= 800 and o in (16, 32, 64, 128, 256) for p, o in a)
    # a longer run starts with the shorter one (same draws, same order)
    assert vp.make_workload(kind, 12, 3)[:10] == a
    with pytest.raises(ValueError):
        vp.make_workload("sharegpt", 1, 0)


def test_parse_runs() -> None:
    assert vp.parse_runs("mixed:1 mixed:16  shared-prefix:16,decode:1") == [
        ("mixed", 1), ("mixed", 16), ("shared-prefix", 16), ("decode", 1)]
    for bad in ("", "mixed", "mixed:0", "mixed:x", "chat:4"):
        with pytest.raises(ValueError):
            vp.parse_runs(bad)


def test_request_extra_isolates_runs() -> None:
    assert vp.request_extra(True, "mixed", "s1", 64) == {"min_tokens": 64, "cache_salt": "s1"}
    assert vp.request_extra(True, "shared-prefix", "s1", 64) == {"min_tokens": 64, "cache_salt": "s1"}
    assert vp.request_extra(False, "mixed", "s1", 16) == {"min_tokens": 16, "cache_prompt": False}
    assert vp.request_extra(False, "shared-prefix", "s1", 64) == {"min_tokens": 64}


def test_body_extras_merge_into_post() -> None:
    seen: dict[str, Any] = {}

    class FakeSession:
        def post(self, url: str, *, json: dict[str, Any], **kw: Any) -> str:
            seen.update(url=url, json=json, kw=kw)
            return "ctx"

    s = vp._BodyExtras(FakeSession(), {"cache_salt": "x", "min_tokens": 8})
    assert s.post("u", json={"prompt": [1], "max_tokens": 8}, headers={}) == "ctx"
    assert seen["json"] == {"prompt": [1], "max_tokens": 8, "cache_salt": "x", "min_tokens": 8}
    assert seen["kw"] == {"headers": {}}


def _args(tmp_path: Path, **kw: Any) -> argparse.Namespace:
    d = dict(peers=str(tmp_path), port=18123, threads=2, kvserve=str(tmp_path / "nope"), kv_dtype="auto",
             kv_args="--max-num-seqs 32", vllm_dtype="bfloat16", llama_gguf="bf16")
    d.update(kw)
    return argparse.Namespace(**d)


def test_engine_commands_and_missing_peers(tmp_path: Path) -> None:
    kv = vp.build_engine("kv", _args(tmp_path))
    assert kv.cmd[1:] == ["serve", "--host", "127.0.0.1", "--port", "18123", "--served-model-name", "m", "--dtype",
                          "auto", "--num-threads", "2", "--max-num-seqs", "32"]
    assert kv.missing and kv.salted
    vl = vp.build_engine("vllm", _args(tmp_path))
    assert vl.missing and vl.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "--max-model-len" in vl.cmd
    ll = vp.build_engine("llama", _args(tmp_path, llama_gguf="f32", threads=1))
    assert ll.missing and not ll.salted
    assert ll.cmd[2].endswith("smollm2-135m-f32.gguf") and ll.cmd[ll.cmd.index("-t") + 1] == "1"
    kvb = vp.build_engine("kvb", _args(tmp_path, kvb_args="--burst-batched-tokens 0"), 18126)
    assert kvb.key == "kvb" and kvb.label == "kvserve auto --burst-batched-tokens 0"
    assert kvb.cmd[5] == "18126" and kvb.cmd[-4:] == ["--max-num-seqs", "32", "--burst-batched-tokens", "0"]
    assert kvb.env == {} and kv.env == {}
    kvb = vp.build_engine("kvb", _args(tmp_path, kvb_env="KVSERVE_ROW_PREFETCH_MIN_M=1 A=b=c"), 18126)
    assert kvb.env == {"KVSERVE_ROW_PREFETCH_MIN_M": "1", "A": "b=c"}
    assert kvb.label == "kvserve auto KVSERVE_ROW_PREFETCH_MIN_M=1 A=b=c"
    assert vp.build_engine("kv", _args(tmp_path, kvb_env="A=1")).env == {}  # kvb's environment only
    with pytest.raises(ValueError, match="--kvb-env: 'NOEQUALS' is not NAME=VALUE"):
        vp.build_engine("kvb", _args(tmp_path, kvb_env="A=1 NOEQUALS"))
    # interleaved rounds: every engine on its own port
    assert vp.build_engine("llama", _args(tmp_path), 18125).cmd[6] == "18125"
    assert "18124" in vp.build_engine("vllm", _args(tmp_path), 18124).cmd


def _res(ttft: float, itl: list[float], n: int, ok: bool = True) -> RequestResult:
    return RequestResult(success=ok, error="" if ok else "HTTP 500", ttft=ttft, e2e=ttft + sum(itl), itl=itl,
                         output_tokens=n, usage_reported=True)


def test_run_record_metrics() -> None:
    spec = vp.EngineSpec("kv", "kvserve auto", ["kvserve"])
    reqs = [([1] * 32, 3), ([2] * 32, 3), ([3] * 32, 3)]
    results = [_res(0.5, [0.02, 0.02], 3), _res(0.7, [0.04, 0.04], 3), _res(0.0, [], 0, ok=False)]
    con = vp.Contention()
    con.wall_s, con.self_cpu, con.other_cpu = 2.0, 0.2, 1.0
    con.load_before, con.load_after = [0.5, 0.4, 0.3], [1.5, 0.6, 0.4]
    rec = vp.run_record(spec, "decode", 1, 0, reqs, results, 2.0, con, 0.9, "cache_salt")
    assert (rec["completed"], rec["failed"], rec["output_tokens"], rec["output_tokens_expected"]) == (2, 1, 6, 9)
    assert rec["output_tok_s"] == 3.0 and rec["ttft_ms"][50] == 600.0
    assert rec["tpot_ms"][50] == 30.0 and rec["decode_tok_s"] == pytest.approx(33.33, abs=0.01)
    assert rec["itl_ms"][50] == 30.0 and rec["itl_samples"] == 4
    assert rec["cpu_s"]["other"] == 0.1
    assert rec["other_cpu_frac"] == round(0.1 / (2.0 * (os.cpu_count() or 1)), 4)
    assert rec["errors"] == ["HTTP 500"] and rec["load1_before"] == 0.5
    assert "decode 33.3 tok/s" in vp.one_line(rec)


def _rec(engine: str, wl: str, c: int, tok_s: float, ttft99: float, itl99: float, itl50: float = 10.0,
         decode: float | None = None, frac: float = 0.0, failed: int = 0) -> dict[str, Any]:
    return dict(engine=engine, workload=wl, concurrency=c, completed=4, failed=failed, output_tok_s=tok_s,
                decode_tok_s=decode, ttft_ms={50: 1.0, 95: 1.0, 99: ttft99}, itl_ms={50: itl50, 95: 1.0, 99: itl99},
                other_cpu_frac=frac)


def test_format_table_and_ratios() -> None:
    result = {
        "engines": {"kv": {"label": "kvserve auto"}, "vllm": {"label": "vLLM bf16"},
                    "llama": {"label": "llama.cpp bf16", "note": "not found"}},
        "runs": [_rec("kv", "mixed", 16, 81.9, 7575.0, 960.0),
                 _rec("kv", "decode", 1, 20.0, 50.0, 40.0, itl50=36.6, decode=26.4, frac=0.2),
                 _rec("vllm", "mixed", 16, 158.8, 4853.0, 613.0, failed=1),
                 _rec("vllm", "decode", 1, 30.0, 40.0, 30.0, itl50=24.0, decode=40.3)],
    }
    text = vp.format_table(result)
    lines = text.splitlines()
    assert lines[0].split() == ["run", "kvserve", "auto", "vLLM", "bf16", "llama.cpp", "bf16", "kv/vllm", "kv/llama"]
    mixed = next(ln for ln in lines if ln.startswith("mixed c16"))
    assert "81.9 (7,575; 960)" in mixed and "158.8 (4,853; 613) !1 failed" in mixed
    assert mixed.split()[-2:] == ["0.52x", "-"]
    dec = next(ln for ln in lines if ln.startswith("decode c1"))
    assert "26.4 (36.6)*" in dec and "40.3 (24.0)" in dec and "0.66x" in dec
    assert "llama.cpp bf16: not found" in text
    assert vp.ratio(None, 1.0) == "-" and vp.ratio(1.0, 0.0) == "-" and vp.ratio(3.0, 2.0) == "1.50x"
    assert vp.cell(None) == "-" and vp.cell(dict(_rec("kv", "mixed", 1, 0, 0, 0), completed=0)) == "failed (0)"
    # without kvserve there is no ratio column
    only_peer = {"engines": {"vllm": {"label": "vLLM bf16"}}, "runs": [result["runs"][2]]}
    assert "kv/" not in vp.format_table(only_peer).splitlines()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_server_cpu_of_own_process() -> None:
    assert vp.server_cpu_s(os.getpid()) > 0 and vp.server_cpu_s(0) == 0.0


def test_roofline_bytes_and_row() -> None:
    args = argparse.Namespace(kv_dtype="float32", vllm_dtype="bfloat16", llama_gguf="bf16")
    assert (vp.served_dtype_bytes("kv", args), vp.served_dtype_bytes("vllm", args),
            vp.served_dtype_bytes("llama", args)) == (4, 2, 2)
    # SmolLM2: 134,515,008 parameters (tied head counted once); KV: 30 layers x 2 x 3 heads x 64 = 11,520
    # elements per token, over the decode workload's mean context of 32 + 64 tokens
    assert vp.step_bytes(2) == 134_515_008 * 2 + 96 * 11_520 * 2
    assert vp.step_bytes(4) == 134_515_008 * 4 + 96 * 11_520 * 4
    kv = dict(_rec("kv", "decode", 1, 20.0, 50.0, 40.0, itl50=20.0, decode=50.0),
              bandwidth_probes=[dict(read_gbs=30.0), dict(read_gbs=55.0), dict(read_gbs=36.0)],
              request_tpot_ms=[20.0, 25.0])
    vllm = dict(_rec("vllm", "decode", 1, 30.0, 40.0, 30.0, itl50=24.0, decode=40.3),
                bandwidth_probes=[dict(read_gbs=40.0), dict(read_gbs=42.0)])
    mixed = _rec("kv", "mixed", 16, 81.9, 7575.0, 960.0)
    roof = vp.roofline_record([kv, vllm, mixed], args)
    assert set(roof["engines"]) == {"kv", "vllm"}
    assert roof["engines"]["kv"]["read_gbs"] == 36.0  # the median probe (a momentary 55 GB/s spike does not set it)
    assert roof["engines"]["vllm"]["read_gbs"] == 41.0
    assert roof["engines"]["vllm"]["roofline_tok_s"] == round(41e9 / vp.step_bytes(2), 1)
    assert roof["engines"]["kv"]["runs"][0]["roofline_step_ms"] == round(vp.step_bytes(4) / 36e9 * 1e3, 3)
    assert roof["engines"]["kv"]["pct"] == round(100 * 50.0 / (36e9 / vp.step_bytes(4)), 1)
    result = {"engines": {"kv": {"label": "kvserve fp32"}, "vllm": {"label": "vLLM bf16"}},
              "runs": [kv, vllm], "roofline": roof}
    row = next(ln for ln in vp.format_table(result).splitlines() if ln.startswith("decode % of roofline"))
    kv_pct = round(100 * 50.0 / roof["engines"]["kv"]["roofline_tok_s"])
    vllm_pct = round(100 * 40.3 / roof["engines"]["vllm"]["roofline_tok_s"])
    assert f"{kv_pct} % of {roof['engines']['kv']['roofline_tok_s']}" in row
    assert f"{vllm_pct} % of {roof['engines']['vllm']['roofline_tok_s']}" in row
    # per request: each TPOT against the mean of the probes around it (30|55 -> 42.5 GB/s, 55|36 -> 45.5 GB/s)
    b4 = vp.step_bytes(4)
    req = [round(100 * 50.0 / (42.5e9 / b4), 1), round(100 * 40.0 / (45.5e9 / b4), 1)]
    assert roof["engines"]["kv"]["runs"][0]["request_pcts"] == req
    assert roof["engines"]["kv"]["paired_pct"] == round((req[0] + req[1]) / 2, 1)
    assert roof["engines"]["vllm"]["paired_pct"] is None  # no per-request TPOTs recorded
    assert f"per request {roof['engines']['kv']['paired_pct']:.0f} %" in row and row.count("per request") == 1
    assert vp.paired_request_pcts(dict(kv, request_tpot_ms=[20.0]), b4) == []  # probes must bracket each request
    assert vp.paired_request_pcts(dict(kv, request_tpot_ms=[None, 25.0]), b4) == [None, req[1]]


def test_rounds_aggregate_to_medians_and_paired_ratios() -> None:
    def r(engine: str, rnd: int, tok_s: float, ttft99: float, frac: float = 0.0) -> dict[str, Any]:
        return dict(_rec(engine, "mixed", 16, tok_s, ttft99, 100.0 + rnd, frac=frac), round=rnd)

    # the host drifts: round 2 is slow for both engines; the paired ratios are 2.0, 2.0, 1.5
    kv = [r("kv", 1, 300.0, 3000.0), r("kv", 2, 200.0, 5000.0), r("kv", 3, 240.0, 4000.0, frac=0.08)]
    vllm = [r("vllm", 1, 150.0, 2000.0), r("vllm", 2, 100.0, 2500.0), r("vllm", 3, 160.0, 2200.0)]
    agg = vp.aggregate(kv)
    assert agg["output_tok_s"] == 240.0 and agg["ttft_ms"][99] == 4000.0 and agg["itl_ms"][99] == 102.0
    assert agg["completed"] == 12 and agg["other_cpu_frac"] == 0.08 and agg["rounds"] == 3
    assert vp.aggregate(kv[:1]) is kv[0]
    assert vp.paired_ratio(kv, vllm) == "2.00x"  # not 240 / 150 = 1.60x, the ratio of the medians
    assert vp.paired_ratio(kv, []) == "-"
    result = {"engines": {"kv": {"label": "kvserve"}, "vllm": {"label": "vLLM"}}, "runs": kv + vllm}
    text = vp.format_table(result)
    row = next(ln for ln in text.splitlines() if ln.startswith("mixed c16"))
    assert "240.0 (4,000; 102)*" in row and "150.0 (2,200; 102)" in row and row.split()[-1] == "2.00x"
    assert "3 interleaved rounds" in text
    # a kvb variant: its own column, and paired ratios against kv and the peer
    kvb = [r("kvb", 1, 330.0, 3000.0), r("kvb", 2, 240.0, 5000.0), r("kvb", 3, 240.0, 4000.0)]
    result = {"engines": {"kv": {"label": "kvserve"}, "kvb": {"label": "kvserve-b"}, "vllm": {"label": "vLLM"}},
              "runs": kv + kvb + vllm}
    lines = vp.format_table(result).splitlines()
    assert lines[0].split()[-3:] == ["kv/vllm", "kvb/kv", "kvb/vllm"]
    row = next(ln for ln in lines if ln.startswith("mixed c16"))
    assert row.split()[-3:] == ["2.00x", "1.10x", "2.20x"]  # kvb/kv per round: 1.1, 1.2, 1.0
