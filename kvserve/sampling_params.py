"""SamplingParams: how to pick tokens and when to stop, validated once at construction.

Field names and semantics follow vLLM's ``SamplingParams`` so that users can switch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param}: {message}", param=param)


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request.

    Attributes:
        n: number of output sequences to return (>= 1).
        temperature: >= 0; 0 means greedy (argmax).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens with probability < min_p * max probability; in [0, 1].
        presence_penalty, frequency_penalty: in [-2, 2], applied to output tokens (OpenAI's definition).
        repetition_penalty: > 0; 1 disables (CTRL paper, Keskar et al. 2019), over prompt + output tokens.
        seed: per-request RNG seed; the same seed gives the same tokens whatever else is in the batch.
        max_tokens: maximum number of generated tokens (None: until ``max_model_len``).
        min_tokens: EOS and stop token ids are ignored until this many tokens were generated.
        ignore_eos: keep generating after EOS.
        stop: strings that end generation; the matched string is not included in the output text.
        stop_token_ids: token ids that end generation (the token is kept in ``token_ids``; its text is
            left out of ``text`` unless ``include_stop_str_in_output``, as vLLM).
        logprobs: number of top log-probabilities to return per generated token (None: none; -1: the whole
            vocabulary). The engine refuses more than its ``max_logprobs``.
        prompt_logprobs: number of top log-probabilities per prompt token (None: none; -1: the whole
            vocabulary); ``RequestOutput.prompt_logprobs`` then has one entry per prompt token (None for
            the first). A request with prompt logprobs does not look up the prefix cache (as vLLM).
        skip_special_tokens: drop special tokens when detokenizing.
        include_stop_str_in_output: keep the matched stop string (or the stop token's text) in the output text.
        logit_bias: token id -> bias in [-100, 100] added to its logit before sampling (OpenAI's field).
        allowed_token_ids: only these token ids can be sampled (None: all).
        bad_words: words that are never generated: a word's last token is banned whenever the output ends
            with the tokens before it (as vLLM; the word is tried with and without a leading space).
        bad_words_token_ids: ``bad_words`` as token id sequences, filled in by the engine's tokenizer.
        truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last ``max_model_len``; None: all).
        structured_outputs: the output must match this JSON schema / regex / choice / grammar (xgrammar).
        kv_transfer_params: prefill/decode disaggregation (vLLM's request field; ``kvserve/disagg/protocol.py``):
            ``{"do_remote_decode": true}`` to a prefill instance, the dict it returned to a decode instance.

    Raises:
        InvalidRequestError: when a field is out of range; the message and ``param`` name the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a number >= 0, got {self.temperature!r}")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2 <= v <= 2, name, f"must be in [-2, 2], got {v!r}")
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty!r}")
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0), "max_tokens",
               f"must be an integer >= 0, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _check(v is None or (_is_int(v) and v >= -1), name, f"must be an integer >= 0 or -1 (all), got {v!r}")
        self._check_token_constraints()
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams")

    def _check_token_constraints(self) -> None:
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
            _check(all(_is_int(t) and t >= 0 for t in self.logit_bias), "logit_bias",
                   "keys must be token ids (integers >= 0)")
            _check(all(_is_num(b) and -100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias",
                   "biases must be numbers in [-100, 100]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(bool(self.allowed_token_ids) and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", "must be a non-empty list of token ids (integers >= 0)")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
                   "must be non-empty strings")
        k = self.truncate_prompt_tokens
        _check(k is None or (_is_int(k) and (k >= 1 or k == -1)), "truncate_prompt_tokens",
               f"must be -1 (max_model_len) or an integer >= 1, got {k!r}")

    @property
    def greedy(self) -> bool:
        """True when the request samples by argmax (temperature ~ 0)."""
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: object) -> SamplingParams:
        """A validated copy with ``changes`` applied."""
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)  # type: ignore[arg-type]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
