#!/usr/bin/env python3
"""Steady-state decode step time of kvserve's engine against the memory roofline, and where the rest goes.

What is measured, and why
-------------------------
Decode is memory-bandwidth-bound (docs/cost-model.md): one step must read every weight once for the whole
batch plus every running request's KV cache, so ``t_step >= (W + sum_i K_i) / bandwidth``. This script puts
kvserve's measured step next to that bound, at several batch sizes, in one run on one machine state:

* **bandwidth**, measured in this run with the same thread count: best of several passes of a large (default
  512 MiB, far beyond any cache) float32 tensor ``sum`` (read bandwidth: bytes read / s; the roofline uses
  this, since decode reads weights and KV) and ``copy_`` (read + write: 2 x bytes / s, reported only);
* **W** = bytes of the parameters, each counted once: the tied embedding / LM head is one tensor, read whole
  by the LM-head matmul (the embedding lookup reads only B rows); an untied embedding table counts only the
  B rows a step looks up;
* **K** = per step, sum over requests of (tokens attended = num_computed_tokens + 1) x kv_bytes_per_token
  (2 x layers x kv_heads x head_dim x dtype bytes), averaged over the timed steps;
* **roofline step** = (W + K) / read bandwidth; **% of roofline** = roofline step / measured step x 100
  (100 % = running at the memory bound). Also shown, because fp32 on 1-2 cores becomes compute-bound at
  modest batch: the compute bound 2 x (linear weights) x B FLOPs (+ attention) / measured GEMM peak (best of
  a 1024^3 float32/bfloat16 matmul), and the % against the larger of the two bounds;
* **measured step**: B requests of 32 (``--prompt-len``) random prompt ids (fixed seed) with enough
  max_tokens are added to an ``LLMEngine``; steps run until every request is decoding (no prefill left),
  a few more warm up, then ``--steps`` calls of ``engine.step()`` are timed one by one (median reported).
  A first pass runs with no instrumentation; a second pass of the same length runs with timers patched
  into instance methods, so the two step times show the instrumentation's own cost;
* **outside the forward**: ``engine.runner.model.forward`` is monkeypatched on the instance to accumulate
  its wall time; (step - forward) / step is the share of each step spent outside the model's forward
  (scheduler, input preparation, LM head, sampler, bookkeeping, detokenizer). It is broken down with
  ``time.perf_counter`` around: ``scheduler.schedule``, input preparation (``runner._prepare`` or the
  module function ``prepare_inputs``, whichever the version has: numpy inputs + attention metadata),
  ``model.compute_logits`` (the LM head matmul: model compute, reported apart from overhead),
  ``SamplingMetadata.build``, ``runner.sampler``, the rest of ``runner.execute_model`` (logits index,
  ``.tolist()``), ``scheduler.update_from_output``, ``engine._apply_update`` (detokenizer, stop strings),
  ``engine._make_output`` (RequestOutput objects) and the remainder of ``engine.step``. Inside the
  forward, the attention call (``paged_attention``, which may run a native ctypes kernel that
  torch.profiler cannot see) and the KV write (``write_kv``) are timed too; the rest is linears, norms,
  rotary and residuals.
* ``--profile N`` additionally runs N steps under ``torch.profiler`` and prints the top ops by self CPU time
  (which ops inside the forward take the time).

The 2 cores are shared and noisy; every result records threads, load averages and other processes' CPU
(``other_cpu_frac`` > ~0.05 = contaminated). Default 1 thread (2 threads can be 10-20x slower when another
process is busy).

Usage::

    python benchmarks/decode_roofline.py                              # batch 1 and 32, 20 steps, 1 thread
    python benchmarks/decode_roofline.py --batch-sizes 1,8,32 --steps 5 --num-threads 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402

PROMPT_LEN = 32
WARMUP_DECODE_STEPS = 3


# ---- machine ---------------------------------------------------------------------------------------
def measure_gemm_peak(dtype_name: str, repeats: int = 3, n: int = 1024) -> float:
    """GFLOP/s of an n^3 matmul in ``dtype_name``, best of ``repeats``."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return round(2 * n ** 3 / best / 1e9, 1)


# ---- model bytes and flops ------------------------------------------------------------------------
def weight_bytes(model: Any, batch: int) -> tuple[int, int]:
    """(bytes a decode step of ``batch`` reads from parameters, linear-weight elements incl. the LM head)."""
    import torch

    emb = model.embed_tokens.weight
    head = model.lm_head.weight
    tied = emb.data_ptr() == head.data_ptr()
    total = 0
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if p is emb and not tied:
            total += batch * emb.shape[1] * emb.element_size()  # an untied lookup reads only B rows
        else:
            total += p.numel() * p.element_size()
    linear_elems = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return total, linear_elems


# ---- timers -----------------------------------------------------------------------------------------
class Timers:
    """Accumulating wall-clock timers installed by monkeypatching instance methods."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def wrap(self, obj: Any, attr: str, key: str) -> bool:
        if not hasattr(obj, attr):
            return False
        had_instance_attr = attr in getattr(obj, "__dict__", {})
        orig = getattr(obj, attr)
        total, calls = self.total, self.calls

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                total[key] += time.perf_counter() - t
                calls[key] += 1

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, orig, had_instance_attr))
        return True

    def restore(self) -> None:
        for obj, attr, orig, had in reversed(self._undo):
            if had:
                setattr(obj, attr, orig)
            else:
                delattr(obj, attr)
        self._undo.clear()

    def reset(self) -> None:
        self.total.clear()
        self.calls.clear()


def install_timers(engine: Any, timers: Timers) -> list[str]:
    """Patch the engine's components; returns the names of what could not be patched."""
    import kvserve.worker.model_runner as mr

    runner, sched = engine.runner, engine.scheduler
    missing = []
    targets = [
        (engine, "step", "step"),
        (sched, "schedule", "schedule"),
        (runner, "execute_model", "execute_model"),
        (runner, "_prepare", "prepare_inputs"),
        (runner.model, "forward", "forward"),
        (runner.model, "compute_logits", "lm_head"),
        (runner, "sampler", "sampler"),
        (sched, "update_from_output", "update_from_output"),
        (engine, "_apply_update", "detokenize"),
        (engine, "_make_output", "make_output"),
    ]
    for obj, attr, key in targets:
        if not timers.wrap(obj, attr, key):
            missing.append(key)
    # Input preparation moved between versions: a runner method ``_prepare`` or a module function
    # ``prepare_inputs`` that model_runner imports (patched in model_runner's namespace, where it is looked up).
    if "prepare_inputs" in missing and timers.wrap(mr, "prepare_inputs", "prepare_inputs"):
        missing.remove("prepare_inputs")
    # optional helpers of execute_model, timed when present (else they fall into execute_model_other)
    timers.wrap(mr, "_mask_stop_tokens_before_min_tokens", "min_tokens_mask")
    # inside the forward: attention (a native ctypes kernel may be invisible to torch.profiler) and the KV
    # write, patched in the model module's namespace where the layers look them up
    model_mod = sys.modules.get(type(runner.model).__module__)
    if model_mod is not None:
        timers.wrap(model_mod, "paged_attention", "fwd_attention")
        timers.wrap(model_mod, "write_kv", "fwd_write_kv")
    # SamplingMetadata.build is a classmethod called through the class: patch the class attribute.
    sm = getattr(mr, "SamplingMetadata", None)
    if sm is not None and hasattr(sm, "build"):
        orig_build = sm.__dict__["build"]
        total, calls = timers.total, timers.calls

        def build(cls: Any, *a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig_build.__func__(cls, *a, **kw)
            finally:
                total["sampling_metadata"] += time.perf_counter() - t
                calls["sampling_metadata"] += 1

        sm.build = classmethod(build)
        timers._undo.append((sm, "build", orig_build, True))
    else:
        missing.append("sampling_metadata")
    return missing


# ---- one batch size ---------------------------------------------------------------------------------
def run_batch(engine: Any, batch: int, args: argparse.Namespace, bw: dict[str, float], peak_gflops: float,
              rng: random.Random) -> dict[str, Any]:
    import torch

    from kvserve import SamplingParams

    sched = engine.scheduler
    # Requests admitted first decode while later ones still prefill (chunked prefill under the token budget),
    # so leave room for one token per prefill step on top of the warm-up, timed and profiled steps.
    prefill_steps = -(-batch * args.prompt_len // engine.config.max_num_batched_tokens)
    max_tokens = WARMUP_DECODE_STEPS + 2 * args.steps + args.profile + prefill_steps + 16
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(None, [rng.randint(1000, 40000) for _ in range(args.prompt_len)], params)
           for _ in range(batch)]
    reqs = [sched.requests[i] for i in ids]

    def all_decoding() -> bool:
        return (not sched.waiting and len(sched.running) == batch
                and all(r.num_tokens - r.num_computed_tokens == 1 for r in reqs))

    guard = 0
    while not all_decoding():
        engine.step()
        guard += 1
        if guard > 1000:
            raise RuntimeError("requests never reached steady decode")
    for _ in range(WARMUP_DECODE_STEPS):
        engine.step()

    dtype_bytes = engine.dtype.itemsize if hasattr(engine.dtype, "itemsize") else torch.empty(
        (), dtype=engine.dtype).element_size()
    kv_per_token = engine.arch.kv_bytes_per_token(dtype_bytes)

    def timed_pass() -> tuple[list[float], list[int]]:
        times, kv = [], []
        for _ in range(args.steps):
            before = [r.num_computed_tokens for r in reqs]
            kv.append(sum(c + 1 for c in before) * kv_per_token)
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
            bad = [(r.request_id, r.status.name, c, r.num_computed_tokens, getattr(r, "error", None))
                   for r, c in zip(reqs, before, strict=True) if r.num_computed_tokens != c + 1]
            if bad:
                raise RuntimeError(f"a timed step was not a pure decode step of the whole batch: {len(bad)} "
                                   f"requests did not advance by one token, e.g. {bad[:3]}; "
                                   f"preemptions so far {engine.num_preemptions}")
        return times, kv

    with common.Contention() as c_clean:
        clean_times, kv_clean = timed_pass()

    timers = Timers()
    missing = install_timers(engine, timers)
    try:
        with common.Contention() as c_inst:
            inst_times, kv_inst = timed_pass()
    finally:
        timers.restore()

    profile_rows: list[dict[str, Any]] = []
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile):
                engine.step()
        for e in sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]:
            profile_rows.append(dict(op=e.key, calls=e.count // args.profile,
                                     self_ms_per_step=round(e.self_cpu_time_total / 1000 / args.profile, 3)))
    engine.abort_request(ids)

    w_bytes, linear_elems = weight_bytes(engine.runner.model, batch)
    kv_bytes = statistics.mean(kv_clean)
    mem_roof = (w_bytes + kv_bytes) / (bw["read_gbs"] * 1e9)
    arch = engine.arch
    avg_ctx = kv_bytes / kv_per_token / batch
    flops = 2 * linear_elems * batch + 4 * batch * avg_ctx * arch.num_attention_heads * arch.head_dim \
        * arch.num_hidden_layers
    compute_roof = flops / (peak_gflops * 1e9)
    step = statistics.median(clean_times)
    inst_step = statistics.median(inst_times)

    n = args.steps
    per_step = {k: v / n * 1000 for k, v in timers.total.items()}  # ms per step
    step_ms = timers.total["step"] / n * 1000
    fwd_ms = per_step.get("forward", 0.0)
    exec_inner = sum(per_step.get(k, 0.0) for k in ("prepare_inputs", "forward", "lm_head", "min_tokens_mask",
                                                    "sampling_metadata", "sampler"))
    breakdown = {
        "schedule": per_step.get("schedule", 0.0),
        "prepare_inputs": per_step.get("prepare_inputs", 0.0),
        "forward": fwd_ms,
        "lm_head": per_step.get("lm_head", 0.0),
        "min_tokens_mask": per_step.get("min_tokens_mask", 0.0),
        "sampling_metadata": per_step.get("sampling_metadata", 0.0),
        "sampler": per_step.get("sampler", 0.0),
        "execute_model_other": per_step.get("execute_model", 0.0) - exec_inner,
        "update_from_output": per_step.get("update_from_output", 0.0),
        "detokenize": per_step.get("detokenize", 0.0),
        "make_output": per_step.get("make_output", 0.0),
    }
    breakdown["engine_other"] = step_ms - sum(v for k, v in breakdown.items())
    # parts of the forward (not added to the sum above)
    inside_forward = {k: per_step[k] for k in ("fwd_attention", "fwd_write_kv") if k in per_step}
    if inside_forward:
        inside_forward["fwd_linears_norms_rest"] = fwd_ms - sum(inside_forward.values())
    return dict(
        batch=batch, steps=n, avg_context_tokens=round(avg_ctx, 1),
        weight_bytes=w_bytes, kv_bytes_per_token=kv_per_token, kv_bytes_per_step=round(kv_bytes),
        bytes_per_step=round(w_bytes + kv_bytes),
        memory_roofline_ms=round(mem_roof * 1000, 3), flops_per_step=round(flops),
        compute_bound_ms=round(compute_roof * 1000, 3),
        measured_step_ms=dict(median=round(step * 1000, 3), min=round(min(clean_times) * 1000, 3),
                              mean=round(statistics.mean(clean_times) * 1000, 3),
                              all=[round(t * 1000, 2) for t in clean_times]),
        instrumented_step_ms=dict(median=round(inst_step * 1000, 3), min=round(min(inst_times) * 1000, 3),
                                  mean=round(statistics.mean(inst_times) * 1000, 3)),
        tok_s=round(batch / step, 2), roofline_tok_s=round(batch / mem_roof, 2),
        pct_of_memory_roofline=round(100 * mem_roof / step, 1),
        measured_over_roofline=round(step / mem_roof, 2),
        pct_of_max_bound=round(100 * max(mem_roof, compute_roof) / step, 1),
        outside_forward_frac=round((step_ms - fwd_ms) / step_ms, 4) if step_ms else None,
        outside_forward_and_lm_head_frac=round((step_ms - fwd_ms - breakdown["lm_head"]) / step_ms, 4)
        if step_ms else None,
        breakdown_ms_per_step={k: round(v, 3) for k, v in breakdown.items()},
        breakdown_step_ms=round(step_ms, 3), inside_forward_ms_per_step={k: round(v, 3) for k, v in
                                                                         inside_forward.items()},
        not_instrumented=missing,
        profile_top_ops=profile_rows,
        contention=dict(clean=c_clean.as_dict(), instrumented=c_inst.as_dict()),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8", "fp8"],
                    help="as the engine's flag (auto: the model dtype)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per pass (two passes per batch size)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN,
                    help="random prompt ids per request (longer prompts: more KV read per step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bw-mib", type=int, default=512, help="size of the bandwidth probe tensor")
    ap.add_argument("--bw-repeats", type=int, default=7)
    ap.add_argument("--profile", type=int, default=0, help="also run N steps under torch.profiler")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="engine without tokenizer/detokenizer")
    ap.add_argument("--out", help="JSON path (default results/decode_roofline-<time>.json)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",") if b.strip()]

    common.set_thread_env(args.num_threads)
    import torch

    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    from kvserve import EngineConfig, LLMEngine

    env = common.environment(args.num_threads)
    with common.Contention() as c_bw:
        bw = common.measure_read_bandwidth(args.bw_mib, args.bw_repeats)
    print(f"bandwidth ({args.num_threads} thread(s)): read {bw['read_gbs']} GB/s, copy {bw['copy_gbs']} GB/s; "
          f"load {c_bw.load_before[0]} -> {c_bw.load_after[0]}", flush=True)

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.num_threads, seed=args.seed,
                                    max_num_seqs=max(max(batches), 1), skip_tokenizer_init=args.skip_tokenizer_init,
                                    kv_cache_dtype=args.kv_cache_dtype))
    dtype_name = str(engine.dtype).replace("torch.", "")
    peak = measure_gemm_peak(dtype_name if dtype_name in ("float32", "bfloat16") else "float32")
    print(f"GEMM peak ({dtype_name}, 1024^3): {peak} GFLOP/s", flush=True)

    rows_out = []
    for b in batches:
        r = run_batch(engine, b, args, bw, peak, rng)
        rows_out.append(r)
        print(f"batch {b}: step {r['measured_step_ms']['median']} ms (roofline {r['memory_roofline_ms']} ms, "
              f"{r['pct_of_memory_roofline']} %); outside forward {100 * (r['outside_forward_frac'] or 0):.1f} %",
              flush=True)

    result = dict(benchmark="decode_roofline", model=args.model, dtype=dtype_name,
                  kv_cache_dtype=str(engine.kv_dtype).replace("torch.", ""), num_threads=args.num_threads,
                  prompt_len=args.prompt_len, args=vars(args), env=env, bandwidth=bw,
                  bandwidth_contention=c_bw.as_dict(),
                  gemm_peak_gflops=peak, engine_config=engine.config.to_dict(), results=rows_out,
                  loadavg_at_end=[round(x, 2) for x in os.getloadavg()])
    path = common.write_result("decode_roofline", result, args.out)

    print()
    print(common.table(
        [[r["batch"], round(r["weight_bytes"] / 1e6, 1), round(r["kv_bytes_per_step"] / 1e6, 2),
          r["memory_roofline_ms"], r["compute_bound_ms"], r["measured_step_ms"]["median"],
          r["instrumented_step_ms"]["median"], r["tok_s"], r["roofline_tok_s"], r["pct_of_memory_roofline"],
          r["pct_of_max_bound"], f"{100 * (r['outside_forward_frac'] or 0):.1f}",
          f"{r['contention']['clean']['load_before'][0]} -> {r['contention']['instrumented']['load_after'][0]}",
          r["contention"]["clean"]["other_cpu_frac"]] for r in rows_out],
        ["batch", "W MB", "KV MB", "roof ms", "compute ms", "step ms", "instr ms", "tok/s", "roof tok/s",
         "% roof", "% max(bound)", "% outside fwd", "load1", "other cpu"]))
    keys = list(rows_out[0]["breakdown_ms_per_step"]) if rows_out else []
    print("\nper-step breakdown (ms, instrumented pass):")
    print(common.table([[k] + [f"{r['breakdown_ms_per_step'][k]:.3f} "
                               f"({100 * r['breakdown_ms_per_step'][k] / r['breakdown_step_ms']:.1f}%)"
                               for r in rows_out] for k in keys] + [["step"] + [r["breakdown_step_ms"]
                                                                         for r in rows_out]],
                       ["part"] + [f"batch {r['batch']}" for r in rows_out]))
    fkeys = list(rows_out[0]["inside_forward_ms_per_step"]) if rows_out else []
    if fkeys:
        print("\ninside the forward (ms per step, part of 'forward' above):")
        print(common.table([[k] + [f"{r['inside_forward_ms_per_step'].get(k, 0.0):.3f}" for r in rows_out]
                            for k in fkeys], ["part"] + [f"batch {r['batch']}" for r in rows_out]))
    for r in rows_out:
        if r["profile_top_ops"]:
            print(f"\ntorch.profiler, batch {r['batch']}: top ops by self CPU (ms/step)")
            print(common.table([[p["op"], p["calls"], p["self_ms_per_step"]] for p in r["profile_top_ops"]],
                               ["op", "calls/step", "self ms/step"]))
        if r["not_instrumented"]:
            print(f"batch {r['batch']}: could not instrument {r['not_instrumented']}")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
