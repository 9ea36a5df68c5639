#!/usr/bin/env python3
"""Recompute vs swap vs auto under forced preemption: total time of one fixed workload per preemption mode.

What is measured, and why
-------------------------
When the KV pool runs out, a running request is preempted. By **recompute** its blocks are dropped and its
tokens are prefilled again later (cost ~ ``seq_len / prefill_tokens_per_s``); by **swap** its blocks are
copied to the host pool and back (cost ~ ``2 x seq_len x kv_bytes_per_token / copy_bandwidth``); **auto**
chooses per victim with those two formulas (docs/cost-model.md, docs/scheduling.md).

* Workload (fixed seed): ``--num-prompts`` (24) requests, prompt lengths ~U[``--min-prompt``, ``--max-prompt``]
  (300-1,000) random token ids ~U[1000, 40000], output lengths ~U[64, 128], greedy, ``ignore_eos``, all
  submitted at once to ``LLM.generate``. The KV pool is forced small with ``num_gpu_blocks_override``
  (``--num-blocks``, default 160 blocks of 16 tokens = 2,560 tokens; the largest request needs 71 blocks)
  so that preemption must happen; ``--swap-space`` GiB of host pool (default 1).
* Per mode (``--modes``, default recompute, swap, auto; one fresh engine each, weights dequantized once):
  wall time of ``generate`` (after a short warm-up), engine steps, ``scheduler.num_preemptions`` and every
  other integer/float/dict attribute of the scheduler whose name mentions preempt/swap (per-mode counters
  when the scheduler has them), plus the runner's own accounting: the sum of ``ModelRunnerOutput.swap_bytes``
  and ``swap_seconds`` over the run (wrapping ``runner.execute_model``), and the effective copy bandwidth.
* Correctness: the greedy token ids of every mode must be identical (asserted; exit status 1 otherwise),
  and each request must produce exactly its requested number of tokens. ``--reference`` adds a run with a
  pool large enough that nothing is preempted, and compares against it too.
* A mode that raises (e.g. swap before the scheduler supports it) is recorded with its error and skipped.
  A swap/auto run whose runner saw no swap bytes is flagged: the scheduler did not swap.
* 2 shared cores: ``--num-threads`` (1); each row records 1-minute load before/after and other processes'
  CPU share; the JSON holds ``uptime`` at start and end.

Usage::

    python benchmarks/preemption_modes.py                               # all modes, 1 thread
    python benchmarks/preemption_modes.py --modes recompute --num-prompts 8 --max-prompt 400
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402
from chunked_prefill_itl import share_weights, uptime  # noqa: E402


def make_workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    reqs = []
    for _ in range(args.num_prompts):
        length = rng.randint(args.min_prompt, args.max_prompt)
        prompt = [rng.randint(1000, 40000) for _ in range(length)]
        reqs.append((prompt, rng.randint(args.min_output, args.max_output)))
    return reqs


def scheduler_counters(scheduler: Any) -> dict[str, Any]:
    """Every numeric or dict attribute of the scheduler whose name mentions preempt or swap."""
    out: dict[str, Any] = {}
    for name, value in vars(scheduler).items():
        if ("preempt" in name or "swap" in name) and isinstance(value, int | float | dict):
            out[name] = dict(value) if isinstance(value, dict) else value
    return out


def run_mode(args: argparse.Namespace, mode: str, reqs: list[tuple[list[int], int]],
             num_blocks: int | None) -> tuple[dict[str, Any], list[list[int]]]:
    from kvserve import LLM, SamplingParams

    kw: dict[str, Any] = dict(model=args.model, dtype="float32", num_threads=args.num_threads, seed=args.seed,
                              max_model_len=args.max_prompt + args.max_output + 16, enable_prefix_caching=False,
                              skip_tokenizer_init=True, preemption_mode=mode, swap_space=args.swap_space)
    if num_blocks is not None:
        kw["num_gpu_blocks_override"] = num_blocks
    llm = LLM(**kw)
    engine = llm.engine
    rng = random.Random(4321)
    llm.generate([{"prompt_token_ids": [rng.randint(1000, 40000) for _ in range(32)]}],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runner = engine.runner
    acc = dict(swap_bytes=0, swap_seconds=0.0, steps=0)
    orig_execute = runner.execute_model

    def execute(so: Any) -> Any:
        out = orig_execute(so)
        acc["steps"] += 1
        acc["swap_bytes"] += out.swap_bytes
        acc["swap_seconds"] += out.swap_seconds
        return out

    runner.execute_model = execute  # instance attribute: sees every step of this run
    counters0 = scheduler_counters(engine.scheduler)
    pre0 = engine.num_preemptions
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    with common.Contention() as c:
        outs = llm.generate(prompts, params, use_tqdm=False)
    runner.execute_model = orig_execute
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    wrong = [i for i, ((_, o), t) in enumerate(zip(reqs, tokens, strict=True)) if len(t) != o]
    out_tokens = sum(o for _, o in reqs)
    res = dict(
        mode=mode, num_kv_blocks=engine.num_blocks, duration_s=round(c.wall_s, 2),
        output_tok_s=round(out_tokens / c.wall_s, 2), preemptions=engine.num_preemptions - pre0,
        scheduler_counters_before=counters0, scheduler_counters=scheduler_counters(engine.scheduler),
        runner_steps=acc["steps"], swap_bytes=acc["swap_bytes"], swap_seconds=round(acc["swap_seconds"], 4),
        swap_gb_s=round(acc["swap_bytes"] / acc["swap_seconds"] / 1e9, 2) if acc["swap_seconds"] else None,
        exact_token_counts=not wrong, wrong_token_counts=wrong[:10], contention=c.as_dict(),
    )
    if mode in ("swap", "auto") and acc["swap_bytes"] == 0:
        res["warning"] = "the runner copied no swap bytes: the scheduler did not swap in this run"
    del llm, engine, runner
    return res, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--min-prompt", type=int, default=300)
    ap.add_argument("--max-prompt", type=int, default=1000)
    ap.add_argument("--min-output", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--num-blocks", type=int, default=160, help="num_gpu_blocks_override (forces preemption)")
    ap.add_argument("--swap-space", type=float, default=1.0, help="GiB of host swap pool")
    ap.add_argument("--modes", default="recompute,swap,auto")
    ap.add_argument("--reference", action="store_true", help="also run unpreempted (large pool) and compare")
    ap.add_argument("--out", help="JSON path (default results/preemption_modes-<time>.json)")
    args = ap.parse_args()

    common.set_thread_env(args.num_threads)
    import torch

    torch.set_num_threads(args.num_threads)
    share_weights()
    reqs = make_workload(args)
    result: dict[str, Any] = dict(benchmark="preemption_modes", args=vars(args),
                                  env=common.environment(args.num_threads), prompt_tokens=sum(len(p) for p, _ in reqs),
                                  output_tokens=sum(o for _, o in reqs), uptime_start=uptime(), rows=[])
    print(f"uptime: {result['uptime_start']}\nworkload: {len(reqs)} requests, {result['prompt_tokens']} prompt "
          f"tokens, {result['output_tokens']} output tokens; {args.num_blocks} KV blocks", flush=True)
    runs: list[tuple[str, int | None]] = [(m, args.num_blocks) for m in args.modes.split(",") if m]
    if args.reference:
        runs.append(("recompute", None))  # default KV budget: no preemption
    tokens: dict[str, list[list[int]]] = {}
    for mode, blocks in runs:
        label = mode if blocks is not None else "reference (no preemption)"
        try:
            row, toks = run_mode(args, mode, reqs, blocks)
        except Exception as e:  # noqa: BLE001 - a mode the scheduler cannot do yet is reported, not fatal
            row, toks = dict(mode=mode, error=f"{type(e).__name__}: {e}"), None
            print(f"{label}: FAILED {row['error']}", flush=True)
        row["label"] = label
        result["rows"].append(row)
        if toks is not None:
            tokens[label] = toks
            print(f"{label}: {row['duration_s']} s, {row['preemptions']} preemptions, swap {row['swap_bytes']} B, "
                  f"counters {row['scheduler_counters']}" + (f"  WARNING: {row['warning']}" if "warning" in row
                                                              else ""), flush=True)
    labels = list(tokens)
    identical = all(tokens[x] == tokens[labels[0]] for x in labels[1:]) if labels else False
    mismatched = {x: [i for i, (a, b) in enumerate(zip(tokens[x], tokens[labels[0]], strict=True)) if a != b]
                  for x in labels[1:]}
    result["greedy_identical_across_modes"] = identical
    result["mismatched_requests_vs_first"] = {k: v for k, v in mismatched.items() if v}
    result["uptime_end"] = uptime()
    path = common.write_result("preemption_modes", result, args.out)
    rows = []
    for r in result["rows"]:
        if "error" in r:
            rows.append([r["label"], "error", "-", "-", "-", "-", "-", "-", "-"])
            continue
        c = r["contention"]
        rows.append([r["label"], r["duration_s"], r["output_tok_s"], r["preemptions"], r["swap_bytes"],
                     r["swap_gb_s"] or "-", r["exact_token_counts"],
                     f"{c['load_before'][0]} -> {c['load_after'][0]}", c["other_cpu_frac"]])
    print()
    print(common.table(rows, ["mode", "wall s", "out tok/s", "preempt", "swap bytes", "swap GB/s", "exact counts",
                              "load1", "other cpu"]))
    print(f"\ngreedy outputs identical across {labels}: {identical}"
          + ("" if identical else f" (mismatched requests: {result['mismatched_requests_vs_first']})"))
    print(f"uptime at end: {result['uptime_end']}\nwrote {path}")
    ok = identical and all(r.get("exact_token_counts", True) for r in result["rows"])
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
