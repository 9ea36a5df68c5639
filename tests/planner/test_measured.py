"""``kvserve plan --metrics-url / --bench-json``: the measured spec-decode acceptance and its highlighted row.

The metrics text is the real exposition of ``kvserve.metrics.EngineMetrics`` (and a vLLM-named copy),
served from an ``http.server`` on 127.0.0.1 inside the test: no network beyond the loopback.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve import cost_model as cm
from kvserve.core.scheduler import SchedulerStats
from kvserve.entrypoints.cli import main
from kvserve.errors import InvalidRequestError
from kvserve.metrics import EngineMetrics
from kvserve.planner import measured
from kvserve.planner.plan import ALPHAS, MAX_K, spec_decode_section
from kvserve.spec_decode.controller import SpecStats

MODEL = "smollm2-135m-instruct"
BW = ["--bandwidth-gbs", "10", "--copy-bandwidth-gbs", "5"]


def _stats(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> SchedulerStats:
    return SchedulerStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0,
                          SpecStats(drafts, draft_tokens, accepted, per_pos, 1.5))


def metrics_text(prefix: str = "kvserve", model_names: tuple[str, ...] = ("m",)) -> str:
    """The exposition of engines that verified 100 draft tokens in 30 rounds and accepted 63 of them (per
    model name; the counts are split over the names so that they sum to those totals)."""
    parts = []
    splits = [(30, 100, 63, [25, 20, 18, 0])] if len(model_names) == 1 else [(10, 40, 23, [9, 8, 6, 0]),
                                                                              (20, 60, 40, [16, 12, 12, 0])]
    for name, (d, t, a, pos) in zip(model_names, splits, strict=True):
        em = EngineMetrics(name, prefix=prefix)
        em.update_engine_state(_stats(0, 0, 0, [0, 0, 0, 0]))
        em.update_engine_state(_stats(d, t, a, pos))
        parts.append(em.render().decode())
    return "".join(parts)


def test_alpha_from_kvserve_metrics() -> None:
    m = measured.acceptance_from_metrics_text(metrics_text(), "stub")
    assert m.alpha == pytest.approx(0.63) and m.num_accepted_tokens == 63 and m.num_draft_tokens == 100
    assert m.num_drafts == 30 and m.mean_accepted_len == pytest.approx(1 + 63 / 30)
    assert m.alpha_token == pytest.approx(25 / 30)
    assert m.source == "stub"


def test_alpha_from_vllm_names_summed_over_model_names() -> None:
    text = metrics_text("vllm", ("a", "b"))
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="b"} 40.0' in text
    m = measured.acceptance_from_metrics_text(text)
    assert (m.num_accepted_tokens, m.num_draft_tokens, m.num_drafts) == (63, 100, 30)
    assert m.alpha == pytest.approx(0.63) and m.alpha_token == pytest.approx(25 / 30)


def test_hand_written_text_without_rounds() -> None:
    text = ("# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            "vllm:spec_decode_num_accepted_tokens_total{model_name=\"x\"} 7\n"
            "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
            "vllm:spec_decode_num_draft_tokens_total{model_name=\"x\"} 10\n")
    m = measured.acceptance_from_metrics_text(text)
    assert m.alpha == pytest.approx(0.7) and m.num_drafts is None and m.mean_accepted_len is None
    assert m.alpha_token is None


def test_metrics_errors() -> None:
    with pytest.raises(InvalidRequestError, match="--speculative-config"):
        measured.acceptance_from_metrics_text("# TYPE kvserve:num_requests_running gauge\n"
                                              "kvserve:num_requests_running 0\n")
    zero = EngineMetrics("m")
    zero.update_engine_state(_stats(0, 0, 0, [0, 0]))
    with pytest.raises(InvalidRequestError, match="no draft tokens"):
        measured.acceptance_from_metrics_text(zero.render().decode())
    with pytest.raises(InvalidRequestError, match="not an http"):
        measured.metrics_url("ftp://host/metrics")


def test_metrics_url_gets_its_path() -> None:
    assert measured.metrics_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/metrics"
    assert measured.metrics_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000/metrics"
    assert measured.metrics_url("http://h:1/custom/metrics") == "http://h:1/custom/metrics"


@pytest.fixture()
def metrics_server() -> Iterator[str]:
    """A loopback HTTP server answering ``/metrics`` with the stub text (404 elsewhere)."""
    body = metrics_text().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path != "/metrics":
                self.send_error(404)
                return
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


def test_fetch_from_a_live_server(metrics_server: str) -> None:
    m = measured.acceptance_from_metrics_url(metrics_server)
    assert m.alpha == pytest.approx(0.63) and m.source == metrics_server + "/metrics"
    with pytest.raises(InvalidRequestError, match="cannot read"):
        measured.fetch_metrics_text(metrics_server + "/nope")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_plan_with_metrics_url(metrics_server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", MODEL, "--json", *BW, "--metrics-url", metrics_server,
                 "--draft-cost-ratio", "0"]) == 0
    sd = json.loads(capsys.readouterr().out)["spec_decode"]
    m = sd["measured"]
    assert m["alpha"] == pytest.approx(0.63) and m["source"].endswith("/metrics")
    best_k, best = cm.spec_decode_best_k(0.63, 0.0, MAX_K)
    assert (m["best_k"], m["best_speedup"]) == (best_k, pytest.approx(best))
    alphas = [r["alpha"] for r in sd["rows"]]
    assert alphas == sorted(alphas) and len(alphas) == len(ALPHAS) + 1
    row = next(r for r in sd["rows"] if r["measured"])
    assert row["alpha"] == pytest.approx(0.63) and row["best_k"] == best_k
    assert row["speedup"][2] == pytest.approx(cm.spec_decode_speedup(0.63, 3, 0.0))
    assert sum(r["measured"] for r in sd["rows"]) == 1

    assert main(["plan", "--model", MODEL, *BW, "--metrics-url", metrics_server]) == 0
    text = capsys.readouterr().out
    assert "0.630 measured" in text and "◀" in text and "63 accepted / 100 draft tokens = 0.630" in text
    assert "mean accepted length 3.10" in text and "per-token estimate 0.833" in text


def test_cli_plan_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", MODEL, "--json", *BW, "--metrics-url", f"http://127.0.0.1:{_free_port()}"]) == 2
    assert "cannot read" in capsys.readouterr().err


def _bench_json(path: Path) -> Path:
    """A JSON shaped as benchmarks/spec_decode.py writes it (only what the planner reads, plus noise)."""
    path.write_text(json.dumps({
        "benchmark": "spec_decode", "sections": {"ngram": {"variants": {}}},
        "acceptance": {
            "draft": {"alpha": 0.55, "num_accepted_tokens": 110, "num_draft_tokens": 200, "num_drafts": 70,
                      "mean_accepted_len": 1 + 110 / 70, "variants": ["draft adaptive k<=4"], "alpha_token": 0.6},
            "ngram": {"alpha": 0.8, "num_accepted_tokens": 400, "num_draft_tokens": 500, "num_drafts": 100,
                      "mean_accepted_len": 5.0, "variants": ["ngram adaptive k<=6"], "alpha_token": 0.9}}}))
    return path


def test_alpha_from_bench_json(tmp_path: Path) -> None:
    f = _bench_json(tmp_path / "sd.json")
    m = measured.acceptance_from_bench_json(f)  # ngram first
    assert m.alpha == pytest.approx(0.8) and m.num_drafts == 100 and m.mean_accepted_len == 5.0
    assert m.alpha_token == 0.9 and "ngram" in m.source and "ngram adaptive k<=6" in m.source
    d = measured.acceptance_from_bench_json(f, "draft")
    assert d.alpha == pytest.approx(0.55) and d.alpha_token == 0.6
    with pytest.raises(InvalidRequestError, match="no acceptance for section 'load'"):
        measured.acceptance_from_bench_json(f, "load")
    (tmp_path / "empty.json").write_text(json.dumps({"benchmark": "spec_decode", "sections": {}}))
    with pytest.raises(InvalidRequestError, match="no acceptance record"):
        measured.acceptance_from_bench_json(tmp_path / "empty.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidRequestError, match="cannot read"):
        measured.acceptance_from_bench_json(tmp_path / "bad.json")


def test_cli_plan_with_bench_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _bench_json(tmp_path / "sd.json")
    assert main(["plan", "--model", MODEL, "--json", *BW, "--bench-json", str(f), "--bench-section", "draft"]) == 0
    sd = json.loads(capsys.readouterr().out)["spec_decode"]
    assert sd["measured"]["alpha"] == pytest.approx(0.55)
    assert sd["measured"]["best_k"] == cm.spec_decode_best_k(0.55, sd["draft_cost_ratio"], MAX_K)[0]
    # a measured α equal to a listed one replaces that row instead of doubling it
    f.write_text(json.dumps({"acceptance": {"ngram": {"num_accepted_tokens": 4, "num_draft_tokens": 5}}}))
    assert main(["plan", "--model", MODEL, "--json", *BW, "--bench-json", str(f)]) == 0
    rows = json.loads(capsys.readouterr().out)["spec_decode"]["rows"]
    assert [r["alpha"] for r in rows] == list(ALPHAS) and [r["measured"] for r in rows].count(True) == 1
    assert main(["plan", "--model", MODEL, *BW, "--bench-json", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_spec_decode_section_without_measurement() -> None:
    sd = spec_decode_section(0.05)
    assert sd["measured"] is None and [r["alpha"] for r in sd["rows"]] == list(ALPHAS)
    assert not any(r["measured"] for r in sd["rows"])


def test_metrics_url_and_bench_json_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--metrics-url", "http://127.0.0.1:1", "--bench-json", "x.json"])
    assert "not allowed with" in capsys.readouterr().err
