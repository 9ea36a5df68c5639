#!/usr/bin/env python3
"""Prefill/decode disaggregation (issue 14) against one chunked-prefill instance, on the same two cores.

What is measured, and why
-------------------------
Disaggregation moves prefill off the decode device so that a long prompt no longer stalls the running
decodes; it pays with a KV transfer per request and with each instance having half the machine. This
script measures both sides on SmolLM2-135M-Instruct (``--model``), ``--dtype auto``, and then asks the
planner (``kvserve plan``'s PD go/no-go, fed the measured transfer bandwidth) whether it would have said so.

Setups (one at a time, never both: the machine has 2 cores; servers bind 127.0.0.1 on free ports, run in
their own sessions and are stopped by PID, SIGTERM then SIGKILL, in ``finally``):

* ``disagg``: a prefill instance P (``taskset -c 0``, ``--num-threads 1``, ``--kv-transfer-config``
  ``kv_role: kv_producer``), a decode instance D (``taskset -c 1``, ``--num-threads 1``, ``kv_consumer``) and
  ``kvserve proxy`` (``--proxy-cpus``: pinned to core 0 with P by default, so that D's core is left to
  decoding; the JSON records it). The client sends every request to the proxy, which gets one token from P
  and streams the rest from D (D pulls P's KV over ZMQ).
* ``single``: one instance with ``--num-threads 2`` (``taskset -c 0,1``) and chunked prefill at the default
  budget (``max_num_batched_tokens``: 512 on CPU since 2026-12-02, 2,048 before, as in docs/disagg.md's table);
  the client talks to it directly. ``--single-args`` adds flags (a smaller budget, say).

The client is this process (not pinned; it parses the streams of both setups alike). Workloads (token-id
prompts, ids ~ U[1000, 40000], greedy, ``ignore_eos`` and ``min_tokens = max_tokens``, streamed
``/v1/completions`` with usage; ``kvserve.bench.client.send_request`` times them):

* ``itl``: decoding streams while long prompts arrive (the serving form of ``chunked_prefill_itl.py``'s
  workload): ``--num-streams`` (16) requests of ``--stream-prompt-len`` (32) ids and
  ``--stream-output-len`` (256) tokens, all sent at t = 0, plus ``--num-long`` (4) prompts of
  ``--long-prompt-len`` (1,500) ids and ``--long-output-len`` (16) tokens, sent at t = ``--long-first-s``
  (2) + i x ``--long-interval-s`` (4) s. ITL = the streams' gaps (their tokens are the decodes a long
  prompt stalls); TTFT over every request, and the long prompts' own ("long TTFT").
* ``mixed``: workload A (``kvserve.bench.offline.make_mixed_workload``: prompts of U[50, 800] ids, outputs
  from {16, ..., 256}) with ``--num-prompts`` (64) requests at concurrency ``--concurrency`` (16), closed
  loop. ITL and TTFT over every request.

Per row: ITL p50 / p99, TTFT p50 / p99 (ms; linear-interpolation percentiles), output tok/s = output tokens
(the servers' usage) / the run's wall time. For ``disagg``, from D's ``/metrics`` scraped before and after
the run: the KV transfer bandwidth = ``kv_transfer_bytes_received_total / kv_transfer_seconds_sum`` of the
run (bytes/s; the planner's own reader, ``kvserve.planner.measured``), bytes per prompt token (bytes
received / the run's prompt tokens; next to the planner's KV bytes per token), pulls, failures and
recomputed requests, and D's ``prompt_tokens_computed_total`` (0 when every prompt's KV came from P).
Every run has its own ``cache_salt`` (so no run reuses another's prefix cache).

The planner: per workload, ``kvserve.planner.plan.build_plan`` with 2 devices, that workload's mean prompt
and output lengths, P's prefill speed (one ``--long-prompt-len`` prompt alone on P, 1 token: its TTFT),
the memory bandwidth measured here, ``--tpot-slo-ms`` if given, and the run's measured transfer bandwidth.
Its verdict is compared with the outcome: disaggregation "won" a workload when it had both the lower ITL
p99 and the higher output tok/s; the planner predicted the outcome when GO and won, or NO-GO and not won.
The JSON's top-level ``kv_transfer`` record (every disagg run, and per workload) is what ``kvserve plan
--bench-json FILE [--bench-section itl|mixed]`` reads.

The machine is shared and noisy: every row records the load average before/after, the CPU seconds of the
servers' process trees, of this client and of everything else (``other_cpu_frac`` = others' CPU / (wall x
ncpu); > 0.05: contaminated, marked ``*``); the JSON holds lscpu's model name and flags.

Usage::

    .venv/bin/python benchmarks/disagg.py                                   # both setups, both workloads
    .venv/bin/python benchmarks/disagg.py --workloads itl --out results/disagg-itl.json
    .venv/bin/python benchmarks/disagg.py --single-args "--max-num-batched-tokens 256"
    .venv/bin/python benchmarks/disagg.py --quick --out results/disagg-quick.json  # smoke: tiny sizes
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import io
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, Contention, machine_info, write_result  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # an uninstalled checkout still finds kvserve

import aiohttp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from vs_peers import EngineSpec, Server, _BodyExtras, _session, server_cpu_s  # noqa: E402

from kvserve.bench.client import RequestInput, RequestResult, send_request  # noqa: E402
from kvserve.bench.metrics import distribution  # noqa: E402
from kvserve.bench.offline import make_mixed_workload  # noqa: E402
from kvserve.errors import InvalidRequestError  # noqa: E402
from kvserve.planner import measured  # noqa: E402

WORKLOADS = measured.TRANSFER_SECTIONS  # ("itl", "mixed"): the planner's --bench-section names
SETUPS = ("disagg", "single")
CONTAMINATED = 0.05
MODEL_NAME = "m"  # --served-model-name of every server


# ---- workloads ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One request: token-id ``prompt``, ``max_tokens``, sent ``at_s`` seconds after the run starts (open
    loop; ignored in a closed loop), ``kind`` ``stream`` | ``long`` | ``mixed``."""

    prompt: list[int]
    max_tokens: int
    at_s: float
    kind: str


def make_itl_workload(args: argparse.Namespace) -> list[Job]:
    """The ``itl`` workload (module docstring), from one ``random.Random(--seed)``: streams first, then the
    long prompts, as ``chunked_prefill_itl.py`` draws them."""
    rng = random.Random(args.seed)
    jobs = [Job([rng.randint(1000, 40000) for _ in range(args.stream_prompt_len)], args.stream_output_len, 0.0,
                "stream") for _ in range(args.num_streams)]
    jobs += [Job([rng.randint(1000, 40000) for _ in range(args.long_prompt_len)], args.long_output_len,
                 args.long_first_s + i * args.long_interval_s, "long") for i in range(args.num_long)]
    return jobs


def make_mixed_jobs(args: argparse.Namespace) -> list[Job]:
    """Workload A with ``--num-prompts`` requests (outputs capped at ``--max-output-len`` when given)."""
    cap = args.max_output_len or 1 << 30
    return [Job(p, min(m, cap), 0.0, "mixed") for p, m in make_mixed_workload(args.num_prompts, args.seed)]


def jobs_for(workload: str, args: argparse.Namespace) -> tuple[list[Job], int | None]:
    """(jobs, concurrency): ``itl`` is open loop (None), ``mixed`` a closed loop at ``--concurrency``."""
    if workload == "itl":
        return make_itl_workload(args), None
    if workload == "mixed":
        return make_mixed_jobs(args), args.concurrency
    raise ValueError(f"unknown workload {workload!r} (expected one of {', '.join(WORKLOADS)})")


# ---- the client ----------------------------------------------------------------------------------------------
async def run_jobs(base_url: str, jobs: list[Job], concurrency: int | None, salt: str
                   ) -> tuple[list[RequestResult], float]:
    """Send ``jobs`` (open loop at their ``at_s`` when ``concurrency`` is None, else at most ``concurrency`` in
    flight); returns the results in job order and the wall seconds from the first send to the last reply."""
    async with _session() as s:
        sem = asyncio.Semaphore(concurrency or max(len(jobs), 1))
        t0 = time.perf_counter()

        async def one(job: Job) -> RequestResult:
            if concurrency is None and job.at_s > 0:
                await asyncio.sleep(max(0.0, t0 + job.at_s - time.perf_counter()))
            async with sem:
                inp = RequestInput("completions", base_url, MODEL_NAME, job.prompt, job.max_tokens, ignore_eos=True,
                                   logprobs=False)
                extra = {"min_tokens": job.max_tokens, "cache_salt": salt}
                return await send_request(cast(aiohttp.ClientSession, _BodyExtras(s, extra)), inp, t0)

        results = await asyncio.gather(*[one(j) for j in jobs])
        return list(results), time.perf_counter() - t0


def one_request(base_url: str, prompt: list[int], max_tokens: int, salt: str) -> RequestResult:
    """One request alone (warm-up, prefill probe)."""
    results, _ = asyncio.run(run_jobs(base_url, [Job(prompt, max_tokens, 0.0, "probe")], 1, salt))
    return results[0]


# ---- servers -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pinned(cmd: list[str], cpus: str) -> list[str]:
    """``cmd`` under ``taskset -c CPUS`` (``cpus`` empty: not pinned)."""
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def serve_cmd(args: argparse.Namespace, port: int, threads: int, extra: list[str]) -> list[str]:
    return [args.kvserve, "serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", MODEL_NAME, "--dtype", args.dtype, "--num-threads", str(threads), *extra]


def transfer_flag(role: str, kv_port: int) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "ZmqConnector", "kv_role": role,
                                                "kv_ip": "127.0.0.1", "kv_port": kv_port})]


def thread_env(threads: int) -> dict[str, str]:
    return {v: str(threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}


@dataclass
class Deployment:
    """The servers of one setup: ``front`` is the URL the client uses; ``decode`` / ``prefill`` the URLs
    whose metrics are read (for ``single`` both are the one instance); ``servers`` by role."""

    setup: str
    front: str
    prefill: str
    decode: str
    servers: dict[str, Server]

    def pids(self) -> list[int]:
        return [s.pid for s in self.servers.values()]


def build_servers(setup: str, args: argparse.Namespace, log_dir: Path) -> tuple[dict[str, Server], dict[str, int]]:
    """The (not yet started) servers of ``setup`` by role, and their HTTP ports."""
    if setup == "disagg":
        ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
        pd_extra = shlex.split(args.pd_args)
        specs = {
            "prefill": EngineSpec("prefill", "P", pinned(serve_cmd(
                args, ports["prefill"], 1, [*transfer_flag("kv_producer", free_port()), *pd_extra]), args.p_cpus),
                thread_env(1)),
            "decode": EngineSpec("decode", "D", pinned(serve_cmd(
                args, ports["decode"], 1, [*transfer_flag("kv_consumer", free_port()), *pd_extra]), args.d_cpus),
                thread_env(1)),
            "proxy": EngineSpec("proxy", "proxy", pinned(
                [args.kvserve, "proxy", "--prefill", f"http://127.0.0.1:{ports['prefill']}", "--decode",
                 f"http://127.0.0.1:{ports['decode']}", "--host", "127.0.0.1", "--port", str(ports["proxy"]),
                 "--routing", args.routing], args.proxy_cpus)),
        }
    elif setup == "single":
        ports = {"single": free_port()}
        specs = {"single": EngineSpec("single", "single", pinned(serve_cmd(
            args, ports["single"], 2, shlex.split(args.single_args)), args.single_cpus), thread_env(2))}
    else:
        raise ValueError(f"unknown setup {setup!r} (expected one of {', '.join(SETUPS)})")
    return {role: Server(spec, ports[role], log_dir / f"{setup}-{role}.log") for role, spec in specs.items()}, ports


def start_deployment(setup: str, args: argparse.Namespace, log_dir: Path, entry: dict[str, Any]) -> Deployment:
    """Start ``setup``'s servers (P and D at once, then the proxy) and wait for each ``/health``.

    Raises:
        RuntimeError: a server did not come up (``entry["note"]`` and the log tail say why).
    """
    servers, ports = build_servers(setup, args, log_dir)
    entry.update(cmds={r: s.spec.cmd for r, s in servers.items()}, ports=ports,
                 logs={r: str(s.log_path) for r, s in servers.items()}, startup_s={})
    engines = [r for r in servers if r != "proxy"]

    def up(role: str) -> None:
        entry["startup_s"][role] = round(servers[role].start(args.start_timeout), 1)

    dep = Deployment(setup, "", "", "", servers)
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            for f in [pool.submit(up, r) for r in engines]:
                f.result()
        if "proxy" in servers:
            up("proxy")
    except BaseException as e:  # a failed start, ^C or SIGTERM: stop whatever did start
        tails = "\n".join(f"--- {r}:\n{s.tail()}" for r, s in servers.items() if s.proc is not None)
        stop_deployment(dep)
        if not isinstance(e, RuntimeError):
            raise
        entry["note"] = f"did not come up: {e}"
        raise RuntimeError(f"{setup}: {e}\n{tails}") from e
    url = {r: f"http://127.0.0.1:{p}" for r, p in ports.items()}
    if setup == "disagg":
        dep.front, dep.prefill, dep.decode = url["proxy"], url["prefill"], url["decode"]
    else:
        dep.front = dep.prefill = dep.decode = url["single"]
    return dep


def stop_deployment(dep: Deployment) -> None:
    """Stop every server of ``dep`` by its PID (the proxy first); idempotent."""
    for role in ("proxy", "decode", "prefill", "single"):
        if role in dep.servers:
            dep.servers[role].stop()


# ---- metrics -------------------------------------------------------------------------------------------------
def scrape(url: str) -> dict[str, float]:
    """A server's ``/metrics`` as sample totals (``kvserve.planner.measured.metric_totals``)."""
    return measured.metric_totals(measured.fetch_metrics_text(url), url)


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def transfer_stats(d: dict[str, float], prompt_tokens: int, source: str) -> dict[str, Any]:
    """D's KV transfer numbers of one run from the metric deltas ``d`` (bytes, seconds, bytes/s)."""
    pfx = measured.PREFIXES[0]
    try:
        t: measured.MeasuredTransfer | None = measured.transfer_from_totals(d, source)
    except InvalidRequestError:
        t = None
    received = d.get(f"{pfx}kv_transfer_bytes_received_total", 0.0)
    return dict(kv_transfer_bandwidth_bytes_per_s=t.bandwidth_bytes_per_s if t else None,
                bytes_received=received, transfer_seconds=d.get(f"{pfx}kv_transfer_seconds_sum", 0.0),
                num_transfers=d.get(f"{pfx}kv_transfer_seconds_count", 0.0),
                pulls=d.get(f"{pfx}kv_transfer_pulls_total", 0.0),
                bytes_per_prompt_token=received / prompt_tokens if prompt_tokens else None,
                failures=d.get(f"{pfx}kv_transfer_failures_total", 0.0),
                recomputed_requests=d.get(f"{pfx}kv_transfer_recomputed_requests_total", 0.0))


def kv_transfer_record(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The JSON's ``kv_transfer`` record (what ``kvserve plan --bench-json`` reads): bytes / seconds summed
    over every disagg row that timed a pull, and per workload; None when none did."""
    def agg(rs: list[dict[str, Any]]) -> dict[str, Any]:
        b = sum(r["kv_transfer"]["bytes_received"] for r in rs)
        s = sum(r["kv_transfer"]["transfer_seconds"] for r in rs)
        n = sum(r["kv_transfer"]["num_transfers"] for r in rs)
        tok = sum(r["prompt_tokens"] for r in rs)
        return dict(kv_transfer_bandwidth_bytes_per_s=b / s if s > 0 else None, bytes_received=b,
                    transfer_seconds=s, num_transfers=n, bytes_per_prompt_token=b / tok if tok else None,
                    source="decode instance /metrics, bytes received / transfer seconds")

    timed = [r for r in rows if r["setup"] == "disagg" and r.get("kv_transfer")
             and r["kv_transfer"]["num_transfers"] > 0 and r["kv_transfer"]["transfer_seconds"] > 0]
    if not timed:
        return None
    out = agg(timed)
    out["workloads"] = {w: agg([r for r in timed if r["workload"] == w]) for w in WORKLOADS
                        if any(r["workload"] == w for r in timed)}
    return out


# ---- one run -------------------------------------------------------------------------------------------------
def _ms(dist: dict[str, float | None], p: int) -> float | None:
    v = dist.get(f"p{p}")
    return None if v is None else round(1000 * v, 2)


def run_record(setup: str, workload: str, jobs: list[Job], concurrency: int | None, results: list[RequestResult],
               wall: float, con: Contention, server_cpu: float, before: dict[str, dict[str, float]],
               after: dict[str, dict[str, float]], salt: str, decode_url: str) -> dict[str, Any]:
    """The row of one run (times in ms; ``before`` / ``after``: metric totals by role, ``prefill``, ``decode``)."""
    ok = [(r, j) for r, j in zip(results, jobs, strict=True) if r.success]
    itl_src = [r for r, j in ok if j.kind == "stream"] if workload == "itl" else [r for r, _ in ok]
    itl = distribution([x for r in itl_src for x in r.itl])
    ttft = distribution([r.ttft for r, _ in ok])
    long_ttft = distribution([r.ttft for r, j in ok if j.kind == "long"])
    out_tokens = sum(r.output_tokens for r, _ in ok)
    prompt_tokens = sum(len(j.prompt) for _, j in ok)
    other = max(con.other_cpu - server_cpu, 0.0)
    ncpu = os.cpu_count() or 1
    pfx = measured.PREFIXES[0]
    dd = delta(after["decode"], before["decode"])
    dp = delta(after["prefill"], before["prefill"])
    computed = f"{pfx}prompt_tokens_computed_total"
    return dict(
        setup=setup, workload=workload, concurrency=concurrency, num_requests=len(jobs), completed=len(ok),
        failed=len(jobs) - len(ok), errors=sorted({r.error for r in results if not r.success})[:5],
        duration_s=round(wall, 3), prompt_tokens=prompt_tokens, output_tokens=out_tokens,
        output_tokens_expected=sum(j.max_tokens for j in jobs), output_tok_s=round(out_tokens / wall, 2),
        itl_ms={p: _ms(itl, p) for p in (50, 95, 99)}, itl_samples=int(itl["count"] or 0),
        itl_of="decoding streams" if workload == "itl" else "every request",
        ttft_ms={p: _ms(ttft, p) for p in (50, 95, 99)},
        long_ttft_ms={p: _ms(long_ttft, p) for p in (50, 99)} if workload == "itl" else None,
        kv_transfer=transfer_stats(dd, prompt_tokens, f"{decode_url}/metrics, {workload} run")
        if setup == "disagg" else None,
        decode_prompt_tokens_computed=dd.get(computed) if setup == "disagg" else None,
        prefill_prompt_tokens_computed=dp.get(computed),
        cache_salt=salt, load1_before=con.load_before[0], load1_after=con.load_after[0],
        loadavg_before=con.load_before, loadavg_after=con.load_after,
        cpu_s=dict(total=round(con.other_cpu + con.self_cpu, 2), servers=round(server_cpu, 2),
                   client=round(con.self_cpu, 2), other=round(other, 2)),
        other_cpu_frac=round(other / (wall * ncpu), 4) if wall > 0 else 0.0)


def run_one(dep: Deployment, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    jobs, concurrency = jobs_for(workload, args)
    salt = f"disagg-bench-{dep.setup}-{workload}-{os.getpid()}-{time.time_ns()}"
    roles = {"prefill": dep.prefill, "decode": dep.decode}
    before = {r: scrape(u) for r, u in roles.items()}
    cpu0 = sum(server_cpu_s(p) for p in dep.pids())
    with Contention() as con:
        results, wall = asyncio.run(run_jobs(dep.front, jobs, concurrency, salt))
    cpu1 = sum(server_cpu_s(p) for p in dep.pids())
    time.sleep(args.settle_s)  # the engine loop publishes the last pulls' timings after its next iteration
    after = {r: scrape(u) for r, u in roles.items()}
    return run_record(dep.setup, workload, jobs, concurrency, results, wall, con, cpu1 - cpu0, before, after, salt,
                      dep.decode)


def warm_and_probe(dep: Deployment, args: argparse.Namespace, entry: dict[str, Any]) -> None:
    """One short request through the front (warms every server and the transfer path), then the prefill
    probe: one ``--long-prompt-len`` prompt alone on the prefill instance, 1 token (its TTFT ~ prefill time)."""
    rng = random.Random(12345)
    w = one_request(dep.front, [rng.randint(1000, 40000) for _ in range(16)], 8, f"disagg-warmup-{time.time_ns()}")
    entry["warmup"] = dict(ok=w.success, error=w.error, e2e_s=round(w.e2e, 3), output_tokens=w.output_tokens)
    if not w.success:
        raise RuntimeError(f"{dep.setup}: warm-up failed: {w.error}")
    n = args.long_prompt_len
    r = one_request(dep.prefill, [rng.randint(1000, 40000) for _ in range(n)], 1, f"disagg-probe-{time.time_ns()}")
    entry["prefill_probe"] = dict(ok=r.success, prompt_tokens=n, ttft_s=round(r.ttft, 4),
                                  prefill_tokens_per_s=round(n / r.ttft, 1) if r.success and r.ttft > 0 else None,
                                  error=r.error)


# ---- the planner ---------------------------------------------------------------------------------------------
def outcome(disagg: dict[str, Any], single: dict[str, Any]) -> dict[str, Any]:
    """Who won a workload: disagg "won" with both the lower ITL p99 and the higher output tok/s."""
    d_itl, s_itl = disagg["itl_ms"][99], single["itl_ms"][99]
    itl_better = d_itl is not None and s_itl is not None and d_itl < s_itl
    tput_better = disagg["output_tok_s"] > single["output_tok_s"]
    return dict(disagg_itl_p99_ms=d_itl, single_itl_p99_ms=s_itl, disagg_output_tok_s=disagg["output_tok_s"],
                single_output_tok_s=single["output_tok_s"], disagg_better_itl_p99=itl_better,
                disagg_better_throughput=tput_better, disagg_won=itl_better and tput_better)


def judge(pd: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """The planner's verdict next to the outcome: ``predicted`` when GO and disagg won, or NO-GO and it did not."""
    return dict(**result, go=pd["go"], verdict=pd["verdict"], predicted=pd["go"] == result["disagg_won"])


def go_no_go(args: argparse.Namespace, rows: list[dict[str, Any]], prefill_tok_s: float | None,
             memory: dict[str, float]) -> dict[str, Any]:
    """Per workload with a disagg and a single row: the planner's PD go/no-go on the measured bandwidth
    (``memory``: the memory / copy bandwidths for the roofline, bytes/s) and whether it predicted the outcome."""
    from kvserve import cpu_features
    from kvserve.planner.model_info import load_model_info
    from kvserve.planner.plan import PlanOptions, build_plan

    info = load_model_info(args.model)
    dtype = ("bfloat16" if cpu_features.has_native_bf16() else "float32") if args.dtype == "auto" else args.dtype
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        d = next((r for r in rows if r["setup"] == "disagg" and r["workload"] == w), None)
        s = next((r for r in rows if r["setup"] == "single" and r["workload"] == w), None)
        if d is None or s is None or not d["completed"] or not s["completed"]:
            continue
        bw = (d.get("kv_transfer") or {}).get("kv_transfer_bandwidth_bytes_per_s")
        transfer = measured.MeasuredTransfer(bw, d["kv_transfer"]["bytes_received"],
                                             d["kv_transfer"]["transfer_seconds"], d["kv_transfer"]["num_transfers"],
                                             f"D's /metrics ({w} run)") if bw else None
        jobs, _ = jobs_for(w, args)
        opts = PlanOptions(dtype=dtype, num_devices=2, prompt_len=round(statistics.mean(len(j.prompt) for j in jobs)),
                           output_len=round(statistics.mean(j.max_tokens for j in jobs)),
                           prefill_tokens_per_s=prefill_tok_s,
                           tpot_slo_s=args.tpot_slo_ms / 1000 if args.tpot_slo_ms else None)
        pd = build_plan(info, opts, memory, None, transfer)["pd"]
        out[w] = dict(judge(pd, outcome(d, s)), checks=pd["checks"], interconnect=pd["interconnect"],
                      plan_options=dict(prompt_len=opts.prompt_len, output_len=opts.output_len, dtype=dtype,
                                        num_devices=2, prefill_tokens_per_s=prefill_tok_s,
                                        tpot_slo_s=opts.tpot_slo_s))
    return out


# ---- tables --------------------------------------------------------------------------------------------------
def _num(x: float | None, fmt: str = ",.1f") -> str:
    return "-" if x is None else format(x, fmt)


def rows_table(rows: list[dict[str, Any]]) -> Table:
    """One line per run: latencies (ms), output tok/s, and for disagg the KV transfer and D's computed prompt."""
    t = Table(title="Prefill/decode disaggregation vs one chunked-prefill instance", title_justify="left",
              caption=f"ms; KV GB/s = D's bytes received / transfer seconds; * other_cpu_frac > {CONTAMINATED}")
    for c in ("workload", "setup", "ok", "ITL p50", "ITL p99", "TTFT p50", "TTFT p99", "long TTFT p50", "out tok/s",
              "KV GB/s", "KV B/prompt tok", "D prompt tok computed", "load1", "other cpu"):
        t.add_column(c, justify="left" if c in ("workload", "setup") else "right")
    for r in rows:
        kv = r.get("kv_transfer") or {}
        bw = kv.get("kv_transfer_bandwidth_bytes_per_s")
        flag = "*" if (r.get("other_cpu_frac") or 0) > CONTAMINATED else ""
        t.add_row(r["workload"], r["setup"], f"{r['completed']}/{r['num_requests']}", _num(r["itl_ms"][50]),
                  _num(r["itl_ms"][99]), _num(r["ttft_ms"][50], ",.0f"), _num(r["ttft_ms"][99], ",.0f"),
                  _num((r.get("long_ttft_ms") or {}).get(50), ",.0f"), _num(r["output_tok_s"]),
                  _num(bw / 1e9 if bw else None, ".3g"), _num(kv.get("bytes_per_prompt_token"), ",.0f"),
                  _num(r.get("decode_prompt_tokens_computed"), ",.0f"),
                  f"{r['load1_before']}->{r['load1_after']}", f"{r['other_cpu_frac']:.3f}{flag}")
    return t


def verdict_table(planner: dict[str, Any]) -> Table:
    """One line per workload: the planner's verdict, its interconnect reason, the outcome, predicted or not."""
    t = Table(title="The planner's PD go/no-go (measured transfer bandwidth) against the outcome",
              title_justify="left", caption="disagg won = lower ITL p99 and higher output tok/s than single")
    for c in ("workload", "verdict", "interconnect", "ITL p99 disagg / single", "tok/s disagg / single",
              "disagg won", "predicted"):
        t.add_column(c, justify="left")
    for w, v in planner.items():
        ic = next((c for c in v["checks"] if c["check"] == "interconnect"), None)
        t.add_row(w, v["verdict"], ("ok: " if ic and ic["ok"] else "no: ") + (ic["reason"] if ic else "-"),
                  f"{_num(v['disagg_itl_p99_ms'])} / {_num(v['single_itl_p99_ms'])}",
                  f"{_num(v['disagg_output_tok_s'])} / {_num(v['single_output_tok_s'])}",
                  "yes" if v["disagg_won"] else "no", "yes" if v["predicted"] else "NO")
    return t


def render(result: dict[str, Any], console: Console | None = None) -> str:
    """Print the tables of ``result`` (``rows``, ``planner``) and return them as plain text."""
    buf = Console(file=io.StringIO(), width=240, record=True)
    tables = [rows_table(result["rows"])] + ([verdict_table(result["planner"])] if result.get("planner") else [])
    for t in tables:
        buf.print(t)
        if console is not None:
            console.print(t)
    return buf.export_text()


# ---- main ----------------------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    """kvserve's and torch's installed versions and the checkout's git revision (None where unknown)."""
    out: dict[str, str | None] = {}
    for dist in ("kvserve", "torch"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    out["git_rev"] = rev or None
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: itl, mixed")
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, in run order: disagg, single")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=64, help="mixed: requests")
    ap.add_argument("--concurrency", type=int, default=16, help="mixed: requests in flight")
    ap.add_argument("--max-output-len", type=int, default=0, help="mixed: cap on output lengths (0: none)")
    ap.add_argument("--num-streams", type=int, default=16, help="itl: decoding streams")
    ap.add_argument("--stream-prompt-len", type=int, default=32)
    ap.add_argument("--stream-output-len", type=int, default=256)
    ap.add_argument("--num-long", type=int, default=4, help="itl: long prompts")
    ap.add_argument("--long-prompt-len", type=int, default=1500)
    ap.add_argument("--long-output-len", type=int, default=16)
    ap.add_argument("--long-first-s", type=float, default=2.0, help="itl: first long prompt at this second")
    ap.add_argument("--long-interval-s", type=float, default=4.0, help="itl: seconds between long prompts")
    ap.add_argument("--p-cpus", default="0", help="taskset CPUs of the prefill instance ('' = not pinned)")
    ap.add_argument("--d-cpus", default="1", help="taskset CPUs of the decode instance")
    ap.add_argument("--proxy-cpus", default="0", help="taskset CPUs of the proxy ('' = free)")
    ap.add_argument("--single-cpus", default="0,1", help="taskset CPUs of the single instance")
    ap.add_argument("--routing", default="least-loaded", choices=["least-loaded", "round-robin"])
    ap.add_argument("--pd-args", default="", help="extra `kvserve serve` flags for P and D (one quoted string)")
    ap.add_argument("--single-args", default="", help="extra `kvserve serve` flags for the single instance")
    ap.add_argument("--tpot-slo-ms", type=float, default=None, help="passed to the planner's go/no-go")
    ap.add_argument("--kvserve", default=str(REPO / ".venv" / "bin" / "kvserve"), help="the kvserve executable")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for each /health")
    ap.add_argument("--settle-s", type=float, default=1.0, help="seconds after a run before its metrics are read")
    ap.add_argument("--quick", action="store_true", help="smoke sizes (a minute or two)")
    ap.add_argument("--out", default=str(REPO / "results" / "disagg.json"))
    ap.add_argument("--log-dir", default="", help="server logs (default: <out without .json>-logs/)")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.concurrency, args.max_output_len = 4, 4, 32
        args.num_streams, args.stream_output_len, args.num_long, args.long_prompt_len = 4, 32, 1, 300
        args.long_output_len, args.long_first_s = 4, 1.0
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.setup_list = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not args.workload_list or any(w not in WORKLOADS for w in args.workload_list):
        ap.error(f"--workloads: comma-separated names from {', '.join(WORKLOADS)}")
    if not args.setup_list or any(s not in SETUPS for s in args.setup_list):
        ap.error(f"--setups: comma-separated names from {', '.join(SETUPS)}")
    if min(args.num_prompts, args.concurrency, args.num_streams, args.long_prompt_len) < 1:
        ap.error("--num-prompts, --concurrency, --num-streams and --long-prompt-len must be >= 1")
    if any(c for c in (args.p_cpus, args.d_cpus, args.proxy_cpus, args.single_cpus)) and not shutil.which("taskset"):
        ap.error("taskset not found: install util-linux, or pass '' to every --*-cpus flag")
    args.log_dir = args.log_dir or str(Path(args.out).with_suffix("")) + "-logs"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks still stop the servers
    if not Path(args.kvserve).is_file():
        print(f"{args.kvserve} not found (run scripts/setup.sh, or pass --kvserve)", file=sys.stderr)
        return 2
    config = {k: v for k, v in vars(args).items() if k not in ("workload_list", "setup_list")}
    result: dict[str, Any] = dict(
        benchmark="disagg", started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine={**machine_info(), "python": platform.python_version(), **versions()}, config=config,
        pinning=dict(prefill=args.p_cpus or None, decode=args.d_cpus or None, proxy=args.proxy_cpus or "free",
                     single=args.single_cpus or None, client="free"),
        setups={}, rows=[])
    m = result["machine"]
    print(f"machine: {m.get('Model name')}; nproc {m.get('nproc')}; flags {' '.join(m['key_flags'])}; load "
          f"{m['loadavg']}; proxy pinned to {args.proxy_cpus or 'nothing (free)'}", flush=True)
    out = Path(args.out)

    def save() -> None:
        write_result("disagg", result, str(out))

    for setup in args.setup_list:
        entry: dict[str, Any] = {}
        result["setups"][setup] = entry
        dep: Deployment | None = None
        try:
            print(f"{time.strftime('%T')} starting {setup}", flush=True)
            dep = start_deployment(setup, args, Path(args.log_dir), entry)
            print(f"{time.strftime('%T')} {setup}: up ({entry['startup_s']} s)", flush=True)
            warm_and_probe(dep, args, entry)
            print(f"{time.strftime('%T')} {setup}: warm-up {entry['warmup']['e2e_s']} s; prefill probe "
                  f"{entry['prefill_probe']['prefill_tokens_per_s']} tok/s", flush=True)
            for w in args.workload_list:
                row = run_one(dep, w, args)
                result["rows"].append(row)
                kv = row.get("kv_transfer") or {}
                bw = kv.get("kv_transfer_bandwidth_bytes_per_s")
                print(f"{time.strftime('%T')} {setup} {w}: {row['completed']}/{row['num_requests']} ok, "
                      f"{row['output_tok_s']} tok/s, ITL p50/p99 {row['itl_ms'][50]}/{row['itl_ms'][99]} ms, TTFT "
                      f"p50/p99 {row['ttft_ms'][50]}/{row['ttft_ms'][99]} ms"
                      + (f", KV {bw / 1e9:.3g} GB/s, D computed {row['decode_prompt_tokens_computed']:g}" if bw
                         else "") + (f", errors {row['errors'][:1]}" if row["errors"] else ""), flush=True)
                save()
        except (RuntimeError, InvalidRequestError) as e:  # a server that did not start, or died (its /metrics)
            entry.setdefault("note", str(e).splitlines()[0])
            print(f"{setup}: {e}", flush=True)
        finally:
            if dep is not None:
                stop_deployment(dep)
        time.sleep(2)  # let the last set's CPU settle
    result["kv_transfer"] = kv_transfer_record(result["rows"])
    probe = (result["setups"].get("disagg") or {}).get("prefill_probe") or {}
    if result["kv_transfer"] and {"disagg", "single"} <= {r["setup"] for r in result["rows"]}:
        from kvserve.planner.bandwidth import measure_bandwidth

        result["planner"] = go_no_go(args, result["rows"], probe.get("prefill_tokens_per_s"),
                                     measure_bandwidth()._asdict())
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print()
    result["table"] = render(result, Console() if sys.stdout.isatty() else Console(width=240))
    for w, v in (result.get("planner") or {}).items():
        print(f"{w}: planner {v['verdict']}; disagg {'won' if v['disagg_won'] else 'did not win'} (ITL p99 "
              f"{'better' if v['disagg_better_itl_p99'] else 'worse'}, throughput "
              f"{'better' if v['disagg_better_throughput'] else 'worse'}): "
              f"{'predicted' if v['predicted'] else 'NOT predicted'}")
    path = write_result("disagg", result, str(out))
    print(f"\nJSON: {path} (kvserve plan --bench-json {path}); server logs: {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
