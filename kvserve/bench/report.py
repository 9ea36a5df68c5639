"""Rich tables of benchmark runs and the matplotlib plot of a sweep (latency percentiles vs throughput)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.bench.metrics import SLO


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}" if v >= 0.1 else f"{v * 1000:.1f}"


def point_table(points: list[dict[str, Any]], slo: SLO, title: str = "kvserve bench serve") -> Table:
    """One row per point: load, throughput, TTFT/TPOT/ITL percentiles (ms), load avg; with an SLO also goodput,
    the violation rate and the verdict (without one there is nothing to judge, so those columns are left out)."""
    t = Table(title=title)
    slo_cols = ("goodput req/s", "SLO viol", "meets SLO") if slo.given else ()
    for col in ("load", "reqs", "ok", "dur s", "req/s", "out tok/s", "TTFT p50", "TTFT p95", "TTFT p99", "TPOT p50",
                "TPOT p95", "TPOT p99", "ITL p50", "ITL p99", "E2E p95", *slo_cols, "load1"):
        t.add_column(col, justify="right" if col not in ("load", "meets SLO") else "left")
    for p in points:
        s = p["summary"]
        verdict = (f"{s['goodput']:.2f}", f"{s['slo_violation_rate']:.0%}", "yes" if p["meets_slo"] else "no")
        t.add_row(
            p["label"], str(s["num_requests"]), str(s["completed"]), f"{s['duration_s']:.1f}",
            f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
            _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p95"]), _ms(s["ttft_s"]["p99"]),
            _ms(s["tpot_s"]["p50"]), _ms(s["tpot_s"]["p95"]), _ms(s["tpot_s"]["p99"]),
            _ms(s["itl_s"]["p50"]), _ms(s["itl_s"]["p99"]), _ms(s["e2e_s"]["p95"]),
            *(verdict if slo.given else ()), f"{p['loadavg_before'][0]}->{p['loadavg_after'][0]}",
        )
    slo_txt = ", ".join(f"{k} ≤ {v * 1000:.0f} ms" for k, v in (("TTFT p95", slo.ttft_s), ("TPOT p95", slo.tpot_s))
                        if v is not None)
    t.caption = f"latencies in ms; SLOs: {slo_txt or 'none'}"
    return t


def make_console() -> Console:
    """A rich console; when stdout is not a terminal (a log file, a pipe) tables get 240 columns instead
    of rich's default 80, which would squeeze every column to an ellipsis."""
    return Console() if sys.stdout.isatty() else Console(width=240)


def print_report(result: dict[str, Any], slo: SLO, console: Console | None = None) -> None:
    """Print the table of all points and the verdict on the best one."""
    console = console or make_console()
    console.print(point_table(result["points"], slo))
    best = result.get("best")
    if not slo.given:
        if best is not None and len(result["points"]) > 1:
            p = next(q for q in result["points"] if q["label"] == best["label"])
            console.print(f"highest output throughput (no SLO given): {best['label']} — "
                          f"{p['summary']['output_throughput']:.1f} output tok/s")
    elif best is None:
        console.print("[bold red]no point meets the SLOs[/bold red]")
    else:
        p = next(q for q in result["points"] if q["label"] == best["label"])
        console.print(f"[bold green]best point under the SLOs: {best['label']}[/bold green] — "
                      f"{p['summary']['output_throughput']:.1f} output tok/s, "
                      f"{p['summary']['request_throughput']:.2f} req/s, goodput {p['summary']['goodput']:.2f}")


def plot_sweep(result: dict[str, Any], slo: SLO, path: Path, title: str = "") -> Path:
    """Save a PNG: TTFT and TPOT p50/p95/p99 (ms) against output token throughput, one marker per point.

    Uses matplotlib's Agg backend (no display); SLO thresholds are dashed lines; the best point is circled.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    x = [p["summary"]["output_throughput"] for p in pts]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=90)
    for ax, key, name, limit in ((axes[0], "ttft_s", "TTFT", slo.ttft_s), (axes[1], "tpot_s", "TPOT", slo.tpot_s)):
        for pct, style in (("p50", "o-"), ("p95", "s-"), ("p99", "^--")):
            y = [(p["summary"][key][pct] or float("nan")) * 1000 for p in pts]
            ax.plot(x, y, style, label=pct, markersize=4)
        for p, xi in zip(pts, x, strict=True):
            y95 = p["summary"][key]["p95"]
            if y95 is not None:
                ax.annotate(p["label"], (xi, y95 * 1000), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if limit is not None:
            ax.axhline(limit * 1000, color="red", linestyle=":", label=f"SLO p95 {limit * 1000:.0f} ms")
        best = result.get("best")
        if best is not None:
            bp = next(p for p in pts if p["label"] == best["label"])
            v = bp["summary"][key]["p95"]
            if v is not None:
                ax.plot([bp["summary"]["output_throughput"]], [v * 1000], "o", mfc="none", mec="green",
                        markersize=12, label="best")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "latency percentiles vs throughput", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
