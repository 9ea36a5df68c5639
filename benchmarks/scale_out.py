#!/usr/bin/env python3
"""Scale-out on one host: data-parallel replicas on Ray behind the router vs one instance, and the router's
cache-aware policy vs round-robin on a multi-tenant workload.

What and why
------------
* ``dp``: ``kvserve serve --data-parallel-size 2 --num-threads 1`` (two replicas as Ray actors on a local
  cluster, the router in front) against ``kvserve serve --num-threads 2`` (one engine, two threads) on
  workload A (``vs_peers.make_workload("mixed")``: prompts of 50-800 random ids, outputs of 16-256 tokens;
  greedy, ``ignore_eos``), closed loop at concurrency 16 and 64. Two 1-thread engines batch half the
  requests each and pay no OpenMP synchronisation; one 2-thread engine batches all and splits each matmul.
* ``tp``: tensor parallelism on one host, offline engines (no HTTP, token-id prompts, prefix caching off):
  ``--tensor-parallel-size 2 --num-threads 1`` (two ranks of one thread, gloo all-reduces between layers) against
  ``--num-threads 2`` (one process), on ``--tp-model`` (Qwen2.5-Coder-0.5B: 14 / 2 heads split in two; SmolLM2's
  9 / 3 do not). Per round and setup: the decode step at batch 1 and 32 (median ms of ``--tp-decode-steps`` steps,
  ``--tp-prompt-len`` tokens of context), and prefill tok/s (``--tp-prefill-prompts`` prompts of
  ``--tp-prefill-len`` tokens, one output token, 512-token steps). One process's decode is also timed on its
  per-layer path (``fuse_decode`` off): the path a rank takes (the fused ``decode_step.c`` has no collectives),
  which separates the all-reduces' cost from the fused kernel's gain. Setups alternate within each round; each
  engine is driven from its own thread (its own OpenMP team; rank 0 pins that thread to its CPU).
* ``tenants``: 8 system prompts (``--system-tokens`` random ids each) x 16 requests (each the system prompt +
  40 random ids, 16 output tokens), interleaved in a seeded random order, concurrency 4, on a DP deployment of
  ``--tenant-replicas`` replicas (default 2) with ``--policy cache-aware`` and with ``--policy round-robin``.
  Each replica's KV cache holds ``--replica-blocks`` blocks: fewer than the 8 system prompts (about 5 at the
  default 200), so that where the tenants go decides what stays cached. Cluster prefix hit rate = cached prompt
  tokens / prompt tokens, from every response's ``usage.prompt_tokens_details.cached_tokens``; TTFT from the
  streams. A run's cache_salt is its own, so no run hits another's blocks. Bound: with R replicas whose caches
  each hold the 8/R prompts routed to them, cache-aware misses only each tenant's first request and the
  suffixes, (1 - 1/16) x 600/640 = 0.88; round-robin sends every tenant to all R caches, each holding about 8/R
  of the 8 prompts, so it hits about 1/R of 600/640 (more from partial prefixes): the ratio is at most about
  R x 15/16, 1.9 at R = 2.

The host is a shared 2-core machine: each run records ``other_cpu_frac`` (others' CPU seconds / (wall x
ncpu); above ~0.05 the run is contaminated, marked ``*``), lscpu's model and flags, load averages.

Usage::

    .venv/bin/python benchmarks/scale_out.py                              # both parts
    .venv/bin/python benchmarks/scale_out.py --parts tenants --num-prompts 32
    .venv/bin/python benchmarks/scale_out.py --parts tp --tp-rounds 5             # tensor parallelism only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import aiohttp  # noqa: E402
from _bench_common import REPO, Contention, machine_info, table, write_result  # noqa: E402
from vs_peers import make_workload, server_cpu_s  # noqa: E402

MODEL = "smollm2-135m-instruct"
KVSERVE = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", MODEL, "--host", "127.0.0.1",
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--disable-log-requests"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``kvserve serve`` child process (its own process group, stopped with SIGINT, then its group)."""

    def __init__(self, flags: list[str], timeout_s: float = 300.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="scale-out-", suffix=".log")[1])
        self._f = self.log.open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([*KVSERVE, "--port", str(self.port), *flags], stdout=self._f,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text()[-4000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{flags}: not healthy in {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._f.close()
        self.log.unlink(missing_ok=True)


async def _one(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, salt: str,
               t0: float) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": salt}
    start = time.perf_counter()
    ttft, usage, error = None, None, None
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}", "start": start - t0}
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                payload = ev.strip()[5:].strip()
                if payload == b"[DONE]":
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    error = obj["error"].get("message")
                if ttft is None and any(c.get("text") for c in obj.get("choices") or []):
                    ttft = time.perf_counter() - start
                usage = obj.get("usage") or usage
    return {"ttft": ttft, "e2e": time.perf_counter() - start, "usage": usage, "error": error}


async def closed_loop(url: str, reqs: list[tuple[list[int], int]], concurrency: int, salt: str, server_pid: int = 0
                      ) -> tuple[list[dict[str, Any]], float, Contention, float]:
    """(results, wall s, contention, CPU s of the server's process tree: Ray's processes and replicas too)."""
    sem = asyncio.Semaphore(concurrency)
    srv0 = server_cpu_s(server_pid)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async def one(p: list[int], m: int) -> dict[str, Any]:
            async with sem:
                return await _one(s, url, p, m, salt, t0)

        with Contention() as con:
            t0 = time.perf_counter()
            results = await asyncio.gather(*[one(p, m) for p, m in reqs])
            wall = time.perf_counter() - t0
    return list(results), wall, con, server_cpu_s(server_pid) - srv0


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return round(1000 * (xs[lo] + (xs[hi] - xs[lo]) * (k - lo)), 1)


def summary(name: str, results: list[dict[str, Any]], wall: float, con: Contention, server_cpu: float
            ) -> dict[str, Any]:
    ok = [r for r in results if r.get("usage") and not r.get("error")]
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for r in ok)
    out = sum(r["usage"]["completion_tokens"] for r in ok)
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    return dict(name=name, completed=len(ok), failed=len(results) - len(ok),
                output_tok_s=round(out / wall, 1), prompt_tokens=prompt, cached_tokens=cached,
                hit_rate=round(cached / prompt, 4) if prompt else None,
                ttft_ms={p: _pct(ttfts, p) for p in (50, 95, 99)},
                e2e_ms={p: _pct([r["e2e"] for r in ok], p) for p in (50, 99)},
                **{**con.as_dict(), "server_cpu_s": round(server_cpu, 2),
                   "other_cpu_frac": round(max(con.other_cpu - server_cpu, 0.0) / (wall * (os.cpu_count() or 1)), 4)})


def tenants_workload(n_tenants: int, per_tenant: int, system_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    systems = [[rng.randint(1000, 40000) for _ in range(system_tokens)] for _ in range(n_tenants)]
    reqs = [(systems[t] + [rng.randint(1000, 40000) for _ in range(40)], 16)
            for t in range(n_tenants) for _ in range(per_tenant)]
    rng.shuffle(reqs)
    return reqs


def _mark(rec: dict[str, Any]) -> str:
    return "*" if rec["other_cpu_frac"] > 0.05 else ""


def part_dp(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    reqs = make_workload("mixed", args.num_prompts, args.seed)
    setups = [("1x2 threads", ["--num-threads", "2"]),
              ("DP=2 x1 thread (Ray)", ["--num-threads", "1", "--data-parallel-size", "2"])]
    for label, flags in setups:
        srv = Server([*flags, "--dtype", args.dtype, *args.server_args.split()])
        try:
            asyncio.run(closed_loop(srv.url, [(reqs[0][0][:16], 4)], 1, "warmup"))
            for c in args.concurrency:
                res, wall, con, cpu = asyncio.run(closed_loop(srv.url, reqs, c, f"dp-{label}-{c}-{time.time_ns()}",
                                                              srv.proc.pid))
                rec = {"part": "dp", "setup": label, "concurrency": c, **summary(label, res, wall, con, cpu)}
                records.append(rec)
                print(f"  {label} c={c}: {rec['output_tok_s']} tok/s, TTFT p50 {rec['ttft_ms'][50]} ms, "
                      f"other_cpu_frac {rec['other_cpu_frac']}", flush=True)
        finally:
            srv.stop()


def part_tenants(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    reqs = tenants_workload(8, args.per_tenant, args.system_tokens, args.seed)
    for policy in ("cache-aware", "round-robin"):
        srv = Server(["--num-threads", "1", "--data-parallel-size", str(args.tenant_replicas), "--policy", policy,
                      "--dtype", args.dtype,
                      "--num-gpu-blocks-override", str(args.replica_blocks), *args.server_args.split()])
        try:
            asyncio.run(closed_loop(srv.url, [(reqs[0][0][:16], 4)], 1, "warmup"))
            res, wall, con, cpu = asyncio.run(closed_loop(srv.url, reqs, 4, f"tenants-{policy}-{time.time_ns()}",
                                                          srv.proc.pid))
            label = f"{policy}, DP={args.tenant_replicas}, {args.replica_blocks} blocks/replica"
            rec = {"part": "tenants", "setup": label, "concurrency": 4, "replica_blocks": args.replica_blocks,
                   "replicas": args.tenant_replicas,
                   **summary(label, res, wall, con, cpu)}
            records.append(rec)
            print(f"  {label}: hit rate {rec['hit_rate']}, TTFT p50 {rec['ttft_ms'][50]} ms", flush=True)
        finally:
            srv.stop()


def _tp_engine(args: argparse.Namespace, tp: int, threads: int) -> Any:
    from kvserve import LLM

    return LLM(args.tp_model, dtype=args.dtype, skip_tokenizer_init=True, tensor_parallel_size=tp,
               num_threads=threads, kv_cache_memory=args.tp_kv_gib, max_num_batched_tokens=512,
               enable_prefix_caching=False, preemption_mode="recompute", max_num_seqs=64, seed=args.seed)


def _tp_decode_ms(llm: Any, batch: int, steps: int, prompt_len: int, rng: random.Random) -> float:
    """Median ms of one engine step while ``batch`` requests decode (their prompts prefilled first)."""
    from kvserve import SamplingParams

    engine = llm.engine
    # enough tokens for the first request to outlast the others' prefills and the timed steps (then all aborted)
    sp = SamplingParams(max_tokens=steps + 2 * batch * prompt_len // 512 + 8, ignore_eos=True, temperature=0)
    ids = [engine.add_request(None, [rng.randint(1000, 30000) for _ in range(prompt_len)], sp) for _ in range(batch)]
    while any(engine.scheduler.requests[i].num_output_tokens < 2 for i in ids):  # prefills, one decode
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    engine.abort_request(ids)
    engine.step()  # (reports the aborted ids to the runner)
    times.sort()
    return round(1000 * times[len(times) // 2], 2)


def _tp_prefill_tok_s(llm: Any, n: int, length: int, rng: random.Random) -> float:
    from kvserve import SamplingParams

    prompts = [{"prompt_token_ids": [rng.randint(1000, 30000) for _ in range(length)]} for _ in range(n)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return round(n * length / (time.perf_counter() - t0), 1)


def _tp_measure(args: argparse.Namespace, llm: Any, setup: str, rnd: int) -> list[dict[str, Any]]:
    """One round of one setup, in the calling thread (the engine's own)."""
    import torch

    torch.set_num_threads(llm.engine.num_threads)
    rng = random.Random(args.seed * 1000 + rnd)
    model = llm.engine.runner.model
    fused = [True, False] if llm.engine.executor.world_size == 1 else [False]
    out = []
    for fuse in fused:
        model.fuse_decode = fuse
        label = setup if fuse or len(fused) == 1 else f"{setup}, per-layer decode"
        for batch in (1, 32):
            tree0 = server_cpu_s(os.getpid())
            with Contention() as con:
                ms = _tp_decode_ms(llm, batch, args.tp_decode_steps, args.tp_prompt_len, rng)
            tree = server_cpu_s(os.getpid()) - tree0
            out.append(_tp_record(label, rnd, f"decode b={batch}", ms, "ms/step", con, tree))
    model.fuse_decode = True
    tree0 = server_cpu_s(os.getpid())
    with Contention() as con:
        tok_s = _tp_prefill_tok_s(llm, args.tp_prefill_prompts, args.tp_prefill_len, rng)
    out.append(_tp_record(setup, rnd, "prefill", tok_s, "tok/s", con, server_cpu_s(os.getpid()) - tree0))
    return out


def _tp_record(setup: str, rnd: int, what: str, value: float, unit: str, con: Contention, tree_cpu: float
               ) -> dict[str, Any]:
    """A measurement; ``other_cpu_frac`` leaves out this process tree's CPU (the tensor-parallel worker's too)."""
    d = con.as_dict()
    other = max(con.other_cpu - (tree_cpu - con.self_cpu), 0.0)
    return {"part": "tp", "setup": setup, "round": rnd, "what": what, "value": value, "unit": unit,
            **d, "tree_cpu_s": round(tree_cpu, 2),
            "other_cpu_frac": round(other / (con.wall_s * (os.cpu_count() or 1)), 4)}


def part_tp(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    setups = [("TP=1 x2 threads", 1, 2), ("TP=2 x1 thread", 2, 1)]
    pools = {name: ThreadPoolExecutor(1, thread_name_prefix=name) for name, _, _ in setups}
    engines = {name: pools[name].submit(_tp_engine, args, tp, threads).result() for name, tp, threads in setups}
    try:
        for rnd in range(args.tp_rounds):
            for name, _, _ in setups if rnd % 2 == 0 else setups[::-1]:
                for rec in pools[name].submit(_tp_measure, args, engines[name], name, rnd).result():
                    records.append(rec)
                    print(f"  round {rnd} {rec['setup']}: {rec['what']} {rec['value']} {rec['unit']} "
                          f"(other_cpu_frac {rec['other_cpu_frac']})", flush=True)
    finally:
        for name in engines:
            pools[name].submit(engines[name].engine.close).result()
            pools[name].shutdown()


def _tp_table(records: list[dict[str, Any]]) -> str:
    """Median over rounds per setup and measurement; the worst other_cpu_frac of its rounds."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        if r["part"] == "tp":
            groups.setdefault((r["setup"], r["what"]), []).append(r)
    rows = []
    for (setup, what), rs in groups.items():
        values = sorted(r["value"] for r in rs)
        worst = max(r["other_cpu_frac"] for r in rs)
        rows.append([setup, what, values[len(values) // 2], rs[0]["unit"], len(rs),
                     f"{worst}{'*' if worst > 0.05 else ''}"])
    return table(rows, ["setup", "measure", "median", "unit", "rounds", "max other_cpu_frac"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="dp,tenants", help="comma-separated: dp, tenants (default: both), tp")
    p.add_argument("--num-prompts", type=int, default=64, help="workload A requests per run (default 64)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    p.add_argument("--per-tenant", type=int, default=16, help="requests per system prompt (default 16)")
    p.add_argument("--system-tokens", type=int, default=600, help="tokens of each system prompt (default 600)")
    p.add_argument("--replica-blocks", type=int, default=200,
                   help="KV blocks of 16 tokens per replica in the tenants part (default 200)")
    p.add_argument("--tenant-replicas", type=int, default=2,
                   help="data-parallel replicas of the tenants part (default 2; 1 thread each, so more replicas "
                        "than cores only slows them, and the hit rates do not depend on speed)")
    p.add_argument("--dtype", default="auto",
                   help="--dtype of every server (default auto: bfloat16 where the CPU has native bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="more kvserve serve flags for every server")
    p.add_argument("--out", default=None, help="JSON path (default results/scale_out-<time>.json)")
    p.add_argument("--tp-model", default="qwen2.5-coder-0.5b-instruct", help="model of the tp part")
    p.add_argument("--tp-rounds", type=int, default=3, help="alternating rounds of the tp part (default 3)")
    p.add_argument("--tp-decode-steps", type=int, default=20, help="decode steps timed per batch size (default 20)")
    p.add_argument("--tp-prompt-len", type=int, default=256, help="context tokens of each decoding request")
    p.add_argument("--tp-prefill-prompts", type=int, default=4, help="prompts of the prefill measurement")
    p.add_argument("--tp-prefill-len", type=int, default=512, help="tokens of each prefill prompt")
    p.add_argument("--tp-kv-gib", type=float, default=1.0, help="--kv-cache-memory of the tp engines (per rank)")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    records: list[dict[str, Any]] = []
    if "dp" in parts:
        print("workload A: DP=2 (1 thread each) vs one 2-thread instance", flush=True)
        part_dp(args, records)
    if "tenants" in parts:
        print(f"multi-tenant shared prefixes: cache-aware vs round-robin (DP={args.tenant_replicas})", flush=True)
        part_tenants(args, records)
    if "tp" in parts:
        print(f"tensor parallelism on {args.tp_model}: TP=2 x 1 thread vs TP=1 x 2 threads", flush=True)
        part_tp(args, records)
        print(_tp_table(records))
    rows = [[r["part"], r["setup"], r["concurrency"], f"{r['completed']}/{r['completed'] + r['failed']}",
             r["output_tok_s"], r["ttft_ms"][50], r["ttft_ms"][99], r["hit_rate"], r["wall_s"],
             f"{r['other_cpu_frac']}{_mark(r)}"] for r in records if r["part"] != "tp"]
    if rows:
        print(table(rows, ["part", "setup", "c", "ok", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "hit rate",
                           "wall s", "other_cpu_frac"]))
    result = {"benchmark": "scale_out", "machine": machine_info(), "note": "shared 2-core host",
              "args": {k: v for k, v in vars(args).items()}, "records": records}
    print("wrote", write_result("scale_out", result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
