"""allowed_token_ids, bad_words and logit_bias on the logits (kvserve/sample/token_constraints.py), no model."""

from __future__ import annotations

import pytest
import torch

from kvserve.core.request import Request
from kvserve.errors import InvalidRequestError
from kvserve.sample.token_constraints import (
    apply_token_constraints,
    bad_words_token_ids,
    banned_by_bad_words,
    prepare_token_constraints,
)
from kvserve.sampling_params import SamplingParams


def _request(params: SamplingParams, output: list[int] | None = None) -> Request:
    r = Request("r", [1, 2, 3], params, eos_token_id=0, max_tokens=16)
    for t in output or []:
        r.append_output_token(t)
    return r


def test_banned_by_bad_words_matches_the_output_tail() -> None:
    words = [[7], [3, 4, 5]]
    assert banned_by_bad_words(words, [9, 3, 4]) == [7, 5]
    assert banned_by_bad_words(words, [9, 4]) == [7]
    assert banned_by_bad_words(words, [4]) == [7]
    assert banned_by_bad_words(words, []) == [7]


def test_apply_constraints_per_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    before = logits.clone()
    reqs = [
        _request(SamplingParams()),  # untouched
        _request(SamplingParams(allowed_token_ids=[1, 3])),
        _request(SamplingParams(logit_bias={2: 5.0, 9: -100.0})),
        _request(SamplingParams(bad_words_token_ids=[[6], [3, 4]]), output=[8, 3]),
    ]
    apply_token_constraints(logits, reqs)
    assert torch.equal(logits[0], before[0])
    assert torch.isinf(logits[1]).sum() == 8 and logits[1, 1] == before[1, 1] and logits[1, 3] == before[1, 3]
    assert logits[2, 2] == pytest.approx(float(before[2, 2]) + 5.0) and logits[2, 9] == pytest.approx(
        float(before[2, 9]) - 100.0)
    assert torch.equal(logits[2, :2], before[2, :2])
    assert torch.isinf(logits[3, 6]) and torch.isinf(logits[3, 4]) and torch.isinf(logits[3]).sum() == 2
    assert int(logits[1].argmax()) in (1, 3)


def test_allowed_ids_with_bias_keeps_the_mask() -> None:
    logits = torch.zeros(1, 6)
    apply_token_constraints(logits, [_request(SamplingParams(allowed_token_ids=[4], logit_bias={0: 100.0}))])
    assert int(logits.argmax()) == 4 and torch.isinf(logits[0, 0])


class _Words:
    """A toy tokenizer: a word -> one id per character; a leading space turns the first id negative-offset."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text.lstrip()]
        if text.startswith(" ") and ids:
            ids[0] += 1000
        return ids


def test_bad_words_tokenized_with_and_without_a_leading_space() -> None:
    assert bad_words_token_ids(["ab", " c"], _Words()) == [[97, 98], [1097, 98], [99], [1099]]


def test_prepare_checks_ids_against_the_vocabulary() -> None:
    with pytest.raises(InvalidRequestError) as e:
        prepare_token_constraints(SamplingParams(allowed_token_ids=[3, 50]), 10, None)
    assert e.value.param == "allowed_token_ids" and "50" in e.value.message
    with pytest.raises(InvalidRequestError) as e:
        prepare_token_constraints(SamplingParams(logit_bias={10: 1.0}), 10, None)
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as e:
        prepare_token_constraints(SamplingParams(bad_words=["x"]), 10, None)
    assert e.value.param == "bad_words"
    p = prepare_token_constraints(SamplingParams(bad_words=["ab"]), 2000, _Words())
    assert p.bad_words_token_ids == [[97, 98], [1097, 98]]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logit_bias": {1: 101.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_sampling_params_validate_the_new_fields(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.param == param
