"""Verification of draft tokens: the target's logits at every draft position -> the tokens emitted.

Each verified position is sampled as if it were its own step: the request's output so far *plus the
drafts before that position* feed the penalties and ``min_tokens``, the logits processors see the
request (speculation is only scheduled for requests whose processors do not depend on earlier output
tokens, ``scheduler.spec_eligible``), then ``rejection_sampler.rejection_sample`` accepts a prefix of the
drafts and draws one more token. Logprobs of the emitted tokens are the target's, at their positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest, TokenLogprobs
from kvserve.sample.logits_processor import LogitsProcessors
from kvserve.sample.rejection_sampler import rejection_sample
from kvserve.sample.sampler import _SAMPLING_EPS, SamplingMetadata, apply_penalties, gather_logprobs


def verify_drafts(logits: torch.Tensor, rows: list[ScheduledRequest], draft_probs: torch.Tensor | None,
                  processors: LogitsProcessors,
                  generator: Callable[[str, int | None], torch.Generator | None]
                  ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
    """Emitted tokens (and logprobs) of rows that verify drafts.

    Args:
        logits: ``[T, V]`` target logits, ``T = sum(len(row.draft_token_ids) + 1)``, row by row (the row's
            own last token first, then one per draft); edited in place by the processors.
        rows: the rows, each with ``draft_token_ids`` (possibly empty).
        draft_probs: ``[sum of drafts, V]`` proposal distributions, or None (deterministic proposals).
        generator: the runner's per-request generator factory (request id, seed) -> generator or None.
    Returns:
        per row the emitted tokens (1 .. drafts + 1) and, when the request asked for logprobs, one
        ``TokenLogprobs`` per emitted token (else None).
    """
    device = logits.device
    requests: list[Request] = []
    outputs: list[list[int]] = []
    for s in rows:
        r = s.request
        for j in range(len(s.draft_token_ids) + 1):
            requests.append(r)
            outputs.append(r.output_token_ids + list(s.draft_token_ids[:j]))
    mask_before_min_tokens(logits, requests, outputs)
    processors.apply(logits, requests)
    meta = SamplingMetadata.build(
        params=[r.sampling_params for r in requests], prompt_token_ids=[r.prompt_token_ids for r in requests],
        output_token_ids=outputs, generators=[None] * len(requests), vocab_size=logits.shape[-1], device=device)
    penalized = apply_penalties(logits.to(torch.float32), meta)
    generators = {}
    for i, s in enumerate(rows):
        p = s.request.sampling_params
        if p.temperature >= _SAMPLING_EPS and p.seed is not None:
            g = generator(s.request.request_id, p.seed)
            if g is not None:
                generators[i] = g
    result = rejection_sample(penalized, [list(s.draft_token_ids) for s in rows], draft_probs, meta, generators)
    logprobs: list[list[TokenLogprobs] | None] = [None] * len(rows)
    if meta.max_num_logprobs is not None:
        full = torch.log_softmax(penalized, dim=-1)
        starts: list[int] = []
        pos: list[int] = []
        toks: list[int] = []
        offset = 0
        for s, emitted in zip(rows, result.token_ids, strict=True):
            starts.append(len(pos))
            pos += range(offset, offset + len(emitted))
            toks += emitted
            offset += len(s.draft_token_ids) + 1
        lp = gather_logprobs(full[torch.tensor(pos, device=device)], torch.tensor(toks, device=device),
                             meta.max_num_logprobs)
        ids_l, lps_l, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        for i, (s, emitted) in enumerate(zip(rows, result.token_ids, strict=True)):
            k = s.request.sampling_params.logprobs
            if k is None:
                continue
            logprobs[i] = [TokenLogprobs(ids_l[q][0], lps_l[q][0], ranks[q],
                                         list(zip(ids_l[q][1:k + 1], lps_l[q][1:k + 1], strict=True)))
                           for q in range(starts[i], starts[i] + len(emitted))]
    return result.token_ids, logprobs


def mask_before_min_tokens(logits: torch.Tensor, requests: list[Request], outputs: list[list[int]]) -> None:
    """``min_tokens`` per position: EOS and stop ids are banned where fewer than ``min_tokens`` outputs
    (the request's and the drafts before the position) precede it."""
    rows: list[int] = []
    cols: list[int] = []
    for row, (r, out) in enumerate(zip(requests, outputs, strict=True)):
        p = r.sampling_params
        if len(out) >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids) + ([r.eos_token_id] if r.eos_token_id is not None and not p.ignore_eos else [])
        rows += [row] * len(banned)
        cols += banned
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
