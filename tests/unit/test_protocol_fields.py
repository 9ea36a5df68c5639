"""Request bodies: unknown fields are a 400 naming them, vLLM's extra fields convert to SamplingParams, and every
body the official ``openai`` client sends validates (captured with an httpx mock transport, no server)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import ValidationError

from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    validation_error,
)
from kvserve.errors import InvalidRequestError

MSGS = [{"role": "user", "content": "Hi"}]


def _error(model: Any, body: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error(e.value)


@pytest.mark.parametrize(("model", "body", "param"), [
    (CompletionRequest, {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
    (CompletionRequest, {"prompt": "x", "my-field": 1}, "my-field"),
    (CompletionRequest, {"prompt": "x", "stream": True, "stream_options": {"foo": 1}}, "stream_options.foo"),
    (ChatCompletionRequest, {"messages": MSGS, "functions": []}, "functions"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    (TokenizeRequest, {"prompt": "x", "return_token_strs": True}, "return_token_strs"),
])
def test_unknown_fields_are_named(model: Any, body: dict[str, Any], param: str) -> None:
    err = _error(model, body)
    assert err.param == param and err.message.startswith(f"{param}: unsupported field")


def test_generation_defaults_fill_only_unset_fields() -> None:
    defaults = {"temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 300}
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0.0})
    p = req.sampling_params(req.max_tokens, None, defaults)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.0, 20, 1.05, 300)
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 5, "top_k": -1})
    p = req.sampling_params(req.max_tokens, None, defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.7, -1, 5)
    chat = ChatCompletionRequest.model_validate({"messages": MSGS, "max_completion_tokens": 9})
    assert chat.sampling_params(chat.effective_max_tokens, None, defaults).max_tokens == 9
    chat = ChatCompletionRequest.model_validate({"messages": MSGS})
    p = chat.sampling_params(chat.effective_max_tokens, None, {})
    assert (p.temperature, p.max_tokens) == (1.0, None)


def test_vllm_fields_reach_sampling_params() -> None:
    req = CompletionRequest.model_validate({
        "prompt": "x", "logit_bias": {"12": 3.5}, "allowed_token_ids": [1, 2], "bad_words": ["no"],
        "include_stop_str_in_output": True, "truncate_prompt_tokens": 7})
    p = req.sampling_params(4, None)
    assert p.logit_bias == {12: 3.5} and p.allowed_token_ids == [1, 2] and p.bad_words == ["no"]
    assert p.include_stop_str_in_output and p.truncate_prompt_tokens == 7
    with pytest.raises(InvalidRequestError) as e:
        CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"a": 1.0}}).sampling_params(4, None)
    assert e.value.param == "logit_bias"


def test_continue_final_message_rules() -> None:
    last = [*MSGS, {"role": "assistant", "content": "The answer is"}]
    ChatCompletionRequest.model_validate({"messages": last, "continue_final_message": True,
                                          "add_generation_prompt": False}).check_unsupported()
    for body in ({"messages": last, "continue_final_message": True},
                 {"messages": MSGS, "continue_final_message": True, "add_generation_prompt": False}):
        with pytest.raises(InvalidRequestError) as e:
            ChatCompletionRequest.model_validate(body).check_unsupported()
        assert e.value.param == "continue_final_message"
    echo = ChatCompletionRequest.model_validate({"messages": last, "echo": True})
    assert echo.echo_text == "The answer is"
    assert ChatCompletionRequest.model_validate({"messages": MSGS, "echo": True}).echo_text == ""


def _captured_bodies() -> list[tuple[str, dict[str, Any]]]:
    bodies: list[tuple[str, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append((request.url.path, json.loads(request.content)))
        return httpx.Response(500, json={"error": {"message": "captured", "type": "x", "param": None, "code": 500}})

    client = openai.OpenAI(base_url="http://test/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    calls = [
        lambda: client.completions.create(model="m", prompt="hi"),
        lambda: client.completions.create(model="m", prompt=["a", "b"], max_tokens=3, temperature=0, top_p=0.9, n=2,
                                          stop=["x"], seed=1, logprobs=2, echo=True, presence_penalty=0.1,
                                          frequency_penalty=0.1, user="u", best_of=2, logit_bias={"5": 1},
                                          stream=True, stream_options={"include_usage": True}),
        lambda: client.chat.completions.create(model="m", messages=MSGS),  # type: ignore[arg-type]
        lambda: client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": "s"}, {"role": "developer", "content": "d"},  # type: ignore[arg-type]
                                 {"role": "user", "content": [{"type": "text", "text": "t"}]}],
            max_tokens=3, max_completion_tokens=3, temperature=0.5, top_p=0.5, n=1, stop="x", seed=3, logprobs=True,
            top_logprobs=2, presence_penalty=0.0, frequency_penalty=0.0, user="u", logit_bias={"7": -1},
            stream=True, stream_options={"include_usage": True},
            extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 1,
                        "stop_token_ids": [2], "skip_special_tokens": True, "include_stop_str_in_output": False,
                        "add_generation_prompt": True, "continue_final_message": False, "echo": False,
                        "truncate_prompt_tokens": 10, "allowed_token_ids": [1], "bad_words": ["z"],
                        "priority": 0, "cache_salt": "s"}),
    ]
    for call in calls:
        with pytest.raises(openai.InternalServerError):
            call()
    return bodies


def test_every_body_the_openai_client_sends_validates() -> None:
    bodies = _captured_bodies()
    assert len(bodies) == 4
    for path, body in bodies:
        model = ChatCompletionRequest if path.endswith("chat/completions") else CompletionRequest
        model.model_validate(body)  # no field is unknown
