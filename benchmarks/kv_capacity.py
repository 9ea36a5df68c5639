#!/usr/bin/env python3
"""8-bit KV cache capacity and what it buys under load: bf16 vs fp8 vs int8 KV (issue 15's "Must measure").

Two measurements, for each ``--kv-dtypes`` value (default ``bfloat16,fp8,int8``):

* **capacity at a budget** (``--budget-gib``, default 2): the KV blocks ``--kv-cache-memory`` buys
  (``worker.kv_cache.num_blocks_for_budget`` over the model's architecture, read from its file without loading
  weights; the same function the engine sizes its cache with), the tokens they hold, and the most sequences of
  ``--seq-len`` tokens (default 524: workload A's mean prompt of 425 + mean output of 99) that fit at once;
* **workload A at concurrency 64 on a pool where bf16 preempts**: the pool is ``--pool-tokens`` tokens of
  *bfloat16* KV (default 16,384: about half of what 64 mixed requests hold at their longest), given to every
  dtype as the same number of bytes (``--kv-cache-memory``), so the 8-bit caches get ~1.8-1.9x the blocks. The
  64 requests are handed to the offline engine at once (``kvserve.bench.offline.run_throughput``: greedy, EOS
  ignored, exact output lengths); reported: output tok/s, wall seconds, preemptions, blocks. The dtypes are
  interleaved round by round (``--rounds``; the shared host drifts) and the medians reported.

Prints one table, writes JSON (results/kv_capacity-<time>.json unless ``--out``) with lscpu's model and flags and
every run's ``other_cpu_frac``. Usage::

    .venv/bin/python benchmarks/kv_capacity.py                    # SmolLM2, 2 threads, 2 rounds
    .venv/bin/python benchmarks/kv_capacity.py --rounds 3 --pool-tokens 12288
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402

KV_DTYPES = ("bfloat16", "fp8", "int8")


def capacity(model: str, kv_dtype: str, budget_gib: float, block_size: int, seq_len: int) -> dict[str, Any]:
    """Blocks, tokens and sequences of ``seq_len`` tokens a ``budget_gib`` KV cache of ``kv_dtype`` holds."""
    import torch

    from kvserve.layers.kv_quant import KV8_DTYPES
    from kvserve.planner.model_info import load_model_info
    from kvserve.worker.kv_cache import GiB, block_bytes, num_blocks_for_budget

    arch = load_model_info(model).arch
    dtype = KV8_DTYPES.get(kv_dtype) or getattr(torch, kv_dtype)
    blocks = num_blocks_for_budget(int(budget_gib * GiB), arch, block_size, dtype)
    per_seq = -(-seq_len // block_size)
    return dict(kv_dtype=kv_dtype, budget_gib=budget_gib, block_bytes=block_bytes(arch, block_size, dtype),
                blocks=blocks, tokens=blocks * block_size, max_sequences=blocks // per_seq, seq_len=seq_len)


def pool_gib(model: str, pool_tokens: int, block_size: int) -> float:
    """GiB of ``pool_tokens`` tokens of bfloat16 KV (whole blocks)."""
    import torch

    from kvserve.planner.model_info import load_model_info
    from kvserve.worker.kv_cache import GiB, block_bytes

    arch = load_model_info(model).arch
    return -(-pool_tokens // block_size) * block_bytes(arch, block_size, torch.bfloat16) / GiB


def run_load(model: str, kv_dtype: str, kv_gib: float, threads: int, num_prompts: int, seed: int) -> dict[str, Any]:
    """Workload A, all ``num_prompts`` requests at once, on a ``kv_gib`` KV cache of ``kv_dtype``."""
    from kvserve.bench.offline import run_throughput

    kwargs = dict(model=model, kv_cache_dtype=kv_dtype, kv_cache_memory=kv_gib, num_threads=threads,
                  max_num_seqs=num_prompts)
    with common.Contention() as con:
        r = run_throughput(kwargs, num_prompts, seed, use_tqdm=False)
    return dict(kv_dtype=kv_dtype, kv_cache_memory_gib=round(kv_gib, 4), output_tok_s=round(r["output_throughput"], 2),
                duration_s=round(r["duration_s"], 2), preemptions=r["preemptions"],
                exact_token_counts=r["exact_token_counts"], other_cpu_frac=round(con.other_cpu_frac, 4),
                load_before=con.load_before, load_after=con.load_after)


def summarize(runs: list[dict[str, Any]], caps: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """Table rows: per dtype, capacity, then the medians of its load runs."""
    rows = []
    base = caps.get("bfloat16")
    for kv, cap in caps.items():
        mine = [r for r in runs if r["kv_dtype"] == kv]
        tok = statistics.median(r["output_tok_s"] for r in mine) if mine else None
        gain = f"{cap['blocks'] / base['blocks']:.2f}x" if base else "-"
        rows.append([kv, cap["block_bytes"], f"{cap['blocks']:,}", gain,
                     cap["max_sequences"], "-" if tok is None else f"{tok:.1f}",
                     "-" if not mine else "/".join(str(r["preemptions"]) for r in mine),
                     "-" if not mine else max(r["other_cpu_frac"] for r in mine)])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--seq-len", type=int, default=524, help="tokens per sequence for the max-concurrency column")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--pool-tokens", type=int, default=16384, help="bfloat16 tokens the loaded pool holds")
    ap.add_argument("--num-prompts", type=int, default=64, help="workload A requests, all at once (concurrency)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-load", action="store_true", help="capacity only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    kvs = [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
    if not kvs or any(k not in KV_DTYPES for k in kvs) or min(args.rounds, args.threads, args.num_prompts) < 1:
        ap.error(f"--kv-dtypes from {', '.join(KV_DTYPES)}; --rounds, --threads, --num-prompts >= 1")
    common.set_thread_env(args.threads)
    caps = {k: capacity(args.model, k, args.budget_gib, args.block_size, args.seq_len) for k in kvs}
    gib = pool_gib(args.model, args.pool_tokens, args.block_size)
    runs: list[dict[str, Any]] = []
    if not args.skip_load:
        for r in range(1, args.rounds + 1):
            for k in kvs:
                rec = run_load(args.model, k, gib, args.threads, args.num_prompts, args.seed)
                rec["round"] = r
                runs.append(rec)
                print(f"round {r} {k}: {rec['output_tok_s']} tok/s, {rec['duration_s']} s, {rec['preemptions']} "
                      f"preemptions, other_cpu_frac {rec['other_cpu_frac']}", flush=True)
    header = ["kv dtype", "block bytes", f"blocks @ {args.budget_gib:g} GiB", "vs bf16",
              f"seqs of {args.seq_len} tok", f"A c{args.num_prompts} tok/s ({gib:.3f} GiB pool)", "preemptions",
              "other_cpu_frac"]
    text = common.table(summarize(runs, caps), header)
    result = dict(benchmark="kv_capacity", args=vars(args), machine=common.machine_info(),
                  env=common.environment(args.threads), capacity=caps, pool_gib=gib, runs=runs, table=text)
    path = common.write_result("kv_capacity", result, args.out)
    print(text)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
