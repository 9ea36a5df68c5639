"""Metric definitions on hand-made timings: ITL from chunks, TPOT, goodput, SLO verdicts, best point, plot."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from kvserve.bench import client
from kvserve.bench.client import RequestInput, RequestResult, request_body, run_async, timings_from_chunks
from kvserve.bench.metrics import SLO, best_point, distribution, meets_slo, summarize
from kvserve.bench.report import plot_sweep


def _res(ttft: float, e2e: float, n: int, ok: bool = True) -> RequestResult:
    itl = [(e2e - ttft) / (n - 1)] * (n - 1) if n > 1 else []
    return RequestResult(success=ok, ttft=ttft, e2e=e2e, itl=itl, output_tokens=n, prompt_tokens=10,
                         error="" if ok else "HTTP 500")


def test_timings_from_chunks() -> None:
    ttft, itl, known = timings_from_chunks([0.5, 0.51, 0.52], [1, 1, 1])
    assert ttft == 0.5 and itl == pytest.approx([0.01, 0.01]) and known
    ttft, itl, known = timings_from_chunks([0.5, 0.53], [2, 3])
    assert itl == pytest.approx([0.0, 0.01, 0.01, 0.01]) and known  # 2 + 3 tokens -> 4 gaps
    _, itl, known = timings_from_chunks([0.5, 0.53], [None, None])
    assert itl == pytest.approx([0.03]) and not known
    with pytest.raises(ValueError):
        timings_from_chunks([], [])


def test_run_async_prefers_uvloop_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    async def loop_module(x: int) -> tuple[int, str]:
        await asyncio.sleep(0)
        return x + 1, type(asyncio.get_running_loop()).__module__

    have_uvloop = importlib.util.find_spec("uvloop") is not None
    value, module = run_async(loop_module(1))
    assert value == 2 and module.startswith("uvloop") == have_uvloop
    real = importlib.util.find_spec
    monkeypatch.setattr(client.importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvloop" else real(name, *a))
    assert run_async(loop_module(2)) == (3, "asyncio.unix_events")


def test_tpot_definition() -> None:
    r = _res(0.5, 1.0, 51)
    assert r.tpot == pytest.approx(0.01)  # (1.0 − 0.5) / 50
    assert _res(0.5, 0.5, 1).tpot is None
    assert _res(0.5, 1.0, 51, ok=False).tpot is None


def test_request_body() -> None:
    url, body = request_body(RequestInput("chat", "http://h:1/", "m", [{"role": "user", "content": "x"}], 8))
    assert url == "http://h:1/v1/chat/completions"
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert body["logprobs"] is True and body["top_logprobs"] == 0
    url, body = request_body(RequestInput("completions", "http://h:1", "m", [1, 2], 8, ignore_eos=False))
    assert url == "http://h:1/v1/completions" and body["logprobs"] == 0 and "ignore_eos" not in body


def test_distribution() -> None:
    d = distribution([1.0, 2.0, 3.0, 4.0, 5.0])
    assert d["mean"] == 3.0 and d["p50"] == 3.0 and d["p90"] == pytest.approx(4.6) and d["count"] == 5
    assert distribution([])["p95"] is None


def test_summary_goodput_and_violations() -> None:
    results = [_res(0.1, 1.1, 11), _res(0.1, 2.1, 11), _res(3.0, 4.0, 11), _res(0.1, 0.2, 1), _res(0, 0, 0, False)]
    # TPOTs: 0.1, 0.2, 0.1, None; SLO TTFT ≤ 1 and TPOT ≤ 0.15 -> good: #0 and #3 (single token: no TPOT)
    s = summarize(results, 10.0, SLO(1.0, 0.15))
    assert s["completed"] == 4 and s["failed"] == 1 and s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(0.2) and s["request_throughput"] == pytest.approx(0.4)
    assert s["slo_violation_rate"] == pytest.approx(0.6)
    assert s["total_output_tokens"] == 34 and s["output_throughput"] == pytest.approx(3.4)
    assert s["itl_s"]["count"] == 30
    assert s["goodput"] <= s["request_throughput"]
    with pytest.raises(ValueError):
        summarize(results, 0.0, SLO())


def test_meets_slo_and_best_point(tmp_path: Path) -> None:
    def point(label: str, ttft: float, tpot: float, tput: float) -> dict[str, object]:
        rs = [_res(ttft, ttft + tpot * 10, 11) for _ in range(4)]
        s = summarize(rs, 4 * 11 / tput, SLO(2.0, 0.1))
        return {"label": label, "max_concurrency": int(label[2:]), "request_rate": None, "summary": s,
                "meets_slo": meets_slo(s, SLO(2.0, 0.1)), "loadavg_before": [0.0], "loadavg_after": [0.0]}

    pts = [point("C=1", 0.2, 0.05, 10.0), point("C=4", 0.5, 0.08, 30.0), point("C=16", 3.0, 0.2, 50.0)]
    slo = SLO(2.0, 0.1)
    assert [meets_slo(p["summary"], slo) for p in pts] == [True, True, False]  # type: ignore[index]
    best = best_point(pts, slo)  # type: ignore[arg-type]
    assert best is not None and best["label"] == "C=4"
    assert best_point(pts, SLO(0.1, None)) is None  # type: ignore[arg-type]
    path = plot_sweep({"points": pts, "best": {"label": "C=4"}}, slo, tmp_path / "p.png")
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size < 200_000
