"""Batched, device-agnostic token sampler.

One call samples one token for each of ``S`` rows (one row per request that samples this step) from logits
``[S, V]``. The order of operations follows vLLM v1's ``Sampler``:

1. logits to float32;
2. penalties: repetition (CTRL, Keskar et al. 2019, over prompt + output tokens), then frequency and
   presence (OpenAI's definition, over output tokens);
3. logprobs (``log_softmax``) of the penalized logits, *before* temperature and truncation, so that the
   reported logprobs describe the model (plus penalties), not the sampling configuration;
4. greedy rows: argmax of the penalized logits;
5. random rows: temperature, min-p, top-k, top-p, then a sample drawn with the exponential race
   (``argmax(p / E)`` with ``E ~ Exponential(1)`` i.i.d. is a draw from ``p``). Seeded rows draw their noise
   from their own ``torch.Generator``, so their tokens do not depend on the rest of the batch.

Everything stays on the logits' device; the normal path has no host synchronisation (no ``.item()``, no
data-dependent python branching on tensor values). Branches are taken on the host-side flags and ``None``
fields of :class:`SamplingMetadata` only, which :meth:`SamplingMetadata.build` sets from the python params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.layers import cpu_kernels
from kvserve.sampling_params import SamplingParams

# Rows with temperature below this sample greedily; the same threshold as SamplingParams.greedy (and vLLM).
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingMetadata:
    """Per-step sampling inputs for S rows (one row per request that samples this step).

    All tensors live on the device of the logits they will be applied to. A ``None`` tensor means no row
    uses that feature, which lets the sampler skip the work entirely (fast paths).

    Attributes:
        temperature: ``[S]`` float32; rows with temperature < 1e-5 are greedy.
        all_greedy: every row is greedy (the random path is skipped).
        all_random: no row is greedy (the final ``torch.where`` is skipped).
        top_k: ``[S]`` int64, 0 = disabled; None when no row uses top-k.
        top_p: ``[S]`` float32, 1.0 = disabled; None when no row uses top-p.
        min_p: ``[S]`` float32, 0 = disabled; None when no row uses min-p.
        generators: row index -> per-request generator (seeded random rows only). Each generator must be
            on the logits' device.
        presence_penalties: ``[S]`` float32 (0 = disabled); None when no row uses any penalty.
        frequency_penalties: ``[S]`` float32 (0 = disabled); None when no row uses any penalty.
        repetition_penalties: ``[S]`` float32 (1 = disabled); None when no row uses any penalty.
        prompt_token_ids: ``[S, max_prompt_len]`` int64 padded with ``vocab_size``; None without penalties.
        output_token_ids: ``[S, max_output_len]`` int64 padded with ``vocab_size``; None without penalties.
        max_num_logprobs: the largest ``logprobs`` asked by any row; None when no row asked for logprobs.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    max_num_logprobs: int | None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Make the metadata tensors from per-row python data.

        Args:
            params: ``S`` validated sampling parameters, one per row.
            prompt_token_ids: ``S`` prompts (only read when some row uses a penalty).
            output_token_ids: ``S`` outputs generated so far (only read when some row uses a penalty).
            generators: ``S`` per-request generators (None for unseeded requests). Greedy rows' generators
                are left out: a greedy row never needs noise, and leaving it out keeps a seeded request's
                generator consumption the same whatever the batch.
            vocab_size: the logits' last dimension ``V``; also the padding id of the token tensors.
            device: where to put the tensors (the logits' device).

        Raises:
            ValueError: when the per-row lists have different lengths.
        """
        num_rows = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == num_rows):
            raise ValueError(
                f"build: got {num_rows} params, {len(prompt_token_ids)} prompts, {len(output_token_ids)} "
                f"outputs and {len(generators)} generators; they must all be one per row"
            )
        greedy = [p.temperature < _SAMPLING_EPS for p in params]
        # Truncation only matters for random rows; deciding on them alone keeps all-greedy-with-top-k
        # batches (common: clients send top_k with temperature 0) on the sort-free path.
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        top_k = None
        if any(p.top_k > 0 for p in random_params):
            # -1 and 0 both mean "disabled"; the sampler reads 0 as "keep all".
            top_k = torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device)
        top_p = f32([p.top_p for p in params]) if any(p.top_p < 1.0 for p in random_params) else None
        min_p = f32([p.min_p for p in params]) if any(p.min_p > 0.0 for p in random_params) else None

        # Penalties change the greedy argmax too, so every row counts here.
        use_penalties = any(
            p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
            for p in params
        )
        presence = frequency = repetition = prompt_ids = output_ids = None
        if use_penalties:
            presence = f32([p.presence_penalty for p in params])
            frequency = f32([p.frequency_penalty for p in params])
            repetition = f32([p.repetition_penalty for p in params])
            prompt_ids = _pad_token_ids(prompt_token_ids, vocab_size, device)
            output_ids = _pad_token_ids(output_token_ids, vocab_size, device)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=f32([p.temperature for p in params]),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            max_num_logprobs=max(asked) if asked else None,
        )


def _pad_token_ids(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Rows of token ids -> ``[S, max_len]`` int64 padded with ``pad_id`` (one host->device copy)."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), pad_id, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out).to(device)


@dataclass
class LogprobsTensors:
    """Log-probabilities of the sampled token and of the top-N tokens, per row.

    Attributes:
        token_ids: ``[S, N+1]`` int64: column 0 = the sampled token, then the top-N ids (most likely first).
        logprobs: ``[S, N+1]`` float32, matching ``token_ids``.
        ranks: ``[S]`` int64: rank of the sampled token (1 = most likely).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    """What one sampler call produced.

    Attributes:
        sampled_token_ids: ``[S]`` int64.
        logprobs: None when no row asked for logprobs.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


class Sampler:
    """Samples one token per row from ``[S, V]`` logits; stateless, so one instance serves every step."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample.

        Args:
            logits: ``[S, V]`` any float dtype, on any device; not modified.
            metadata: per-row inputs, on ``logits``' device.

        Returns:
            ``SamplerOutput`` with ``sampled_token_ids`` ``[S]`` int64 on ``logits``' device.
        """
        # (1) float32: bf16/fp16 logits lose too much precision for softmax / cumsum of top-p.
        logits = logits.to(torch.float32)
        # (2) penalties (out of place: the caller's logits may be float32 already and must not change).
        logits = apply_penalties(logits, metadata)
        # (3) logprobs describe the (penalized) model distribution, not the sampling knobs (vLLM default).
        full_logprobs = None
        if metadata.max_num_logprobs is not None:
            full_logprobs = torch.log_softmax(logits, dim=-1)

        if metadata.all_greedy:
            # (4) greedy only: no temperature, truncation or noise work at all.
            sampled = argmax(logits)
        else:
            # (5) random rows; greedy rows in a mixed batch are sampled too (cheaper than gathering the
            # random rows into a new tensor) and then replaced by (4) their argmax.
            probs = compute_probs(logits, metadata)
            sampled = exponential_race(probs, metadata.generators)
            if not metadata.all_random:
                is_greedy = metadata.temperature < _SAMPLING_EPS
                sampled = torch.where(is_greedy, argmax(logits), sampled)

        logprobs = None
        if full_logprobs is not None and metadata.max_num_logprobs is not None:
            logprobs = gather_logprobs(full_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[S, V]`` logits; on CPU the native kernel (``decode_io.c``, the same index:
    torch's took 45-85 us for one 49,152-entry row on the 2-vCPU Zen 4 host, the kernel a few us)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
            and cpu_kernels.native_available()):
        return cpu_kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; returns a new tensor (or ``logits`` unchanged).

    Repetition penalty (CTRL, Keskar et al. 2019, as implemented by Hugging Face and vLLM): for every token
    that appears in the prompt or the output, a positive logit is divided by the penalty and a negative one
    multiplied by it, so a penalty > 1 always makes the token less likely.
    Frequency / presence (OpenAI API docs, "Parameter details"): ``logit -= count * frequency_penalty +
    (count > 0) * presence_penalty`` where ``count`` is how often the token occurs in the *output*.

    Args:
        logits: ``[S, V]`` float32.
        metadata: penalties ``[S]`` and token ids ``[S, L]`` padded with an id >= V (ids >= V are ignored).

    Returns:
        ``[S, V]`` float32.
    """
    if (
        metadata.repetition_penalties is None
        or metadata.frequency_penalties is None
        or metadata.presence_penalties is None
        or metadata.prompt_token_ids is None
        or metadata.output_token_ids is None
    ):
        return logits
    num_rows, vocab = logits.shape
    output_counts = _token_counts(metadata.output_token_ids, num_rows, vocab, logits.dtype)  # [S, V]
    output_seen = output_counts > 0
    prompt_seen = _token_counts(metadata.prompt_token_ids, num_rows, vocab, logits.dtype) > 0

    rep = metadata.repetition_penalties.unsqueeze(1)  # [S, 1]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(prompt_seen | output_seen, penalized, logits)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits = logits - metadata.presence_penalties.unsqueeze(1) * output_seen.to(logits.dtype)
    return logits


def _token_counts(token_ids: torch.Tensor, num_rows: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """``[S, L]`` padded ids -> ``[S, V]`` occurrence counts.

    Counting happens in ``V + 1`` bins; every id >= V (the padding) lands in the extra bin, which is dropped,
    so padding needs no mask and no host-side lengths.
    """
    counts = torch.zeros(num_rows, vocab + 1, dtype=dtype, device=token_ids.device)
    index = token_ids.clamp(max=vocab)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=dtype))
    return counts[:, :vocab]


def compute_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: temperature, min-p, top-k, top-p, softmax.

    Greedy rows are given temperature 1 here so that nothing divides by ~0; their result is discarded.

    Args:
        logits: ``[S, V]`` float32 (after penalties); not modified.
        metadata: ``temperature`` ``[S]`` and the optional ``min_p`` / ``top_k`` / ``top_p`` ``[S]``.

    Returns:
        ``[S, V]`` float32 probabilities; filtered-out tokens have probability exactly 0.
    """
    temperature = metadata.temperature
    if not metadata.all_random:
        temperature = torch.where(temperature < _SAMPLING_EPS, torch.ones_like(temperature), temperature)
    logits = logits / temperature.unsqueeze(1)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    return torch.softmax(logits, dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (set to -inf) tokens whose probability is < ``min_p`` × the largest probability.

    Min-p sampling: Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM
    Outputs". Applied after temperature, as vLLM does. ``min_p == 0`` drops nothing (no probability is < 0),
    so disabled rows need no special case.

    Args:
        logits: ``[S, V]`` float32 (temperature-scaled).
        min_p: ``[S]`` float32 in [0, 1].

    Returns:
        ``[S, V]`` float32 (a new tensor).
    """
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [S, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k then top-p truncation with one descending sort; returns ``logits`` itself when both are None.

    Top-k (Fan et al. 2018, "Hierarchical Neural Story Generation") keeps the k largest logits (exactly k:
    ties are broken by sort order). Top-p / nucleus (Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration") keeps the smallest prefix of the sorted distribution whose mass is >= p, measured on the
    distribution already truncated by top-k (as vLLM). The most likely token is always kept.

    Args:
        logits: ``[S, V]`` float32.
        top_k: ``[S]`` int64, values <= 0 or >= V disable it for the row; or None.
        top_p: ``[S]`` float32 in (0, 1], 1 disables it for the row; or None.

    Returns:
        ``[S, V]`` float32 with dropped tokens at -inf. Rows where both are disabled come back with their
        values bit-identical (the sort/scatter only permutes), so a row's result never depends on whether
        other rows in the batch use truncation.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [S, V] each
    if top_k is not None:
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k).clamp(max=vocab)  # [S]
        positions = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
        sorted_logits = sorted_logits.masked_fill(positions >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Mass strictly before each position: a token is kept while the tokens above it sum to < p, which
        # gives the smallest prefix with mass >= p and always keeps position 0 (its prefix mass is 0).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p.unsqueeze(1)
        # A float32 cumsum can reach 1.0 before the tail ends; without this, rows with top_p == 1 would lose
        # their tiniest tokens (and differ from the same row sampled in a batch without top-p).
        drop &= (top_p < 1.0).unsqueeze(1)
        # Position 0's prefix mass is exactly 0, so this only matters for a (hand-built) top_p <= 0.
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from ``probs`` as ``argmax(probs / E)`` with ``E ~ Exponential(1)``.

    Why it is a correct sample: ``E_i / p_i ~ Exponential(p_i)``, and the index of the minimum of independent
    exponentials with rates ``p_i`` is ``i`` with probability ``p_i / sum(p)`` (the "exponential race"; this
    is the Gumbel-max trick in another form, since ``-log E`` is Gumbel). Unlike ``torch.multinomial`` it is
    a plain elementwise op + argmax, has no host sync, and lets each row take its noise from its own
    generator.

    Noise: one ``exponential_()`` call on the default RNG for the whole batch, then each seeded row's noise
    is overwritten with exactly one ``V``-sized draw from its own generator, so a seeded row's tokens depend
    only on its seed and its step count, never on the batch. (The loop is over seeded rows only.)

    Args:
        probs: ``[S, V]`` float32, rows summing to 1; not modified.
        generators: row index -> generator on ``probs``' device.

    Returns:
        ``[S]`` int64 token ids.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    # Exponential noise of exactly 0 (possible in some backends' float32 samplers) would turn a filtered
    # token's 0 / 0 into NaN, which argmax treats as the maximum; the smallest normal float keeps it finite.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return argmax(probs / noise)


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """The sampled token's logprob and rank, plus the top-N logprobs.

    Args:
        logprobs: ``[S, V]`` float32 ``log_softmax`` of the penalized logits.
        sampled: ``[S]`` int64 sampled ids.
        num_logprobs: N; capped at V (``topk`` cannot return more than V entries).

    Returns:
        ``LogprobsTensors`` with ``[S, N+1]`` ids / logprobs (column 0 = sampled) and ``[S]`` ranks, where
        rank = 1 + the number of tokens strictly more likely than the sampled one.
    """
    n = min(num_logprobs, logprobs.shape[-1])
    sampled_col = sampled.unsqueeze(1)  # [S, 1]
    sampled_logprobs = logprobs.gather(-1, sampled_col)  # [S, 1]
    ranks = (logprobs > sampled_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(n, dim=-1)  # sorted, most likely first
    return LogprobsTensors(
        token_ids=torch.cat([sampled_col, top_ids], dim=1),
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )
