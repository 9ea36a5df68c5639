#!/usr/bin/env python3
"""Weight quantization against the model dtype's weights: batch-1 decode, decode steps, prefill; and llama.cpp.

What is measured, offline through ``LLMEngine`` (no server), for each model and each weight mode (``--modes``):
``float`` (the model dtype, ``--dtype auto`` by default: bfloat16 on AVX512-BF16 CPUs; a GGUF file dequantized at
load, as kvserve serves it without ``--quantization``), ``int8`` (``--quantization int8``) and ``gguf``
(``--quantization gguf``: the GGUF file's blocks as they are; GGUF models only):

* **batch-1 decode tok/s**: one request of ``--prompt-len`` seeded random ids, ``--decode-tokens`` greedy tokens
  (ignore_eos); the steps after its first token are timed: tok/s = (tokens - 1) / their wall time;
* **prefill tok/s**: one request of ``--prefill-len`` random ids (one step at the default 512-token budget), the
  steps up to its first token timed;
* both repeated ``--rounds`` times, the modes interleaved round by round (the shared host drifts), medians reported;
* **decode step time at batch B** (``--batch-sizes``, default 1 and 16): B such requests, stepped until all are
  decoding, then ``--steps`` pure decode steps timed one by one (median, ms);
* **weight bytes read per decode step**: every parameter and buffer once, except the rows of an untied embedding
  table not looked up;
* with ``--peers WORK`` (``WORK/bin/llama-server``, from ../shared/bench/setup_peers.sh): llama.cpp's
  ``llama-server`` on **the same GGUF file**, batch-1 decode of the same prompts and lengths, in the same rounds
  (its own ``predicted_per_second``; benchmarks/_llama_peer.py), SIGSTOPped while kvserve runs.

Every phase records its ``other_cpu_frac`` (CPU used by other processes / (wall x CPUs), llama-server's own CPU
excluded from its phase; above ~0.05 the number is contaminated) and the JSON records lscpu's model and flags.
Usage::

    .venv/bin/python benchmarks/quantization.py                          # SmolLM2, 2 threads, float/int8/gguf
    .venv/bin/python benchmarks/quantization.py --models smollm2-135m-instruct,qwen2.5-coder-1.5b-instruct \\
        --peers WORK
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402

MODES = ("float", "int8", "gguf")


def weight_bytes_per_step(model: Any, batch: int) -> int:
    """Bytes of parameters and buffers a decode step of ``batch`` reads (see the module doc)."""
    emb = model.embed_tokens
    table = emb.weight if hasattr(emb, "weight") else emb.packed
    head = getattr(model.lm_head, "weight", None)
    if head is None:
        head = getattr(model.lm_head, "packed", None)
    tied = head is not None and head.data_ptr() == table.data_ptr()
    total = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("rotary."):
            continue  # position tables: B rows read
        if t is table and not tied:
            total += batch * (t.numel() * t.element_size()) // model.config.vocab_size
        else:
            total += t.numel() * t.element_size()
    return total


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(1000, 30000) for _ in range(n)]


def batch1_decode(engine: Any, prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    rid = engine.add_request(None, prompt, params)
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


def prefill(engine: Any, prompt: list[int]) -> dict[str, Any]:
    from kvserve import SamplingParams

    rid = engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    req = engine.scheduler.requests[rid]
    with common.Contention() as c:
        t0 = time.perf_counter()
        while not req.output_token_ids:
            engine.step()
        wall = time.perf_counter() - t0
    while not req.is_finished:
        engine.step()
    return dict(tok_s=round(len(prompt) / wall, 1), wall_s=round(wall, 4), contention=c.as_dict())


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


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its threads, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def llama_decode(server: Any, prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """One llama-server batch-1 decode; its own CPU time is removed from the phase's other_cpu."""
    cpu0 = _proc_cpu_s(server.proc.pid)
    with common.Contention() as c:
        res = server.decode(prompt, args.decode_tokens)
    cont = c.as_dict()
    own = _proc_cpu_s(server.proc.pid) - cpu0
    other = max(cont["other_cpu_s"] - own, 0.0)
    cont.update(server_cpu_s=round(own, 2), other_cpu_s=round(other, 2),
                other_cpu_frac=round(other / (c.wall_s * (os.cpu_count() or 1)), 4))
    return dict(res, contention=cont)


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from contextlib import ExitStack

    from kvserve import EngineConfig, LLMEngine
    from kvserve.models.catalog import resolve_model_path

    path = resolve_model_path(name)
    modes = [m for m in args.modes if m != "gguf" or path.suffix == ".gguf"]
    engines = {}
    for mode in modes:
        cfg = EngineConfig(model=name, dtype=args.dtype, num_threads=args.num_threads, seed=0,
                           quantization=None if mode == "float" else mode, kv_cache_memory=args.kv_cache_memory,
                           max_num_seqs=max(args.batch_sizes), skip_tokenizer_init=True)
        t0 = time.perf_counter()
        engines[mode] = LLMEngine(cfg)
        print(f"{name} {mode}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    out: dict[str, Any] = dict(model=name, path=str(path), dtype=str(engines["float"].dtype).removeprefix("torch.")
                               if "float" in engines else args.dtype, modes={})
    with ExitStack() as stack:
        server = None
        if args.peers and path.suffix == ".gguf":
            from _llama_peer import LlamaServer

            server = stack.enter_context(LlamaServer(Path(args.peers), path, args.num_threads))
            out["llama_server"] = dict(version=server.version(), cmd=server.cmd)
            print(f"{name} llama-server: up ({out['llama_server']['version']})", flush=True)
        rng = random.Random(0)
        rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in [*modes, "llama"]}
        prefills: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for r in range(args.rounds + 1):  # round 0 warms up (kernel build, page faults)
            prompt, long_prompt = _prompt(rng, args.prompt_len), _prompt(rng, args.prefill_len)
            for mode in modes:
                res = batch1_decode(engines[mode], prompt, args)
                pre = prefill(engines[mode], long_prompt)
                if r:
                    rounds[mode].append(res)
                    prefills[mode].append(pre)
            if server is not None:
                res = llama_decode(server, prompt, args)
                if r:
                    rounds["llama"].append(res)
            print(f"{name} round {r}: " + ", ".join(f"{m} {x[-1]['tok_s']}" for m, x in rounds.items() if x),
                  flush=True)
    steps = {m: [decode_steps(engines[m], b, args, rng) for b in args.batch_sizes] for m in modes}
    for mode in modes:
        model = engines[mode].runner.model
        phases = rounds[mode] + prefills[mode] + steps[mode]
        out["modes"][mode] = dict(
            batch1_tok_s=round(statistics.median(x["tok_s"] for x in rounds[mode]), 2), batch1_rounds=rounds[mode],
            prefill_tok_s=round(statistics.median(x["tok_s"] for x in prefills[mode]), 1),
            prefill_rounds=prefills[mode],
            decode_steps=steps[mode], weight_bytes_b1=weight_bytes_per_step(model, 1),
            max_other_cpu_frac=max(x["contention"]["other_cpu_frac"] for x in phases))
    if rounds["llama"]:
        out["modes"]["llama-server"] = dict(
            batch1_tok_s=round(statistics.median(x["tok_s"] for x in rounds["llama"]), 2),
            batch1_rounds=rounds["llama"],
            max_other_cpu_frac=max(x["contention"]["other_cpu_frac"] for x in rounds["llama"]))
    base = out["modes"].get("float")
    if base:
        for m in out["modes"].values():
            m["batch1_vs_float"] = round(m["batch1_tok_s"] / base["batch1_tok_s"], 3)
            if "prefill_tok_s" in m:
                m["prefill_vs_float"] = round(m["prefill_tok_s"] / base["prefill_tok_s"], 3)
    del engines
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct", help="comma-separated catalog names")
    ap.add_argument("--modes", type=lambda s: [m for m in s.split(",") if m], default=list(MODES),
                    help=f"comma-separated, from {', '.join(MODES)} (gguf: GGUF models only)")
    ap.add_argument("--dtype", default="auto", help="the float mode's dtype (int8 / gguf keep it for activations)")
    ap.add_argument("--num-threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-cache-memory", type=float, default=0.5)
    ap.add_argument("--peers", default=None, metavar="WORK",
                    help="a folder with bin/llama-server: also measure llama.cpp on the same GGUF file")
    ap.add_argument("--out", help="JSON path (default results/quantization-<time>.json)")
    args = ap.parse_args()
    if unknown := set(args.modes) - set(MODES):
        ap.error(f"--modes: unknown {', '.join(sorted(unknown))} (from {', '.join(MODES)})")
    common.set_thread_env(args.num_threads)
    import torch

    torch.set_num_threads(args.num_threads)
    results = [run_model(m, args) for m in args.models.split(",") if m]
    path = common.write_result("quantization", dict(benchmark="quantization", args=vars(args),
                                                    env=common.environment(args.num_threads),
                                                    machine=common.machine_info(), results=results), args.out)
    rows = []
    for r in results:
        for mode, m in r["modes"].items():
            label = {"float": r["dtype"], "int8": f"int8 ({r['dtype']} act.)", "gguf": f"gguf ({r['dtype']} act.)"}
            steps = {s["batch"]: s["step_ms"] for s in m.get("decode_steps", [])}
            rows.append([r["model"], label.get(mode, mode),
                         round(m["weight_bytes_b1"] / 1e6, 1) if "weight_bytes_b1" in m else "",
                         m["batch1_tok_s"], m.get("batch1_vs_float", ""), m.get("prefill_tok_s", ""),
                         m.get("prefill_vs_float", ""), *[steps.get(b, "") for b in args.batch_sizes],
                         m["max_other_cpu_frac"]])
    print()
    print(common.table(rows, ["model", "weights", "MB/step", "b1 tok/s", "vs float", f"prefill{args.prefill_len} tok/s",
                              "vs float", *[f"step ms b{b}" for b in args.batch_sizes], "other cpu"]))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
