#!/usr/bin/env python3
"""Server vs offline engine: N concurrent streaming clients against ``kvserve serve``, then the same requests
through ``LLM.generate`` in this process. Is the HTTP layer the bottleneck?

What is measured, and why
-------------------------
* Workload: N requests (default 64), each a prompt of ``--prompt-len`` random token ids (ids ~ U[1000, 40000]
  from ``random.Random(seed)``), ``--output-len`` output tokens, greedy, EOS ignored, so both paths do exactly
  the same work and must return the same tokens.
* Server: ``kvserve serve`` as a subprocess with the same engine flags (``--max-num-seqs N`` so every client is
  in the batch), a warm-up request, then N streaming clients (httpx, one connection each) started at once.
  Output tok/s = completion tokens (from ``usage``) / wall time from the first send to the last ``[DONE]``.
  Per request: TTFT = send -> first chunk with text; ITL = gaps between later text chunks (a chunk can carry
  several tokens when the client falls behind; the count of chunks is reported); TPOT = (e2e - TTFT) /
  (tokens - 1).
* Offline: ``LLM.generate`` on the same prompts in this process, same thread count, after a warm-up;
  output tok/s = tokens / wall time of the call; TTFT from the engine's timestamps (add -> first token).
* The clients run in this process and share the machine's 2 cores with the server: that is part of the
  cost of serving over HTTP here. The JSON records this process's CPU seconds in the server phase and the
  CPU used by everything else (``other_cpu_frac``), as benchmarks/_bench_common.py does.

Usage::

    python benchmarks/serve_vs_offline.py                      # 64 clients, 64-token prompts, 64 tokens out
    python benchmarks/serve_vs_offline.py --num-requests 8 --output-len 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402

MODEL = "smollm2-135m-instruct"


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1000, 40000) for _ in range(length)] for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


# ---- server --------------------------------------------------------------------------------------
def engine_flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--num-threads", str(args.num_threads), "--max-num-seqs", str(args.num_requests),
            "--kv-cache-memory", str(args.kv_cache_memory), "--max-model-len", str(args.max_model_len),
            "--seed", str(args.seed)]


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used; 0.0 where /proc is unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", *engine_flags(args), "--port", str(port),
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy in 300 s")


async def one_client(client: Any, url: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps: list[float] = []
    text, tokens = "", 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for ch in event["choices"]:
                if ch["text"]:
                    stamps.append(time.perf_counter())
                    text += ch["text"]
    end = time.perf_counter()
    ttft = stamps[0] - t0 if stamps else float("nan")
    return dict(ttft=ttft, itl=[b - a for a, b in zip(stamps, stamps[1:], strict=False)], e2e=end - t0,
                tokens=tokens, chunks=len(stamps), text=text,
                tpot=(end - t0 - ttft) / (tokens - 1) if tokens > 1 and stamps else float("nan"))


async def run_clients(url: str, prompts: list[list[int]], output_len: int) -> tuple[list[dict[str, Any]], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
        await one_client(client, url, prompts[0][:8], 4)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_client(client, url, p, output_len) for p in prompts))
        return list(results), time.perf_counter() - t0


def run_server_phase(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict[str, Any], list[str]]:
    proc, url = start_server(args)
    try:
        server_cpu0 = proc_cpu_s(proc.pid)
        with common.Contention() as c:
            results, wall = asyncio.run(run_clients(url, prompts, args.output_len))
        server_cpu = proc_cpu_s(proc.pid) - server_cpu0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tpot = [r["tpot"] for r in results]
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    out = dict(engine="kvserve serve", output_tokens=tokens, duration_s=round(wall, 3),
               output_tok_s=round(tokens / wall, 2), exact_token_counts=all(r["tokens"] == args.output_len
                                                                            for r in results),
               ttft_ms=dict(p50=ms(percentile(ttft, 50)), p99=ms(percentile(ttft, 99)), max=ms(max(ttft))),
               itl_ms=dict(p50=ms(percentile(itl, 50)), p99=ms(percentile(itl, 99)), samples=len(itl)),
               tpot_ms=dict(p50=ms(percentile(tpot, 50)), p99=ms(percentile(tpot, 99))),
               chunks_per_request=round(statistics.mean(r["chunks"] for r in results), 1),
               client_and_harness_cpu_s=round(c.self_cpu, 2), server_cpu_s=round(server_cpu, 2),
               contention=c.as_dict())
    # The server is another process: take its CPU out of "other" (what is left is truly someone else's).
    ncpu = os.cpu_count() or 1
    out["contention"]["other_cpu_frac"] = round(max(c.other_cpu - server_cpu, 0.0) / (c.wall_s * ncpu), 4)
    return out, [r["text"] for r in results]


# ---- offline -------------------------------------------------------------------------------------
def run_offline_phase(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict[str, Any], list[str]]:
    from kvserve import LLM, SamplingParams

    llm = LLM(args.model, num_threads=args.num_threads, max_num_seqs=args.num_requests,
              kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len, seed=args.seed)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], sp.clone(max_tokens=4), use_tqdm=False)  # warm-up
    with common.Contention() as c:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # The engine's own timestamps (arrival at add_request -> first token), for comparison with the server's.
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    return dict(engine="LLM.generate (offline)", output_tokens=tokens, duration_s=round(c.wall_s, 3),
                output_tok_s=round(tokens / c.wall_s, 2),
                ttft_ms=dict(p50=ms(percentile(ttft, 50)), p99=ms(percentile(ttft, 99)), max=ms(max(ttft))),
                contention=c.as_dict()), [o.outputs[0].text for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--num-requests", type=int, default=64, help="concurrent streaming clients")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON path (default results/serve_vs_offline-<time>.json)")
    args = ap.parse_args()
    common.set_thread_env(args.num_threads)

    prompts = make_prompts(args.num_requests, args.prompt_len, args.seed)
    result: dict[str, Any] = dict(benchmark="serve_vs_offline", args=vars(args),
                                  env=common.environment(args.num_threads))
    print(f"{args.num_requests} streaming clients, {args.prompt_len}-token prompts, {args.output_len} tokens out, "
          f"{args.num_threads} thread(s); load {os.getloadavg()[0]:.2f}", flush=True)
    result["server"], server_texts = run_server_phase(args, prompts)
    print(f"server: {result['server']['output_tok_s']} tok/s", flush=True)
    result["offline"], offline_texts = run_offline_phase(args, prompts)
    print(f"offline: {result['offline']['output_tok_s']} tok/s", flush=True)
    result["ratio_server_over_offline"] = round(result["server"]["output_tok_s"] / result["offline"]["output_tok_s"], 3)
    result["same_greedy_text"] = sum(a == b for a, b in zip(server_texts, offline_texts, strict=True))
    path = common.write_result("serve_vs_offline", result, args.out)

    s, o = result["server"], result["offline"]
    rows = [[s["engine"], s["output_tok_s"], s["duration_s"], s["output_tokens"], s["ttft_ms"]["p50"],
             s["ttft_ms"]["p99"], s["itl_ms"]["p50"], s["itl_ms"]["p99"], s["contention"]["other_cpu_frac"]],
            [o["engine"], o["output_tok_s"], o["duration_s"], o["output_tokens"], o["ttft_ms"]["p50"],
             o["ttft_ms"]["p99"], "-", "-", o["contention"]["other_cpu_frac"]]]
    print()
    print(common.table(rows, ["path", "out tok/s", "wall s", "tokens", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                              "ITL p99 ms", "other cpu"]))
    print(f"\nserver / offline = {result['ratio_server_over_offline']}  (target >= 0.90); identical greedy text: "
          f"{result['same_greedy_text']}/{args.num_requests}; client CPU in the server phase: "
          f"{s['client_and_harness_cpu_s']} s, server CPU {s['server_cpu_s']} s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
