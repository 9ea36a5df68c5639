"""Decode attention alone over bf16, int8 and fp8 KV caches (``cpu_kernels.paged_decode_attention``, one layer).

The docs/kv_cache_8bit.md "Speed" table: per shape, the three caches are timed in turn within each round
(interleaved, so host drift hits them alike), ``--rounds`` rounds; a cell is the median time of one call in
µs and, for the 8-bit caches, the median over rounds of its time / bf16's time of the same round. Shapes
(KV heads x head_dim, query heads per KV head; sequences x tokens each):

* SmolLM2-135M: 3 x 64, group 3; 1 x 2,048 and 16 x 1,024;
* Qwen2.5-1.5B: 2 x 128, group 6; 16 x 1,024.

Blocks of 16 tokens, each sequence's blocks scattered over the pool (a random permutation), K/V values
``randn`` times a random magnitude per row. "GB/s" is the cache bytes read (K and V rows of every attended
token, scales included) per second of the median call.

    .venv/bin/python benchmarks/kv8_attention.py [--threads 1] [--rounds 40] [--out results/x.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

from _bench_common import Contention, environment, set_thread_env, table, write_result

if __name__ == "__main__":
    set_thread_env(int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1)

import torch  # noqa: E402

from kvserve.layers import cpu_kernels  # noqa: E402
from kvserve.layers.kv_quant import quantize  # noqa: E402

BLOCK = 16
SHAPES = {  # name -> (num_kv_heads, head_dim, group, num_seqs, tokens per sequence)
    "SmolLM2 1x2048": (3, 64, 3, 1, 2048),
    "SmolLM2 16x1024": (3, 64, 3, 16, 1024),
    "Qwen2.5-1.5B 16x1024": (2, 128, 6, 16, 1024),
}
FORMATS = ("bf16", "int8", "fp8")


def make_case(num_kv_heads: int, head_dim: int, group: int, num_seqs: int, tokens: int,
              seed: int = 0) -> dict[str, torch.Tensor]:
    """q ``[num_seqs, H, group, D]`` float32, block tables, seq lens, and K/V caches per format (bf16
    ``[blocks, 16, H, D]``; int8 / fp8 rows of ``kv_quant.quantize``)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-tokens // BLOCK)
    num_blocks = num_seqs * per_seq
    shape = (num_blocks, BLOCK, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g) * torch.rand(shape[:3] + (1,), generator=g) * 4
    v = torch.randn(shape, generator=g) * torch.rand(shape[:3] + (1,), generator=g) * 4
    case = {"q": torch.randn(num_seqs, num_kv_heads, group, head_dim, generator=g),
            "tables": torch.randperm(num_blocks, generator=g).view(num_seqs, per_seq),
            "lens": torch.full((num_seqs,), tokens, dtype=torch.int64),
            "k_bf16": k.bfloat16(), "v_bf16": v.bfloat16(),
            "k_int8": quantize(k, torch.int8), "v_int8": quantize(v, torch.int8),
            "k_fp8": quantize(k, torch.uint8), "v_fp8": quantize(v, torch.uint8)}
    return case


def bytes_read(case: dict[str, torch.Tensor], fmt: str) -> int:
    """K and V bytes of every attended token's rows (scales included)."""
    k = case[f"k_{fmt}"]
    row = k.shape[3] * k.element_size()
    return 2 * int(case["lens"].sum()) * k.shape[2] * row


def decode_call(case: dict[str, torch.Tensor], fmt: str) -> Callable[[], torch.Tensor]:
    q, k, v = case["q"], case[f"k_{fmt}"], case[f"v_{fmt}"]
    scale = 1 / math.sqrt(q.shape[-1])
    return lambda: cpu_kernels.paged_decode_attention(q, k, v, case["tables"], case["lens"], scale)


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of one call of each of ``calls``, timed in turn within each of ``rounds`` rounds (after
    ``warmup`` untimed rounds): name -> the per-round times."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def summarize(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    """Per name: the median µs, and the median over rounds of its time / ``base``'s time in that round."""
    return {name: {"median_us": statistics.median(t) * 1e6,
                   "ratio": statistics.median(a / b for a, b in zip(t, times[base], strict=True))}
            for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", default=None, help="result JSON (default results/kv8_attention-<time>.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_kernels.native_available():
        print("the native kernels are unavailable (no C compiler?): nothing to time", file=sys.stderr)
        return 1
    import kvserve

    result: dict[str, object] = {"env": environment(args.threads), "kvserve": kvserve.__file__,
                                 "kv8_features": sorted(cpu_kernels.kv8_features()), "rounds": args.rounds,
                                 "shapes": {}}
    rows = []
    for name, shape in SHAPES.items():
        case = make_case(*shape)
        with Contention() as c:
            times = interleaved({fmt: decode_call(case, fmt) for fmt in FORMATS}, args.rounds)
        s = summarize(times, "bf16")
        gbs = {fmt: bytes_read(case, fmt) / (s[fmt]["median_us"] * 1e-6) / 1e9 for fmt in FORMATS}
        result["shapes"][name] = {"shape": shape, "stats": s, "gbs": gbs, "contention": c.as_dict()}  # type: ignore[index]
        rows.append([name] + [f"{s[f]['median_us']:,.0f} µs" + ("" if f == "bf16" else f" ({s[f]['ratio']:.2f}x)")
                              + f", {gbs[f]:.1f} GB/s" for f in FORMATS] + [f"{c.other_cpu_frac:.2f}"])
    print(table(rows, ["shape", *FORMATS, "other CPU"]))
    print(f"result: {write_result('kv8_attention', result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
