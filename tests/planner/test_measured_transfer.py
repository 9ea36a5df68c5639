"""``kvserve plan --metrics-url / --bench-json``: the measured KV transfer bandwidth in the PD go/no-go.

The metrics text is the real exposition of ``kvserve.metrics.EngineMetrics`` fed the connector's
``TransferSnapshot`` (as a decode instance's engine loop feeds it), served from an ``http.server`` on
127.0.0.1 inside the test; the bench JSON is shaped as ``benchmarks/disagg.py`` writes it.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve import cost_model as cm
from kvserve.core.scheduler import SchedulerStats
from kvserve.disagg.connector import TransferSnapshot
from kvserve.entrypoints.cli import main
from kvserve.errors import InvalidRequestError
from kvserve.metrics import EngineMetrics
from kvserve.planner import measured
from kvserve.planner.model_info import load_model_info
from kvserve.planner.plan import GB, PlanOptions, build_plan
from kvserve.spec_decode.controller import SpecStats

MODEL = "smollm2-135m-instruct"
BW = ["--bandwidth-gbs", "10", "--copy-bandwidth-gbs", "5"]
BPT = 46_080  # SmolLM2-135M fp32 KV bytes per token (tests/planner/test_plan.py)
# a decode instance that pulled 3 prompts of 100, 200 and 300 tokens (fp32) in 0.01 + 0.02 + 0.03 s
PULLED = 600 * BPT
SECONDS = 0.06


def _snap(pulls: int, received: int, seconds: list[float], sent: int = 0) -> TransferSnapshot:
    return TransferSnapshot(pulls, received, sent, 0, {"timeout": 0}, 0, 0, 0, seconds)


def _stats(transfer: TransferSnapshot | None, spec: SpecStats | None = None) -> SchedulerStats:
    return SchedulerStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, spec, None, 0, transfer)


def decode_metrics(prefix: str = "kvserve", spec: bool = False) -> str:
    """A decode instance's exposition after its three pulls (two engine-loop updates, as the loop feeds them)."""
    em = EngineMetrics("m", prefix=prefix)
    s0 = SpecStats(0, 0, 0, [0, 0], 1.0) if spec else None
    s1 = SpecStats(10, 40, 30, [9, 8], 1.0) if spec else None
    em.update_engine_state(_stats(_snap(1, 100 * BPT, [0.01]), s0))
    em.update_engine_state(_stats(_snap(3, PULLED, [0.02, 0.03]), s1))
    return em.render().decode()


def prefill_metrics() -> str:
    """A prefill instance's: it served KV (bytes sent) but pulled nothing."""
    em = EngineMetrics("m")
    em.update_engine_state(_stats(_snap(0, 0, [], sent=PULLED)))
    return em.render().decode()


def test_bandwidth_from_decode_metrics() -> None:
    text = decode_metrics()
    assert "kvserve:kv_transfer_seconds_count{model_name=\"m\"} 3.0" in text
    t = measured.transfer_from_metrics_text(text, "stub")
    assert t.bytes_received == PULLED and t.transfer_seconds == pytest.approx(SECONDS) and t.num_transfers == 3
    assert t.bandwidth_bytes_per_s == pytest.approx(PULLED / SECONDS) and t.source == "stub"
    v = measured.transfer_from_metrics_text(decode_metrics("vllm"))
    assert v.bandwidth_bytes_per_s == pytest.approx(PULLED / SECONDS)
    totals = measured.metric_totals(text)
    assert totals["kvserve:kv_transfer_pulls_total"] == 3


def test_bandwidth_of_one_run_from_two_scrapes() -> None:
    before = measured.metric_totals(decode_metrics())
    em = EngineMetrics("m")
    em.update_engine_state(_stats(_snap(1, 100 * BPT, [0.01])))
    em.update_engine_state(_stats(_snap(3, PULLED, [0.02, 0.03])))
    em.update_engine_state(_stats(_snap(4, PULLED + 50 * BPT, [0.5])))
    after = measured.metric_totals(em.render().decode())
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    t = measured.transfer_from_totals(delta, "one run")
    assert t.bytes_received == 50 * BPT and t.num_transfers == 1
    assert t.bandwidth_bytes_per_s == pytest.approx(50 * BPT / 0.5)


def test_no_bandwidth_without_pulls() -> None:
    with pytest.raises(InvalidRequestError, match="kv_transfer_seconds_count is 0"):
        measured.transfer_from_metrics_text(prefill_metrics())
    with pytest.raises(InvalidRequestError, match="kv_consumer"):
        measured.transfer_from_metrics_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")


def test_one_exposition_both_measurements_or_one() -> None:
    both = measured.from_metrics_text(decode_metrics(spec=True), "src")
    assert both.acceptance is not None and both.acceptance.alpha == pytest.approx(0.75)
    assert both.transfer is not None and both.transfer.bandwidth_bytes_per_s == pytest.approx(PULLED / SECONDS)
    assert both.notes == ()
    only = measured.from_metrics_text(decode_metrics(), "src")
    assert only.acceptance is None and only.transfer is not None
    assert len(only.notes) == 1 and "spec-decode acceptance not measured" in only.notes[0]
    with pytest.raises(InvalidRequestError, match="nothing to measure") as e:
        measured.from_metrics_text(prefill_metrics(), "src")
    assert "no draft tokens verified" in e.value.message and "kv_transfer_seconds_count is 0" in e.value.message


def _opts(interconnect_bytes_per_s: float) -> PlanOptions:
    return PlanOptions(bandwidth_bytes_per_s=10 * GB, copy_bytes_per_s=5 * GB, prefill_tokens_per_s=300.0,
                       interconnect_bytes_per_s=interconnect_bytes_per_s)


def test_go_no_go_uses_the_measured_bandwidth() -> None:
    info = load_model_info(MODEL)
    slow = measured.MeasuredTransfer(1.5 * GB, 3e9, 2.0, 40, "http://d:8001/metrics")
    given = build_plan(info, _opts(interconnect_bytes_per_s=400 * GB))["pd"]
    ic = next(c for c in given["checks"] if c["check"] == "interconnect")
    assert ic["ok"] and ic["reason"].startswith("400 GB/s link")
    assert given["interconnect"] == {"bytes_per_s": 400 * GB, "measured": False, "source": "--interconnect-gbs",
                                     "measurement": None}
    pd = build_plan(info, _opts(interconnect_bytes_per_s=400 * GB), transfer=slow)["pd"]
    ic = next(c for c in pd["checks"] if c["check"] == "interconnect")
    assert not ic["ok"]  # 1.5 GB/s is under RDMA class, whatever --interconnect-gbs says
    assert ic["reason"].startswith("measured 1.5 GB/s from http://d:8001/metrics")
    assert pd["transfer_s"] == pytest.approx(cm.pd_transfer_time_s(2048, BPT, 1.5 * GB))
    assert pd["interconnect"]["measured"] and pd["interconnect"]["source"] == "http://d:8001/metrics"
    assert pd["interconnect"]["measurement"]["num_transfers"] == 40
    fast = measured.MeasuredTransfer(900 * GB, None, None, None, "x.json, all workloads")
    pd = build_plan(info, _opts(interconnect_bytes_per_s=1 * GB), transfer=fast)["pd"]
    ic = next(c for c in pd["checks"] if c["check"] == "interconnect")
    assert ic["ok"] and "measured 900 GB/s from x.json, all workloads" in ic["reason"]


@pytest.fixture()
def decode_server() -> Iterator[str]:
    """A loopback HTTP server answering ``/metrics`` with a decode instance's exposition."""
    body = decode_metrics().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_cli_plan_with_a_decode_instance(decode_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", MODEL, "--json", *BW, "--metrics-url", decode_server]) == 0
    out = capsys.readouterr()
    plan = json.loads(out.out)
    assert plan["spec_decode"]["measured"] is None  # no spec decode there: that part is unmeasured
    assert "spec-decode acceptance not measured" in out.err
    ic = plan["pd"]["interconnect"]
    assert ic["measured"] and ic["source"] == decode_server + "/metrics"
    assert ic["bytes_per_s"] == pytest.approx(PULLED / SECONDS)
    assert main(["plan", "--model", MODEL, *BW, "--metrics-url", decode_server]) == 0
    text = capsys.readouterr().out
    assert f"measured {PULLED / SECONDS / GB:.3g} GB/s from {decode_server}/metrics" in text
    assert "interconnect measured" in text and "over 3 pulls" in text


def disagg_json(path: Path) -> Path:
    """A JSON shaped as benchmarks/disagg.py writes it (what the planner reads, plus noise)."""
    entry = {"kv_transfer_bandwidth_bytes_per_s": 2.0e9, "bytes_received": 4.0e9, "transfer_seconds": 2.0,
             "num_transfers": 80.0, "bytes_per_prompt_token": 23_040.0}
    path.write_text(json.dumps({
        "benchmark": "disagg", "rows": [],
        "kv_transfer": {**entry, "workloads": {"itl": {**entry, "kv_transfer_bandwidth_bytes_per_s": 1.0e9},
                                               "mixed": {**entry, "kv_transfer_bandwidth_bytes_per_s": 3.0e9}}}}))
    return path


def test_bandwidth_from_bench_json(tmp_path: Path) -> None:
    f = disagg_json(tmp_path / "disagg.json")
    t = measured.transfer_from_bench_json(f)
    assert t.bandwidth_bytes_per_s == 2.0e9 and t.num_transfers == 80 and t.source == "disagg.json, all workloads"
    assert measured.transfer_from_bench_json(f, "itl").bandwidth_bytes_per_s == 1.0e9
    assert measured.transfer_from_bench_json(f, "ngram").source.endswith("all workloads")
    m = measured.from_bench_json(f, "mixed")
    assert m.acceptance is None and m.transfer is not None and m.transfer.source == "disagg.json, mixed"
    assert "spec-decode acceptance not measured" in m.notes[0]
    (tmp_path / "one.json").write_text(json.dumps({"kv_transfer": {"kv_transfer_bandwidth_bytes_per_s": 5e8,
                                                                   "workloads": {"mixed": {}}}}))
    with pytest.raises(InvalidRequestError, match="no kv_transfer for workload 'itl'"):
        measured.transfer_from_bench_json(tmp_path / "one.json", "itl")
    with pytest.raises(InvalidRequestError, match="no measured kv_transfer_bandwidth_bytes_per_s"):
        measured.transfer_from_bench_json(tmp_path / "one.json", "mixed")
    (tmp_path / "none.json").write_text(json.dumps({"kv_transfer": {"kv_transfer_bandwidth_bytes_per_s": None}}))
    with pytest.raises(InvalidRequestError, match="nothing to measure"):
        measured.from_bench_json(tmp_path / "none.json")


def test_bench_json_with_both_records(tmp_path: Path) -> None:
    f = disagg_json(tmp_path / "both.json")
    data = json.loads(f.read_text())
    data["acceptance"] = {"ngram": {"num_accepted_tokens": 4, "num_draft_tokens": 5}}
    f.write_text(json.dumps(data))
    m = measured.from_bench_json(f, "itl")  # a workload section: the acceptance takes its default
    assert m.acceptance is not None and m.acceptance.alpha == pytest.approx(0.8)
    assert m.transfer is not None and m.transfer.bandwidth_bytes_per_s == 1.0e9 and m.notes == ()


def test_cli_plan_with_disagg_bench_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = disagg_json(tmp_path / "disagg.json")
    assert main(["plan", "--model", MODEL, "--json", *BW, "--bench-json", str(f), "--bench-section", "itl"]) == 0
    pd = json.loads(capsys.readouterr().out)["pd"]
    assert pd["interconnect"]["source"] == "disagg.json, itl" and pd["interconnect"]["bytes_per_s"] == 1.0e9
    assert next(c for c in pd["checks"] if c["check"] == "interconnect")["reason"].startswith(
        "measured 1 GB/s from disagg.json, itl")
    (tmp_path / "empty.json").write_text(json.dumps({"benchmark": "disagg"}))
    assert main(["plan", "--model", MODEL, *BW, "--bench-json", str(tmp_path / "empty.json")]) == 2
    err = capsys.readouterr().err
    assert "no acceptance record" in err and "no kv_transfer record" in err
