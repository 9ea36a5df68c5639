"""The logits-processor hook: per-request edits of a step's logits before the sampler draws.

A processor sees the ``[S, V]`` float logits of the rows that sample this step (one row per request, in
the order of ``requests``) and edits them **in place** (the runner owns that tensor: it was just computed
from the hidden states). It must leave the rows of requests it does not act on bit-identical, and should
cost no tensor work at all when no row uses it (decide on the host from ``request.sampling_params``).

Processors that keep per-request state (a grammar matcher, say) drop it in :meth:`LogitsProcessor.release`,
called with the ids of requests that finished or were aborted since the previous step. A request preempted
by recompute keeps its output tokens, so such state stays valid; a processor that tracks how many output
tokens it has seen can always resynchronise from ``request.output_token_ids``.

Example (a processor that bans token 0 for requests asking ``min_tokens > 3``)::

    class NoZero:
        def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
            rows = [i for i, r in enumerate(requests) if r.sampling_params.min_tokens > 3]
            if rows:
                logits[rows, 0] = float("-inf")

        def release(self, request_ids: Iterable[str]) -> None:
            pass

    runner.logits_processors.add(NoZero())
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from kvserve.core.request import Request


class LogitsProcessor(Protocol):
    """Edits the logits of the requests it applies to, in place (see the module docstring)."""

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Edit ``logits`` ``[S, V]`` in place; row ``i`` belongs to ``requests[i]``."""
        ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget the state of these (finished or aborted) requests; unknown ids are ignored."""
        ...

    # Optional: ``acts_on(request) -> bool``, False when the processor leaves that request's row untouched
    # (decided from its parameters alone). It lets a step whose rows no processor touches skip the logits
    # entirely (``worker/greedy_decode.py``); a processor without it is assumed to act on every row.


class LogitsProcessors:
    """An ordered list of processors, applied one after the other (the first added runs first)."""

    def __init__(self) -> None:
        self._processors: list[LogitsProcessor] = []

    def add(self, processor: LogitsProcessor) -> None:
        """Append ``processor``; it runs after those already added."""
        self._processors.append(processor)

    def __len__(self) -> int:
        return len(self._processors)

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Run every processor on ``logits`` ``[S, V]`` (in place)."""
        for processor in self._processors:
            processor(logits, requests)

    def act_on_any(self, requests: Sequence[Request]) -> bool:
        """Whether some processor may edit the row of one of ``requests`` (one without ``acts_on``: yes)."""
        for processor in self._processors:
            acts_on = getattr(processor, "acts_on", None)
            if acts_on is None or any(acts_on(r) for r in requests):
                return True
        return False

    def release(self, request_ids: Sequence[str]) -> None:
        """Tell every processor these requests are gone."""
        if request_ids:
            for processor in self._processors:
                processor.release(request_ids)
