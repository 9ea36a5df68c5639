"""What the engine returns: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.core.scheduler_output import TokenLogprobs


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        text: the full text so far (or, when streaming deltas, only the new part).
        token_ids: generated token ids (a stop token id is included; EOS is included).
        logprobs: one entry per token when requested.
        finish_reason: ``stop`` | ``length`` | ``abort`` | ``error`` | None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    Attributes:
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timestamps in ``time.monotonic()`` seconds (arrival, first_token, finished).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
