"""Prefill attention: the native paged kernel (csrc/prefill_attention.c) against the torch SDPA path.

One layer's attention of a prefill step, bf16 (q, K/V cache), SmolLM2-135M's geometry by default (9 query
heads, 3 KV heads, head_dim 64), 2 threads. Cases:

* ``512x4``: four fresh 512-token prompts (2,048 tokens);
* ``mixed``: fresh prompts of 100..800 tokens (seeded) filling 2,048 tokens;
* ``chunk60+1000``: 16 chunks of 60 tokens, each continuing a 1,000-token cached prefix.

GFLOP/s counts the causal work only: ``4 * head_dim * num_heads * sum_i (offset + i + 1)`` (two matmuls,
2 FLOP per multiply-add), the same numerator for both paths. Times are the median of ``--repeats`` calls;
"x layers" multiplies one layer's attention by ``--layers`` (SmolLM2-135M: 30) for a step's total.

``--model NAME`` instead times whole forward passes of that model (``--dtype``, its own geometry) over the
same three steps, with the native prefill kernel and with the torch SDPA prefill (everything else equal).

    .venv/bin/python benchmarks/prefill_attention.py [--threads 2] [--head-dim 64] [--repeats 5]
    .venv/bin/python benchmarks/prefill_attention.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

from _bench_common import set_thread_env

if __name__ == "__main__":
    set_thread_env(int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 2)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvserve.core.request import Request  # noqa: E402
from kvserve.core.scheduler_output import ScheduledRequest  # noqa: E402
from kvserve.layers.attention import paged_attention  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402
from kvserve.worker.input_batch import prepare_inputs  # noqa: E402


def cases() -> dict[str, list[tuple[int, int]]]:
    """name -> [(num_computed_tokens, num_new_tokens)] per request."""
    rng = np.random.default_rng(0)
    mixed, total = [], 0
    while total < 2048:
        n = min(int(rng.integers(100, 801)), 2048 - total)
        mixed.append((0, n))
        total += n
    return {"512x4": [(0, 512)] * 4, "mixed": mixed, "chunk60+1000": [(1000, 60)] * 16}


def causal_flops(shapes: list[tuple[int, int]], num_heads: int, head_dim: int) -> float:
    keys = sum(n * c + n * (n + 1) // 2 for c, n in shapes)
    return 4.0 * head_dim * num_heads * keys


def time_call(fn: object, repeats: int) -> float:
    fn()  # type: ignore[operator]  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def scheduled_steps(block_size: int) -> dict[str, tuple[list[ScheduledRequest], int]]:
    """name -> (the step's requests in the runner's order, with disjoint block tables; blocks used)."""
    steps = {}
    for name, shapes in cases().items():
        order, next_block = [], 0
        for c, n in shapes:
            nb = -(-(c + n) // block_size)
            req = Request("r", [(7 * i + 3) % 500 + 10 for i in range(c + n)], SamplingParams(), None, 8)
            order.append(ScheduledRequest(req, c, n, list(range(next_block, next_block + nb)),  # type: ignore[arg-type]
                                          sample=True))
            next_block += nb
        order.sort(key=lambda s: s.num_computed_tokens == 0)  # continuing chunks first, as the runner does
        steps[name] = (order, next_block)
    return steps


def model_main(args: argparse.Namespace) -> None:
    """Whole forward passes: native prefill attention vs the torch SDPA prefill, same model and step."""
    from kvserve import LLM

    bs = args.block_size
    steps = scheduled_steps(bs)
    blocks = max(nb for _, nb in steps.values())
    llm = LLM(args.model, dtype=args.dtype, num_gpu_blocks_override=blocks + 1, block_size=bs,
              skip_tokenizer_init=True, num_threads=args.threads)
    runner = llm.engine.runner
    model, cfg = runner.model, runner.arch
    assert runner.native_prefill, "the native prefill kernel is unavailable here"
    print(f"# {args.model}: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / "
          f"{cfg.num_key_value_heads} KV heads, head_dim {cfg.head_dim}, {args.dtype}, {args.threads} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'case':<14}{'tokens':>7}{'torch prefill ms':>18}{'native ms':>11}{'step speedup':>14}"
          f"{'attn GFLOP':>12}")
    cpu = torch.device("cpu")
    for name, (order, _) in steps.items():
        metas = {}
        for native in (False, True):
            ids, pos, metas[native], _ = prepare_inputs(order, 0, bs, cpu, runner.native_decode, native)
        with torch.inference_mode():
            t = {native: time_call(lambda: model(ids, pos, runner.kv_caches, metas[native]),  # noqa: B023
                                   args.repeats) for native in (False, True)}
        shapes = [(s.num_computed_tokens, s.num_scheduled_tokens) for s in order]
        gf = causal_flops(shapes, cfg.num_attention_heads, cfg.head_dim) * cfg.num_hidden_layers / 1e9
        print(f"{name:<14}{ids.shape[0]:>7}{t[False] * 1e3:>18.1f}{t[True] * 1e3:>11.1f}"
              f"{t[False] / t[True]:>13.2f}x{gf:>12.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=30, help="layers per step for the 'x layers' columns")
    ap.add_argument("--model", default=None, help="time whole forward passes of this model instead")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        model_main(args)
        return
    dtype = getattr(torch, args.dtype)
    bs, hq, hk, d = args.block_size, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    print(f"# {args.dtype}, {hq} heads / {hk} KV heads, head_dim {d}, block_size {bs}, {args.threads} threads, "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'case':<14}{'tokens':>7}{'GFLOP':>8}{'torch ms':>10}{'GFLOP/s':>9}{'native ms':>11}{'GFLOP/s':>9}"
          f"{'speedup':>9}   ms x {args.layers} layers: torch / native")
    for name, shapes in cases().items():
        num_blocks = sum(-(-(c + n) // bs) for c, n in shapes)
        perm = torch.randperm(num_blocks, generator=g).tolist()
        order = []
        for c, n in shapes:
            nb = -(-(c + n) // bs)
            table, perm = perm[:nb], perm[nb:]
            req = Request("r", [1] * (c + n), SamplingParams(), None, 8)
            order.append(ScheduledRequest(req, c, n, table, sample=True))  # type: ignore[arg-type]
        order.sort(key=lambda s: s.num_computed_tokens == 0)  # continuing chunks first, as the runner does
        k_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(dtype)
        v_cache = torch.randn(num_blocks, bs, hk, d, generator=g).to(dtype)
        t = sum(n for _, n in shapes)
        q = torch.randn(t, hq, d, generator=g).to(dtype)
        scale = 1 / math.sqrt(d)
        _, _, meta_t, _ = prepare_inputs(order, 0, bs, torch.device("cpu"))
        _, _, meta_n, _ = prepare_inputs(order, 0, bs, torch.device("cpu"), native_prefill=True)
        assert meta_n.native_prefill is not None and not meta_n.prefill_groups
        ref = paged_attention(q, k_cache, v_cache, meta_t, scale)
        out = paged_attention(q, k_cache, v_cache, meta_n, scale)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 0.05, f"{name}: native differs from torch by {err}"
        t_torch = time_call(lambda: paged_attention(q, k_cache, v_cache, meta_t, scale), args.repeats)  # noqa: B023
        t_nat = time_call(lambda: paged_attention(q, k_cache, v_cache, meta_n, scale), args.repeats)  # noqa: B023
        gf = causal_flops(shapes, hq, d) / 1e9
        print(f"{name:<14}{t:>7}{gf:>8.2f}{t_torch * 1e3:>10.2f}{gf / t_torch:>9.0f}{t_nat * 1e3:>11.2f}"
              f"{gf / t_nat:>9.0f}{t_torch / t_nat:>8.1f}x   {t_torch * 1e3 * args.layers:>8.0f} / "
              f"{t_nat * 1e3 * args.layers:.0f}")


if __name__ == "__main__":
    main()
