"""``kvserve bench throughput`` workload and ``kvserve bench latency`` on the real model (tiny)."""

from __future__ import annotations

import pytest

from kvserve.bench.offline import make_mixed_workload, run_latency


def test_mixed_workload_is_workload_a() -> None:
    """Pinned to ``shared/bench/anchor_bench.make_workload("mixed", 64, 0)`` (checked equal when written):
    the same prompts and output lengths as the peers' numbers in performance.md."""
    reqs = make_mixed_workload(64, 0)
    assert [len(p) for p, _ in reqs[:5]] == [444, 637, 191, 632, 309]
    assert [o for _, o in reqs[:5]] == [16, 256, 64, 32, 64]
    assert reqs[0][0][:4] == [28562, 3653, 17968, 34506]
    assert (sum(len(p) for p, _ in reqs), sum(o for _, o in reqs)) == (26383, 6048)
    assert all(50 <= len(p) <= 800 and o in (16, 32, 64, 128, 256) for p, o in make_mixed_workload(50, 1))


@pytest.mark.slow
def test_latency_single_request() -> None:
    res = run_latency({"model": "smollm2-135m-instruct", "num_threads": 1}, input_len=16, output_len=4,
                      num_iters=1, num_iters_warmup=0)
    assert res["prefill_s"]["mean"] > 0 and res["decode_s_per_token"]["mean"] > 0
    assert res["e2e_s"]["mean"] >= res["prefill_s"]["mean"]
    with pytest.raises(ValueError):
        run_latency({"model": "smollm2-135m-instruct"}, 16, 1, 1)
