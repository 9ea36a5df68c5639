"""The ``kvserve plan`` command: ``kvserve plan --model smollm2-135m-instruct [--memory-gib 16] [--json]
[--metrics-url URL | --bench-json FILE]`` (a measured spec-decode acceptance and/or KV transfer bandwidth)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvserve import cpu_features
from kvserve.cost_model import KV_DTYPE_BYTES
from kvserve.planner.measured import BENCH_SECTIONS, TRANSFER_SECTIONS, MeasuredAcceptance, Measurements
from kvserve.planner.plan import GB, GiB, PlanOptions


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_plan_parser(sub: Any) -> None:
    """Add ``plan`` to the ``kvserve`` subparsers."""
    d = PlanOptions()
    p = sub.add_parser("plan", help="capacity planner: KV size, concurrency, roofline, preemption, PD, spec decode")
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalog name, .gguf path or HF folder")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights as served (auto: what kvserve serves on this CPU: bfloat16 with native bf16 "
                        "dot products, else float32)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_DTYPE_BYTES])
    p.add_argument("--quantization", default=None, choices=["int8", "gguf"],
                   help="int8 / gguf: the weights as kvserve --quantization int8 / gguf serves them (gguf: a GGUF "
                        "file's quantized blocks as they are)")
    p.add_argument("--memory-gib", type=float, default=d.memory_bytes / GiB, help="device memory (GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.utilization)
    p.add_argument("--reserve-gib", type=float, default=0.0, help="activations/fragmentation reserve (GiB)")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="KV budget in GiB (overrides the above)")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth GB/s (default: measured)")
    p.add_argument("--copy-bandwidth-gbs", type=float, default=None, help="swap copy GB/s (default: measured)")
    p.add_argument("--seq-lens", type=_ints, default=d.seq_lens, help="comma-separated tokens")
    p.add_argument("--context-len", type=int, default=d.context_len, help="tokens/request for roofline and fetch")
    p.add_argument("--prefill-tokens-per-s", type=float, default=None,
                   help="prefill speed (default: --compute-tflops / (2 × params))")
    p.add_argument("--compute-tflops", type=float, default=d.compute_flops / 1e12,
                   help="effective prefill FLOP/s in TFLOP/s (default 0.08: measured kvserve CPU prefill here)")
    p.add_argument("--draft-cost-ratio", type=float, default=d.draft_cost_ratio)
    p.add_argument("--num-devices", type=int, default=d.num_devices)
    p.add_argument("--interconnect-gbs", type=float, default=d.interconnect_bytes_per_s / GB,
                   help="P -> D link GB/s for the PD go/no-go (a bandwidth measured through --metrics-url / "
                        "--bench-json replaces it)")
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="add what N tensor-parallel ranks cost (all-reduce bytes and time per step) and gain")
    p.add_argument("--tp-link-gbs", type=float, default=d.tp_link_bytes_per_s / GB,
                   help="the ranks' link GB/s (25: PCIe 4 x16; NVLink 4: 450; CPU ranks on one host: loopback)")
    p.add_argument("--tp-latency-us", type=float, default=d.tp_latency_s * 1e6,
                   help="fixed cost of one collective in µs (gloo on loopback ~30-300, NCCL over NVLink ~10)")
    p.add_argument("--tp-shares-bandwidth", action="store_true",
                   help="the ranks share one memory bandwidth (CPU ranks on one socket), each reading at 1/N of it")
    p.add_argument("--tpot-slo-ms", type=float, default=None)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--metrics-url", default=None, metavar="URL",
                     help="a running server's /metrics (kvserve: or vllm: names): show its measured spec-decode "
                          "acceptance α = accepted / draft tokens in the spec-decode table, and (a decode "
                          "instance) use its KV transfer bandwidth = bytes received / transfer seconds in the "
                          "PD interconnect check")
    src.add_argument("--bench-json", default=None, metavar="FILE",
                     help="the acceptance recorded by benchmarks/spec_decode.py, or the KV transfer bandwidth "
                          "recorded by benchmarks/disagg.py, in FILE, likewise")
    p.add_argument("--bench-section", default=None, choices=[*BENCH_SECTIONS, *TRANSFER_SECTIONS],
                   help="which section of --bench-json: ngram, draft, load for the acceptance (default: the "
                        "first it has), itl, mixed for the bandwidth (default: every workload)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    """The :class:`PlanOptions` of parsed ``kvserve plan`` flags (GiB, GB/s, ms -> bytes, bytes/s, s)."""
    return PlanOptions(
        dtype=("bfloat16" if cpu_features.has_native_bf16() else "float32") if args.dtype == "auto" else args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
        memory_bytes=args.memory_gib * GiB, utilization=args.gpu_memory_utilization,
        reserve_bytes=args.reserve_gib * GiB,
        kv_cache_memory_bytes=None if args.kv_cache_memory is None else args.kv_cache_memory * GiB,
        bandwidth_bytes_per_s=None if args.bandwidth_gbs is None else args.bandwidth_gbs * GB,
        copy_bytes_per_s=None if args.copy_bandwidth_gbs is None else args.copy_bandwidth_gbs * GB,
        seq_lens=args.seq_lens, context_len=args.context_len, prefill_tokens_per_s=args.prefill_tokens_per_s,
        compute_flops=args.compute_tflops * 1e12, draft_cost_ratio=args.draft_cost_ratio,
        num_devices=args.num_devices, interconnect_bytes_per_s=args.interconnect_gbs * GB,
        tpot_slo_s=None if args.tpot_slo_ms is None else args.tpot_slo_ms / 1000,
        prompt_len=args.prompt_len, output_len=args.output_len, tensor_parallel_size=args.tensor_parallel_size,
        tp_link_bytes_per_s=args.tp_link_gbs * GB, tp_latency_s=args.tp_latency_us / 1e6,
        tp_shares_bandwidth=args.tp_shares_bandwidth)


def measurements(args: argparse.Namespace) -> Measurements:
    """What ``--metrics-url`` / ``--bench-json`` measured (nothing without either): the acceptance and the
    KV transfer bandwidth, either of which a source may lack.

    Raises:
        InvalidRequestError: the source cannot be read or has neither measurement.
    """
    from kvserve.planner import measured

    if getattr(args, "metrics_url", None):
        return measured.from_metrics_url(args.metrics_url)
    if getattr(args, "bench_json", None):
        return measured.from_bench_json(args.bench_json, getattr(args, "bench_section", None))
    return Measurements()


def measured_acceptance(args: argparse.Namespace) -> MeasuredAcceptance | None:
    """The acceptance ``--metrics-url`` / ``--bench-json`` point at (None without either, or when the
    source has only a KV transfer bandwidth).

    Raises:
        InvalidRequestError: the source cannot be read or has neither measurement.
    """
    return measurements(args).acceptance


def cmd_plan(args: argparse.Namespace) -> int:
    from kvserve.planner.model_info import load_model_info
    from kvserve.planner.plan import build_plan

    opts = options_from_args(args)
    measured: dict[str, float] = {}
    if opts.bandwidth_bytes_per_s is None or opts.copy_bytes_per_s is None:
        from kvserve.planner.bandwidth import measure_bandwidth

        measured = measure_bandwidth()._asdict()
    found = measurements(args)
    for note in found.notes:  # the part a source lacks (the other one is there)
        print(f"kvserve plan: {note}", file=sys.stderr)
    plan = build_plan(load_model_info(args.model), opts, measured, found.acceptance, found.transfer)
    if args.json:
        json.dump(plan, sys.stdout, indent=1)
        print()
    else:
        from kvserve.planner.render import render_plan

        render_plan(plan)
    return 0
