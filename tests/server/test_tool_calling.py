"""Tool calling against a live server (Qwen2.5-Coder-0.5B, whose chat template renders tools) started with
``--enable-auto-tool-choice --tool-call-parser hermes``, through the official ``openai`` client.

A two-turn agent loop (the model calls the tool, the tool's result goes back as a ``role: "tool"`` message,
the model answers) with ``tool_choice`` auto and required, streamed and not; a named choice. The parsed
arguments must be JSON valid against the function's schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from server_harness import Server

pytestmark = pytest.mark.slow

QWEN = "qwen2.5-coder-0.5b-instruct"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"]}
TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city", "parameters": PARAMETERS}}]
QUESTION = {"role": "user", "content": "What is the weather like in Paris today? Use celsius."}
RESULT = {"temperature": 21, "unit": "celsius", "sky": "sunny"}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    s = Server("--model", QWEN, "--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
    s.stop()


def _create(client: openai.OpenAI, messages: list[Any], stream: bool, **kwargs: Any) -> tuple[Any, str | None, str]:
    """(tool calls as [(id, name, arguments)], content, finish_reason), streamed or not."""
    common: Any = {"model": QWEN, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**common).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.message.content, choice.finish_reason
    parts: dict[int, list[str]] = {}
    content, finish = "", ""
    for ev in client.chat.completions.create(**common, stream=True):
        if not ev.choices:
            continue
        delta = ev.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = parts.setdefault(tc.index, ["", "", ""])
            entry[0] += tc.id or ""
            entry[1] += (tc.function.name or "") if tc.function else ""
            entry[2] += (tc.function.arguments or "") if tc.function else ""
        finish = ev.choices[0].finish_reason or finish
    return [tuple(parts[i]) for i in sorted(parts)], content or None, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_two_turn_agent_loop(client: openai.OpenAI, tool_choice: str, stream: bool) -> None:
    calls, content, finish = _create(client, [QUESTION], stream, tool_choice=tool_choice)
    assert finish == "tool_calls" and len(calls) == 1 and not content
    call_id, name, arguments = calls[0]
    assert call_id.startswith("chatcmpl-tool-") and name == "get_weather"
    args = json.loads(arguments)
    jsonschema.validate(args, PARAMETERS)
    assert args["city"] == "Paris"
    history = [QUESTION,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
               {"role": "tool", "tool_call_id": call_id, "content": json.dumps(RESULT)}]
    calls, content, finish = _create(client, history, stream)  # tool_choice defaults to auto
    assert finish == "stop" and calls == [] and content is not None and "21" in content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_tool_choice(client: openai.OpenAI, stream: bool) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls, content, finish = _create(client, [{"role": "user", "content": "Tokyo, in fahrenheit please."}], stream,
                                     tool_choice=named)
    assert finish == "stop" and len(calls) == 1 and not content
    assert calls[0][1] == "get_weather"
    jsonschema.validate(json.loads(calls[0][2]), PARAMETERS)


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    calls, content, finish = _create(client, [QUESTION], False, tool_choice="none")
    assert calls == [] and content and finish in ("stop", "length")
