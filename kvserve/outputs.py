"""What the engine returns: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.core.scheduler_output import TokenLogprobs


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``).

    Attributes:
        logprob: natural log of the token's probability under the model (raw logits, no sampling knobs).
        rank: 1 + the number of tokens strictly more likely.
        decoded_token: the token's text alone (None without a tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``PromptLogprobs``: one entry per prompt token, None for the first (nothing predicts it), else
# token id -> Logprob for the prompt's own token (first) and the top-N alternatives.
PromptLogprobs = list[dict[int, Logprob] | None]


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
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``, filled once the prompt is computed.
        num_cached_tokens: prompt tokens served from the prefix cache.
        metrics: timestamps in ``time.monotonic()`` seconds (arrival, first_token, finished).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # PD disaggregation: what a prefill instance returns for the decode instance (None: nothing to continue).
    kv_transfer_params: dict[str, Any] | None = None
