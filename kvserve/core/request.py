"""Request: one sequence being served, and its lifecycle status."""

from __future__ import annotations

import enum
import time
from typing import NewType

from kvserve.core.block_hash import BlockHash
from kvserve.sampling_params import SamplingParams

RequestId = NewType("RequestId", str)


class RequestStatus(enum.IntEnum):
    """Where a request is in its lifecycle. Every status >= FINISHED_STOPPED is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # preempted by recompute: back in the waiting queue, its KV dropped
    SWAPPED = 3  # preempted by swap: its KV in the host swap pool, resumes before new requests
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` for a final status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A single sequence: its prompt, its output so far, and how much of it has KV in the cache.

    The scheduler's whole view of progress is two numbers: ``num_tokens`` (prompt + output so far) and
    ``num_computed_tokens`` (tokens whose K/V are already in the cache). A step computes some of the
    difference; when it reaches ``num_tokens`` a new token is sampled.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt, ``[num_prompt_tokens]``; never empty.
        sampling_params: validated parameters.
        eos_token_id: the model's end-of-sequence id, or None.
        max_tokens: the effective output limit in tokens (already capped by ``max_model_len``).
        arrival_time: ``time.monotonic()`` seconds at arrival.
        priority: lower runs first under the priority policy (as vLLM).
        cache_salt: tenant salt for prefix caching; requests with different salts never share blocks.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        assert prompt_token_ids, "empty prompts are refused before a Request is made"
        self.request_id = RequestId(request_id)
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # prompt + output; appended to, never rebuilt (the runner slices it every step).
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.first_scheduled_time: float | None = None
        # Chained hashes of the full blocks of all_token_ids (prefix caching; filled by the BlockManager).
        self.block_hashes: list[BlockHash] = []
        # PD disaggregation (disagg/protocol.py): the request's kv_transfer_params (RemoteDecode on a prefill
        # instance, RemotePrefill on a decode one; None once its KV is in), and what a prefill instance hands
        # back for the decode instance (a RemotePrefill, set when the request finished with its blocks pinned).
        self.kv_transfer: object | None = None
        self.kv_transfer_out: object | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` output tokens (a stop string ended before them; the request is
        finishing). ``num_computed_tokens`` is capped at what remains."""
        if num_tokens <= 0:
            return
        del self.output_token_ids[len(self.output_token_ids) - num_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - num_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, len(self.all_token_ids))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
