"""``kvserve bench serve``: drive an OpenAI-compatible server with a workload and measure it against SLOs.

Arrivals: with a request rate ``R`` (requests/s), inter-arrival gaps are exponential with mean ``1/R``
(a Poisson process, seeded); ``R = inf`` sends everything at once. With a max concurrency ``C``, at most
``C`` requests are in flight (a closed loop when no rate is given: a new request starts as soon as one
finishes). A multi-turn session is one unit of work: its turns are sent one after another, each after
the previous reply arrived, with the reply text added to the history.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from kvserve.bench import datasets as ds
from kvserve.bench.client import RequestInput, RequestResult, connection_trace, run_async, send_request
from kvserve.bench.metrics import SLO, best_point, loadavg, meets_slo, summarize


@dataclass(frozen=True)
class ClientConfig:
    """How to talk to the server. ``api``: ``completions`` or ``chat``; ``timeout_s``: per request; ``endpoint``:
    the URL path (None: the API's usual one)."""

    base_url: str
    model: str
    api: str = "completions"
    api_key: str | None = None
    ignore_eos: bool = True
    logprobs: bool = True
    temperature: float = 0.0
    timeout_s: float = 3600.0
    endpoint: str | None = None


@dataclass(frozen=True)
class LoadSpec:
    """One point: ``request_rate`` (requests/s, inf = all at once) and/or ``max_concurrency`` (None: unbounded)."""

    request_rate: float = math.inf
    max_concurrency: int | None = None

    def label(self) -> str:
        parts = []
        if self.max_concurrency is not None:
            parts.append(f"C={self.max_concurrency}")
        if not math.isinf(self.request_rate):
            parts.append(f"R={self.request_rate:g}/s")
        return " ".join(parts) or "all at once"


def _first_prompt(req: ds.SampleRequest, api: str) -> str | list[int] | list[dict[str, str]]:
    if api == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("token-id prompts (the random dataset) need --api completions")
        return list(ds.iter_turn_messages([], req.prompt, req.system))
    if req.multi_turn and isinstance(req.prompt, str):
        return ds.transcript([], req.prompt)
    if req.system is not None and isinstance(req.prompt, str):
        return req.system + "\n\n" + req.prompt
    return req.prompt


async def _run_session(session: aiohttp.ClientSession, cfg: ClientConfig, req: ds.SampleRequest, t0: float
                       ) -> list[RequestResult]:
    """All turns of one work item (a single request unless ``req.turns``); stops at the first failed turn."""
    def inp(prompt: str | list[int] | list[dict[str, str]]) -> RequestInput:
        return RequestInput(cfg.api, cfg.base_url, cfg.model, prompt, req.output_len, cfg.ignore_eos, cfg.logprobs,
                            cfg.temperature, cfg.api_key, cfg.endpoint)

    results = [await send_request(session, inp(_first_prompt(req, cfg.api)), t0)]
    history: list[tuple[str, str]] = []
    question = str(req.prompt)
    for nxt in req.turns:
        if not results[-1].success:
            break
        history.append((question, results[-1].text))
        question = nxt
        prompt: str | list[dict[str, str]] = (list(ds.iter_turn_messages(history, question, req.system))
                                              if cfg.api == "chat" else ds.transcript(history, question))
        results.append(await send_request(session, inp(prompt), t0))
    return results


async def run_load(cfg: ClientConfig, requests: list[ds.SampleRequest], load: LoadSpec, seed: int = 0,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``requests`` under ``load``; returns (per-request results in send order, duration in seconds).

    Duration runs from the first send to the last reply.
    """
    rng = random.Random(seed)
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    total = sum(1 + len(r.turns) for r in requests)
    bar = tqdm(total=total, desc=load.label(), disable=not progress, leave=False)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)

    traces = [connection_trace()]  # tells send_request whether a connection was reused (keep-alive retry)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trace_configs=traces) as session:
        async def work(req: ds.SampleRequest) -> list[RequestResult]:
            if sem is None:
                out = await _run_session(session, cfg, req, t0)
            else:
                async with sem:
                    out = await _run_session(session, cfg, req, t0)
            bar.update(len(out))
            return out

        t0 = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and not math.isinf(load.request_rate):
                await asyncio.sleep(rng.expovariate(load.request_rate))
            tasks.append(asyncio.create_task(work(req)))
        groups = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return [r for g in groups for r in g], duration


def run_point(cfg: ClientConfig, requests: list[ds.SampleRequest], load: LoadSpec, slo: SLO, seed: int = 0,
              progress: bool = True, keep_requests: bool = True) -> dict[str, Any]:
    """One measured run: its load, machine load averages before/after, summary and per-request timings."""
    before = loadavg()
    results, duration = run_async(run_load(cfg, requests, load, seed, progress))
    after = loadavg()
    summary = summarize(results, duration, slo)
    point: dict[str, Any] = {
        "label": load.label(),
        "max_concurrency": load.max_concurrency,
        "request_rate": None if math.isinf(load.request_rate) else load.request_rate,
        "num_prompts": len(requests),
        "loadavg_before": before,
        "loadavg_after": after,
        "meets_slo": meets_slo(summary, slo) if slo.given else None,  # no verdict without an SLO
        "summary": summary,
    }
    if keep_requests:
        point["requests"] = [{k: v for k, v in r.as_dict().items() if k not in ("text", "chunk_times")}
                             for r in results]
    return point


def warmup(cfg: ClientConfig, req: ds.SampleRequest) -> RequestResult:
    """One short request (4 tokens) before measuring; its result is not counted.

    Raises:
        RuntimeError: the request failed (server down, wrong model name ...), with the error.
    """
    short = ds.SampleRequest(req.prompt, req.prompt_len, 4, req.system, multi_turn=req.multi_turn)
    results, _ = run_async(run_load(cfg, [short], LoadSpec(), progress=False))
    if not results[0].success:
        raise RuntimeError(f"warm-up request to {cfg.base_url} failed: {results[0].error}")
    return results[0]


def sweep(cfg: ClientConfig, requests: list[ds.SampleRequest], loads: list[LoadSpec], sizes: list[int], slo: SLO,
          seed: int = 0, progress: bool = True, on_point: Callable[[dict[str, Any]], None] | None = None
          ) -> dict[str, Any]:
    """Run each load on the first ``sizes[i]`` requests; returns ``{"points": [...], "best": point | None}``.

    ``best`` is the point with the highest output token throughput that meets the SLOs (p95, no failures).
    """
    points = []
    for load, n in zip(loads, sizes, strict=True):
        p = run_point(cfg, requests[:n], load, slo, seed, progress)
        points.append(p)
        if on_point is not None:
            on_point(p)
    best = best_point(points, slo)
    return {"points": points, "best": None if best is None else {k: best[k] for k in ("label", "max_concurrency",
                                                                                      "request_rate")}}
