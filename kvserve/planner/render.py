"""``kvserve plan`` as rich tables (one per section of :func:`kvserve.planner.plan.build_plan`)."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.planner.plan import GB, GiB


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _s(t: float) -> str:
    return f"{t * 1000:,.2f} ms" if t < 1 else f"{t:,.2f} s"


def _table(title: str, cols: list[str], rows: list[list[str]], caption: str = "",
           styles: list[str | None] | None = None) -> Table:
    t = Table(title=title, caption=caption or None, title_justify="left")
    for c in cols:
        t.add_column(c, justify="left" if c in ("link", "check", "reason") else "right")
    for i, r in enumerate(rows):
        t.add_row(*r, style=styles[i] if styles else None)
    return t


def spec_decode_table(sd: dict[str, Any]) -> Table:
    """The spec-decode speedup table; a measured α's row in bold, marked, and named in the caption."""
    rows, styles = [], []
    for r in sd["rows"]:
        measured = r.get("measured", False)
        rows.append([f"{r['alpha']:.3f} measured" if measured else f"{r['alpha']:.1f}",
                     *[f"{s:.2f}" for s in r["speedup"]],
                     f"{r['best_k']} ({r['best_speedup']:.2f}×)" + (" ◀" if measured else "")])
        styles.append("bold yellow" if measured else None)
    caption = "only while compute is idle (low batch); Leviathan et al. 2023"
    m = sd.get("measured")
    if m:
        extra = []
        if m.get("mean_accepted_len") is not None:
            extra.append(f"mean accepted length {m['mean_accepted_len']:.2f}")
        if m.get("alpha_token") is not None:
            extra.append(f"per-token estimate {m['alpha_token']:.3f}")
        caption = (f"measured α = {m['num_accepted_tokens']:,.0f} accepted / {m['num_draft_tokens']:,.0f} draft "
                   f"tokens = {m['alpha']:.3f} ({m['source']}){'; ' + ', '.join(extra) if extra else ''}: best "
                   f"k = {m['best_k']} ({m['best_speedup']:.2f}×)\n" + caption)
    return _table(f"Speculative decoding speedup (draft cost {sd['draft_cost_ratio']:g} of a target step)",
                  ["α", *[f"k={k}" for k in sd["k"]], "best k"], rows, caption, styles)


def _quantized(quantization: str | None) -> str:
    return f" + {quantization} projections" if quantization else ""


def render_plan(plan: dict[str, Any], console: Console | None = None) -> None:
    """Print every section of ``plan``."""
    c = console or (Console() if sys.stdout.isatty() else Console(width=240))
    m, kv, rf = plan["model"], plan["kv"], plan["roofline"]
    c.print(f"[bold]{m['name']}[/bold] ({m['architecture']}): {m['num_layers']} layers, {m['num_heads']} heads / "
            f"{m['num_kv_heads']} KV heads × {m['head_dim']}, {m['num_params'] / 1e6:,.1f} M params; weights "
            f"{_bytes(m['weight_bytes'])} as {m['dtype']}{_quantized(m.get('quantization'))} "
            f"(file {_bytes(m['file_bytes'])})")
    c.print(_table(f"KV cache ({kv['kv_cache_dtype']}): {kv['kv_bytes_per_token']:,} B/token; KV budget "
                   f"{_bytes(kv['kv_memory_bytes'])}", ["seq len", "KV / request", "max concurrency",
                                                         "max concurrency 8-bit KV"],
                   [[f"{r['seq_len']:,}", _bytes(r["kv_bytes"]), f"{r['max_concurrency']:,}",
                     f"{r['max_concurrency_8bit']:,}"] for r in kv["per_seq_len"]],
                   f"GQA saves {kv['gqa_factor']:g}× vs full MHA"))
    c.print(_table(f"Decode roofline at {rf['context_len']:,} tokens/request, {rf['bandwidth_bytes_per_s'] / GB:.1f} "
                   f"GB/s ({rf['bandwidth_source']})", ["batch", "KV read", "step ≥", "tok/s per request ≤",
                                                        "total tok/s ≤", "KV share", "fits"],
                   [[str(r["batch"]), _bytes(r["kv_bytes"]), _s(r["step_s"]), f"{r['per_request_tok_s']:,.1f}",
                     f"{r['total_tok_s']:,.0f}", f"{r['kv_share']:.0%}", "yes" if r["fits"] else "no"]
                    for r in rf["rows"]],
                   f"largest batch that fits: {rf['max_batch_that_fits']}; best batch"
                   f"{' under the TPOT SLO' if rf['tpot_slo_s'] else ''}: {rf['best_batch']}"))
    p = plan["preemption"]
    c.print(_table(f"Preemption: prefill {p['prefill_tokens_per_s']:,.0f} tok/s ({p['prefill_source']}), copy "
                   f"{p['copy_bytes_per_s'] / GB:.1f} GB/s ({p['copy_source']})", ["seq len", "recompute", "swap",
                                                                                   "cheaper"],
                   [[f"{r['seq_len']:,}", _s(r["recompute_s"]), _s(r["swap_s"]), r["choice"]] for r in p["rows"]]))
    f = plan["fetch_vs_recompute"]
    c.print(_table(f"Tiered KV: fetch or recompute {f['seq_len']:,} tokens (prefill {f['prefill_tokens_per_s']:,.0f} "
                   "tok/s)", ["link", "GB/s", "break-even prefill tok/s", "fetch", "recompute", "cheaper"],
                   [[r["link"], f"{r['link_bytes_per_s'] / GB:g}", f"{r['break_even_prefill_tokens_per_s']:,.0f}",
                     _s(r["fetch_s"]), _s(r["recompute_s"]), r["choice"]] for r in f["rows"]]))
    c.print(spec_decode_table(plan["spec_decode"]))
    q = plan["kv_8bit"]
    c.print(_table(f"8-bit KV cache ({q['kv_cache_dtype_8bit']}): {q['kv_bytes_per_token_8bit']:,} B/token, "
                   f"{q['concurrency_gain']:g}× concurrency",
                   ["seq len", "max concurrency", "with 8-bit KV"],
                   [[f"{r['seq_len']:,}", f"{r['max_concurrency']:,}", f"{r['max_concurrency_8bit']:,}"]
                    for r in q["rows"]]))
    c.print(pd_table(plan["pd"]))
    if plan.get("tensor_parallel"):
        c.print(tp_table(plan["tensor_parallel"]))


def tp_table(tp: dict[str, Any]) -> Table:
    """What N tensor-parallel ranks cost (collectives) and gain (each reads 1/N) per decode step."""
    n = tp["size"]
    title = (f"Tensor parallelism, {n} ranks ({tp['split']}): link {tp['link_bytes_per_s'] / GB:g} GB/s, "
             f"{tp['collectives_per_step']} collectives/step of {tp['latency_s'] * 1e6:g} µs, "
             f"{tp['rank_bandwidth_bytes_per_s'] / GB:.1f} GB/s per rank"
             f"{' (shared)' if tp['shares_bandwidth'] else ''}")
    caption = (f"at {tp['context_len']:,} tokens/request; {n} ranks' KV budget {_bytes(tp['kv_memory_bytes'])} holds "
               f"{tp['max_batch_that_fits']} requests" + ("" if tp["splits"] else "; kvserve refuses this size"))
    return _table(title, ["batch", "all-reduced", "link bytes", "collectives", "step TP=1 ≥", f"step TP={n} ≥",
                          "speedup ≤", "fits"],
                  [[str(r["batch"]), _bytes(r["allreduce_bytes"]), _bytes(r["link_bytes"]), _s(r["comm_s"]),
                    _s(r["step_s_1"]), _s(r["step_s"]), f"{r['speedup']:.2f}×", "yes" if r["fits"] else "no"]
                   for r in tp["rows"]], caption)


def pd_table(pd: dict[str, Any]) -> Table:
    """The PD go/no-go table; with a measured interconnect the caption gives its counts and source."""
    ic = pd.get("interconnect") or {}
    m = ic.get("measurement")
    caption = ""
    if ic.get("measured") and m:
        counts = (f" = {m['bytes_received']:,.0f} B / {m['transfer_seconds']:.3f} s"
                  if m.get("bytes_received") is not None and m.get("transfer_seconds") is not None else "")
        pulls = f" over {m['num_transfers']:,.0f} pulls" if m.get("num_transfers") is not None else ""
        caption = (f"interconnect measured: {m['bandwidth_bytes_per_s'] / GB:.3g} GB/s{counts}{pulls} "
                   f"({m['source']}); --interconnect-gbs not used")
    return _table(f"Prefill/decode disaggregation: {pd['verdict']}", ["check", "ok", "reason"],
                  [[x["check"], "yes" if x["ok"] else "no", x["reason"]] for x in pd["checks"]], caption)
