#!/usr/bin/env python3
"""Offline throughput on workload A ("mixed"): kvserve's LLM.generate against HF transformers static batching.

What is measured, and why
-------------------------
* Workload: the same definition as ``anchor_bench.make_workload("mixed", N, seed)`` (re-implemented here so
  the script needs nothing outside the repository): N requests, prompt = L random token ids with
  L ~ U[50, 800] and ids ~ U[1000, 40000], output length drawn from {16, 32, 64, 128, 256}, all drawn from one
  ``random.Random(seed)`` in that order. Greedy, EOS ignored, prompts passed as token-id lists, so both
  engines see exactly the same tokens and must produce exactly the requested number of tokens.
* kvserve: every request is handed to ``LLM.generate`` at once (continuous batching decides the batches);
  output tok/s = sum of requested output tokens / wall time of the ``generate`` call. The script checks that
  each request produced exactly its requested number of tokens, and reports the engine's preemptions and
  the number of engine steps.
* HF transformers: static batching exactly as ``shared/bench/hf_floor.py`` does (the floor every serving
  engine must beat): consecutive left-padded batches of ``--hf-batch`` requests (pad id 2), each batch run
  to its longest requested output (min_new_tokens = max_new_tokens, so EOS is ignored), greedy; useful
  tok/s counts only the tokens each request asked for, raw tok/s everything generated. The model is loaded
  from the very GGUF file kvserve serves (dequantized, float32), so both run the same weights.
* Both run in one process, one after the other, with the same thread count, each after a short warm-up
  on unrelated prompts. The 2 cores of this machine are shared and noisy: the JSON records the thread
  count, load averages before/after each phase and the CPU seconds other processes used meanwhile
  (``other_cpu_frac`` > ~0.05 means the numbers are contaminated). Default 1 thread: with another process
  busy, 2 torch threads can run 10-20x slower (OpenMP spin).
* As a sanity check the greedy outputs of the two engines are compared (common prefix per request); small
  numeric differences (padding, summation order) can legitimately make greedy paths diverge late.

Usage::

    python benchmarks/throughput.py                        # 64 prompts, both engines, 1 thread
    python benchmarks/throughput.py --num-prompts 8 --skip-hf
    python benchmarks/throughput.py --num-prompts 8 --hf-batch 4
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench_common as common  # noqa: E402

from kvserve.bench.offline import make_mixed_workload  # noqa: E402  (workload A, as anchor_bench's "mixed")

HF_PAD_ID = 2


def warmup_prompts() -> list[list[int]]:
    rng = random.Random(12345)  # unrelated to the workload's seed
    return [[rng.randint(1000, 40000) for _ in range(16)] for _ in range(2)]


# ---- kvserve --------------------------------------------------------------------------------------
def run_kvserve(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> tuple[dict[str, Any], list[list[int]]]:
    from kvserve import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(model=args.model, dtype=args.dtype, num_threads=args.num_threads, seed=args.seed)
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = args.kv_cache_memory
    if args.skip_tokenizer_init:
        kwargs["skip_tokenizer_init"] = True
    t = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t
    engine = llm.engine

    # warm-up on unrelated prompts (first-call allocations, OpenMP pool start)
    llm.generate([{"prompt_token_ids": p} for p in warmup_prompts()],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    steps = 0
    orig_step = engine.step

    def counted_step(*a: Any, **kw: Any) -> Any:
        nonlocal steps
        steps += 1
        return orig_step(*a, **kw)

    engine.step = counted_step  # instance attribute: counts the steps LLM.generate takes
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    pre0 = engine.num_preemptions
    with common.Contention() as c:
        outs = llm.generate(prompts, params, use_tqdm=False)
    engine.step = orig_step
    preemptions = engine.num_preemptions - pre0

    tokens = [list(o.outputs[0].token_ids) for o in outs]
    wrong = [dict(request=i, requested=o, got=len(t)) for i, ((_, o), t) in enumerate(zip(reqs, tokens, strict=True))
             if len(t) != o]
    useful = sum(o for _, o in reqs)
    produced = sum(len(t) for t in tokens)
    prompt_tokens = sum(len(p) for p, _ in reqs)
    res = dict(
        engine="kvserve", config=engine.config.to_dict(), resolved_dtype=str(engine.dtype).replace("torch.", ""),
        load_s=round(load_s, 2), num_kv_blocks=engine.num_blocks, duration_s=round(c.wall_s, 3),
        requested_output_tokens=useful, produced_output_tokens=produced, prompt_tokens=prompt_tokens,
        output_tok_s=round(useful / c.wall_s, 2), total_tok_s=round((useful + prompt_tokens) / c.wall_s, 2),
        request_s=round(len(reqs) / c.wall_s, 4), engine_steps=steps, preemptions=preemptions,
        exact_token_counts=not wrong, wrong_token_counts=wrong[:10], contention=c.as_dict(),
    )
    del llm, engine
    return res, tokens


# ---- HF transformers --------------------------------------------------------------------------------
def run_hf(args: argparse.Namespace, reqs: list[tuple[list[int], int]], gguf_path: Path
           ) -> tuple[dict[str, Any], list[list[int]]]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=getattr(torch, args.hf_dtype)).eval()
    load_s = time.perf_counter() - t

    def batch_tensors(rs: list[tuple[list[int], int]]) -> tuple[Any, Any]:
        width = max(len(p) for p, _ in rs)
        ids = torch.full((len(rs), width), HF_PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(rs), width), dtype=torch.long)
        for i, (p, _) in enumerate(rs):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask

    with torch.inference_mode():  # warm-up, as hf_floor.py
        w = [(p, 4) for p in warmup_prompts()]
        ids, mask = batch_tensors(w)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=HF_PAD_ID)

    per, raw, tokens = [], 0, []
    with common.Contention() as c, torch.inference_mode():
        for b in range(0, len(reqs), args.hf_batch):
            rs = reqs[b:b + args.hf_batch]
            ids, mask = batch_tensors(rs)
            n = max(o for _, o in rs)
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=HF_PAD_ID)
            el = time.perf_counter() - t
            gen = out.shape[1] - ids.shape[1]
            raw += gen * len(rs)
            for i, (_, o) in enumerate(rs):
                tokens.append(out[i, ids.shape[1]:ids.shape[1] + o].tolist())
            per.append(dict(batch=b // args.hf_batch, size=len(rs), padded_prompt=ids.shape[1], new_tokens=gen,
                            secs=round(el, 2)))
            print(f"  hf batch {per[-1]['batch']}: {len(rs)} reqs, padded prompt {ids.shape[1]}, "
                  f"{gen} new tokens, {el:.1f} s", flush=True)
    useful = sum(o for _, o in reqs)
    res = dict(
        engine="hf-transformers", transformers=transformers.__version__, dtype=args.hf_dtype, batch=args.hf_batch,
        load_s=round(load_s, 2), duration_s=round(c.wall_s, 3), requested_output_tokens=useful,
        raw_generated_tokens=raw, output_tok_s=round(useful / c.wall_s, 2), raw_tok_s=round(raw / c.wall_s, 2),
        request_s=round(len(reqs) / c.wall_s, 4), batches=per, contention=c.as_dict(),
    )
    del model
    return res, tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Common greedy prefix length per request between two engines' outputs."""
    prefixes = []
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefixes.append(k)
    n = len(prefixes)
    return dict(identical=sum(1 for p, x in zip(prefixes, a, strict=True) if p == len(x)),
                first_token_match=sum(1 for p in prefixes if p >= 1), first_8_match=sum(1 for p in prefixes if p >= 8),
                mean_common_prefix=round(sum(prefixes) / max(n, 1), 1), num_requests=n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="kvserve model (catalog name or path)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=1, help="torch threads for both engines (1 or 2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="kvserve dtype (auto = float32 on CPU)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="kvserve max_num_seqs (default: engine's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="kvserve max_num_batched_tokens (default: engine's)")
    ap.add_argument("--kv-cache-memory", type=float, default=None, help="kvserve KV cache GiB (default: engine's)")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="kvserve without tokenizer/detokenizer")
    ap.add_argument("--skip-hf", action="store_true", help="measure kvserve only")
    ap.add_argument("--skip-kvserve", action="store_true", help="measure HF only")
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", help="JSON path (default results/throughput-<time>.json)")
    args = ap.parse_args()

    common.set_thread_env(args.num_threads)
    import torch

    torch.set_num_threads(args.num_threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    from kvserve.models.catalog import resolve_model_path

    reqs = make_mixed_workload(args.num_prompts, args.seed)
    result: dict[str, Any] = dict(
        benchmark="throughput", workload="mixed", num_prompts=len(reqs), seed=args.seed,
        num_threads=args.num_threads, args=vars(args), env=common.environment(args.num_threads),
        prompt_tokens=sum(len(p) for p, _ in reqs), requested_output_tokens=sum(o for _, o in reqs),
    )
    print(f"workload mixed: {len(reqs)} requests, {result['prompt_tokens']} prompt tokens, "
          f"{result['requested_output_tokens']} output tokens; threads {args.num_threads}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    kv_tokens = hf_tokens = None
    if not args.skip_kvserve:
        result["kvserve"], kv_tokens = run_kvserve(args, reqs)
        k = result["kvserve"]
        print(f"kvserve: {k['output_tok_s']} tok/s in {k['duration_s']} s, {k['engine_steps']} steps, "
              f"{k['preemptions']} preemptions, exact counts {k['exact_token_counts']}", flush=True)
    if not args.skip_hf:
        gguf = resolve_model_path(args.model)
        if gguf.suffix != ".gguf":
            raise SystemExit(f"HF comparison loads a GGUF file; {gguf} is not one (use --skip-hf)")
        result["hf"], hf_tokens = run_hf(args, reqs, gguf)
    if kv_tokens is not None and hf_tokens is not None:
        result["ratio_kvserve_over_hf"] = round(result["kvserve"]["output_tok_s"] / result["hf"]["output_tok_s"], 3)
        result["greedy_agreement"] = agreement(kv_tokens, hf_tokens)
    result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    path = common.write_result("throughput", result, args.out)

    rows = []
    for key in ("kvserve", "hf"):
        r = result.get(key)
        if r is None:
            continue
        c = r["contention"]
        rows.append([r["engine"], r.get("resolved_dtype", r.get("dtype")), args.num_threads, r["output_tok_s"],
                     r["duration_s"], r["requested_output_tokens"], r.get("preemptions", "-"),
                     r.get("engine_steps", "-"), f"{c['load_before'][0]} -> {c['load_after'][0]}",
                     c["other_cpu_frac"]])
    print()
    print(common.table(rows, ["engine", "dtype", "threads", "out tok/s", "wall s", "out tokens", "preempt", "steps",
                              "load1 before->after", "other cpu"]))
    if "ratio_kvserve_over_hf" in result:
        print(f"\nkvserve / HF = {result['ratio_kvserve_over_hf']}x;  greedy agreement: {result['greedy_agreement']}")
    if "kvserve" in result:
        k = result["kvserve"]
        print(f"kvserve exact token counts: {k['exact_token_counts']}"
              + ("" if k["exact_token_counts"] else f" (mismatches: {k['wrong_token_counts']})"))
    print(f"wrote {path}")
    if "kvserve" in result and not result["kvserve"]["exact_token_counts"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
