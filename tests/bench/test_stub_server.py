"""The serving benchmark against a stub server with known delays: TTFT and ITL must match them (BC-24)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from kvserve.bench.client import RequestResult
from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import SLO, summarize
from kvserve.bench.serve import ClientConfig, LoadSpec, run_load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stub_server import StubConfig, stub_server  # noqa: E402


def run_against_stub(cfg: StubConfig, n: int = 20, output_len: int = 50, api: str = "completions",
                     logprobs: bool = True, load: LoadSpec | None = None) -> tuple[list[RequestResult], float]:
    """Send ``n`` requests of ``output_len`` tokens to a stub with ``cfg``; returns (results, duration s)."""
    reqs = [SampleRequest("hello", 1, output_len) for _ in range(n)]

    async def main() -> tuple[list[RequestResult], float]:
        async with stub_server(cfg) as url:
            client = ClientConfig(url, "stub", api=api, logprobs=logprobs)
            return await run_load(client, reqs, load or LoadSpec(), progress=False)

    return asyncio.run(main())


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_ttft_and_itl_match_injected_delays(api: str) -> None:
    # Poisson arrivals at 50 req/s: 20 simultaneous connects on this loaded 2-core machine would add
    # 20-50 ms of connection setup to every TTFT (real, but not what this test checks)
    results, duration = run_against_stub(StubConfig(), api=api, load=LoadSpec(request_rate=50.0))
    s = summarize(results, duration, SLO(ttft_s=0.6, tpot_s=0.02))
    assert s["completed"] == 20 and s["failed"] == 0
    assert s["ttft_s"]["p50"] == pytest.approx(0.5, abs=0.03)
    assert s["itl_s"]["p50"] == pytest.approx(0.010, abs=0.005)
    # the tail is the host's scheduling jitter, not the client's arithmetic: 980 gaps on a loaded 2-core CI
    # host put the p99 at 52 ms once; nine gaps in ten at the injected 10 ms, and none near the 500 ms first
    # token (checked per request below), are what the client must get right
    assert s["itl_s"]["p90"] == pytest.approx(0.010, abs=0.010)
    assert s["itl_s"]["p99"] < 0.25
    assert s["tpot_s"]["p50"] == pytest.approx(0.010, abs=0.003)
    for r in results:
        assert r.output_tokens == 50 and len(r.itl) == 49 and r.itl_token_aligned
        assert max(r.itl) < 0.4  # the 500 ms first-token gap is never an ITL sample
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 49)
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = s[key]
        assert d["p50"] <= d["p90"] <= d["p95"] <= d["p99"]
    assert s["goodput"] <= s["request_throughput"]


def test_multi_token_chunks_are_split_by_logprobs_count() -> None:
    results, _ = run_against_stub(StubConfig(tokens_per_chunk=3), n=5, output_len=50, load=LoadSpec(request_rate=50.0))
    for r in results:
        # 17 chunks: the first carries 3 tokens (2 zero gaps), the others 3 each (3 × gap/3) -> 49 samples
        assert r.output_tokens == 50 and len(r.itl) == 49 and r.itl_token_aligned
        # the stub cannot answer sooner than its delays; a loaded CI host can answer later (56 ms seen)
        assert 0.5 + 2 * 0.010 - 0.005 <= r.ttft <= 0.5 + 2 * 0.010 + 0.08
        later = sorted(r.itl)[2:]
        assert sum(later) / len(later) == pytest.approx(0.010, abs=0.004)


def test_multi_token_chunks_without_token_counts_use_usage_and_say_so() -> None:
    results, _ = run_against_stub(StubConfig(tokens_per_chunk=3, send_logprobs=False), n=3, output_len=30)
    for r in results:
        assert r.output_tokens == 30  # from usage, not the 10 chunks
        assert len(r.itl) == 9 and not r.itl_token_aligned  # one sample per chunk gap, flagged
        assert r.tpot == pytest.approx((r.e2e - r.ttft) / 29)


def test_no_usage_falls_back_to_counted_tokens() -> None:
    results, _ = run_against_stub(StubConfig(send_usage=False), n=2, output_len=10)
    assert all(r.output_tokens == 10 and not r.usage_reported for r in results)


def test_closed_loop_concurrency_and_poisson_rate() -> None:
    cfg = StubConfig(first_delay_s=0.05, token_gap_s=0.005)
    # closed loop, 2 in flight: 6 requests of ~0.1 s run in 3 waves
    results, duration = run_against_stub(cfg, n=6, output_len=10, load=LoadSpec(max_concurrency=2))
    starts = sorted(r.start for r in results)
    assert starts[2] >= min(r.start + r.e2e for r in results) - 0.01  # the third waits for a finished one
    assert 0.25 < duration < 2.0
    # Poisson at 50 req/s: 10 requests spread over ~0.2 s on average, seeded
    results, _ = run_against_stub(cfg, n=10, output_len=4, load=LoadSpec(request_rate=50.0))
    starts = sorted(r.start for r in results)
    assert starts[-1] > 0.02
