#!/usr/bin/env python3
"""Prefix caching on vs off on two workloads (issue 4), on the default model.

* ``agent``: one agent session through the chat template: a fixed ~1,000-token system prompt, 7 turns,
  ~60-token user messages and 120-token model replies (greedy, EOS ignored), the whole history carried
  into the next turn (the reply text is re-rendered by the template, as a client would send it). Per turn:
  prompt tokens, cached tokens (hit rate = cached / prompt) and TTFT (from ``add_request`` to the step
  that returns the first token). Target: from turn 2 on, hit rate >= 90 % and TTFT <= 25 % of cache-off.
* ``shared``: 64 requests sharing the same ~1,000-token system prompt, each with a short distinct
  question (~20 tokens), 32 output tokens, all submitted at once: wall time and tok/s, on vs off.
* ``layout``: the prompt-layout lesson of docs/prefix_caching.md, caching on: 8 sequential requests
  whose ~500-token system prompt carries a timestamp, once at the start ("bad") and once at the end
  ("good"), each with a distinct question: mean hit rate and TTFT per layout.

Both phases run in one process with the same thread count, caching off first then on, on two engines
with identical settings; greedy outputs of on and off are compared (must be identical). Results: a table
and JSON under results/.

Usage::

    python benchmarks/prefix_caching.py                 # all three workloads, 1 thread
    python benchmarks/prefix_caching.py --workload agent --num-threads 2
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import Contention, environment, set_thread_env, table, write_result  # noqa: E402

_WORD_TEXT = ("river valley engine cache block request token memory budget planner kernel stream queue agent tool "
              "search answer history window layer vector matrix server client policy metric window latency batch "
              "prefix decode prefill schedule worker model careful summary detail reason example check result")
WORDS = _WORD_TEXT.split(" ")


def words_to_tokens(tokenizer: Any, rng: random.Random, num_tokens: int) -> str:
    """Random words, cut to ``num_tokens`` tokens of the model's tokenizer and decoded back to text."""
    text = " ".join(rng.choice(WORDS) for _ in range(num_tokens * 2))
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    return str(tokenizer.decode(ids))


def run_one(engine: Any, request_id: str, prompt_ids: list[int], params: Any) -> tuple[Any, float]:
    """Run one request alone; returns (final RequestOutput, TTFT seconds)."""
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


def agent_session(llm: Any, system: str, users: list[str], reply_tokens: int) -> list[dict[str, Any]]:
    from kvserve import SamplingParams

    tok = llm.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=reply_tokens, ignore_eos=True)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    rows = []
    for turn, user in enumerate(users, 1):
        messages.append({"role": "user", "content": user})
        ids = tok.apply_chat_template(messages)
        out, ttft = run_one(llm.engine, f"turn{turn}-{time.monotonic_ns()}", ids, params)
        reply = out.outputs[0].text
        messages.append({"role": "assistant", "content": reply})
        rows.append(dict(turn=turn, prompt_tokens=len(ids), cached_tokens=out.num_cached_tokens,
                         hit_rate=out.num_cached_tokens / len(ids), ttft_s=ttft, reply=out.outputs[0].token_ids))
    return rows


def bench_agent(engines: dict[str, Any], seed: int, turns: int) -> dict[str, Any]:
    tok = engines["off"].engine.tokenizer
    rng = random.Random(seed)
    system = "You are a careful planning agent. " + words_to_tokens(tok, rng, 1000)
    users = [words_to_tokens(tok, rng, 60) for _ in range(turns)]
    result: dict[str, Any] = {}
    for name, llm in engines.items():
        with Contention() as c:
            result[name] = agent_session(llm, system, users, 120)
        result[f"{name}_contention"] = c.as_dict()
    off, on = result["off"], result["on"]
    same = all(a["reply"] == b["reply"] for a, b in zip(off, on, strict=True))
    rows = []
    for a, b in zip(off, on, strict=True):
        rows.append([a["turn"], b["prompt_tokens"], b["cached_tokens"], f"{b['hit_rate']:.1%}",
                     f"{a['ttft_s']:.3f}", f"{b['ttft_s']:.3f}", f"{b['ttft_s'] / a['ttft_s']:.1%}"])
    print(table(rows, ["turn", "prompt tok", "cached tok", "hit rate", "TTFT off s", "TTFT on s", "on/off"]))
    later = [(a, b) for a, b in zip(off, on, strict=True) if a["turn"] >= 2]
    summary = dict(min_hit_rate_turn2plus=min(b["hit_rate"] for _, b in later),
                   max_ttft_ratio_turn2plus=max(b["ttft_s"] / a["ttft_s"] for a, b in later),
                   identical_replies=same)
    print(f"turns 2-{turns}: min hit rate {summary['min_hit_rate_turn2plus']:.1%} (target >= 90 %), "
          f"max TTFT on/off {summary['max_ttft_ratio_turn2plus']:.1%} (target <= 25 %), "
          f"replies identical on/off: {same}")
    for rows_ in (off, on):
        for r in rows_:
            del r["reply"]
    result["summary"] = summary
    return result


def bench_shared(engines: dict[str, Any], seed: int, num_prompts: int, output_len: int) -> dict[str, Any]:
    from kvserve import SamplingParams

    tok = engines["off"].engine.tokenizer
    rng = random.Random(seed + 1)
    system = "You answer questions about the following notes. " + words_to_tokens(tok, rng, 1000)
    prompts = []
    for i in range(num_prompts):
        question = f"Question {i}: " + words_to_tokens(tok, rng, 16) + "?"
        prompts.append({"prompt_token_ids": tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}])})
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    result: dict[str, Any] = {}
    outputs = {}
    for name, llm in engines.items():
        llm.reset_prefix_cache()
        before = llm.get_prefix_cache_stats()
        with Contention() as c:
            outs = llm.generate(prompts, params, use_tqdm=False)
        after = llm.get_prefix_cache_stats()
        outputs[name] = [o.outputs[0].token_ids for o in outs]
        queries = after["queries"] - before["queries"]
        hits = after["hits"] - before["hits"]
        n_prompt = sum(len(p["prompt_token_ids"]) for p in prompts)
        result[name] = dict(wall_s=c.wall_s, output_tok_s=num_prompts * output_len / c.wall_s,
                            total_tok_s=(n_prompt + num_prompts * output_len) / c.wall_s,
                            hit_rate=hits / queries if queries else 0.0, prompt_tokens=n_prompt,
                            contention=c.as_dict())
    off, on = result["off"], result["on"]
    rows = [[name, f"{r['wall_s']:.1f}", f"{r['output_tok_s']:.1f}", f"{r['total_tok_s']:.1f}",
             f"{r['hit_rate']:.1%}", r["contention"]["other_cpu_frac"]] for name, r in result.items()]
    print(table(rows, ["caching", "wall s", "output tok/s", "total tok/s", "hit rate", "other cpu"]))
    result["speedup"] = off["wall_s"] / on["wall_s"]
    result["identical_outputs"] = outputs["on"] == outputs["off"]
    print(f"{num_prompts} requests sharing a {len(tok.encode(system))}-token system prompt: on is "
          f"{result['speedup']:.2f}x faster; outputs identical: {result['identical_outputs']}")
    return result


def bench_layout(llm: Any, seed: int, num_requests: int = 8) -> dict[str, Any]:
    from kvserve import SamplingParams

    tok = llm.engine.tokenizer
    rng = random.Random(seed + 2)
    rules = "Follow the house rules below when you answer. " + words_to_tokens(tok, rng, 500)
    questions = [words_to_tokens(tok, rng, 20) + "?" for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    result: dict[str, Any] = {}
    for layout in ("bad", "good"):
        llm.reset_prefix_cache()
        rows = []
        for i, q in enumerate(questions):
            stamp = f"Current time: 2026-11-29 10:{i:02d}:{(7 * i) % 60:02d} UTC."
            system = f"{stamp} {rules}" if layout == "bad" else f"{rules} {stamp}"
            ids = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
            out, ttft = run_one(llm.engine, f"{layout}{i}-{time.monotonic_ns()}", ids, params)
            rows.append(dict(prompt_tokens=len(ids), cached_tokens=out.num_cached_tokens, ttft_s=ttft))
        later = rows[1:]
        result[layout] = dict(rows=rows, hit_rate=sum(r["cached_tokens"] for r in later) / sum(
            r["prompt_tokens"] for r in later), mean_ttft_s=sum(r["ttft_s"] for r in later) / len(later))
    print(table([[k, f"{v['hit_rate']:.1%}", f"{v['mean_ttft_s']:.3f}"] for k, v in result.items()],
                ["timestamp", "hit rate (requests 2..)", "mean TTFT s (requests 2..)"]))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["agent", "shared", "layout", "all"], default="all")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--turns", type=int, default=7)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    set_thread_env(args.num_threads)
    from kvserve import LLM

    engines = {name: LLM(args.model, num_threads=args.num_threads, kv_cache_memory=1.0, max_model_len=4096,
                         enable_prefix_caching=(name == "on")) for name in ("off", "on")}
    result: dict[str, Any] = dict(env=environment(args.num_threads), args=vars(args))
    if args.workload in ("layout", "all"):
        print("== prompt layout: a timestamp at the start (bad) or at the end (good) of the system prompt")
        result["layout"] = bench_layout(engines["on"], args.seed)
    if args.workload in ("agent", "all"):
        print("== agent workload: 1 session, system prompt ~1,000 tokens, 60-token users, 120-token replies")
        result["agent"] = bench_agent(engines, args.seed, args.turns)
    if args.workload in ("shared", "all"):
        print(f"== shared system prompt: {args.num_prompts} requests, {args.output_len} output tokens each")
        result["shared"] = bench_shared(engines, args.seed, args.num_prompts, args.output_len)
    print(f"saved {write_result('prefix_caching', result, args.out)}")


if __name__ == "__main__":
    main()
