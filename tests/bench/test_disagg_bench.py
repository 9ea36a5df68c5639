"""benchmarks/disagg.py without servers: its workloads, the server commands, a run's row from canned request
results and metric totals, the ``kv_transfer`` record ``kvserve plan --bench-json`` reads, the planner's
verdict against the outcome, and the tables."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from bench_script import load_benchmark

from kvserve.bench.client import RequestResult
from kvserve.bench.offline import make_mixed_workload
from kvserve.planner import measured

db = load_benchmark("disagg.py", "disagg_bench")
P = "kvserve:"
BPT = 23_040  # SmolLM2-135M bf16 KV bytes per token


def _args(*argv: str) -> argparse.Namespace:
    return db.parse_args(["--out", "disagg-test.json", *argv])  # parsed only: nothing is written


def test_workloads() -> None:
    a = _args()
    itl = db.make_itl_workload(a)
    streams, longs = [j for j in itl if j.kind == "stream"], [j for j in itl if j.kind == "long"]
    assert len(streams) == 16 and all(len(j.prompt) == 32 and j.max_tokens == 256 and j.at_s == 0 for j in streams)
    assert [j.at_s for j in longs] == [2.0, 6.0, 10.0, 14.0] and all(len(j.prompt) == 1500 for j in longs)
    assert db.make_itl_workload(a) == itl  # seeded
    mixed, conc = db.jobs_for("mixed", a)
    assert conc == 16 and [(j.prompt, j.max_tokens) for j in mixed] == make_mixed_workload(64, 0)
    q = _args("--quick")
    qm, qc = db.jobs_for("mixed", q)
    assert qc == 4 and len(qm) == 4 and max(j.max_tokens for j in qm) == 32
    assert db.jobs_for("itl", q)[1] is None and len(db.make_itl_workload(q)) == 5


def test_server_commands(tmp_path: Path) -> None:
    servers, ports = db.build_servers("disagg", _args(), tmp_path)
    p, d, proxy = (servers[r].spec.cmd for r in ("prefill", "decode", "proxy"))
    assert p[:3] == ["taskset", "-c", "0"] and d[:3] == ["taskset", "-c", "1"] and proxy[:3] == ["taskset", "-c", "0"]
    for cmd, role in ((p, "kv_producer"), (d, "kv_consumer")):
        assert cmd[cmd.index("--num-threads") + 1] == "1" and cmd[cmd.index("--dtype") + 1] == "auto"
        assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_role"] == role
    assert f"http://127.0.0.1:{ports['decode']}" in proxy and "--no-enable-chunked-prefill" not in p
    single, _ = db.build_servers("single", _args("--proxy-cpus", "", "--single-args", "--max-num-batched-tokens 256"),
                                 tmp_path)
    cmd = single["single"].spec.cmd
    assert cmd[:3] == ["taskset", "-c", "0,1"] and cmd[cmd.index("--num-threads") + 1] == "2"
    assert cmd[-2:] == ["--max-num-batched-tokens", "256"]
    free, _ = db.build_servers("disagg", _args("--proxy-cpus", ""), tmp_path)
    assert free["proxy"].spec.cmd[0] != "taskset"


def _result(ttft: float, itl: list[float], n_out: int) -> RequestResult:
    return RequestResult(success=True, ttft=ttft, e2e=ttft + sum(itl), itl=itl, output_tokens=n_out,
                         usage_reported=True)


def _totals(pulled_tokens: int, seconds: float, count: int, computed: int) -> dict[str, float]:
    return {f"{P}kv_transfer_bytes_received_total": pulled_tokens * BPT, f"{P}kv_transfer_seconds_sum": seconds,
            f"{P}kv_transfer_seconds_count": count, f"{P}kv_transfer_pulls_total": count,
            f"{P}prompt_tokens_computed_total": computed, f"{P}kv_transfer_failures_total": 0.0}


def _row(setup: str, workload: str, itl_gap: float, wall: float, pulled: tuple[float, int] = (0.0, 0)) -> dict:
    a = _args("--quick")
    jobs, conc = db.jobs_for(workload, a)
    results = [_result(0.5 + 0.1 * i, [itl_gap] * (j.max_tokens - 1), j.max_tokens) for i, j in enumerate(jobs)]
    tokens = sum(len(j.prompt) for j in jobs)
    con = SimpleNamespace(other_cpu=3.0, self_cpu=1.0, load_before=[1.0, 1.0, 1.0], load_after=[1.5, 1.0, 1.0])
    before = {"prefill": _totals(0, 0, 0, 100), "decode": _totals(16, 0.01, 1, 0)}
    seconds, count = pulled
    after = {"prefill": _totals(0, 0, 0, 100 + tokens),
             "decode": _totals(16 + (tokens if count else 0), 0.01 + seconds, 1 + count, 0)}
    return db.run_record(setup, workload, jobs, conc, results, wall, con, 2.5, before, after, f"salt-{setup}",
                         "http://127.0.0.1:9")


def canned_rows() -> list[dict[str, Any]]:
    """disagg: smoother ITL, lower throughput on mixed; single: the reverse."""
    return [_row("disagg", "itl", 0.040, 10.0, (0.05, 5)), _row("disagg", "mixed", 0.050, 20.0, (0.2, 4)),
            _row("single", "itl", 0.060, 9.0), _row("single", "mixed", 0.030, 12.0)]


def test_run_record_from_canned_results() -> None:
    d_itl, d_mixed, s_itl, _ = canned_rows()
    assert d_itl["completed"] == 5 and d_itl["itl_of"] == "decoding streams" and d_itl["itl_ms"][99] == 40.0
    assert d_itl["output_tok_s"] == pytest.approx((4 * 32 + 4) / 10.0)
    assert d_itl["long_ttft_ms"][50] == pytest.approx(900.0)  # the 5th job, the long prompt: 0.5 + 0.4 s
    kv = d_itl["kv_transfer"]
    tokens = 4 * 32 + 300
    assert kv["bytes_received"] == tokens * BPT and kv["num_transfers"] == 5
    assert kv["kv_transfer_bandwidth_bytes_per_s"] == pytest.approx(tokens * BPT / 0.05)
    assert kv["bytes_per_prompt_token"] == BPT and d_itl["decode_prompt_tokens_computed"] == 0
    assert d_itl["prefill_prompt_tokens_computed"] == tokens
    assert d_itl["other_cpu_frac"] == pytest.approx(0.5 / (10.0 * (os.cpu_count() or 1)), abs=1e-4)
    assert s_itl["kv_transfer"] is None and s_itl["decode_prompt_tokens_computed"] is None
    assert d_mixed["itl_of"] == "every request" and d_mixed["long_ttft_ms"] is None


def test_kv_transfer_record_reads_back_in_the_planner(tmp_path: Path) -> None:
    rows = canned_rows()
    rec = db.kv_transfer_record(rows)
    b = sum(r["kv_transfer"]["bytes_received"] for r in rows[:2])
    assert rec["kv_transfer_bandwidth_bytes_per_s"] == pytest.approx(b / 0.25) and rec["num_transfers"] == 9
    assert set(rec["workloads"]) == {"itl", "mixed"}
    assert db.kv_transfer_record(rows[2:]) is None  # no disagg row: nothing measured
    f = db.write_result("disagg", {"benchmark": "disagg", "rows": rows, "kv_transfer": rec}, str(tmp_path / "d.json"))
    t = measured.transfer_from_bench_json(f)
    assert t.bandwidth_bytes_per_s == pytest.approx(b / 0.25) and t.num_transfers == 9
    m = measured.from_bench_json(f, "mixed")
    assert m.transfer is not None and m.transfer.bandwidth_bytes_per_s == pytest.approx(
        rows[1]["kv_transfer"]["kv_transfer_bandwidth_bytes_per_s"])


def test_outcome_and_prediction() -> None:
    d_itl, d_mixed, s_itl, s_mixed = canned_rows()
    o = db.outcome(d_itl, s_itl)
    assert o["disagg_better_itl_p99"] and o["disagg_better_throughput"] is False and not o["disagg_won"]
    assert db.judge({"go": False, "verdict": "NO-GO"}, o)["predicted"]
    assert not db.judge({"go": True, "verdict": "GO"}, o)["predicted"]
    won = db.outcome(dict(d_itl, output_tok_s=99.0), s_itl)
    assert won["disagg_won"] and db.judge({"go": True, "verdict": "GO"}, won)["predicted"]
    assert not db.outcome(d_mixed, s_mixed)["disagg_better_itl_p99"]


def test_go_no_go_uses_the_measured_bandwidth() -> None:
    rows = canned_rows()
    planner = db.go_no_go(_args("--quick"), rows, 400.0, {"memory": 20e9, "copy": 10e9})
    assert set(planner) == {"itl", "mixed"}
    v = planner["itl"]
    assert v["go"] is False and v["predicted"]  # 2 devices: NO-GO; disagg lost on throughput
    ic = next(c for c in v["checks"] if c["check"] == "interconnect")
    assert ic["reason"].startswith("measured ") and "from D's /metrics (itl run)" in ic["reason"]
    assert v["interconnect"]["bytes_per_s"] == pytest.approx(
        rows[0]["kv_transfer"]["kv_transfer_bandwidth_bytes_per_s"])
    assert v["plan_options"]["num_devices"] == 2 and v["plan_options"]["prompt_len"] == round((4 * 32 + 300) / 5)


def test_tables() -> None:
    rows = canned_rows()
    rows[3]["other_cpu_frac"] = 0.2  # a contaminated run
    pd = {"go": False, "verdict": "NO-GO: chunked prefill first",
          "checks": [{"check": "interconnect", "ok": False, "reason": "measured 1.2 GB/s from D"}]}
    planner = {"itl": dict(db.judge(pd, db.outcome(rows[0], rows[2])), checks=pd["checks"])}
    text = db.render({"rows": rows, "planner": planner})
    assert "D prompt tok computed" in text and "KV B/prompt tok" in text and "23,040" in text
    assert "NO-GO: chunked prefill first" in text and "no: measured 1.2 GB/s from D" in text
    assert "40.0 / 60.0" in text  # ITL p99 disagg / single
    lines = [ln.strip("│ ") for ln in text.splitlines()]
    assert len([ln for ln in lines if ln.startswith(("itl", "mixed"))]) == 5  # four runs and one verdict
    runs = [ln for ln in lines if ln.startswith(("itl ", "mixed "))][:4]  # the runs table comes first
    assert [ln.endswith("*") for ln in runs] == [False] * 3 + [True]
