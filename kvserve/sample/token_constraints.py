"""Per-request token constraints on the logits: ``allowed_token_ids``, ``bad_words`` and ``logit_bias``.

They run on the ``[S, V]`` logits of a step before the sampler, as the runner's first logits processor
(``TokenConstraints``; so structured output, penalties, logprobs, greedy and random sampling all see them),
in vLLM's order: the allowed-ids mask, then bad words, then the bias. Only rows of requests that use a
constraint are touched; a step where no request uses one costs a single Python check per row and no tensor
work.

``bad_words`` are tokenized once, when the request is added (:func:`prepare_token_constraints`), as vLLM
does: each word both as given and with a leading space (the middle-of-text spelling), keeping the second
form only when it is a different first token with the same token count. A one-token word is always banned;
a longer one bans its last token whenever the output so far ends with its other tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from kvserve.core.request import Request
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def uses_token_constraints(params: SamplingParams) -> bool:
    """Whether a request's logits need :func:`apply_token_constraints`."""
    return bool(params.logit_bias or params.allowed_token_ids or params.bad_words_token_ids)


def prepare_token_constraints(params: SamplingParams, vocab_size: int, tokenizer: _Encoder | None) -> SamplingParams:
    """Check token ids against the vocabulary and tokenize ``bad_words``; returns the params to run with.

    Raises:
        InvalidRequestError: a token id outside ``[0, vocab_size)`` (``param`` names the field), or
            ``bad_words`` without a tokenizer.
    """
    for name, ids in (("logit_bias", list(params.logit_bias or {})), ("allowed_token_ids", params.allowed_token_ids)):
        bad = next((t for t in ids or [] if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"{name}: token id {bad} is out of range [0, {vocab_size})", param=name)
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    if tokenizer is None:
        raise InvalidRequestError("bad_words: needs a tokenizer (skip_tokenizer_init is set)", param="bad_words")
    return params.clone(bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer))


def bad_words_token_ids(words: Sequence[str], tokenizer: _Encoder) -> list[list[int]]:
    """Token id sequences of ``words`` (see the module docstring); empty encodings are dropped."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def banned_by_bad_words(sequences: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """Token ids a bad word forbids next, given the output so far.

    Example: bad words ``[[7], [3, 4, 5]]`` with output ``[..., 3, 4]`` -> ``[7, 5]``; with ``[..., 4]`` -> ``[7]``.
    """
    banned = []
    for seq in sequences:
        prefix = list(seq[:-1])
        if not prefix or (len(output_token_ids) >= len(prefix) and list(output_token_ids[-len(prefix):]) == prefix):
            banned.append(seq[-1])
    return banned


def apply_token_constraints(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Apply each request's constraints to its row of ``logits`` ``[S, V]``, in place.

    A disallowed or banned token gets ``-inf``; the bias is added to the remaining logits. The row of a
    request without constraints is left bit-identical.
    """
    for row, r in enumerate(requests):
        p = r.sampling_params
        if not uses_token_constraints(p):
            continue
        device = logits.device
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.int64, device=device)
            kept = logits[row, allowed]
            logits[row] = float("-inf")
            logits[row, allowed] = kept
        if p.bad_words_token_ids:
            banned = banned_by_bad_words(p.bad_words_token_ids, r.output_token_ids)
            if banned:
                logits[row, torch.tensor(banned, dtype=torch.int64, device=device)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device)
            logits[row].index_add_(0, ids, bias)


class TokenConstraints:
    """:func:`apply_token_constraints` as a logits processor (``kvserve.sample.logits_processor``); stateless."""

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        apply_token_constraints(logits, requests)

    def acts_on(self, request: Request) -> bool:
        """Whether the request has constraints (``LogitsProcessor``'s optional hook)."""
        return uses_token_constraints(request.sampling_params)

    def release(self, request_ids: Iterable[str]) -> None:
        """Nothing to forget: the constraints live in each request's SamplingParams."""
