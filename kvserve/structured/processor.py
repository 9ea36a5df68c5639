"""StructuredOutputProcessor: the logits processor that keeps each request's output inside its grammar.

Per request (each of the ``n`` samples is its own request) it keeps a :class:`xgrammar.GrammarMatcher` and
how many output tokens the matcher has accepted. Every step, for the rows that sample and carry
``sampling_params.structured_outputs``:

1. sync: the matcher accepts the output tokens it has not seen yet (normally the one sampled last step).
   If the request has fewer output tokens than accepted (never, today: recompute preemption keeps the
   output tokens), the matcher is reset and replays the output from the start, so it can never drift;
2. fill: each matcher writes its row of one ``[S, ceil(V / 32)]`` int32 bitmask;
3. apply: one batched call sets every disallowed logit to ``-inf`` (xgrammar's CPU/CUDA kernel).

A matcher that has accepted EOS is *terminated*: its row is left unconstrained (as vLLM), which only
matters with ``ignore_eos``. Before that, a finished grammar allows only EOS, so the request stops there.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from kvserve.core.request import Request
from kvserve.structured.backend import StructuredOutputBackend

logger = logging.getLogger(__name__)


@dataclass
class _State:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0
    broken: bool = False  # an output token the grammar refused (e.g. forced by min_tokens): stop masking


class StructuredOutputProcessor:
    """Masks the logits of structured-output requests (a :class:`kvserve.sample.logits_processor.LogitsProcessor`).

    Args:
        backend: compiles (cached) and makes matchers.
    """

    def __init__(self, backend: StructuredOutputBackend) -> None:
        self.backend = backend
        self._states: dict[str, _State] = {}

    def acts_on(self, request: Request) -> bool:
        """Whether the request asks for structured output (``LogitsProcessor``'s optional hook)."""
        return request.sampling_params.structured_outputs is not None

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Mask the rows of structured-output requests in ``logits`` ``[S, V]`` (in place)."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured_outputs is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(requests), logits.shape[-1])  # [S, ceil(V / 32)] int32
        masked: list[int] = []
        for i in rows:
            matcher = self._synced(requests[i])
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, i)
                masked.append(i)
        if masked:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=masked)

    def _synced(self, request: Request) -> xgr.GrammarMatcher | None:
        """The request's matcher after accepting all its output tokens; None when the row stays unmasked."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _State(self.backend.matcher(params))
        output = request.output_token_ids
        if state.num_accepted > len(output):  # rolled back: replay from the start
            state.matcher.reset()
            state.num_accepted, state.broken = 0, False
        for token in output[state.num_accepted:]:
            if state.broken or state.matcher.is_terminated():
                break
            if not state.matcher.accept_token(token):
                logger.warning("request %s: output token %d is outside its grammar; no longer constrained",
                               request.request_id, token)
                state.broken = True
        state.num_accepted = len(output)
        if state.broken or state.matcher.is_terminated():
            return None
        return state.matcher

    def release(self, request_ids: Iterable[str]) -> None:
        """Drop the matchers of finished or aborted requests."""
        for request_id in request_ids:
            self._states.pop(request_id, None)

    @property
    def num_active(self) -> int:
        """How many requests hold a matcher (0 once all finished)."""
        return len(self._states)
