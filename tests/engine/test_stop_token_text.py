"""The text of a stop token id (and of EOS) is left out of the output unless include_stop_str_in_output
(as vLLM), while the token stays in ``token_ids``; surrogates in an offline prompt are a clean error."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m-instruct", kv_cache_memory=0.05, max_model_len=256)


def test_stop_token_text_is_removed_unless_asked(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    assert tok is not None
    [free] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    ids = free.outputs[0].token_ids
    # The first visible token not seen before it, past the first.
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and tok.decode([ids[i]]).strip())
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[k]])
    [cut] = llm.generate([PROMPT], params, use_tqdm=False)
    c = cut.outputs[0]
    assert c.token_ids == ids[:k + 1] and c.finish_reason == "stop" and c.stop_reason == ids[k]
    assert c.text == tok.decode(ids[:k]) and c.text != tok.decode(ids[:k + 1])
    [kept] = llm.generate([PROMPT], params.clone(include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == tok.decode(ids[:k + 1]) and kept.outputs[0].token_ids == ids[:k + 1]


def test_eos_text_is_removed_even_when_special_tokens_are_shown(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    assert tok is not None
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}])
    params = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    [out] = llm.generate([{"prompt_token_ids": chat}], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == tok.eos_token_id
    assert c.text == tok.decode(c.token_ids[:-1], skip_special_tokens=False) and "<|im_end|>" not in c.text


def test_lone_surrogate_in_an_offline_prompt(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="surrogate") as e:
        llm.generate(["a \ud800 b"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.param == "prompt"
    assert not llm.engine.groups
