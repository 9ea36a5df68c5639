"""The proposer interface the model runner calls every step, and the n-gram proposer behind it.

``propose`` sees every scheduled row of the step (a draft model must also mirror the prefill chunks to
keep its own KV cache in step with the target's) and fills ``draft_token_ids`` of the rows the scheduler
gave draft slots (``num_spec_tokens > 0``): up to that many tokens, ``num_scheduled_tokens`` shrunk to
the row's own token plus the drafts actually proposed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import torch

from kvserve.core.scheduler_output import ScheduledRequest
from kvserve.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    """Suggests draft tokens for the rows of a step that have draft slots."""

    def propose(self, scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        """Return the step's rows (same order) with drafts filled in, and the draft distribution.

        Returns:
            rows: ``scheduled`` with each row that has ``num_spec_tokens = k > 0`` replaced by one with
                ``draft_token_ids`` (0..k tokens) and ``num_scheduled_tokens = 1 + len(drafts)``;
            draft_probs: ``[sum of len(drafts), V]`` float32, each draft token's proposal distribution
                ``q`` in row order; None when proposals are deterministic (``q`` one-hot).
        """
        ...

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget finished requests."""
        ...

    def take_timings(self) -> list[tuple[int, float]]:
        """``(tokens, seconds)`` of each model forward the proposer ran since the last call (the k
        controller's draft cost); empty for a proposer without a model."""
        ...


def with_drafts(row: ScheduledRequest, drafts: Sequence[int]) -> ScheduledRequest:
    """``row`` (a decode row with draft slots) computing its own token and ``drafts``."""
    return replace(row, num_scheduled_tokens=1 + len(drafts), draft_token_ids=tuple(drafts))


class NgramRowProposer:
    """Prompt-lookup proposals (``ngram.NgramProposer``) for the runner; deterministic, no model."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.ngram = NgramProposer(min_n, max_n)

    def propose(self, scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        rows = [with_drafts(s, self.ngram.propose(s.request.all_token_ids, s.num_spec_tokens))
                if s.num_spec_tokens else s for s in scheduled]
        return rows, None

    def release(self, request_ids: Sequence[str]) -> None:
        pass

    def take_timings(self) -> list[tuple[int, float]]:
        return []
