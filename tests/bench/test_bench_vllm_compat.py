"""``kvserve bench serve`` as a vLLM user runs it: vLLM's flag spellings, one-line errors, no SLO verdict without
an SLO, and keep-alive connections that the server closed are not counted as server failures."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rich.console import Console

from kvserve.bench.cli import resolve_target
from kvserve.bench.client import RequestInput, request_body
from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import SLO
from kvserve.bench.report import print_report
from kvserve.bench.serve import ClientConfig, LoadSpec, run_load
from kvserve.entrypoints.cli import build_parser, main

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stub_server import StubConfig, StubStats, stub_server  # noqa: E402

FAST = StubConfig(first_delay_s=0.01, token_gap_s=0.001)


def _run(cfg: StubConfig, n: int, stats: StubStats) -> list:  # type: ignore[type-arg]
    reqs = [SampleRequest("hello", 1, 5) for _ in range(n)]

    async def go() -> list:  # type: ignore[type-arg]
        async with stub_server(cfg, stats) as url:
            results, _ = await run_load(ClientConfig(url, "stub"), reqs, LoadSpec(max_concurrency=1), progress=False)
            return results

    return asyncio.run(go())


def test_reused_connection_closed_by_the_server_is_retried_on_a_fresh_one() -> None:
    stats = StubStats()
    results = _run(StubConfig(first_delay_s=0.01, token_gap_s=0.001, drop_connections="reused"), 6, stats)
    assert [r.error for r in results] == [""] * 6 and all(r.success and r.output_tokens == 5 for r in results)
    # request 1 opens a connection; request 2 reuses it and is dropped, then retried on a fresh one; request 3
    # opens a new connection (the dropped one left the pool), request 4 reuses it ... -> 3 drops in 6 requests
    assert stats.dropped == 3
    assert [r.retried for r in results] == [False, True, False, True, False, True]


def test_a_fresh_connection_dropped_is_still_a_failure() -> None:
    stats = StubStats()
    results = _run(StubConfig(first_delay_s=0.01, token_gap_s=0.001, drop_connections="all"), 2, stats)
    assert stats.dropped == 2  # no retry: a fresh connection closed without an answer is the server's doing
    assert all(not r.success and not r.retried and "ServerDisconnectedError" in r.error for r in results)


def _bench_args(*flags: str) -> list[str]:
    return ["bench", "serve", "--model", "stub", "--num-prompts", "3", "--random-input-len", "4",
            "--random-output-len", "3", "--no-progress", *flags]


def test_vllm_spellings_select_url_api_and_dataset() -> None:
    args = build_parser().parse_args(_bench_args("--backend", "openai-chat", "--host", "10.0.0.7", "--port", "9001",
                                                 "--endpoint", "/v1/chat/completions", "--dataset-name", "sharegpt"))
    assert resolve_target(args) == ("http://10.0.0.7:9001", "chat", "/v1/chat/completions")
    assert args.dataset == "sharegpt"
    args = build_parser().parse_args(_bench_args("--backend", "vllm", "--endpoint", "v1/completions"))
    assert resolve_target(args) == ("http://127.0.0.1:8000", "completions", "/v1/completions")
    args = build_parser().parse_args(_bench_args("--base-url", "http://h:1/", "--host", "ignored"))
    assert resolve_target(args) == ("http://h:1", "completions", None)
    args = build_parser().parse_args(_bench_args("--api", "completions", "--endpoint", "/v1/chat/completions"))
    with pytest.raises(ValueError, match="--api -> completions, --endpoint -> chat"):
        resolve_target(args)
    url, _ = request_body(RequestInput("completions", "http://h:1", "m", "hi", 4, endpoint="/custom/path"))
    assert url == "http://h:1/custom/path"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(_bench_args("--port", str(_free_port()), "--out", str(tmp_path / "r.json")))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err
    assert len(err.splitlines()) == 1 and err.startswith("error: warm-up request to http://127.0.0.1:")
    assert "Cannot connect" in err


@contextmanager
def _stub_in_thread(cfg: StubConfig) -> Iterator[str]:
    """The stub on its own event loop thread (the command under test runs asyncio.run itself)."""
    loop = asyncio.new_event_loop()
    started: asyncio.Future[str] = loop.create_future()
    stop = asyncio.Event()

    async def serve() -> None:
        async with stub_server(cfg) as url:
            started.set_result(url)
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    url = asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(started), 30), loop).result(30)
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def test_no_slo_verdict_without_an_slo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _stub_in_thread(FAST) as url:
        out = tmp_path / "r.json"
        rc = main(_bench_args("--base-url", url, "--tokenizer", "none", "--sweep", "1,2", "--out", str(out)))
        printed = capsys.readouterr().out
        assert rc == 0
        result = json.loads(out.read_text())
        assert [p["meets_slo"] for p in result["points"]] == [None, None]
        assert "SLO viol" not in printed and "meets SLO" not in printed and "under the SLOs" not in printed
        assert "no SLO given" in printed
        rc = main(_bench_args("--base-url", url, "--tokenizer", "none", "--slo-ttft-p95", "30", "--out", str(out)))
        printed = capsys.readouterr().out
        assert rc == 0 and json.loads(out.read_text())["points"][0]["meets_slo"] is True
        assert "meets SLO: True" in printed


def test_report_without_slo_has_no_verdict_columns() -> None:
    summary = {"num_requests": 1, "completed": 1, "duration_s": 1.0, "request_throughput": 1.0,
               "output_throughput": 5.0, "goodput": 1.0, "slo_violation_rate": 0.0,
               **{k: {"p50": 0.1, "p95": 0.1, "p99": 0.1} for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")}}
    point = {"label": "C=1", "summary": summary, "meets_slo": None, "loadavg_before": [0.1], "loadavg_after": [0.2]}
    console = Console(record=True, width=300)
    print_report({"points": [point], "best": {"label": "C=1"}}, SLO(), console)
    text = console.export_text()
    assert "C=1" in text and "SLO viol" not in text and "meets SLO" not in text and "goodput" not in text
