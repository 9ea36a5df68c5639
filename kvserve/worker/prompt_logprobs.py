"""Prompt logprobs: the model's log-probability of each prompt token, from the step that computes it.

Position ``p``'s logits predict token ``p + 1``, so a chunk computing positions ``[c, c + n)`` of a prompt of
``P`` tokens scores prompt tokens ``c + 1 .. min(c + n, P - 1)``; the last prompt position's logits are the
ones the sampler uses for the first output token. E.g. ``P = 6`` in chunks of 4 and 2::

    chunk 1: positions 0 1 2 3  -> scores prompt tokens 1 2 3 4
    chunk 2: positions 4 5      -> scores prompt token  5        (position 5 samples output token 0)

Logprobs are ``log_softmax`` of the raw logits in float32 (no penalties, no temperature), as vLLM. Prefix
cache hits have no hidden states, so a request with ``prompt_logprobs`` skips the cache lookup (see
``BlockManager.get_computed_blocks``): every prompt position is computed, and scored, by this step or an
earlier one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.core.scheduler_output import PromptLogprobsChunk, ScheduledRequest

# Rows of logits materialized at once ([rows, vocab] float32: 512 x 150k = 300 MB at most).
_ROWS_PER_SLICE = 512


def prompt_logprob_spans(order: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, int, int]]:
    """The rows of a step's hidden states that score prompt tokens: ``(request, begin, m)`` for each request that
    asked for prompt logprobs and has something to score, rows ``hidden[begin : begin + m]`` (positions
    ``c .. c + m - 1`` of its prompt, ``c`` its ``num_computed_tokens``)."""
    spans = []
    flat_start = 0
    for s in order:
        begin = flat_start
        flat_start += s.num_scheduled_tokens
        request = s.request
        if request.sampling_params.prompt_logprobs is None:
            continue
        c = s.num_computed_tokens
        end = min(c + s.num_scheduled_tokens, request.num_prompt_tokens - 1)  # positions [c, end) score
        if end > c:
            spans.append((s, begin, end - c))
    return spans


def compute_prompt_logprobs(order: list[ScheduledRequest], hidden: torch.Tensor,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, PromptLogprobsChunk]:
    """Score the prompt tokens this step's chunks predict, for the requests that asked for prompt logprobs.

    Args:
        order: the step's requests in the order their tokens are laid out in ``hidden``.
        hidden: ``[num_tokens, hidden_size]`` final hidden states of the step.
        compute_logits: the model's ``[rows, hidden_size] -> [rows, vocab]`` float32 head, called on slices of
            at most ``_ROWS_PER_SLICE`` rows of ``prompt_logprob_spans`` in order (a tensor-parallel rank that does
            not sample calls it on the same slices: ``follow_prompt_logprobs``).
    Returns:
        request id -> the chunk of prompt tokens scored this step (requests with nothing to score are absent).
    """
    out: dict[str, PromptLogprobsChunk] = {}
    for s, begin, m in prompt_logprob_spans(order):
        request, c = s.request, s.num_computed_tokens
        k = request.sampling_params.prompt_logprobs
        assert k is not None
        targets = torch.tensor(request.prompt_token_ids[c + 1:c + m + 1], dtype=torch.int64, device=hidden.device)
        rows = hidden[begin:begin + m]  # [m, hidden_size]
        ids, lps, ranks = [], [], []
        for lo in range(0, rows.shape[0], _ROWS_PER_SLICE):
            logprobs = torch.log_softmax(compute_logits(rows[lo:lo + _ROWS_PER_SLICE]).float(), dim=-1)
            tgt = targets[lo:lo + _ROWS_PER_SLICE].unsqueeze(1)  # [m', 1]
            tgt_lp = logprobs.gather(1, tgt)  # [m', 1]
            num_top = logprobs.shape[1] if k == -1 else min(k, logprobs.shape[1])
            top_lp, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (tgt_lp[:, :0], tgt[:, :0])
            ids += torch.cat([tgt, top_ids], dim=1).tolist()
            lps += torch.cat([tgt_lp, top_lp], dim=1).tolist()
            ranks += ((logprobs > tgt_lp).sum(dim=-1) + 1).tolist()
        out[request.request_id] = PromptLogprobsChunk(c + 1, ids, lps, ranks)
    return out


def follow_prompt_logprobs(order: list[ScheduledRequest], hidden: torch.Tensor,
                           compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A tensor-parallel rank other than 0: call ``compute_logits`` (a collective) on exactly the slices
    ``compute_prompt_logprobs`` calls it on at rank 0, and nothing else."""
    for _, begin, m in prompt_logprob_spans(order):
        for lo in range(0, m, _ROWS_PER_SLICE):
            compute_logits(hidden[begin + lo:begin + min(m, lo + _ROWS_PER_SLICE)])
