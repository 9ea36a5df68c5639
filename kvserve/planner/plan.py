"""Every section of ``kvserve plan`` as plain data (JSON-ready), from :mod:`kvserve.cost_model`.

Units: bytes, seconds, tokens; GB = 1e9 bytes (link and memory speeds), GiB = 2^30 bytes (memory sizes).
Each section names its cost-model.md section; docs/planner.md has the formulas and the defaults' sources.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvserve import cost_model as cm
from kvserve.planner.measured import MeasuredAcceptance, MeasuredTransfer
from kvserve.planner.model_info import ModelInfo

GiB = 1 << 30
GB = 1e9
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)
MAX_K = 8
# name -> bytes/s (cost-model.md "Tiered KV"; nominal unidirectional speeds).
LINKS: dict[str, float] = {"NVLink 4 (H100)": 450 * GB, "PCIe 4 x16": 25 * GB, "100 GbE / 100G RDMA": 12.5 * GB,
                           "NVMe SSD": 3 * GB, "10 GbE": 1.25 * GB}
RDMA_CLASS_BYTES_PER_S = 25 * GB  # 200 Gb/s InfiniBand; slower links fail the PD interconnect check
PD_MIN_DEVICES = 8


@dataclass(frozen=True)
class PlanOptions:
    """Inputs of a plan. Speeds: bytes/s or tokens/s; sizes: bytes; ``None`` bandwidths are measured.

    Attributes:
        dtype: weights as served (for ``auto`` kvserve serves ``float32`` on CPUs without native bf16 dot
            products, ``bfloat16`` on those with them).
        kv_cache_dtype: ``auto`` = ``dtype``.
        quantization: None, ``int8`` (``--quantization int8``: projections and head at 1 byte per weight
            plus scales, ``ModelInfo.int8_weight_bytes``; the rest in ``dtype``) or ``gguf`` (a GGUF file's blocks
            as they are, ``ModelInfo.gguf_weight_bytes``).
        memory_bytes: device memory; the KV budget is ``memory × utilization − weights − reserve``.
        kv_cache_memory_bytes: use this KV budget instead (kvserve's ``--kv-cache-memory`` on CPU).
        context_len: tokens per request for the roofline and the preemption/fetch examples.
        prefill_tokens_per_s: None: ``compute_flops / (2 × params)`` (compute-bound prefill estimate).
        tpot_slo_s: a TPOT objective (seconds): the roofline names the largest batch meeting it, and the PD
            check counts it as a strict TPOT SLO.
        tensor_parallel_size: ranks for the tensor-parallel section (1: no section); each rank has
            ``memory_bytes`` (``kv_cache_memory_bytes`` is per rank, as kvserve's ``--kv-cache-memory``).
        tp_link_bytes_per_s, tp_latency_s: the ranks' link (bytes/s one way) and the fixed cost of one collective.
        tp_shares_bandwidth: the ranks share one memory bandwidth (one CPU socket): each reads at
            ``bandwidth / N``; False: each has its own (GPUs, sockets).
    """

    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    memory_bytes: float = 16 * GiB
    utilization: float = 0.9
    reserve_bytes: float = 0.0
    kv_cache_memory_bytes: float | None = None
    bandwidth_bytes_per_s: float | None = None
    copy_bytes_per_s: float | None = None
    seq_lens: tuple[int, ...] = (512, 2048, 8192)
    context_len: int = 2048
    prefill_tokens_per_s: float | None = None
    compute_flops: float = 80e9
    draft_cost_ratio: float = 0.05
    num_devices: int = 1
    interconnect_bytes_per_s: float = 25 * GB
    tpot_slo_s: float | None = None
    prompt_len: int = 2048
    output_len: int = 256
    links: dict[str, float] = field(default_factory=lambda: dict(LINKS))
    tensor_parallel_size: int = 1
    tp_link_bytes_per_s: float = 25 * GB
    tp_latency_s: float = 50e-6
    tp_shares_bandwidth: bool = False


def dtype_bytes(name: str) -> int:
    """Element size of a ``--dtype`` / ``--kv-cache-dtype`` name.

    Raises:
        ValueError: an unknown name.
    """
    if name not in cm.KV_DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(cm.KV_DTYPE_BYTES)})")
    return cm.KV_DTYPE_BYTES[name]


def spec_decode_section(draft_cost_ratio: float, acceptance: MeasuredAcceptance | None = None) -> dict[str, Any]:
    """Speedup ``E(α, k) / (k c + 1)`` for α in :data:`ALPHAS` × k in 1..:data:`MAX_K`, the best k per α.

    With a measured ``acceptance`` its α gets a row of its own (in α order, ``"measured": true``; it
    replaces a listed α it equals) and ``"measured"`` holds the measurement and that row's best k.
    """
    def row(al: float, measured: bool) -> dict[str, Any]:
        best_k, best = cm.spec_decode_best_k(al, draft_cost_ratio, MAX_K)
        return {"alpha": al, "speedup": [cm.spec_decode_speedup(al, k, draft_cost_ratio) for k in range(1, MAX_K + 1)],
                "best_k": best_k, "best_speedup": best, "measured": measured}

    rows = [row(al, False) for al in ALPHAS if acceptance is None or abs(al - acceptance.alpha) > 1e-9]
    out: dict[str, Any] = {"draft_cost_ratio": draft_cost_ratio, "k": list(range(1, MAX_K + 1)), "rows": rows,
                           "measured": None}
    if acceptance is not None:
        m = row(acceptance.alpha, True)
        rows.append(m)
        rows.sort(key=lambda r: r["alpha"])
        out["measured"] = {**acceptance.as_dict(), "best_k": m["best_k"], "best_speedup": m["best_speedup"]}
    return out


def build_plan(info: ModelInfo, opts: PlanOptions, measured: dict[str, float] | None = None,
               acceptance: MeasuredAcceptance | None = None,
               transfer: MeasuredTransfer | None = None) -> dict[str, Any]:
    """The whole plan. ``measured``: bandwidths measured on this machine (bytes/s: ``memory``, ``copy``), used
    where ``opts`` gives none. ``acceptance``: a measured speculative-decoding acceptance
    (``planner.measured``), shown as its own row of the spec-decode table. ``transfer``: a measured KV
    transfer bandwidth, used by the PD interconnect check instead of ``opts.interconnect_bytes_per_s``.

    Raises:
        ValueError: no bandwidth given or measured, an unknown dtype, or an invalid size.
    """
    measured = measured or {}
    a = info.arch
    w_bytes = dtype_bytes(opts.dtype)
    kv_dtype = opts.dtype if opts.kv_cache_dtype == "auto" else opts.kv_cache_dtype
    b = dtype_bytes(kv_dtype)
    # the 8-bit caches' real layouts, scales included (int8: a float16 per 16 channels; fp8: a float32 per row);
    # the 8-bit comparison shows the chosen 8-bit format, else int8
    kv8 = kv_dtype if b == 1 else "int8"
    bpt8 = cm.kv_bytes_per_token_8bit(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, kv8)
    bpt = bpt8 if b == 1 else cm.kv_bytes_per_token(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, b)
    weights = (info.int8_weight_bytes(w_bytes) if opts.quantization == "int8" else
               info.gguf_weight_bytes(w_bytes) if opts.quantization == "gguf" else info.weight_bytes(w_bytes))
    kv_mem = (opts.kv_cache_memory_bytes if opts.kv_cache_memory_bytes is not None else
              cm.kv_memory_bytes(opts.memory_bytes, weights, opts.utilization, opts.reserve_bytes))
    bw = opts.bandwidth_bytes_per_s or measured.get("memory")
    copy_bw = opts.copy_bytes_per_s or measured.get("copy")
    if not bw or not copy_bw:
        raise ValueError("no memory/copy bandwidth given or measured")
    prefill = opts.prefill_tokens_per_s or opts.compute_flops / (2 * info.num_params)
    ctx = opts.context_len

    model = {"name": info.name, "path": info.path, "architecture": a.architecture, "num_layers": a.num_hidden_layers,
             "num_heads": a.num_attention_heads, "num_kv_heads": a.num_key_value_heads, "head_dim": a.head_dim,
             "hidden_size": a.hidden_size, "vocab_size": a.vocab_size, "max_position_embeddings":
             a.max_position_embeddings, "num_params": info.num_params, "file_bytes": info.file_bytes,
             "dtype": opts.dtype, "quantization": opts.quantization, "weight_bytes": weights}

    per_seq_len = [{"seq_len": n, "kv_bytes": cm.kv_bytes(bpt, n),
                    "max_concurrency": cm.max_concurrency(kv_mem, bpt, n),
                    "max_concurrency_8bit": cm.max_concurrency(kv_mem, bpt8, n)} for n in opts.seq_lens]
    kv = {"kv_cache_dtype": kv_dtype, "dtype_bytes": b, "kv_bytes_per_token": bpt, "kv_memory_bytes": kv_mem,
          "gqa_factor": a.num_attention_heads / a.num_key_value_heads,
          "per_seq_len": per_seq_len}

    max_fit = cm.max_concurrency(kv_mem, bpt, ctx)
    rows = []
    for batch in BATCH_SIZES:
        kv_total = batch * cm.kv_bytes(bpt, ctx)
        t = cm.decode_step_lower_bound_s(weights, kv_total, bw)
        rows.append({"batch": batch, "kv_bytes": kv_total, "step_s": t, "per_request_tok_s": 1 / t,
                     "total_tok_s": batch / t, "kv_share": kv_total / (weights + kv_total), "fits": batch <= max_fit})
    ok = [r for r in rows if r["fits"] and (opts.tpot_slo_s is None or r["step_s"] <= opts.tpot_slo_s)]
    roofline = {"bandwidth_bytes_per_s": bw, "bandwidth_source": "given" if opts.bandwidth_bytes_per_s else
                "measured (numpy copy)", "context_len": ctx, "max_batch_that_fits": max_fit, "rows": rows,
                "best_batch": ok[-1]["batch"] if ok else None, "tpot_slo_s": opts.tpot_slo_s}

    preempt = {"prefill_tokens_per_s": prefill, "prefill_source": "given" if opts.prefill_tokens_per_s else
               f"estimate: {opts.compute_flops:.3g} FLOP/s / (2 × params)", "copy_bytes_per_s": copy_bw,
               "copy_source": "given" if opts.copy_bytes_per_s else "measured (numpy copy)",
               "rows": [{"seq_len": n, "recompute_s": cm.recompute_time_s(n, prefill),
                         "swap_s": cm.swap_time_s(n, bpt, copy_bw),
                         "choice": cm.preempt_choice(n, bpt, prefill, copy_bw)} for n in opts.seq_lens]}

    fetch = {"seq_len": ctx, "prefill_tokens_per_s": prefill,
             "rows": [{"link": name, "link_bytes_per_s": s,
                       "break_even_prefill_tokens_per_s": cm.fetch_break_even_prefill_tokens_per_s(s, bpt),
                       "fetch_s": cm.fetch_time_s(ctx, bpt, s), "recompute_s": cm.recompute_time_s(ctx, prefill),
                       "choice": "recompute" if prefill > cm.fetch_break_even_prefill_tokens_per_s(s, bpt)
                       else "fetch"} for name, s in opts.links.items()]}

    spec = spec_decode_section(opts.draft_cost_ratio, acceptance)

    quant = {"kv_cache_dtype_8bit": kv8, "kv_bytes_per_token_8bit": bpt8, "concurrency_gain": bpt / bpt8,
             "rows": [{"seq_len": r["seq_len"], "max_concurrency": r["max_concurrency"],
                       "max_concurrency_8bit": r["max_concurrency_8bit"]} for r in per_seq_len]}

    decode_tok_s = next((r["total_tok_s"] for r in rows if r["batch"] == roofline["best_batch"]),
                        rows[0]["total_tok_s"])
    pd = pd_checklist(opts, bpt, prefill, decode_tok_s, transfer)
    tp = tensor_parallel_section(info, opts, weights, bpt, bw, w_bytes)
    return {"model": model, "kv": kv, "roofline": roofline, "preemption": preempt, "fetch_vs_recompute": fetch,
            "spec_decode": spec, "kv_8bit": quant, "pd": pd, "tensor_parallel": tp, "options": asdict(opts)}


def tensor_parallel_section(info: ModelInfo, opts: PlanOptions, weight_bytes: float, kv_bytes_per_token: int,
                            bandwidth_bytes_per_s: float, act_bytes: int) -> dict[str, Any] | None:
    """What ``--tensor-parallel-size N`` costs and gains per decode step (docs/distributed.md): the bytes
    all-reduced and moved over the link, the collectives' time, the step's lower bound at 1 and N ranks, and the
    KV capacity of N ranks' memory. None at size 1.

    ``splits`` says whether kvserve can split the model so (whole heads per rank: ``tp_shard.shard_arch``).
    """
    from kvserve.errors import InvalidRequestError
    from kvserve.models.tp_shard import shard_arch

    n = opts.tensor_parallel_size
    if n == 1:
        return None
    a = info.arch
    try:
        shard_arch(a, n)
        splits = True
        reason = f"{a.num_attention_heads // n} query and {a.num_key_value_heads // n} KV head(s) per rank"
    except InvalidRequestError as e:
        splits, reason = False, e.message
    ctx = opts.context_len
    if opts.kv_cache_memory_bytes is not None:
        kv_mem = n * opts.kv_cache_memory_bytes
    else:
        kv_mem = cm.kv_memory_bytes(n * opts.memory_bytes, weight_bytes, opts.utilization, n * opts.reserve_bytes)
    max_fit = cm.max_concurrency(kv_mem, kv_bytes_per_token, ctx)
    rank_bw = bandwidth_bytes_per_s / n if opts.tp_shares_bandwidth else bandwidth_bytes_per_s
    collectives = 2 * a.num_hidden_layers + 2  # the all-reduces and the logits' gather
    rows = []
    for batch in BATCH_SIZES:
        kv_total = batch * cm.kv_bytes(kv_bytes_per_token, ctx)
        allreduce = cm.tp_allreduce_bytes_per_step(a.num_hidden_layers, a.hidden_size, batch, act_bytes)
        link = cm.tp_link_bytes_per_step(allreduce, a.vocab_size, batch, n)
        comm = link / opts.tp_link_bytes_per_s + collectives * opts.tp_latency_s
        one = cm.decode_step_lower_bound_s(weight_bytes, kv_total, bandwidth_bytes_per_s)
        step = cm.tp_decode_step_s(weight_bytes, kv_total, rank_bw, n, link, opts.tp_link_bytes_per_s, collectives,
                                   opts.tp_latency_s)
        rows.append({"batch": batch, "allreduce_bytes": allreduce, "link_bytes": link, "comm_s": comm,
                     "step_s_1": one, "step_s": step, "speedup": one / step, "fits": batch <= max_fit})
    return {"size": n, "splits": splits, "split": reason, "link_bytes_per_s": opts.tp_link_bytes_per_s,
            "latency_s": opts.tp_latency_s, "shares_bandwidth": opts.tp_shares_bandwidth,
            "rank_bandwidth_bytes_per_s": rank_bw, "collectives_per_step": collectives, "context_len": ctx,
            "kv_memory_bytes": kv_mem, "max_batch_that_fits": max_fit, "rows": rows}


def pd_checklist(opts: PlanOptions, kv_bytes_per_token: int, prefill_tokens_per_s: float,
                 decode_tokens_per_s: float, transfer: MeasuredTransfer | None = None) -> dict[str, Any]:
    """Prefill/decode disaggregation go/no-go with a reason per check (cost-model.md "Prefill/decode
    disaggregation"). GO only when every check passes; otherwise "chunked prefill first".

    Checks: interconnect at least RDMA class (25 GB/s) and the prompt's KV transfer at most 10 % of its
    prefill time; at least 8 devices; a strict TPOT SLO given; both pools get ≥ 1 device at the P:D split
    the prompt/output ratio implies (``cost_model.pd_prefill_share``). The interconnect is ``transfer``'s
    measured bandwidth (bytes/s) when given, else ``opts.interconnect_bytes_per_s``; ``interconnect`` in
    the result says which (``source``: ``"--interconnect-gbs"`` or the measurement's source).
    """
    link = transfer.bandwidth_bytes_per_s if transfer is not None else opts.interconnect_bytes_per_s
    link_txt = (f"measured {link / GB:.3g} GB/s from {transfer.source}" if transfer is not None
                else f"{link / GB:g} GB/s link")
    t_x = cm.pd_transfer_time_s(opts.prompt_len, kv_bytes_per_token, link)
    t_p = cm.recompute_time_s(opts.prompt_len, prefill_tokens_per_s)
    share = cm.pd_prefill_share(opts.prompt_len, opts.output_len, prefill_tokens_per_s, decode_tokens_per_s)
    n_p = min(max(round(share * opts.num_devices), 1), max(opts.num_devices - 1, 1))
    checks = [
        {"check": "interconnect", "ok": link >= RDMA_CLASS_BYTES_PER_S and t_x <= 0.1 * t_p,
         "reason": f"{link_txt} (RDMA class ≥ {RDMA_CLASS_BYTES_PER_S / GB:g}); "
                   f"moving a {opts.prompt_len}-token prompt's KV takes {t_x * 1000:.2f} ms vs "
                   f"{t_p * 1000:.1f} ms to prefill it (must be ≤ 10 %)"},
        {"check": "devices", "ok": opts.num_devices >= PD_MIN_DEVICES,
         "reason": f"{opts.num_devices} devices (each pool needs its own scale: ≥ ~{PD_MIN_DEVICES})"},
        {"check": "tpot_slo", "ok": opts.tpot_slo_s is not None,
         "reason": (f"strict TPOT SLO {opts.tpot_slo_s * 1000:g} ms: separate decode devices stop prefill stalls"
                    if opts.tpot_slo_s is not None else "no strict TPOT SLO: chunked prefill bounds stalls enough")},
        {"check": "pd_split", "ok": opts.num_devices >= 2,
         "reason": f"prompt {opts.prompt_len} / output {opts.output_len} tokens: prefill needs {share:.0%} of device "
                   f"time -> {n_p} prefill : {max(opts.num_devices - n_p, 0)} decode devices"},
    ]
    go = all(c["ok"] for c in checks)
    interconnect = {"bytes_per_s": link, "measured": transfer is not None,
                    "source": transfer.source if transfer is not None else "--interconnect-gbs",
                    "measurement": transfer.as_dict() if transfer is not None else None}
    return {"go": go, "verdict": "GO: disaggregate" if go else "NO-GO: chunked prefill first", "checks": checks,
            "interconnect": interconnect, "transfer_s": t_x, "prefill_s": t_p, "prefill_share": share,
            "prefill_devices": n_p}
