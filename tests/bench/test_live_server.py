"""The serving benchmark against a live ``kvserve serve`` on a tiny workload (one server for the module)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.bench import datasets as ds
from kvserve.bench.metrics import SLO, meets_slo
from kvserve.bench.serve import ClientConfig, LoadSpec, run_point, sweep, warmup
from kvserve.entrypoints.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_harness import MODEL, Server  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--max-model-len", "512", "--max-num-seqs", "8")
    yield s
    s.stop()


def test_every_metric_and_itl_count(server: Server) -> None:
    cfg = ClientConfig(server.url, MODEL)
    reqs = ds.sample_random(4, seed=0, input_len=24, output_len=8, range_ratio=0.5)
    warmup(cfg, reqs[0])
    p = run_point(cfg, reqs, LoadSpec(max_concurrency=2), SLO(30.0, 5.0), progress=False)
    s = p["summary"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["usage_reported"] and s["itl_token_aligned"]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert all(s[key][k] is not None and s[key][k] > 0 for k in ("mean", "p50", "p90", "p95", "p99"))
    for k in ("request_throughput", "output_throughput", "total_token_throughput", "goodput"):
        assert s[k] > 0
    assert s["goodput"] <= s["request_throughput"] and 0 <= s["slo_violation_rate"] <= 1
    assert len(p["loadavg_before"]) == 3 and len(p["loadavg_after"]) == 3
    for r, q in zip(p["requests"], reqs, strict=True):
        assert r["output_tokens"] == q.output_len  # ignore_eos: exactly the dataset's length
        assert r["prompt_tokens"] == q.prompt_len
        assert len(r["itl"]) == r["output_tokens"] - 1


def test_sweep_best_meets_slo(server: Server) -> None:
    cfg = ClientConfig(server.url, MODEL)
    reqs = ds.sample_random(4, seed=1, input_len=16, output_len=6)
    loose, impossible = SLO(60.0, 10.0), SLO(0.001, 0.0001)
    res = sweep(cfg, reqs, [LoadSpec(max_concurrency=1), LoadSpec(max_concurrency=4)], [2, 4], loose, progress=False)
    assert len(res["points"]) == 2 and res["best"] is not None
    best = next(p for p in res["points"] if p["label"] == res["best"]["label"])
    assert meets_slo(best["summary"], loose)
    assert all(best["summary"]["output_throughput"] >= p["summary"]["output_throughput"]
               for p in res["points"] if p["meets_slo"])
    none = sweep(cfg, reqs[:2], [LoadSpec(max_concurrency=2)], [2], impossible, progress=False)
    assert none["best"] is None and none["points"][0]["summary"]["good_requests"] == 0


def test_multi_turn_history_grows(server: Server) -> None:
    cfg = ClientConfig(server.url, MODEL, api="chat")
    sessions = ds.sample_multi_turn(2, seed=0, num_turns=3, question_words=6, output_len=5)
    p = run_point(cfg, sessions, LoadSpec(max_concurrency=2), SLO(), progress=False)
    assert p["summary"]["completed"] == 6
    by_session = [p["requests"][i * 3:(i + 1) * 3] for i in range(2)]
    for turns in by_session:
        lens = [t["prompt_tokens"] for t in turns]
        assert lens[0] < lens[1] < lens[2]  # each turn carries the earlier turns and replies


def test_cli_bench_serve_writes_json_and_plot(server: Server, tmp_path: Path) -> None:
    out, plot = tmp_path / "r.json", tmp_path / "p.png"
    rc = main(["bench", "serve", "--base-url", server.url, "--model", MODEL, "--dataset", "shared-prefix",
               "--shared-prefix-words", "40", "--question-words", "5", "--output-len", "4", "--num-prompts", "2",
               "--sweep", "1,2", "--slo-ttft-p95", "60", "--slo-tpot-p95", "10", "--out", str(out),
               "--plot", str(plot), "--no-progress"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [p["label"] for p in data["points"]] == ["C=1", "C=2"] and data["best"] is not None
    assert data["dataset"]["length_source"].startswith("tokenizer:")
    assert plot.read_bytes()[:4] == b"\x89PNG"
