"""Scheduler: token-centric continuous batching over the paged KV cache.

Each step hands out a token budget (``max_num_batched_tokens``): running requests first (one token each
when decoding, a chunk when still prefilling), then waiting requests in arrival order while blocks and
``max_num_seqs`` allow. Each request gets ``min(num_tokens - num_computed_tokens, budget left)`` tokens:
that cap *is* chunked prefill. When a running request cannot get a block, the most recently admitted
running request is preempted by recompute: its blocks are freed, ``num_computed_tokens`` goes back to 0
and it returns to the front of the waiting queue (its output so far is kept and recomputed as prompt).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.core.block_manager import BlockManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from kvserve.core.stop_checker import check_stop


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    Attributes:
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget per step.
        max_model_len: longest sequence in tokens (prompt + output).
        enable_chunked_prefill: False: a prompt is only admitted when it fits the budget whole.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


@dataclass
class RequestUpdate:
    """What a step did to one request: its new tokens (0 or 1 without spec decode) and their logprobs."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler for metrics (vLLM's ``SchedulerStats``); counters are totals since start.

    Attributes:
        kv_cache_usage: fraction (0..1) of KV blocks in use (cached-but-free blocks count as free).
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found, each request once.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    """Decides, every step, which requests compute how many tokens. Torch-free.

    Args:
        config: step limits.
        block_manager: the KV block allocator the scheduler owns the use of.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        # Prefix-cache counters in tokens; each request is counted once, at its first admission (a
        # preempted request finding its own blocks again is not a hit: BC-16).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Parallel sampling: samples waiting for their leader's prompt to be computed, then forked.
        self._forks: dict[str, list[Request]] = {}
        self._fork_of: dict[str, str] = {}

    # ---- queue management ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_forks(self, leader: Request, samples: list[Request]) -> None:
        """Parallel sampling (n > 1): ``samples`` share ``leader``'s prompt blocks instead of computing them.

        The leader is scheduled as usual. When its prompt is computed (the step that samples its first
        token), each sample gets a fork of its block table (ref counts + 1) with ``num_computed_tokens =
        num_prompt_tokens - 1`` and joins the running requests, so its next step recomputes only the last
        prompt token (copy-on-write of the shared last block) and samples its own first token. Samples
        join even beyond ``max_num_seqs`` (they belong to an admitted request).
        """
        assert leader.request_id in self.requests, "add the leader first"
        for sample in samples:
            assert sample.prompt_token_ids == leader.prompt_token_ids
            self._fork_of[sample.request_id] = leader.request_id
        self._forks.setdefault(leader.request_id, []).extend(samples)

    def _fork_samples(self, leader: Request) -> None:
        for sample in self._forks.pop(leader.request_id, []):
            del self._fork_of[sample.request_id]
            self.block_manager.fork(leader.request_id, sample.request_id)
            sample.num_computed_tokens = sample.num_prompt_tokens - 1
            sample.num_cached_tokens = leader.num_cached_tokens
            sample.first_scheduled_time = leader.first_scheduled_time
            sample.status = RequestStatus.RUNNING
            self.requests[sample.request_id] = sample
            self.running.append(sample)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop, fail) requests wherever they are; frees all their blocks.

        Samples of a leader that was not forked yet are finished with it. Unknown or already finished
        ids are ignored. Returns the requests that were finished now.
        """
        assert status.finished
        done = []
        for request_id in request_ids:
            if request_id in self._fork_of:  # a sample still waiting for its leader's prompt
                leader_id = self._fork_of.pop(request_id)
                sample = next(r for r in self._forks[leader_id] if r.request_id == request_id)
                self._forks[leader_id].remove(sample)
                self._finish(sample, status)
                done.append(sample)
                continue
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            for sample in self._forks.pop(request_id, []):
                del self._fork_of[sample.request_id]
                self._finish(sample, status)
                done.append(sample)
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            done.append(request)
        return done

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.block_manager.free(request.request_id)
        self._finished_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.block_manager.usage, self.num_preemptions,
                              self.prefix_cache_queries, self.prefix_cache_hits)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step under the token budget. See the module docstring for the rules."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not bm.allocate_slots(request.request_id, request.num_computed_tokens, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1

        # Admit waiting requests (none while we are short of blocks: they would be preempted at once).
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = bm.get_computed_blocks(request)
            num_computed = len(hits) * bm.block_size
            remaining = request.num_tokens - num_computed
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if not bm.allocate_slots(request.request_id, num_computed, num_new, hits):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_computed
                if bm.enable_caching:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_computed
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            blocks_to_copy=bm.take_pending_copies(),
            preempted_request_ids=preempted,
            finished_request_ids=finished,
        )

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=num_new,
            block_table=list(self.block_manager.get_block_table(request.request_id)),
            sample=request.num_computed_tokens + num_new == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the blocks, back to the front of the waiting queue."""
        self.block_manager.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance ``num_computed_tokens``, append sampled tokens, finish requests that hit a stop.

        Returns one update per request that got a token (or prompt logprobs) this step; finished requests
        have a final ``status`` and no blocks.
        """
        for s in output.scheduled:
            if s.request.status == RequestStatus.RUNNING:
                s.request.num_computed_tokens += s.num_scheduled_tokens
                self.block_manager.cache_blocks(s.request, s.request.num_computed_tokens)
        updates: list[RequestUpdate] = []
        prompt_lps = runner_output.prompt_logprobs
        for row, request_id in enumerate(runner_output.req_ids):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished (aborted) while the step ran
            token_id = runner_output.sampled_token_ids[row]
            request.append_output_token(token_id)
            if request.request_id in self._forks:
                self._fork_samples(request)  # its prompt is computed: the samples share it from now on
            lp = runner_output.logprobs[row] if runner_output.logprobs is not None else None
            updates.append(RequestUpdate(request, [token_id], [lp], prompt_lps.get(request_id)))
            status = check_stop(request, self.config.max_model_len)
            if status is not None:
                self.requests.pop(request_id)
                self.running.remove(request)
                self._finish(request, status)
        return updates
