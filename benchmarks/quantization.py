#!/usr/bin/env python3
"""int8 weights (``--quantization int8``) against the model dtype's weights: batch-1 decode and decode steps.

What is measured, offline through ``LLMEngine`` (no server), for each model and each weight mode (the model
dtype, ``--dtype auto`` by default: bfloat16 on AVX512-BF16 CPUs; and ``int8``):

* **batch-1 decode tok/s**: one request of ``--prompt-len`` seeded random ids, ``--decode-tokens`` greedy tokens
  (ignore_eos); the steps after its first token are timed: tok/s = (tokens - 1) / their wall time. Repeated
  ``--rounds`` times, the two modes interleaved round by round (the shared host drifts), median reported;
* **decode step time at batch B** (``--batch-sizes``, default 1, 8, 16): B such requests, stepped until all are
  decoding, then ``--steps`` pure decode steps timed one by one (median, ms);
* **weight bytes read per decode step**: every parameter and buffer once, except the rows of an untied
  embedding table not looked up (the int8 codes count 1 byte plus 8 bytes of scale and row sum per row).

Every phase records its ``other_cpu_frac`` (CPU used by other processes / (wall x CPUs); above ~0.05 the number
is contaminated) and the JSON records lscpu's model and flags. Usage::

    .venv/bin/python benchmarks/quantization.py                          # SmolLM2, 2 threads
    .venv/bin/python benchmarks/quantization.py --models smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402

MODES = ("float", "int8")


def weight_bytes_per_step(model: Any, batch: int) -> int:
    """Bytes of parameters and buffers a decode step of ``batch`` reads (see the module doc)."""
    emb = model.embed_tokens.weight
    tied = getattr(model.lm_head, "weight", None) is emb
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rotary."):
            continue  # position tables: B rows read
        if t is emb and not tied:
            total += batch * emb.shape[1] * emb.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1000, 40000) for _ in range(n)]


def batch1_decode(engine: Any, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    rid = engine.add_request(None, _prompt(rng, args.prompt_len), params)
    req = engine.scheduler.requests[rid]
    while not req.output_token_ids:
        engine.step()
    with common.Contention() as c:
        t0 = time.perf_counter()
        n0 = len(req.output_token_ids)
        while not req.is_finished:
            engine.step()
        wall = time.perf_counter() - t0
    tokens = len(req.output_token_ids) - n0
    return dict(tok_s=round(tokens / wall, 2), tokens=tokens, wall_s=round(wall, 3), contention=c.as_dict())


def decode_steps(engine: Any, batch: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from kvserve import SamplingParams

    sched = engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
    ids = [engine.add_request(None, _prompt(rng, args.prompt_len), params) for _ in range(batch)]
    reqs = [sched.requests[i] for i in ids]
    while not (len(sched.running) == batch and all(r.num_tokens - r.num_computed_tokens == 1 for r in reqs)):
        engine.step()
    engine.step()  # warm-up
    times = []
    with common.Contention() as c:
        for _ in range(args.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
    engine.abort_request(ids)
    return dict(batch=batch, step_ms=round(1000 * statistics.median(times), 3),
                min_ms=round(1000 * min(times), 3), contention=c.as_dict())


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import EngineConfig, LLMEngine

    engines = {}
    for mode in MODES:
        cfg = EngineConfig(model=name, dtype=args.dtype, num_threads=args.num_threads, seed=0,
                           quantization="int8" if mode == "int8" else None, kv_cache_memory=args.kv_cache_memory,
                           max_num_seqs=max(args.batch_sizes), skip_tokenizer_init=True)
        t0 = time.perf_counter()
        engines[mode] = LLMEngine(cfg)
        print(f"{name} {mode}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(args.rounds + 1):  # round 0 warms up (kernel build, page faults)
        for mode in MODES:
            res = batch1_decode(engines[mode], args, rng)
            if r:
                rounds[mode].append(res)
    steps = {m: [decode_steps(engines[m], b, args, rng) for b in args.batch_sizes] for m in MODES}
    out: dict[str, Any] = dict(model=name, dtype=str(engines["float"].dtype).removeprefix("torch."), modes={})
    for mode in MODES:
        model = engines[mode].runner.model
        out["modes"][mode] = dict(
            batch1_tok_s=statistics.median(x["tok_s"] for x in rounds[mode]), batch1_rounds=rounds[mode],
            decode_steps=steps[mode], weight_bytes_b1=weight_bytes_per_step(model, 1),
            max_other_cpu_frac=max(x["contention"]["other_cpu_frac"] for x in rounds[mode] + steps[mode]))
    f, q = out["modes"]["float"], out["modes"]["int8"]
    out["int8_speedup_batch1"] = round(q["batch1_tok_s"] / f["batch1_tok_s"], 3)
    del engines
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct", help="comma-separated catalog names")
    ap.add_argument("--dtype", default="auto", help="the float mode's dtype (int8 keeps it for activations)")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 16])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-cache-memory", type=float, default=0.5)
    ap.add_argument("--out", help="JSON path (default results/quantization-<time>.json)")
    args = ap.parse_args()
    common.set_thread_env(args.num_threads)
    import torch

    torch.set_num_threads(args.num_threads)
    results = [run_model(m, args) for m in args.models.split(",") if m]
    path = common.write_result("quantization", dict(benchmark="quantization", args=vars(args),
                                                    env=common.environment(args.num_threads),
                                                    machine=common.machine_info(), results=results), args.out)
    rows = []
    for r in results:
        for mode in MODES:
            m = r["modes"][mode]
            label = r["dtype"] if mode == "float" else f"int8 ({r['dtype']} activations)"
            rows.append([r["model"], label, round(m["weight_bytes_b1"] / 1e6, 1), m["batch1_tok_s"],
                         *[s["step_ms"] for s in m["decode_steps"]], m["max_other_cpu_frac"]])
    print()
    print(common.table(rows, ["model", "weights", "MB/step", "b1 tok/s",
                              *[f"step ms b{b}" for b in args.batch_sizes], "other cpu"]))
    for r in results:
        print(f"{r['model']}: int8 / {r['dtype']} batch-1 decode = {r['int8_speedup_batch1']}x")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
