"""What rank 0 sends the other tensor-parallel ranks each step: the ``SchedulerOutput`` without the parts only
rank 0 uses, and the token ids as deltas.

A worker keeps a mirror ``Request`` per running request (its prompt, its sampling parameters and its token ids
so far), so a step sends each row's new tokens only: a decode row carries one token, not the whole sequence
(vLLM's "cached request" deltas). The worker rebuilds a ``SchedulerOutput`` over its mirrors and runs the same
``ModelRunner.execute_model`` on it. E.g. a request with a 5-token prompt, chunked 3 + 2, then decoding::

    step 1: new=(5, params), start=0, tokens=[t0..t4]   (first sight: the whole prompt)  mirror [t0..t4]
    step 2: start=3, tokens=[t3, t4]                                                      mirror [t0..t4]
    step 3: start=5, tokens=[t5] (sampled at step 2)                                      mirror [t0..t5]
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.block_manager import BlockId
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvserve.sampling_params import SamplingParams


@dataclass
class StepRow:
    """One scheduled request: ``ScheduledRequest``'s fields, and its token ids ``all_token_ids[start:]`` up to the
    end of what this step computes; ``new`` (``num_prompt_tokens``, sampling parameters) on first sight."""

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[BlockId]
    sample: bool
    start: int
    tokens: list[int]
    new: tuple[int, SamplingParams] | None = None


@dataclass
class WorkerStep:
    """A step for ranks 1..N-1 (the ``SchedulerOutput`` fields they act on; block ids are per rank alike)."""

    rows: list[StepRow]
    blocks_to_copy: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[BlockId, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, BlockId]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)


class StepEncoder:
    """Rank 0's side: ``SchedulerOutput`` -> ``WorkerStep``, remembering how many tokens each mirror holds."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[Request, int]] = {}  # id -> (the request, tokens its mirrors hold)
        self._forgotten: list[str] = []

    def forget(self, request_ids: list[str]) -> None:
        """Finished requests that no step reported: dropped here now, on the workers with the next step."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)
        self._forgotten += request_ids

    def encode(self, so: SchedulerOutput) -> WorkerStep:
        """The step for the workers. Raises AssertionError for parts refused under tensor parallelism (KV offload
        loads and reads, draft tokens)."""
        assert not so.blocks_to_offload and not so.blocks_to_load, "KV offload is refused with tensor parallelism"
        finished, self._forgotten = self._forgotten + so.finished_request_ids, []
        for request_id in so.finished_request_ids:
            self._sent.pop(request_id, None)
        rows = []
        for s in so.scheduled:
            assert not s.num_spec_tokens, "speculative decoding is refused with tensor parallelism"
            req = s.request
            end = s.num_computed_tokens + s.num_scheduled_tokens
            known = self._sent.get(req.request_id)
            new: tuple[int, SamplingParams] | None = None
            if known is None or known[0] is not req:  # (an id reused by a later request is a new request)
                start, new = 0, (req.num_prompt_tokens, req.sampling_params)
                end = max(end, req.num_prompt_tokens)
            else:
                # NOTE: tokens before num_computed_tokens never change; from there on they are resent (a
                # preempted request recomputing from 0 resends its prompt; a decode row sends one token).
                start = min(known[1], s.num_computed_tokens)
            rows.append(StepRow(req.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.block_table, s.sample,
                                start, req.all_token_ids[start:end], new))
            self._sent[req.request_id] = (req, end)
        return WorkerStep(rows, so.blocks_to_copy, so.blocks_to_swap_out, so.blocks_to_swap_in,
                          so.preempted_request_ids, finished)


class StepDecoder:
    """A worker's side: ``WorkerStep`` -> the ``SchedulerOutput`` its runner executes, over mirror requests."""

    def __init__(self) -> None:
        self.mirrors: dict[str, Request] = {}

    def decode(self, step: WorkerStep) -> SchedulerOutput:
        """Apply the step's token deltas to the mirrors and rebuild the ``SchedulerOutput``.

        Raises:
            KeyError: a row without ``new`` for a request this worker has no mirror of (the ranks disagree).
        """
        for request_id in step.finished_request_ids:
            self.mirrors.pop(request_id, None)
        scheduled = []
        for row in step.rows:
            if row.new is not None:
                num_prompt, params = row.new
                req = Request(row.request_id, row.tokens[:num_prompt], params, None, max_tokens=1)
                req.all_token_ids = list(row.tokens)
                self.mirrors[row.request_id] = req
            else:
                req = self.mirrors[row.request_id]
                del req.all_token_ids[row.start:]
                req.all_token_ids += row.tokens
            scheduled.append(ScheduledRequest(req, row.num_computed_tokens, row.num_scheduled_tokens,
                                              row.block_table, row.sample))
        return SchedulerOutput(scheduled, blocks_to_copy=step.blocks_to_copy,
                               blocks_to_swap_out=step.blocks_to_swap_out, blocks_to_swap_in=step.blocks_to_swap_in,
                               preempted_request_ids=step.preempted_request_ids,
                               finished_request_ids=step.finished_request_ids)
