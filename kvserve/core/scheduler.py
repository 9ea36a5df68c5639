"""Scheduler: token-centric continuous batching over the paged KV cache.

One step hands out a token budget (``max_num_batched_tokens``, or ``burst_batched_tokens`` while at least that
many prompt tokens wait to be prefilled: ``SchedulerConfig.step_budget``) in this order:

1. running requests that decode get their one token each (so a long prompt never stalls a stream);
2. running requests still prefilling get their next chunk;
3. swapped-out requests resume (their KV is copied back from the host pool), before any new request;
4. waiting requests are admitted in policy order (``fcfs``: arrival; ``priority``: lower value first), each
   after a prefix-cache lookup, while blocks, ``max_num_seqs`` and the budget allow.

A prefill chunk is ``min(tokens left, budget left)``, at most ``long_prefill_token_threshold`` for a long
prompt, and a chunk that does not finish its prompt is never smaller than ``min_prefill_chunk`` (a tiny
chunk pays a whole forward pass for little work). At most ``max_num_partial_prefills`` prompts are
mid-prefill (admitted, not fully computed) at once. With chunked prefill off, a prompt is admitted only
when it fits the budget whole.

When a running request cannot get a block, a victim is preempted: the newest admitted request (``fcfs``)
or the lowest-priority, newest one (``priority``). It is preempted by **recompute** (blocks freed, back to
the waiting queue, its tokens so far recomputed as a prompt) or by **swap** (its computed blocks copied to
the host pool, resumed later by copying them back), chosen per victim by ``preemption_mode``; ``auto``
picks the cheaper by the cost model (``kvserve.cost_model.preempt_choice``: ``tokens / prefill speed`` vs
``2 × KV bytes / copy bandwidth``), with speeds the engine measures (``PerfEstimates``). Under the
priority policy a waiting request may also preempt a running one of strictly lower priority.
No request is admitted or resumed in a step that preempted for lack of blocks.

Speculative decoding (``spec_decode/``): a decoding request may get ``1 + k`` tokens, its last token and
``k`` slots for draft tokens the runner proposes and verifies in the same forward; ``k`` comes from the
``SpecController`` (0: plain decode) and counts in the budget. After the step, ``num_computed_tokens``
advances by the tokens emitted (accepted drafts + one), the blocks past that are freed (rejected drafts'
slots), and only verified tokens are ever committed to the prefix cache.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.core.block_hash import BlockHash
from kvserve.core.block_manager import BlockId, BlockManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from kvserve.core.stop_checker import check_stop
from kvserve.cost_model import preempt_choice
from kvserve.kv_offload.manager import OffloadManager, OffloadSnapshot
from kvserve.spec_decode.controller import SpecController, SpecStats

if TYPE_CHECKING:  # the connector needs zmq; the core imports it only for types
    from kvserve.disagg.connector import TransferSnapshot, ZmqConnector


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policies of scheduling.

    Attributes:
        max_num_seqs: most running requests (forked samples of an admitted request may exceed it).
        max_num_batched_tokens: token budget per step.
        max_model_len: longest sequence in tokens (prompt + output).
        enable_chunked_prefill: False: a prompt is only admitted when it fits the budget whole.
        max_num_partial_prefills: most prompts mid-prefill at once.
        long_prefill_token_threshold: per-step cap on a long prompt's chunk (0: none; with
            ``max_num_partial_prefills > 1`` it defaults to 4 % of ``max_model_len``, as vLLM).
        preemption_mode: ``recompute`` | ``swap`` | ``auto``.
        scheduling_policy: ``fcfs`` | ``priority``.
        num_host_blocks: blocks of the host swap pool (0: swap impossible, every preemption recomputes).
        block_bytes: bytes of one KV block over all layers, K and V (swap accounting and the cost model).
        burst_batched_tokens: token budget of a step while at least this many prompt tokens wait to be
            prefilled (a burst of arrivals); 0, or not above ``max_num_batched_tokens``: off.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    num_host_blocks: int = 0
    block_bytes: int = 0
    burst_batched_tokens: int = 0

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step may compute (activation buffers are sized for it)."""
        return max(self.max_num_batched_tokens, self.burst_batched_tokens)

    def step_budget(self, backlog: int) -> int:
        """The token budget of a step that finds ``backlog`` prompt tokens waiting to be prefilled.

        A step of ``burst_batched_tokens`` only while the backlog fills one: under a burst of arrivals the
        prompts behind the first are prefilled in fewer, larger steps (fewer passes with the running decodes;
        server, SmolLM2 bf16 on 2 Zen 5 cores, 2,048 vs 512 tokens: TTFT p99 of vs_peers' A c16 2.8 vs 3.6 s,
        A c64 12.0 vs 13.1 s, docs/performance-log.md window s26b); once the backlog is smaller the step goes back
        to ``max_num_batched_tokens``, which keeps the decodes' inter-token gaps short.

        Args:
            backlog: prompt tokens not yet computed, of running, swapped and waiting requests.
        Returns:
            tokens, ``max_num_batched_tokens`` or ``burst_batched_tokens``.
        """
        if self.burst_batched_tokens > self.max_num_batched_tokens and backlog >= self.burst_batched_tokens:
            return self.burst_batched_tokens
        return self.max_num_batched_tokens

    @property
    def long_prefill_cap(self) -> int:
        """Tokens per step of a long prompt (0: uncapped)."""
        if self.long_prefill_token_threshold > 0:
            return self.long_prefill_token_threshold
        return max(1, self.max_model_len * 4 // 100) if self.max_num_partial_prefills > 1 else 0

    @property
    def min_prefill_chunk(self) -> int:
        """Smallest chunk that leaves a prompt unfinished: 1/8 of the budget, at most 64 tokens."""
        return max(1, min(64, self.max_num_batched_tokens // 8))


@dataclass
class PerfEstimates:
    """The speeds the ``auto`` preemption choice uses, measured by the engine (0: not measured yet).

    Attributes:
        prefill_tokens_per_s: tokens per second of prefill forward passes.
        copy_bytes_per_s: bytes per second of device <-> host swap copies.
    """

    prefill_tokens_per_s: float = 0.0
    copy_bytes_per_s: float = 0.0


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler for metrics (vLLM's ``SchedulerStats``); counters are totals since start.

    Attributes:
        kv_cache_usage: fraction (0..1) of KV blocks in use (cached-but-free blocks count as free).
        num_partial_prefills: running requests whose prompt is not fully computed.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found, each request once.
        swapped_bytes: bytes copied by swaps, out and in.
        spec: speculative decoding's counters (None: off).
        offload: the KV offload tiers' counters (None: off).
        prompt_tokens_computed: prompt tokens run through the model (not prefix-cache hits, not KV loaded
            from a tier or transferred from a prefill instance; a recomputed prompt counts again).
        transfer: the KV connector's counters (None: no ``--kv-transfer-config``).
    """

    num_running: int
    num_waiting: int
    num_swapped: int
    num_partial_prefills: int
    kv_cache_usage: float
    num_preemptions: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    swapped_bytes: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec: SpecStats | None = None
    offload: OffloadSnapshot | None = None
    prompt_tokens_computed: int = 0
    transfer: TransferSnapshot | None = None


@dataclass
class RequestUpdate:
    """What a step did to one request: its new tokens (0 or 1 without spec decode) and their logprobs."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]


@dataclass
class _Step:
    """The plan being built by one ``schedule()`` call."""

    budget: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[BlockId, int]] = field(default_factory=list)
    swap_in: list[tuple[int, BlockId]] = field(default_factory=list)
    loads: list[tuple[BlockId, bytes]] = field(default_factory=list)
    swapped_in: set[str] = field(default_factory=set)
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens scheduled this step
    # Hashes of the uncached full prompt blocks that running or admitted requests compute (None: not gathered)
    computing: set[BlockHash] | None = None


class Scheduler:
    """Decides, every step, which requests compute how many tokens. Torch-free.

    Args:
        config: step limits and policies.
        block_manager: the KV block allocator the scheduler owns the use of.
        perf: measured speeds for the ``auto`` preemption choice (the engine updates them as it runs).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, perf: PerfEstimates | None = None,
                 spec: SpecController | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.perf = perf or PerfEstimates()
        self.spec = spec  # speculative decoding's k controller (None: off)
        self.offload: OffloadManager | None = None  # KV offload tiers (None: off); see set_offload
        self.connector: ZmqConnector | None = None  # PD disaggregation (None: off); see set_connector
        self.prompt_tokens_computed = 0
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.swapped_bytes = 0
        self._finished_ids: list[str] = []
        # Prefix-cache counters in tokens; each request is counted once, at its first admission (a
        # preempted request finding its own blocks again is not a hit: BC-16).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Parallel sampling: samples waiting for their leader's prompt to be computed, then forked.
        self._forks: dict[str, list[Request]] = {}
        self._fork_of: dict[str, str] = {}
        # Host swap pool: free host block ids, the host blocks of each swapped request, and host blocks
        # released during a step (they are read by that step's swap-in: reusable from the next step).
        self._host_free: list[int] = list(range(config.num_host_blocks - 1, -1, -1))
        self.host_tables: dict[str, list[int]] = {}
        self._host_release: list[int] = []

    # ---- queue management ----------------------------------------------------------------------
    def _key(self, request: Request) -> tuple[int, float]:
        """Policy order: lower runs first. fcfs: arrival time; priority: (priority, arrival time)."""
        if self.config.scheduling_policy == "priority":
            return (request.priority, request.arrival_time)
        return (0, request.arrival_time)

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        if self.config.scheduling_policy == "priority":
            bisect.insort_right(self.waiting, request, key=self._key)
        else:
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
            # The prompt's blocks only (the leader may have emitted several tokens this step: drafts).
            self.block_manager.trim(sample.request_id, sample.num_prompt_tokens)
            sample.num_computed_tokens = sample.num_prompt_tokens - 1
            sample.num_cached_tokens = leader.num_cached_tokens
            sample.first_scheduled_time = leader.first_scheduled_time
            sample.status = RequestStatus.RUNNING
            self.requests[sample.request_id] = sample
            self.running.append(sample)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop, fail) requests wherever they are; frees all their blocks (device and host).

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
            {RequestStatus.RUNNING: self.running, RequestStatus.SWAPPED: self.swapped}.get(
                request.status, self.waiting).remove(request)
            self._finish(request, status)
            done.append(request)
        return done

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if self.spec is not None:
            self.spec.release([request.request_id])
        request.status = status
        bm = self.block_manager
        if self.connector is not None:
            self.connector.finish(request)  # a decode request that never got admitted: P frees its blocks
            if status == RequestStatus.FINISHED_LENGTH_CAPPED and self.connector.wants_pin(request):
                # A prefill instance's prompt: its KV is kept (copied out) for the decode instance.
                request.kv_transfer_out = self.connector.pin(
                    request, bm.get_block_table(request.request_id), bm.request_block_hashes(request))
        bm.free(request.request_id)
        self._host_release.extend(self.host_tables.pop(request.request_id, []))
        self._finished_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_waiting_sequences(self) -> int:
        """Sequences not running yet: waiting requests plus the samples (n > 1) forked from them later."""
        return len(self.waiting) + sum(len(self._forks.get(r.request_id, ())) for r in self.waiting)

    @property
    def num_pending_forks(self) -> int:
        """Samples of running leaders that join the running requests once their leader's prompt is done."""
        return sum(len(self._forks.get(r.request_id, ())) for r in self.running)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def make_stats(self) -> SchedulerStats:
        partial = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1)
        return SchedulerStats(
            len(self.running), len(self.waiting), len(self.swapped), partial, self.block_manager.usage,
            self.num_preemptions, self.num_preemptions_by_mode["recompute"], self.num_preemptions_by_mode["swap"],
            self.swapped_bytes, self.prefix_cache_queries, self.prefix_cache_hits,
            self.spec.stats.snapshot() if self.spec is not None else None,
            self.offload.snapshot() if self.offload is not None else None,
            self.prompt_tokens_computed, self.connector.snapshot() if self.connector is not None else None)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step under the token budget. See the module docstring for the rules."""
        self._host_free.extend(self._host_release)  # last step's swap-ins have been read
        self._host_release = []
        step = _Step(self._step_budget())
        bm = self.block_manager
        self.release_pins()

        # 1-2. running requests: decodes first, then prefill chunks (each in running order).
        order = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        num_decodes = len(order)
        order += [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        # Prefill tokens this step would compute besides the decodes (the k controller's load signal).
        prefill_demand = max(0, min(self.prefill_backlog(), step.budget - num_decodes)) if self.spec is not None else 0
        if self.spec is not None:
            self.spec.begin_step()
        for request in order:
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._num_new_tokens(request, step, admitted=True)
            if num_new == 0:
                continue
            num_spec = 0
            if num_new == 1 and self.spec is not None:
                num_spec = self._num_spec(request, num_decodes, prefill_demand, step.budget)
            while not bm.allocate_slots(request.request_id, request.num_computed_tokens, num_new + num_spec):
                if num_spec:  # no room for the drafts: decode plainly rather than preempt for them
                    num_spec = 0
                    continue
                victim = self._victim()
                self._preempt(victim, step)
                if victim is request:
                    break
            else:
                self._schedule(request, num_new + num_spec, step, num_spec)

        # 3. swapped requests resume before new ones; 4. then waiting requests are admitted.
        if not step.preempted:
            self._resume_swapped(step)
        if not step.preempted and not self.swapped:
            self._admit_waiting(step)

        finished, self._finished_ids = self._finished_ids, []
        offload: list[tuple[BlockId, BlockHash, bool]] = []
        if self.offload is not None:
            if finished:
                self.offload.release(finished)
            evicted, committed = bm.take_offload()
            offload = [(b, h, True) for b, h in evicted] + [(b, h, False) for b, h in committed]
        return SchedulerOutput(
            scheduled=step.scheduled,
            blocks_to_copy=bm.take_pending_copies(),
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
            preempted_request_ids=step.preempted,
            finished_request_ids=finished,
            blocks_to_offload=offload,
            blocks_to_load=step.loads,
        )

    def set_offload(self, manager: OffloadManager, publish: bool) -> None:
        """Turn on KV offload: evicted cached blocks (and, with ``publish``, every newly committed block) are
        handed to ``manager``'s tiers, and admission continues a request's device prefix hits with the
        tiers' (loaded into fresh device blocks, counted as cached tokens)."""
        self.offload = manager
        self.block_manager.record_evictions = True
        self.block_manager.record_commits = publish

    def release_pins(self) -> None:
        """Drop the KV kept for decode instances that confirmed having it, or timed out."""
        if self.connector is not None:
            self.connector.take_releases()

    def set_connector(self, connector: ZmqConnector) -> None:
        """Turn on PD disaggregation: a prefill request (``do_remote_decode``) that finishes by length has
        its prompt's KV kept (copied out of its blocks) for a decode instance, and a decode request
        (``do_remote_prefill``) is admitted with its prompt's KV pulled from the prefill instance
        (``disagg/connector.py``)."""
        self.connector = connector

    def _external_kv(self, request: Request, hits: list[BlockId]) -> tuple[list[bytes], int] | None:
        """KV for the blocks after the prefix-cache hits from outside the device: the prefill instance's
        (a decode request of PD disaggregation) or the offload tiers'. Returns the payloads and the tokens
        computed with them (``len(hits) * block_size`` without any), or None while they are being fetched.
        """
        bm = self.block_manager
        base = len(hits) * bm.block_size
        if self.connector is not None and request.kv_transfer is not None and self.connector.config.is_consumer:
            bm.request_block_hashes(request)  # the chain the transferred blocks are checked against
            got = self.connector.lookup(request, len(hits))
            if got is None or not got[0]:
                return None if got is None else ([], max(base, got[1]))
            return got
        if self.offload is not None and bm.enable_caching and request.sampling_params.prompt_logprobs is None:
            loaded = self.offload.lookup(request, len(hits), (request.num_tokens - 1) // bm.block_size - len(hits))
            if loaded is None:
                return None
            return loaded, base + len(loaded) * bm.block_size
        return [], base

    def _step_budget(self) -> int:
        cfg = self.config
        if cfg.burst_batched_tokens <= cfg.max_num_batched_tokens:
            return cfg.max_num_batched_tokens  # (no backlog to count)
        return cfg.step_budget(self.prefill_backlog())

    def prefill_backlog(self) -> int:
        """Prompt tokens not yet computed: the rest of running requests mid-prefill, of swapped requests and
        the whole of waiting ones (before their prefix-cache lookup)."""
        pending = sum(r.num_tokens - r.num_computed_tokens for r in self.running
                      if r.num_tokens - r.num_computed_tokens > 1)
        pending += sum(r.num_tokens - r.num_computed_tokens for r in self.swapped)
        return pending + sum(r.num_tokens for r in self.waiting)

    def _num_spec(self, request: Request, num_decodes: int, prefill_demand: int, budget_left: int) -> int:
        """Draft slots for a decoding request: the controller's ``k`` within ``max_tokens``, ``max_model_len``
        and the budget left after its own token."""
        assert self.spec is not None
        limit = min(request.max_tokens - request.num_output_tokens - 1,
                    self.config.max_model_len - request.num_tokens - 1, budget_left - 1)
        return self.spec.num_spec_tokens(request.request_id, num_decodes, prefill_demand, limit,
                                         eligible=spec_eligible(request))

    def _num_new_tokens(self, request: Request, step: _Step, admitted: bool, num_computed: int | None = None) -> int:
        """Tokens ``request`` computes this step under the budget and prefill rules (0: not this step)."""
        computed = request.num_computed_tokens if num_computed is None else num_computed
        remaining = request.num_tokens - computed
        if step.budget <= 0:
            return 0
        if remaining == 1:
            return 1
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= step.budget else 0
        num_new = min(remaining, step.budget)
        cap = self.config.long_prefill_cap
        min_chunk = self.config.min_prefill_chunk
        if cap and remaining > cap:
            num_new = min(num_new, cap)
            min_chunk = min(min_chunk, cap)
        if num_new < remaining:  # stays mid-prefill after this step
            if num_new < min_chunk:
                return 0
            if not admitted and self._num_partial(step) >= self.config.max_num_partial_prefills:
                return 0
        return num_new

    def _num_partial(self, step: _Step) -> int:
        """Prompts that will still be mid-prefill after this step, as planned so far."""
        return sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1
                   and r.num_computed_tokens + step.tokens.get(r.request_id, 0) < r.num_tokens)

    def _schedule(self, request: Request, num_new: int, step: _Step, num_spec: int = 0) -> None:
        step.scheduled.append(ScheduledRequest(
            request=request,
            num_computed_tokens=request.num_computed_tokens,
            num_scheduled_tokens=num_new,
            block_table=list(self.block_manager.get_block_table(request.request_id)),
            sample=request.num_computed_tokens + num_new - num_spec == request.num_tokens,
            num_spec_tokens=num_spec,
        ))
        step.budget -= num_new
        step.tokens[request.request_id] = num_new

    def _resume_swapped(self, step: _Step) -> None:
        bm = self.block_manager
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            request = self.swapped[0]
            num_new = self._num_new_tokens(request, step, admitted=False)
            if num_new == 0:
                break
            # A fresh block table: its first blocks receive the swapped-in KV, the rest the new tokens.
            if not bm.allocate_slots(request.request_id, 0, request.num_computed_tokens + num_new):
                break
            self.swapped.pop(0)
            host = self.host_tables.pop(request.request_id)
            table = bm.get_block_table(request.request_id)
            step.swap_in.extend(zip(host, table[:len(host)], strict=True))
            self._host_release.extend(host)
            self.swapped_bytes += len(host) * self.config.block_bytes
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.swapped_in.add(request.request_id)
            self._schedule(request, num_new, step)

    def _admit_waiting(self, step: _Step) -> None:
        """Admit in policy order. A prompt held back only by the partial-prefill limit is passed over, so
        that shorter prompts behind it (which finish their prefill this step) are not starved."""
        bm = self.block_manager
        i = 0
        while i < len(self.waiting) and step.budget > 0:
            request = self.waiting[i]
            if len(self.running) >= self.config.max_num_seqs:
                if self._preempt_for(request, step):
                    continue
                break
            hits = bm.get_computed_blocks(request)
            if self._computed_by_another(request, hits, step):
                i += 1  # its next block is being computed for another prompt: a step later it is a cache hit
                continue
            external = self._external_kv(request, hits)
            if external is None:
                i += 1  # its blocks are being fetched (a slower tier, a prefill instance): next one first
                continue
            loaded, num_computed = external
            num_new = self._num_new_tokens(request, step, admitted=True, num_computed=num_computed)
            if num_new == 0:
                break
            if (num_new < request.num_tokens - num_computed
                    and self._num_partial(step) >= self.config.max_num_partial_prefills):
                i += 1  # it would be one partial prefill too many: let the next one try
                continue
            if not bm.allocate_slots(request.request_id, len(hits) * bm.block_size,
                                     num_computed - len(hits) * bm.block_size + num_new, hits):
                if self._preempt_for(request, step):
                    continue
                break
            if self.offload is not None:
                self.offload.release([request.request_id])
            if self.connector is not None:
                self.connector.finish(request)  # the KV is in (or will be recomputed): P may free it
            if loaded:  # external KV: fresh blocks, written before the forward, cached from now on
                table = bm.get_block_table(request.request_id)
                step.loads.extend(zip(table[len(hits):len(hits) + len(loaded)], loaded, strict=True))
                bm.cache_blocks(request, num_computed, publish=False)  # not computed here
            del self.waiting[i]
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_computed
                if bm.enable_caching:
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_computed
            self.running.append(request)
            self._schedule(request, num_new, step)
            if step.computing is not None:
                step.computing.update(self._uncached_prompt_hashes(request))

    def _uncached_prompt_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the full blocks ``request`` has still to compute (none for a prompt-logprobs request)."""
        bm = self.block_manager
        if request.sampling_params.prompt_logprobs is not None:
            return []  # (its blocks are committed too, but it never waits for others')
        return bm.request_block_hashes(request)[request.num_computed_tokens // bm.block_size:]

    def _computed_by_another(self, request: Request, hits: list[BlockId], step: _Step) -> bool:
        """Whether the first block after ``request``'s prefix-cache hits is one that a running or just admitted
        request computes (two prompts sharing an uncached prefix in one burst). Admitting it now would compute
        that prefix twice; a step later the blocks are cached (in-batch prefix sharing, as SGLang's scheduler
        holds back waiting requests that share a prefix with one already in the batch)."""
        bm = self.block_manager
        if (not bm.enable_caching or request.sampling_params.prompt_logprobs is not None
                or request.kv_transfer is not None or len(hits) >= (request.num_tokens - 1) // bm.block_size):
            return False
        if step.computing is None:
            step.computing = set()
            for r in self.running:
                if r.num_tokens - r.num_computed_tokens > 1:
                    step.computing.update(self._uncached_prompt_hashes(r))
        return bool(step.computing) and bm.request_block_hashes(request)[len(hits)] in step.computing

    def recompute_swapped(self, request_ids: Iterable[str]) -> None:
        """Turn swapped requests into recompute ones (their host copy is not trusted: the step that swapped
        them out failed). Unknown or not-swapped ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.SWAPPED:
                continue
            self.swapped.remove(request)
            self._host_release.extend(self.host_tables.pop(request_id))
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            self._requeue(request)

    # ---- preemption ----------------------------------------------------------------------------
    def _victim(self, exclude: set[str] | None = None) -> Request:
        """The running request to preempt first: the newest (fcfs) or the lowest-priority newest one."""
        candidates = [r for r in self.running if not exclude or r.request_id not in exclude]
        if self.config.scheduling_policy == "priority":
            # Ties go to the most recently admitted (later in ``running``), so that the older of two
            # requests that do not fit together always makes progress (no preemption ping-pong).
            return max(reversed(candidates), key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt_for(self, request: Request, step: _Step) -> bool:
        """Priority policy: preempt a running request of strictly lower priority to admit ``request``."""
        if self.config.scheduling_policy != "priority" or not self.running:
            return False
        candidates = [r for r in self.running if r.request_id not in step.swapped_in]
        if not candidates:
            return False
        victim = self._victim(step.swapped_in)
        if victim.priority <= request.priority:
            return False
        self._preempt(victim, step)
        return True

    def _requeue(self, request: Request) -> None:
        """A recomputed request goes back to waiting: at the front (fcfs), or by its priority."""
        if self.config.scheduling_policy == "priority":
            bisect.insort_left(self.waiting, request, key=self._key)
        else:
            self.waiting.insert(0, request)

    def _mode_for(self, victim: Request) -> str:
        """``swap`` or ``recompute`` for this victim (see the module docstring)."""
        mode = self.config.preemption_mode
        num_blocks = self.block_manager.num_blocks_for(victim.num_computed_tokens)
        if mode == "recompute" or num_blocks == 0 or num_blocks > len(self._host_free):
            return "recompute"
        if mode == "swap":
            return "swap"
        perf = self.perf
        if perf.prefill_tokens_per_s <= 0 or perf.copy_bytes_per_s <= 0 or self.config.block_bytes <= 0:
            return "recompute"
        kv_bytes_per_token = self.config.block_bytes // self.block_manager.block_size
        return preempt_choice(victim.num_computed_tokens, kv_bytes_per_token, perf.prefill_tokens_per_s,
                              perf.copy_bytes_per_s)

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Preempt a running request by swap or recompute; undo its share of this step if it had one."""
        for i, s in enumerate(step.scheduled):
            if s.request is victim:
                del step.scheduled[i]
                step.budget += s.num_scheduled_tokens
                del step.tokens[victim.request_id]
                break
        bm = self.block_manager
        self.running.remove(victim)
        mode = self._mode_for(victim)
        # A copy-on-write queued this step for the victim has not run: its destination still holds
        # garbage, the source the right contents. Swap the source out instead, and drop the copy.
        pending = {dst: src for src, dst in bm.pending_copies}
        table = bm.get_block_table(victim.request_id)
        bm.pending_copies = [(src, dst) for src, dst in bm.pending_copies if dst not in table]
        if mode == "swap":
            num_blocks = bm.num_blocks_for(victim.num_computed_tokens)
            host = [self._host_free.pop() for _ in range(num_blocks)]
            step.swap_out.extend((pending.get(b, b), h) for b, h in zip(table[:num_blocks], host, strict=True))
            self.host_tables[victim.request_id] = host
            self.swapped_bytes += num_blocks * self.config.block_bytes
            bm.free(victim.request_id)
            victim.status = RequestStatus.SWAPPED
            bisect.insort_right(self.swapped, victim, key=self._key)
        else:
            bm.free(victim.request_id)
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
            self._requeue(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_mode[mode] += 1
        step.preempted.append(victim.request_id)

    # ---- after the step ------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance ``num_computed_tokens``, commit full blocks to the prefix cache, append sampled tokens,
        fork the samples of leaders whose prompt is done, finish requests that hit a stop.

        Returns one update per request that got a token this step; finished requests
        have a final ``status`` and no blocks.
        """
        bm = self.block_manager
        spec_rows: dict[str, ScheduledRequest] = {}
        for s in output.scheduled:
            # prompt positions this step ran through the model (also for a request aborted meanwhile)
            if s.num_computed_tokens < s.request.num_prompt_tokens:
                self.prompt_tokens_computed += min(s.num_computed_tokens + s.num_scheduled_tokens,
                                                   s.request.num_prompt_tokens) - s.num_computed_tokens
            if s.request.status != RequestStatus.RUNNING:
                continue
            if s.num_spec_tokens:  # advanced by the tokens it emits, below (accepted drafts + one)
                spec_rows[s.request.request_id] = s
                continue
            s.request.num_computed_tokens += s.num_scheduled_tokens
            bm.cache_blocks(s.request, s.request.num_computed_tokens)
        updates: list[RequestUpdate] = []
        for row, request_id in enumerate(runner_output.req_ids):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished (aborted) while the step ran
            token_ids = runner_output.sampled_token_ids[row]
            lps = runner_output.logprobs[row] if runner_output.logprobs is not None else None
            status = None
            emitted = 0
            for token_id in token_ids:  # stop exactly where the tokens one at a time would have stopped
                request.append_output_token(token_id)
                emitted += 1
                status = check_stop(request, self.config.max_model_len)
                if status is not None:
                    break
            spec = spec_rows.get(request_id)
            if spec is not None:
                num_drafts = runner_output.num_draft_tokens[row] if runner_output.num_draft_tokens else 0
                if self.spec is not None:
                    self.spec.observe(request_id, spec.num_spec_tokens, num_drafts, len(token_ids) - 1)
                # KV is valid for the verified tokens only: the last one computed and the accepted drafts.
                request.num_computed_tokens += emitted
                bm.cache_blocks(request, request.num_computed_tokens)
                bm.trim(request_id, request.num_computed_tokens)  # rejected drafts' blocks
            if request.request_id in self._forks:
                self._fork_samples(request)  # its prompt is computed: the samples share it from now on
            updates.append(RequestUpdate(request, list(token_ids[:emitted]),
                                         list(lps[:emitted]) if lps is not None else [None] * emitted))
            if status is not None:
                self.requests.pop(request_id)
                self.running.remove(request)
                self._finish(request, status)
        return updates


def spec_eligible(request: Request) -> bool:
    """Whether drafts can be verified exactly for this request: not under a grammar (structured output)
    nor multi-token ``bad_words``, whose masks depend on the tokens before each draft position."""
    p = request.sampling_params
    return p.structured_outputs is None and not any(len(w) > 1 for w in p.bad_words_token_ids or ())
