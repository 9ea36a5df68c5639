"""``kvserve bench throughput`` workload and ``kvserve bench latency`` on the real model (tiny)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvserve.bench.offline import make_mixed_workload, run_latency


def test_mixed_workload_matches_benchmarks_script() -> None:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"
    spec = importlib.util.spec_from_file_location("bench_throughput_script", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert make_mixed_workload(16, 7) == mod.make_mixed_workload(16, 7)
    reqs = make_mixed_workload(50, 0)
    assert all(50 <= len(p) <= 800 and o in (16, 32, 64, 128, 256) for p, o in reqs)


@pytest.mark.slow
def test_latency_single_request() -> None:
    res = run_latency({"model": "smollm2-135m-instruct", "num_threads": 1}, input_len=16, output_len=4,
                      num_iters=1, num_iters_warmup=0)
    assert res["prefill_s"]["mean"] > 0 and res["decode_s_per_token"]["mean"] > 0
    assert res["e2e_s"]["mean"] >= res["prefill_s"]["mean"]
    with pytest.raises(ValueError):
        run_latency({"model": "smollm2-135m-instruct"}, 16, 1, 1)
