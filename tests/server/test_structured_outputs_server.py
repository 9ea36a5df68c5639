"""Structured output against a live server with the official ``openai`` client (SmolLM2, greedy).

``response_format`` json_schema over 5 schemas x 3 prompts must give 15/15 outputs that parse and validate
(jsonschema), and json_object outputs parse to JSON objects; vLLM's ``structured_outputs`` (choice, regex,
grammar) and ``guided_*`` spellings; invalid constraints are 400s naming the field; ``tool_choice: auto`` on a
server without ``--enable-auto-tool-choice`` is a 400 as in vLLM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_harness import MODEL, Server, is_idle

pytestmark = pytest.mark.slow

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                                      "capital": {"type": "boolean"}},
     "required": ["city", "population", "capital"]},
    {"type": "object", "properties": {"colors": {"type": "array", "minItems": 1, "maxItems": 3,
                                                 "items": {"type": "string", "enum": ["red", "green", "blue"]}}},
     "required": ["colors"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "meta": {"type": "object", "properties": {"pages": {"type": "integer", "minimum": 1, "maximum": 5000}},
                 "required": ["pages"]}},
     "required": ["title", "tags", "meta"]},
]
PROMPTS = ["Describe a person as JSON.", "Give me some data about a city in Europe, as JSON.",
           "Answer in JSON: is the sky blue?"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--max-model-len", "1024")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, prompt: str, **kwargs: Any) -> Any:
    kwargs = {"temperature": 0, "max_tokens": 200, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kwargs)


def test_json_schema_5x3_all_parse_and_validate(client: openai.OpenAI, server: Server) -> None:
    def one(job: tuple[int, str]) -> tuple[int, Any]:
        i, prompt = job
        fmt = {"type": "json_schema", "json_schema": {"name": f"schema{i}", "schema": SCHEMAS[i], "strict": True}}
        return i, _chat(client, prompt, response_format=fmt).choices[0]  # type: ignore[arg-type]

    jobs = [(i, p) for i in range(len(SCHEMAS)) for p in PROMPTS]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, jobs))
    valid = 0
    for i, choice in results:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[i])
        valid += 1
    assert valid == 15
    assert is_idle(server.wait_idle())


def test_streamed_equals_non_streamed_and_n2(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}}
    whole = _chat(client, PROMPTS[0], response_format=fmt).choices[0].message.content
    stream = _chat(client, PROMPTS[0], response_format=fmt, stream=True)
    text = "".join(ev.choices[0].delta.content or "" for ev in stream if ev.choices)
    assert text == whole
    out = _chat(client, PROMPTS[0], response_format=fmt, n=2, temperature=1.0, seed=3)
    assert len(out.choices) == 2
    for c in out.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMAS[0])


def test_json_object_outputs_parse_to_objects(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_object"}
    # greedy SmolLM2 repeats itself inside a JSON string or array until max_tokens on some of these prompts;
    # vLLM's repetition_penalty makes every one of them close its object
    penalty = {"repetition_penalty": 1.1}
    prompts = [*PROMPTS, "Give me a JSON object describing a cat, with name and age.", "Say hello."]
    texts = {}
    for prompt in prompts:
        choice = _chat(client, prompt, response_format=fmt, extra_body=penalty).choices[0]
        assert choice.finish_reason == "stop", (prompt, choice)
        texts[prompt] = choice.message.content
        assert isinstance(json.loads(texts[prompt]), dict), (prompt, texts[prompt])
    # the constraint made it JSON: "Say hello." alone is not answered with JSON
    plain = _chat(client, "Say hello.", max_tokens=20, extra_body=penalty).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(plain)
    stream = _chat(client, prompts[3], response_format=fmt, extra_body=penalty, stream=True)
    assert "".join(ev.choices[0].delta.content or "" for ev in stream if ev.choices) == texts[prompts[3]]


def test_choice_regex_grammar_and_guided_spellings(client: openai.OpenAI) -> None:
    choices = ["Paris", "London", "Berlin"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        text = _chat(client, "What is the capital of France?", extra_body=body).choices[0].message.content
        assert text in choices
    for body in ({"structured_outputs": {"regex": r"\d{3}-\d{4}"}}, {"guided_regex": r"\d{3}-\d{4}"}):
        text = _chat(client, "Give me a phone number.", extra_body=body).choices[0].message.content
        assert re.fullmatch(r"\d{3}-\d{4}", text), text
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    text = _chat(client, "Is water wet?", extra_body={"structured_outputs": {"grammar": grammar}}).choices[0]
    assert re.fullmatch(r"The answer is (yes|no)\.", text.message.content)
    # The completions endpoint takes the same fields.
    out = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=20, temperature=0,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert out.choices[0].text in ("red", "green", "blue") and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_invalid_constraints_are_400_naming_the_field(server: Server, body: dict[str, Any], param: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    if "tools" in body and "tool_choice" not in body or body.get("tool_choice") == "auto":
        assert "--enable-auto-tool-choice" in err["message"]
    assert server.alive()
