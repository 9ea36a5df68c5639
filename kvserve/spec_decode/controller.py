"""The k controller: how many draft tokens each request verifies this step (0: no speculation).

Per request it keeps an acceptance estimate (exponentially decayed counts of accepted drafts and of
Bernoulli trials: a round that accepts ``a`` of ``m`` drafts is ``a`` successes in ``a + [a < m]`` trials,
the geometric model's maximum-likelihood form; a new request starts from the estimate over all requests)
and how often a proposal existed at all. For each ``k`` in ``1..k_max`` it
predicts the useful tokens per second of the whole step (``cost_model.spec_decode_step_speedup``) from
the measured target (and draft) forward times at the step's token count, and takes the best ``k``; ``0``
when no ``k`` gains at least ``min_gain`` (5 %). At batch 1 that is Leviathan et al.'s walltime formula;
when the step is compute-bound (large batches, long prefill chunks) every ``k`` loses and speculation
turns itself off. Torch-free: the scheduler calls it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvserve.cost_model import spec_decode_step_speedup
from kvserve.spec_decode.config import SpeculativeConfig


class StepTimeModel:
    """Seconds of a forward pass as a function of its token count, learnt from measurements.

    Observations land in half-octave buckets (EMA of token count and of seconds per bucket); a query
    interpolates linearly between bucket points and extrapolates beyond the largest at its seconds per
    token (compute-bound: linear), below the smallest as flat (memory-bound: a weight read).
    """

    EMA = 0.1

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[float, float]] = {}
        self._points: list[tuple[float, float]] | None = None  # sorted bucket points, rebuilt after observe

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record one forward of ``num_tokens`` tokens that took ``seconds`` (ignored unless both > 0)."""
        if num_tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        b = round(2 * math.log2(num_tokens))
        self._points = None
        old = self._buckets.get(b)
        if old is None:
            self._buckets[b] = (float(num_tokens), seconds)
        else:
            a = self.EMA
            self._buckets[b] = ((1 - a) * old[0] + a * num_tokens, (1 - a) * old[1] + a * seconds)

    @property
    def known(self) -> bool:
        return bool(self._buckets)

    def __call__(self, num_tokens: float) -> float:
        """Predicted seconds for ``num_tokens`` tokens (0.0 with no observation yet)."""
        if self._points is None:
            self._points = sorted(self._buckets.values())
        points = self._points
        if not points:
            return 0.0
        if num_tokens <= points[0][0]:
            return points[0][1]
        for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
            if num_tokens <= n1:
                return t0 + (t1 - t0) * (num_tokens - n0) / max(n1 - n0, 1e-9)
        n_last, t_last = points[-1]
        return t_last * num_tokens / n_last

    def table(self) -> list[tuple[float, float]]:
        """The bucket points ``(tokens, seconds)``, by token count (for logs and benchmarks)."""
        return sorted(self._buckets.values())


@dataclass
class _Acceptance:
    accepted: float
    trials: float
    proposed: float = 1.0  # EMA of "a proposal existed" (n-gram lookups can find none)

    @property
    def alpha(self) -> float:
        return min(max(self.accepted / self.trials, 0.0), 0.99) if self.trials > 0 else 0.0


@dataclass
class SpecStats:
    """Totals since start (vLLM's spec-decode counters).

    Attributes:
        num_drafts: verification rounds with at least one draft token.
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: draft tokens accepted.
        accepted_per_pos: accepted drafts by position in the round (0-based).
        last_mean_k: the mean ``k`` over the decode requests of the latest step (speculating or not).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    last_mean_k: float = 0.0

    def snapshot(self) -> SpecStats:
        """A copy (the scheduler's stats are read by another thread)."""
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_pos), self.last_mean_k)


class SpecController:
    """Picks ``k`` per request and step and learns from the outcomes.

    Args:
        config: the speculative config (``num_speculative_tokens`` = ``k_max``, ``adaptive``).
        max_num_batched_tokens: the scheduler's token budget (spec tokens share it).
        prior_alpha: the acceptance assumed for a new request (weight of two trials).
        min_gain: the least predicted step speedup worth speculating for (0.05: 5 %).
    """

    #: A request the estimates keep at k = 0 (new, no n-gram match lately, drafts rejected) gets a probe
    #: round of ``k_max`` drafts at its first decode step and then every this many of its decode steps,
    #: when the step would pay if every draft were accepted: otherwise it could never learn that its
    #: proposals are good (or came back).
    PROBE_EVERY = 8

    def __init__(self, config: SpeculativeConfig, max_num_batched_tokens: int, prior_alpha: float = 0.6,
                 min_gain: float = 0.05) -> None:
        self.config = config
        self.k_max = config.num_speculative_tokens
        self.budget = max_num_batched_tokens
        self.prior_alpha = prior_alpha
        self.min_gain = min_gain
        self.target_time = StepTimeModel()
        self.draft_time = StepTimeModel()
        self.uses_draft_model = config.method == "draft_model"
        self._acc: dict[str, _Acceptance] = {}
        self._idle: dict[str, int] = {}  # decode steps since a request last had draft slots
        # Acceptance over all requests: the starting estimate of a new request (learnt, not assumed).
        self._global = _Acceptance(2 * prior_alpha, 2.0)
        self.stats = SpecStats(accepted_per_pos=[0] * self.k_max)
        self._step_k: list[int] = []

    # ---- decisions -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Called by the scheduler at the start of every ``schedule()``."""
        self._step_k = []
        self.stats.last_mean_k = 0.0

    def num_spec_tokens(self, request_id: str, num_decodes: int, num_prefill_tokens: int, limit: int,
                        eligible: bool = True) -> int:
        """``k`` for one decoding request this step.

        Args:
            num_decodes: requests decoding this step (each would verify the same ``k``).
            num_prefill_tokens: prefill tokens this step would also compute (capped by the budget).
            limit: the most drafts this request may take (``max_tokens``, ``max_model_len``, budget left).
            eligible: False for requests speculation cannot serve exactly (e.g. grammar-constrained).
        """
        k = self._choose(request_id, num_decodes, num_prefill_tokens, limit) if eligible else 0
        self._step_k.append(k)
        self.stats.last_mean_k = sum(self._step_k) / len(self._step_k)
        return k

    def _choose(self, request_id: str, num_decodes: int, num_prefill_tokens: int, limit: int) -> int:
        k_max = min(self.k_max, limit)
        if k_max <= 0:
            return 0
        dbs = self.config.disable_by_batch_size
        if dbs is not None and num_decodes > dbs:
            return 0
        if not self.config.adaptive:
            return k_max
        if not self.target_time.known:
            return k_max  # nothing measured yet: the engine probes step times at start-up
        acc = self._acc.get(request_id)
        alpha = acc.alpha if acc is not None else self._global.alpha
        proposed = acc.proposed if acc is not None else 1.0
        best_k, best = 0, 1.0 + self.min_gain
        for k in range(1, k_max + 1):
            s = self._speedup(alpha, k, num_decodes, num_prefill_tokens, proposed)
            if s > best:
                best_k, best = k, s
        if best_k == 0:
            idle = self._idle.get(request_id, self.PROBE_EVERY - 1) + 1  # a new request probes at once
            if idle >= self.PROBE_EVERY and self._speedup(0.99, k_max, num_decodes, num_prefill_tokens,
                                                          1.0) > 1.0 + self.min_gain:
                idle, best_k = 0, k_max
            self._idle[request_id] = idle
        else:
            self._idle[request_id] = 0
        return best_k

    def _speedup(self, alpha: float, k: int, num_decodes: int, num_prefill_tokens: int, proposed: float) -> float:
        return spec_decode_step_speedup(alpha, k, num_decodes, num_prefill_tokens, self.budget, self.target_time,
                                        self.draft_time if self.uses_draft_model else None, proposal_rate=proposed)

    # ---- learning ------------------------------------------------------------------------------
    def observe(self, request_id: str, num_slots: int, num_drafts: int, num_accepted: int) -> None:
        """The outcome of one request's round: ``num_slots`` reserved, ``num_drafts`` proposed, accepted."""
        if num_slots <= 0:
            return
        self._idle[request_id] = 0
        a = 0.3  # EMA weight of the newest round
        acc = self._acc.get(request_id)
        if acc is None:
            g = self._global.alpha
            acc = self._acc[request_id] = _Acceptance(2 * g, 2.0)
        acc.proposed = (1 - a) * acc.proposed + a * (1.0 if num_drafts > 0 else 0.0)
        if num_drafts <= 0:
            return
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        for est, w in ((acc, a), (self._global, 0.05)):  # decayed counts: a long round weighs more
            est.accepted = (1 - w) * est.accepted + num_accepted
            est.trials = (1 - w) * est.trials + trials
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.accepted_per_pos[pos] += 1

    def alpha(self, request_id: str) -> float:
        """The current acceptance estimate of a request (the all-requests estimate when it has none)."""
        acc = self._acc.get(request_id)
        return acc.alpha if acc is not None else self._global.alpha

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests."""
        for request_id in request_ids:
            self._acc.pop(request_id, None)
            self._idle.pop(request_id, None)
