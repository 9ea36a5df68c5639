"""``kvserve bench throughput`` and ``kvserve bench latency``: the engine in-process, no server.

* throughput: the mixed workload of the engine-core issue (``make_mixed_workload``, the same definition as
  ``benchmarks/throughput.py``): N requests, prompt length ~ U[50, 800] random ids ~ U[1000, 40000], output
  length drawn from {16, 32, 64, 128, 256}, greedy with EOS ignored, all handed to ``LLM.generate`` at
  once. Output tok/s = requested output tokens / wall seconds of the ``generate`` call.
* latency: one request at a time (batch 1): prefill time = add_request -> first token (seconds; may span
  several steps with chunked prefill), decode time per token = (last token − first token) /
  (output tokens − 1). Each iteration uses a fresh random prompt so that a prefix cache cannot help.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from kvserve.bench.metrics import distribution, loadavg

OUT_CHOICES = (16, 32, 64, 128, 256)


def make_mixed_workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    """N ``(prompt token ids, output length)`` pairs of workload A ("mixed"), drawn from one seeded RNG."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        length = rng.randint(50, 800)
        prompt = [rng.randint(1000, 40000) for _ in range(length)]
        reqs.append((prompt, rng.choice(OUT_CHOICES)))
    return reqs


def set_threads(num_threads: int | None) -> None:
    """Pin OpenMP/MKL pools before torch starts them (the engine also calls ``torch.set_num_threads``)."""
    if num_threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(num_threads)


def _warmup(llm: Any) -> None:
    from kvserve import SamplingParams

    rng = random.Random(12345)
    prompts = [{"prompt_token_ids": [rng.randint(1000, 40000) for _ in range(16)]} for _ in range(2)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)


def run_throughput(engine_kwargs: dict[str, Any], num_prompts: int, seed: int, use_tqdm: bool = True
                   ) -> dict[str, Any]:
    """Run the mixed workload; returns tokens, wall seconds, tok/s, req/s, preemptions, load averages.

    Raises:
        ModelNotFoundError, InvalidRequestError: from the engine.
    """
    from kvserve import LLM, SamplingParams

    reqs = make_mixed_workload(num_prompts, seed)
    t = time.perf_counter()
    llm = LLM(**engine_kwargs)
    load_s = time.perf_counter() - t
    _warmup(llm)
    pre0 = llm.engine.num_preemptions
    before = loadavg()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs],
                        use_tqdm=use_tqdm)
    wall = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    requested = sum(o for _, o in reqs)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    return {
        "benchmark": "throughput", "workload": "mixed", "num_prompts": num_prompts, "seed": seed,
        "engine": engine_kwargs, "load_s": load_s, "duration_s": wall, "prompt_tokens": prompt_tokens,
        "requested_output_tokens": requested, "produced_output_tokens": produced,
        "output_throughput": requested / wall, "total_token_throughput": (requested + prompt_tokens) / wall,
        "request_throughput": num_prompts / wall, "preemptions": llm.engine.num_preemptions - pre0,
        "exact_token_counts": produced == requested, "loadavg_before": before, "loadavg_after": loadavg(),
    }


def run_latency(engine_kwargs: dict[str, Any], input_len: int, output_len: int, num_iters: int,
                num_iters_warmup: int = 1, seed: int = 0) -> dict[str, Any]:
    """Batch-1 latency: prefill seconds, decode seconds per token and E2E seconds, as distributions.

    Raises:
        ValueError: ``output_len`` < 2 (no decode step to time) or ``num_iters`` < 1.
    """
    if output_len < 2 or num_iters < 1:
        raise ValueError(f"need output_len >= 2 and num_iters >= 1, got {output_len}, {num_iters}")
    from kvserve import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prefill, decode, e2e = [], [], []
    before = loadavg()
    for it in range(num_iters_warmup + num_iters):
        ids = [rng.randint(1000, 40000) for _ in range(input_len)]
        t0 = time.perf_counter()
        rid = engine.add_request(None, {"prompt_token_ids": ids}, params)
        t_first: float | None = None
        done = False
        while not done:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                if t_first is None and out.outputs[0].token_ids:
                    t_first = time.perf_counter()
                done = out.finished
        t_end = time.perf_counter()
        assert t_first is not None
        if it >= num_iters_warmup:
            prefill.append(t_first - t0)
            decode.append((t_end - t_first) / (output_len - 1))
            e2e.append(t_end - t0)
    p = distribution(prefill)
    return {
        "benchmark": "latency", "engine": engine_kwargs, "input_len": input_len, "output_len": output_len,
        "num_iters": num_iters, "prefill_s": p, "decode_s_per_token": distribution(decode), "e2e_s": distribution(e2e),
        "prefill_tokens_per_s": input_len / p["mean"] if p["mean"] else None,
        "loadavg_before": before, "loadavg_after": loadavg(),
    }
