"""The serving cost model as pure functions (../shared/docs/cost-model.md; the formulas in docs/planner.md).

Torch-free and numpy-free on purpose: the scheduler imports the preemption functions, and the planner
(``kvserve plan``) builds every table from these. Units: bytes, seconds, tokens; ``dtype_bytes`` is the
size of one KV cache element (fp32 4, bf16/fp16 2, fp8/int8 1).

Every function raises ``ValueError`` on a negative size or a non-positive speed/bandwidth, naming the
argument, so that a planner typo never prints a silently absurd number.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

PreemptMode = Literal["recompute", "swap"]

# Bytes per KV cache element, by the names ``--kv-cache-dtype`` accepts (``auto`` is resolved by the caller).
KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


# ---- KV cache size (cost-model.md, "KV cache size") ------------------------------------------------------
def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """KV cache bytes one token occupies: ``2 (K and V) × num_layers × num_kv_heads × head_dim × dtype_bytes``.

    Source: cost-model.md, "KV cache size". SmolLM2-135M in fp32: 2 × 30 × 3 × 64 × 4 = 46,080 bytes.

    Raises:
        ValueError: any argument is not positive.
    """
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("dtype_bytes", dtype_bytes)):
        _positive(name, v)
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


KV8_INT8_GROUP = 16  # channels per float16 scale of an int8 KV row (kvserve/layers/kv_quant.py)
KV8_FP8_SCALE_BYTES = 4  # one float32 scale per fp8 KV row (token, KV head)


def kv8_row_bytes(head_dim: int, kv_cache_dtype: str = "int8") -> int:
    """Bytes of one (token, KV head) row of kvserve's 8-bit KV cache (kvserve/layers/kv_quant.py):
    ``int8``: ``head_dim`` codes + a 2-byte float16 scale per 16 channels, ``head_dim + 2 × ceil(head_dim / 16)``
    (72 at head_dim 64, 144 at 128); ``fp8``: ``head_dim`` codes + one float32 scale, ``head_dim + 4``.

    Raises:
        ValueError: head_dim not positive, or a dtype other than ``int8`` / ``fp8`` / ``fp8_e4m3``.
    """
    _positive("head_dim", head_dim)
    if kv_cache_dtype == "int8":
        return head_dim + 2 * -(-head_dim // KV8_INT8_GROUP)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return head_dim + KV8_FP8_SCALE_BYTES
    raise ValueError(f"not an 8-bit KV cache dtype: {kv_cache_dtype!r} (int8, fp8, fp8_e4m3)")


def kv_bytes_per_token_8bit(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str = "int8") -> int:
    """Bytes one token occupies in kvserve's 8-bit KV cache, scales included:
    ``2 × num_layers × num_kv_heads × kv8_row_bytes(head_dim, kv_cache_dtype)``.

    SmolLM2-135M: int8 2 × 30 × 3 × 72 = 12,960 bytes, fp8 2 × 30 × 3 × 68 = 12,240 (bf16: 23,040; the block
    count grows 1.78× with int8, 1.88× with fp8; at head_dim 128 1.78× and 1.94×).

    Raises:
        ValueError: any size not positive, or not an 8-bit dtype.
    """
    return kv_bytes_per_token(num_layers, num_kv_heads, kv8_row_bytes(head_dim, kv_cache_dtype), 1)


def kv_bytes(kv_bytes_per_token: int, seq_len: int) -> int:
    """KV cache bytes of one request of ``seq_len`` tokens: ``kv_bytes_per_token × seq_len``.

    Source: cost-model.md, "KV cache size". Multiply by the batch size for a batch.

    Raises:
        ValueError: a negative argument.
    """
    _non_negative("kv_bytes_per_token", kv_bytes_per_token)
    _non_negative("seq_len", seq_len)
    return kv_bytes_per_token * seq_len


def max_concurrency(kv_memory_bytes: float, kv_bytes_per_token: int, seq_len: int) -> int:
    """How many requests of ``seq_len`` tokens fit in ``kv_memory_bytes``: ``floor(kv_memory / kv_bytes(seq_len))``.

    Source: cost-model.md, "KV cache size" (``kv_memory`` is what is left after weights and reserve).
    Ignores paging waste (at most ``block_size − 1`` tokens per request, cost-model.md "Block size").

    Raises:
        ValueError: ``kv_bytes_per_token`` or ``seq_len`` not positive, or negative memory.
    """
    _non_negative("kv_memory_bytes", kv_memory_bytes)
    _positive("kv_bytes_per_token", kv_bytes_per_token)
    _positive("seq_len", seq_len)
    return math.floor(kv_memory_bytes / (kv_bytes_per_token * seq_len))


def kv_memory_bytes(device_memory_bytes: float, weight_bytes: float, utilization: float = 1.0,
                    reserve_bytes: float = 0.0) -> float:
    """Memory left for the KV cache: ``device_memory × utilization − weights − reserve`` (never below 0).

    Source: cost-model.md, "KV cache size" (reserve = activations and fragmentation).

    Raises:
        ValueError: ``utilization`` outside (0, 1] or a negative size.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    for name, v in (("device_memory_bytes", device_memory_bytes), ("weight_bytes", weight_bytes),
                    ("reserve_bytes", reserve_bytes)):
        _non_negative(name, v)
    return max(device_memory_bytes * utilization - weight_bytes - reserve_bytes, 0.0)


# ---- Decode roofline (cost-model.md, "Decode roofline") -------------------------------------------------
def decode_step_lower_bound_s(weight_bytes: float, kv_bytes_total: float, bandwidth_bytes_per_s: float) -> float:
    """Lower bound of one decode step in seconds: ``(W + Σ K_i) / bandwidth``.

    Every step reads all weights once (shared by the batch) and each running request's whole KV cache.
    Source: cost-model.md, "Decode roofline". Ignores compute, so real steps are at least this long.

    Raises:
        ValueError: negative bytes or non-positive bandwidth.
    """
    _non_negative("weight_bytes", weight_bytes)
    _non_negative("kv_bytes_total", kv_bytes_total)
    _positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    return (weight_bytes + kv_bytes_total) / bandwidth_bytes_per_s


def decode_throughput_upper_bound(weight_bytes: float, kv_bytes_per_token: int, context_len: int, batch_size: int,
                                  bandwidth_bytes_per_s: float) -> tuple[float, float]:
    """Upper bounds ``(per-request tok/s, total tok/s)`` for ``batch_size`` requests at ``context_len`` tokens.

    ``t = decode_step_lower_bound_s(W, batch × kv_bytes(context_len), bw)``; per request ``1 / t``, total
    ``batch / t``. Source: cost-model.md, "Decode roofline".

    Raises:
        ValueError: ``batch_size`` not positive, or as ``decode_step_lower_bound_s``.
    """
    _positive("batch_size", batch_size)
    t = decode_step_lower_bound_s(weight_bytes, batch_size * kv_bytes(kv_bytes_per_token, context_len),
                                  bandwidth_bytes_per_s)
    return 1.0 / t, batch_size / t


# ---- Preemption (cost-model.md, "Preemption: recompute or swap") ----------------------------------------
def recompute_time_s(num_tokens: int, prefill_tokens_per_s: float) -> float:
    """Seconds to rebuild a preempted request's KV by prefill: ``num_tokens / prefill_tokens_per_s``.

    Source: cost-model.md, "Preemption: recompute or swap".

    Raises:
        ValueError: negative tokens or non-positive speed.
    """
    _non_negative("num_tokens", num_tokens)
    _positive("prefill_tokens_per_s", prefill_tokens_per_s)
    return num_tokens / prefill_tokens_per_s


def swap_time_s(num_tokens: int, kv_bytes_per_token: int, copy_bytes_per_s: float) -> float:
    """Seconds to swap a request's KV out and back in: ``2 × num_tokens × kv_bytes_per_token / copy_bandwidth``.

    Source: cost-model.md, "Preemption: recompute or swap".

    Raises:
        ValueError: negative sizes or non-positive bandwidth.
    """
    _non_negative("num_tokens", num_tokens)
    _non_negative("kv_bytes_per_token", kv_bytes_per_token)
    _positive("copy_bytes_per_s", copy_bytes_per_s)
    return 2 * num_tokens * kv_bytes_per_token / copy_bytes_per_s


def preempt_choice(num_tokens: int, kv_bytes_per_token: int, prefill_tokens_per_s: float,
                   copy_bytes_per_s: float) -> PreemptMode:
    """``"recompute"`` or ``"swap"``, whichever of the two times above is smaller; a tie is ``"recompute"``.

    Both times are linear in ``num_tokens``, so the answer depends only on the speeds (swap wins when
    ``copy_bandwidth > 2 × kv_bytes_per_token × prefill_tokens_per_s``) except at 0 tokens (a tie).
    Source: cost-model.md, "Preemption: recompute or swap".

    Raises:
        ValueError: as ``recompute_time_s`` / ``swap_time_s``.
    """
    t_rec = recompute_time_s(num_tokens, prefill_tokens_per_s)
    t_swap = swap_time_s(num_tokens, kv_bytes_per_token, copy_bytes_per_s)
    return "swap" if t_swap < t_rec else "recompute"


# ---- Tiered KV (cost-model.md, "Tiered KV: fetch or recompute") -----------------------------------------
def fetch_time_s(num_tokens: int, kv_bytes_per_token: int, link_bytes_per_s: float) -> float:
    """Seconds to fetch ``num_tokens`` of KV over a link: ``kv_bytes_per_token × num_tokens / link_bandwidth``.

    Source: cost-model.md, "Tiered KV: fetch or recompute".

    Raises:
        ValueError: negative sizes or non-positive bandwidth.
    """
    _non_negative("num_tokens", num_tokens)
    _non_negative("kv_bytes_per_token", kv_bytes_per_token)
    _positive("link_bytes_per_s", link_bytes_per_s)
    return num_tokens * kv_bytes_per_token / link_bytes_per_s


def fetch_break_even_prefill_tokens_per_s(link_bytes_per_s: float, kv_bytes_per_token: int) -> float:
    """The prefill speed (tokens/s) at which fetching KV and recomputing it take equally long.

    ``prefill_tokens_per_s* = link_bandwidth / kv_bytes_per_token``, independent of the length. A faster
    prefill than this: recompute; slower: fetch. Source: cost-model.md, "Tiered KV: fetch or recompute".

    Raises:
        ValueError: non-positive arguments.
    """
    _positive("link_bytes_per_s", link_bytes_per_s)
    _positive("kv_bytes_per_token", kv_bytes_per_token)
    return link_bytes_per_s / kv_bytes_per_token


# ---- Prefill/decode disaggregation (cost-model.md, "Prefill/decode disaggregation") ----------------------
def pd_transfer_time_s(prompt_len: int, kv_bytes_per_token: int, link_bytes_per_s: float) -> float:
    """Seconds to move one request's prompt KV from the prefill to the decode pool: ``kv_bytes(prompt) / link``.

    Source: cost-model.md, "Prefill/decode disaggregation".

    Raises:
        ValueError: negative sizes or non-positive bandwidth.
    """
    return fetch_time_s(prompt_len, kv_bytes_per_token, link_bytes_per_s)


def pd_prefill_share(prompt_len: int, output_len: int, prefill_tokens_per_s: float,
                     decode_tokens_per_s: float) -> float:
    """Fraction of devices the prefill pool needs so that both pools keep pace (the P:D split), in [0, 1].

    Device-seconds per request: prefill ``P / prefill_speed``, decode ``O / decode_speed`` (``decode_speed``
    = total tok/s of one decode device at its batch). Share = prefill / (prefill + decode). Derived from
    cost-model.md, "Prefill/decode disaggregation" ("prompt/output length ratio decides the P:D split").

    Raises:
        ValueError: negative lengths, both zero, or non-positive speeds.
    """
    _non_negative("prompt_len", prompt_len)
    _non_negative("output_len", output_len)
    _positive("prefill_tokens_per_s", prefill_tokens_per_s)
    _positive("decode_tokens_per_s", decode_tokens_per_s)
    p = prompt_len / prefill_tokens_per_s
    d = output_len / decode_tokens_per_s
    if p + d == 0:
        raise ValueError("prompt_len and output_len are both 0")
    return p / (p + d)


# ---- Speculative decoding (cost-model.md, "Speculative decoding"; Leviathan et al. 2023, Chen et al. 2023) -
def spec_decode_expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per speculative round: ``(1 − α^(k+1)) / (1 − α)``; ``k + 1`` when ``α = 1``.

    ``α`` = per-token acceptance probability (i.i.d. approximation), ``k`` = draft length. Source:
    Leviathan et al. 2023 (eq. 1); cost-model.md, "Speculative decoding".

    Raises:
        ValueError: ``α`` outside [0, 1] or negative ``k``.
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    _non_negative("k", k)
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def spec_decode_speedup(alpha: float, k: int, draft_cost_ratio: float) -> float:
    """Speedup of speculative decoding over plain decoding: ``E(α, k) / (k × c_draft + 1)``.

    ``c_draft`` = cost of one draft step in target-step units; the verify step costs 1 (one target forward
    over ``k + 1`` tokens at low batch, memory-bound). Source: Leviathan et al. 2023 (walltime improvement);
    cost-model.md, "Speculative decoding".

    Raises:
        ValueError: as ``spec_decode_expected_tokens``, or a negative ``draft_cost_ratio``.
    """
    _non_negative("draft_cost_ratio", draft_cost_ratio)
    return spec_decode_expected_tokens(alpha, k) / (k * draft_cost_ratio + 1)


def spec_decode_best_k(alpha: float, draft_cost_ratio: float, max_k: int = 8) -> tuple[int, float]:
    """The draft length in ``1..max_k`` with the largest speedup, and that speedup (the smallest k on ties).

    Raises:
        ValueError: ``max_k`` < 1, or as ``spec_decode_speedup``.
    """
    _positive("max_k", max_k)
    best = max(range(1, max_k + 1), key=lambda k: (spec_decode_speedup(alpha, k, draft_cost_ratio), -k))
    return best, spec_decode_speedup(alpha, best, draft_cost_ratio)


def spec_decode_step_speedup(alpha: float, k: int, num_decodes: int, num_prefill_tokens: int, budget: int,
                             target_time: Callable[[float], float],
                             draft_time: Callable[[float], float] | None = None,
                             proposal_rate: float = 1.0) -> float:
    """Predicted useful tokens per second of a step with draft length ``k`` over the same step without drafts.

    A step without speculation computes ``n0 = B + P`` tokens (``B`` decoding requests, ``P`` prefill
    tokens) in ``T(n0)`` seconds, all of them useful. With ``k`` drafts per request it computes
    ``B × k × r`` more (``r`` = how often a proposal exists) when they fit the token budget, of which
    ``B × r × (E(α, k) − 1)`` are accepted (``spec_decode_expected_tokens``); when they do not fit, the
    budget is reached and prefill gives way to the reserved draft slots. A draft model adds a forward
    over the step's tokens and ``k − 1`` decode forwards at batch ``B``. Speedup =
    ``(useful₁ / t₁) / (n0 / T(n0))``. At ``B = 1, P = 0`` this is Leviathan et al. 2023's walltime
    improvement ``E / (k c + c_verify)`` with the verify cost measured; when ``T`` is linear in tokens
    (compute-bound) it is below 1 for every ``k``, so speculation turns off under load.
    Source: cost-model.md, "Speculative decoding"; the useful-throughput form is this project's.

    Args:
        target_time / draft_time: seconds of a forward of ``n`` tokens (measured, e.g.
            ``spec_decode.controller.StepTimeModel``); no ``draft_time`` for n-gram proposals.
    Raises:
        ValueError: as ``spec_decode_expected_tokens``, or negative counts.
    """
    _non_negative("num_prefill_tokens", num_prefill_tokens)
    _positive("budget", budget)
    b = max(1, num_decodes)
    gain = min(max(proposal_rate, 0.0), 1.0) * (spec_decode_expected_tokens(alpha, k) - 1)
    n0 = b + num_prefill_tokens
    if n0 + b * k <= budget:
        n1 = n0 + b * k * min(max(proposal_rate, 0.0), 1.0)
        useful1 = n0 + b * gain
    else:
        n1 = max(budget, b * (k + 1))
        useful1 = n1 - b * k + b * gain
    t0 = target_time(n0)
    t1 = target_time(n1)
    if draft_time is not None:
        t1 += draft_time(n0) + (k - 1) * draft_time(b)
    if t0 <= 0 or t1 <= 0:
        return 1.0
    return (useful1 / t1) / (n0 / t0)


# ---- Quantization (cost-model.md, "Quantization") ---------------------------------------------------------
def concurrency_gain(dtype_bytes_from: int, dtype_bytes_to: int) -> float:
    """Factor by which concurrency grows at the same KV memory when elements shrink: ``from / to`` (fp32→int8: 4).

    Source: cost-model.md, "Quantization" (an 8-bit KV cache halves the bytes of a 16-bit one).

    Raises:
        ValueError: non-positive arguments.
    """
    _positive("dtype_bytes_from", dtype_bytes_from)
    _positive("dtype_bytes_to", dtype_bytes_to)
    return dtype_bytes_from / dtype_bytes_to


# ---- Tensor parallelism (docs/distributed.md, "Tensor parallelism") ----------------------------------------
def tp_allreduce_bytes_per_step(num_layers: int, hidden_size: int, num_tokens: int, act_bytes: int) -> int:
    """Bytes all-reduced in one step at tensor parallelism: ``(2 L + 1) × tokens × hidden × act_bytes`` (the
    attention output and the MLP output of every layer, and the vocabulary-parallel embedding's lookup).

    E.g. Qwen2.5-Coder-0.5B (24 layers, hidden 896) in float32 at batch 1: 49 × 896 × 4 = 175,616 bytes.

    Raises:
        ValueError: a non-positive argument.
    """
    for name, v in (("num_layers", num_layers), ("hidden_size", hidden_size), ("num_tokens", num_tokens),
                    ("act_bytes", act_bytes)):
        _positive(name, v)
    return (2 * num_layers + 1) * num_tokens * hidden_size * act_bytes


def tp_link_bytes_per_step(allreduce_bytes: int, vocab_size: int, num_sampled: int, size: int) -> float:
    """Bytes rank 0 moves over its link in one step at ``size`` ranks: a ring all-reduce sends and receives
    ``2 (N − 1) / N`` of each payload, and rank 0 receives the other ranks' float32 logit shards of the sampled
    rows, ``(N − 1) × rows × ceil(V / N) × 4``. 0 at ``size`` 1.

    Raises:
        ValueError: ``size`` < 1 or negative sizes.
    """
    _positive("size", size)
    _non_negative("allreduce_bytes", allreduce_bytes)
    _non_negative("num_sampled", num_sampled)
    gather = (size - 1) * num_sampled * -(-vocab_size // size) * 4
    return 2 * (size - 1) / size * allreduce_bytes + gather


def tp_decode_step_s(weight_bytes: float, kv_bytes_total: float, bandwidth_bytes_per_s: float, size: int,
                     link_bytes: float, link_bytes_per_s: float, num_collectives: int, latency_s: float) -> float:
    """Lower bound of a decode step at ``size`` ranks: each rank reads its ``1 / N`` of the weights and the KV at
    ``bandwidth_bytes_per_s`` (per rank: a GPU's own memory; ranks sharing one CPU socket share its bandwidth,
    so pass ``bandwidth / N``), then the collectives: ``link_bytes / link_bytes_per_s + num_collectives ×
    latency_s``. At ``size`` 1 (no collectives) it is ``decode_step_lower_bound_s``.

    Raises:
        ValueError: non-positive bandwidths or size, negative bytes or latency.
    """
    _positive("size", size)
    _positive("link_bytes_per_s", link_bytes_per_s)
    _non_negative("link_bytes", link_bytes)
    _non_negative("latency_s", latency_s)
    compute = decode_step_lower_bound_s(weight_bytes / size, kv_bytes_total / size, bandwidth_bytes_per_s)
    return compute + link_bytes / link_bytes_per_s + num_collectives * latency_s
