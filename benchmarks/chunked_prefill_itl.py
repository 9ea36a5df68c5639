#!/usr/bin/env python3
"""Inter-token latency of decoding streams while long prompts arrive: chunked prefill on (several budgets) vs off.

What is measured, and why
-------------------------
A long prompt prefilled whole stalls every running decode for the length of that prefill: that is how
ITL p99 is destroyed. Chunked prefill caps the tokens of one step (``max_num_batched_tokens``), decodes
first, so each decode waits for at most one budget's worth of prefill per token.

* Workload (fixed seed): ``--num-streams`` (16) requests with short random prompts (``--stream-prompt-len``
  token ids, ~U[1000, 40000]), greedy, ``ignore_eos``, ``max_tokens`` large enough never to finish inside the
  window. The engine is stepped (``LLMEngine.add_request`` / ``step()``, driven directly, no threads) until
  every stream has its first token, then ``--warm-steps`` more steps (their gaps are the undisturbed
  **baseline**). Then ``--num-long`` (2) prompts of ``--long-prompt-len`` (2,000) random ids are added at
  once (time ``t_arrival``).
* Every new token of every request is stamped with ``time.perf_counter()`` right after the ``step()`` that
  produced it. **Window**: from ``t_arrival`` until the end of the ``--after-steps``-th (8) step after the step
  in which the last long prompt got its first token. **ITL** = every gap between consecutive tokens of the
  decoding streams whose later token falls inside the window (so the first gap spans the arrival);
  reported as p50 / p99 / max over all streams together. **TTFT** of a long prompt = its first token's
  stamp - its ``add_request`` time. ``p99/p50`` is the issue's target (<= 3 with chunking); ``p99/base``
  divides by the baseline p50 (what a stream sees without long prompts), the stricter view.
* Configurations (one fresh engine each, weights dequantized once and shared): chunking off
  (``enable_chunked_prefill=False``, ``max_num_batched_tokens = max_model_len``), and chunking on with budgets
  ``--budgets`` (default 64, 128, 256, 512, 1024), plus ``--partial`` variants
  ``budget:max_num_partial_prefills:long_prefill_token_threshold`` (default ``512:2:256``: both long prompts
  mid-prefill at once, each at most 256 tokens per step). Prefix caching is off (random prompts never hit;
  it keeps the comparison to scheduling), no tokenizer (token-id prompts), float32, ``--num-threads`` (1).
* Each engine is warmed up (a short prefill + decodes) before the measured run. The 2 cores are shared:
  every row records the 1-minute load before/after and other processes' CPU share (``other_cpu_frac`` >
  ~0.05 = contaminated), and the JSON holds ``uptime`` at start and end.

Usage::

    python benchmarks/chunked_prefill_itl.py                          # everything, 1 thread
    python benchmarks/chunked_prefill_itl.py --budgets 256 --no-off --partial ''   # one quick row
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return f"loadavg {os.getloadavg()}"


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def share_weights() -> None:
    """Dequantize the model once for all engines of this process (as tests/conftest.py does)."""
    import kvserve.engine.llm_engine as llm_engine_module

    llm_engine_module.load_weights = functools.lru_cache(maxsize=1)(llm_engine_module.load_weights)


def make_engine(args: argparse.Namespace, **overrides: Any) -> Any:
    from kvserve.config import EngineConfig
    from kvserve.engine.llm_engine import LLMEngine

    kw: dict[str, Any] = dict(model=args.model, dtype="float32", num_threads=args.num_threads, seed=args.seed,
                              max_model_len=args.max_model_len, max_num_seqs=args.num_streams + args.num_long + 2,
                              enable_prefix_caching=False, skip_tokenizer_init=True, kv_cache_memory=1.0)
    kw.update(overrides)
    return LLMEngine(EngineConfig(**kw))


def warm_up(engine: Any, rng: random.Random) -> None:
    from kvserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"warm{i}", [rng.randint(1000, 40000) for _ in range(200)], sp)
    while engine.has_unfinished_requests():
        engine.step()


def run_config(args: argparse.Namespace, label: str, **overrides: Any) -> dict[str, Any]:
    from kvserve import SamplingParams

    engine = make_engine(args, **overrides)
    warm_up(engine, random.Random(999))
    rng = random.Random(args.seed)
    streams = [f"s{i}" for i in range(args.num_streams)]
    longs = [f"long{i}" for i in range(args.num_long)]
    stream_sp = SamplingParams(temperature=0, max_tokens=args.max_model_len - args.stream_prompt_len - 1,
                               ignore_eos=True)
    long_sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    stamps: dict[str, list[float]] = {r: [] for r in streams + longs}
    added: dict[str, float] = {}

    def step() -> None:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            ts = stamps.get(o.request_id)
            if ts is not None:
                ts.extend([now] * (len(o.outputs[0].token_ids) - len(ts)))

    with common.Contention() as c:
        for r in streams:
            engine.add_request(r, [rng.randint(1000, 40000) for _ in range(args.stream_prompt_len)], stream_sp)
        while any(not stamps[r] for r in streams):
            step()
        for _ in range(args.warm_steps):
            step()
        t_arrival = time.perf_counter()
        for r in longs:
            added[r] = time.perf_counter()
            engine.add_request(r, [rng.randint(1000, 40000) for _ in range(args.long_prompt_len)], long_sp)
        steps_in_window = 0
        while any(not stamps[r] for r in longs):
            step()
            steps_in_window += 1
        for _ in range(args.after_steps):
            step()
            steps_in_window += 1
        t_end = time.perf_counter()
        engine.abort_request(streams + longs)
    base, window = [], []
    for r in streams:
        ts = stamps[r]
        for a, b in zip(ts, ts[1:], strict=False):
            if a == b:
                continue  # several tokens from one step cannot happen without spec decode; be safe
            (window if t_arrival < b <= t_end else base if b <= t_arrival else []).append(b - a)
    ttft = [stamps[r][0] - added[r] for r in longs]
    p50, p99 = percentile(window, 50), percentile(window, 99)
    base_p50 = percentile(base, 50)
    return dict(
        label=label, overrides=overrides, num_window_gaps=len(window), steps_in_window=steps_in_window,
        itl_p50_ms=round(p50 * 1e3, 1), itl_p99_ms=round(p99 * 1e3, 1), itl_max_ms=round(max(window) * 1e3, 1),
        p99_over_p50=round(p99 / p50, 2), baseline_itl_p50_ms=round(base_p50 * 1e3, 1),
        p99_over_baseline_p50=round(p99 / base_p50, 2), ttft_long_s=[round(t, 2) for t in ttft],
        window_s=round(t_end - t_arrival, 2), preemptions=engine.num_preemptions, contention=c.as_dict(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-streams", type=int, default=16)
    ap.add_argument("--stream-prompt-len", type=int, default=32)
    ap.add_argument("--num-long", type=int, default=2)
    ap.add_argument("--long-prompt-len", type=int, default=2000)
    ap.add_argument("--max-model-len", type=int, default=2560)
    ap.add_argument("--warm-steps", type=int, default=8, help="steps after all streams decode, before arrival")
    ap.add_argument("--after-steps", type=int, default=8, help="steps after the last long prompt's first token")
    ap.add_argument("--budgets", default="64,128,256,512,1024", help="comma-separated chunked budgets")
    ap.add_argument("--no-off", action="store_true", help="skip the chunking-off row")
    ap.add_argument("--partial", default="512:2:256",
                    help="comma-separated budget:max_num_partial_prefills:long_prefill_token_threshold variants")
    ap.add_argument("--out", help="JSON path (default results/chunked_prefill_itl-<time>.json)")
    args = ap.parse_args()

    common.set_thread_env(args.num_threads)
    import torch

    torch.set_num_threads(args.num_threads)
    share_weights()
    result: dict[str, Any] = dict(benchmark="chunked_prefill_itl", args=vars(args),
                                  env=common.environment(args.num_threads), uptime_start=uptime(), rows=[])
    print(f"uptime: {result['uptime_start']}", flush=True)
    configs: list[tuple[str, dict[str, Any]]] = []
    if not args.no_off:
        configs.append(("off", dict(enable_chunked_prefill=False, max_num_batched_tokens=args.max_model_len)))
    for b in (int(x) for x in args.budgets.split(",") if x):
        configs.append((f"chunked {b}", dict(max_num_batched_tokens=b)))
    for spec in (x for x in args.partial.split(",") if x):
        b, p, t = (int(v) for v in spec.split(":"))
        configs.append((f"chunked {b} partial {p} thr {t}", dict(
            max_num_batched_tokens=b, max_num_partial_prefills=p, long_prefill_token_threshold=t)))
    for label, overrides in configs:
        row = run_config(args, label, **overrides)
        result["rows"].append(row)
        print(f"{label}: p50 {row['itl_p50_ms']} ms, p99 {row['itl_p99_ms']} ms, max {row['itl_max_ms']} ms, "
              f"TTFT {row['ttft_long_s']} s, load {row['contention']['load_before'][0]}"
              f"->{row['contention']['load_after'][0]}", flush=True)
    result["uptime_end"] = uptime()
    path = common.write_result("chunked_prefill_itl", result, args.out)
    rows = [[r["label"], r["itl_p50_ms"], r["itl_p99_ms"], r["itl_max_ms"], r["p99_over_p50"],
             r["baseline_itl_p50_ms"], r["p99_over_baseline_p50"], " / ".join(str(t) for t in r["ttft_long_s"]),
             r["steps_in_window"], f"{r['contention']['load_before'][0]} -> {r['contention']['load_after'][0]}",
             r["contention"]["other_cpu_frac"]] for r in result["rows"]]
    print()
    print(common.table(rows, ["config", "ITL p50 ms", "p99 ms", "max ms", "p99/p50", "base p50 ms", "p99/base",
                              "TTFT long s", "steps", "load1", "other cpu"]))
    print(f"\nuptime at end: {result['uptime_end']}\nwrote {path}")


if __name__ == "__main__":
    main()
