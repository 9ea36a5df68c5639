"""Aggregate request timings into the report of one benchmark run, and pick the best point of a sweep.

Definitions (cost-model.md "Benchmarks"; vLLM's ``benchmark_serving``):

* percentiles: linear interpolation between order statistics (``numpy.percentile``'s default).
* request throughput = completed requests / duration; output token throughput = Σ output tokens / duration;
  total token throughput = Σ (prompt + output tokens) / duration. Duration = first send -> last reply (s).
* a request is *good* when it succeeded and meets every SLO given: TTFT ≤ ``slo_ttft_s`` and TPOT ≤
  ``slo_tpot_s`` (a single-token request has no TPOT and meets that SLO). Goodput = good requests /
  duration (requests/s); SLO violation rate = 1 − good / all requests (failed requests are violations).
* a run *meets the SLOs* when every request succeeded, TTFT p95 ≤ ``slo_ttft_p95`` and TPOT p95 ≤
  ``slo_tpot_p95``. The best sweep point is the run with the highest output token throughput among those.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.bench.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; None: no objective on that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def given(self) -> bool:
        """Whether any objective was set (without one, no run gets a "meets SLO" verdict)."""
        return self.ttft_s is not None or self.tpot_s is not None

    def request_ok(self, r: RequestResult) -> bool:
        """Whether one request succeeded and met every objective (per request, not a percentile)."""
        if not r.success:
            return False
        if self.ttft_s is not None and r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_p95_s": self.ttft_s, "tpot_p95_s": self.tpot_s}


def distribution(values: list[float]) -> dict[str, float | None]:
    """``mean``, ``p50``, ``p90``, ``p95``, ``p99`` (and ``count``) of ``values`` in their unit; None if empty."""
    out: dict[str, float | None] = {"count": float(len(values))}
    if not values:
        out.update({"mean": None, **{f"p{p}": None for p in PERCENTILES}})
        return out
    arr = np.asarray(values, dtype=np.float64)
    out["mean"] = float(arr.mean())
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    return out


def summarize(results: list[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The metrics of one run (seconds, tokens, requests/s, tokens/s); see the module docstring.

    Raises:
        ValueError: ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    good = sum(1 for r in results if slo.request_ok(r))
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    lat = {
        "ttft": distribution([r.ttft for r in ok]),
        "tpot": distribution(tpots),
        "itl": distribution([x for r in ok for x in r.itl]),
        "e2e": distribution([r.e2e for r in ok]),
    }
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "good_requests": good,
        "goodput": good / duration_s,
        "slo_violation_rate": 1 - good / len(results) if results else 0.0,
        "itl_token_aligned": all(r.itl_token_aligned for r in ok),
        "usage_reported": all(r.usage_reported for r in ok),
        **{f"{k}_s": v for k, v in lat.items()},
    }


def meets_slo(summary: dict[str, Any], slo: SLO) -> bool:
    """Whether a run meets the objectives at p95 with no failed request (see the module docstring)."""
    if summary["failed"] or not summary["completed"]:
        return False
    for key, limit in (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s)):
        p95 = summary[key]["p95"]
        if limit is not None and p95 is not None and p95 > limit:
            return False
    return True


def best_point(points: list[dict[str, Any]], slo: SLO) -> dict[str, Any] | None:
    """The point with the highest output token throughput among those meeting the SLOs; None if none does.

    ``points``: dicts with a ``summary`` (from :func:`summarize`); a tie keeps the earlier point.
    """
    best: dict[str, Any] | None = None
    for p in points:
        if meets_slo(p["summary"], slo) and (
                best is None or p["summary"]["output_throughput"] > best["summary"]["output_throughput"]):
            best = p
    return best


def loadavg() -> list[float]:
    """The machine's 1/5/15-minute load averages (``os.getloadavg``), rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]
