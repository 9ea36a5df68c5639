"""The scheduler <-> model runner contract: what to compute this step, and what came out of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.block_hash import BlockHash
from kvserve.core.block_manager import BlockId
from kvserve.core.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes K/V for ``request.all_token_ids[num_computed_tokens : num_computed_tokens +
    num_scheduled_tokens]`` at those positions, writing them into ``block_table``'s slots, and samples a
    token iff ``sample`` (the step reaches the end of the request's known tokens).

    Speculative decoding: the last ``num_spec_tokens`` of the scheduled tokens are slots for draft tokens
    (not in ``all_token_ids``); the runner proposes up to that many, verifies them with the target in the
    same forward and may emit several tokens. ``draft_token_ids`` holds the proposal once made (runner).
    """

    request: Request
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[BlockId]
    sample: bool
    num_spec_tokens: int = 0
    draft_token_ids: tuple[int, ...] = ()


@dataclass
class SchedulerOutput:
    """Everything the model runner needs for one step; nothing else crosses from scheduler to runner.

    Attributes:
        scheduled: the requests of this step, running ones first, then newly admitted ones.
        blocks_to_swap_out: ``(device_block, host_block)`` copies device -> host swap pool, done first
            (the device blocks may be reused by this very step).
        blocks_to_swap_in: ``(host_block, device_block)`` copies host swap pool -> device, done second.
        blocks_to_copy: ``(src, dst)`` device block copies (copy-on-write), done third, before the forward.
        preempted_request_ids: requests preempted by recompute this step (their blocks are already freed).
        finished_request_ids: requests finished or aborted since the previous step (drop their state).
        blocks_to_offload: ``(device_block, hash, evicted)``: KV offload: read these blocks' contents
            first of all (before any copy or write of this step): evicted ones go to the local tiers,
            newly committed ones (``evicted`` False) are published to the remote tiers.
        blocks_to_load: ``(device_block, payload)``: KV offload hits to write into fresh device blocks after
            the copies and before the forward.
    """

    scheduled: list[ScheduledRequest]
    blocks_to_copy: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[BlockId, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, BlockId]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    blocks_to_offload: list[tuple[BlockId, BlockHash, bool]] = field(default_factory=list)
    blocks_to_load: list[tuple[BlockId, bytes]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's and the top-N alternatives (natural log)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """Log-probabilities of the prompt tokens a step scored for one request (rows are prompt positions).

    Row ``r`` scores prompt token ``start + r`` from the logits at position ``start + r - 1``; column 0 is
    that prompt token, columns 1.. the top-N alternatives (most likely first). ``start >= 1``: nothing
    predicts the first prompt token.
    """

    start: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """What one step produced, in the order of the requests that sampled.

    Attributes:
        req_ids: ids of the requests that sampled a token this step.
        sampled_token_ids: per entry of ``req_ids``, the tokens emitted: one, or with speculative
            decoding the accepted drafts and one more.
        logprobs: per entry of ``req_ids``, one ``TokenLogprobs`` per emitted token when the request asked
            for logprobs, else None.
        num_draft_tokens: per entry of ``req_ids``, the draft tokens verified (None: no speculation).
        prompt_logprobs: per request id, the prompt tokens scored this step (also on steps that do not
            sample); only for requests that asked for ``prompt_logprobs``. A request recomputed after
            preemption scores its prompt again: the engine keeps the first copy.
        offloaded: ``(hash, payload, evicted)`` of the step's ``blocks_to_offload`` (for the offload tiers).
        swap_bytes: bytes copied between device and host swap pool this step (out + in).
        swap_seconds: wall time of those copies (the engine's copy-bandwidth estimate uses both).
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    num_draft_tokens: list[int] | None = None
    offloaded: list[tuple[BlockHash, bytes, bool]] = field(default_factory=list)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    swap_bytes: int = 0
    swap_seconds: float = 0.0
