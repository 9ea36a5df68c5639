"""Tool calling without a model: the hermes parser (whole and streamed), the plans of every tool_choice,
the schema that forces ``required`` calls, and the history messages for the chat template."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvserve.entrypoints.openai.protocol import ChatCompletionRequest
from kvserve.entrypoints.openai.tool_calls import ToolCallPlan, assistant_message, parse_hermes
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"$ref": "#/$defs/tz"}}, "required": ["tz"],
    "$defs": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}}}}
NAMES = frozenset({"get_weather", "get_time"})


def _plan(tool_choice: Any = None, parser: str | None = "hermes", parallel: bool = True,
          tools: list[Any] | None = None) -> ToolCallPlan:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "tools": tools or [WEATHER, TIME],
                            "parallel_tool_calls": parallel}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    req = ChatCompletionRequest.model_validate(body)
    return ToolCallPlan(req.tools, req.tool_choice, req.parallel_tool_calls, parser)


CALL1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "content", "calls"), [
    ("Hello there", "Hello there", []),
    (CALL1, None, [("get_weather", {"city": "Paris"})]),
    ("Let me check. " + CALL1 + "\n" + CALL2, "Let me check. ",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    ('<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}', None, [("get_time", {"tz": "CET"})]),  # unclosed
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```', None, [("get_weather", {"city": "Oslo"})]),
    ('{"name": "unknown_tool", "arguments": {}}', '{"name": "unknown_tool", "arguments": {}}', []),
    ('{"a": 1}\n{"b": 2}', '{"a": 1}\n{"b": 2}', []),
])
def test_hermes_parser_and_its_stream_agree(text: str, content: str | None, calls: list[Any]) -> None:
    got_content, got_calls = parse_hermes(text, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got_calls)
    for step in (1, 3, 7):  # any split of the text gives the same content and calls
        streamer = _plan("auto").streamer()
        text_out, calls_out = "", {}
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            fields = streamer.feed(piece, i == len(pieces) - 1)
            text_out += fields.get("content", "")
            for tc in fields.get("tool_calls", []):
                calls_out[tc["index"]] = (tc["function"]["name"], json.loads(tc["function"]["arguments"]))
        assert list(calls_out.values()) == calls
        assert text_out == (content or "") if calls else text_out == text
        assert streamer.num_calls == len(calls)


def test_auto_message_and_finish_reason() -> None:
    plan = _plan("auto")
    message, finish = assistant_message(plan, "Sure. " + CALL1, "stop")
    assert finish == "tool_calls" and message["content"] == "Sure. " and len(message["tool_calls"]) == 1
    assert assistant_message(plan, "No tools needed.", "stop") == (
        {"role": "assistant", "content": "No tools needed."}, "stop")
    assert assistant_message(_plan("auto", parallel=False), CALL1 + CALL2, "stop")[0]["tool_calls"][0][
        "function"]["name"] == "get_weather"
    assert len(assistant_message(_plan("auto", parallel=False), CALL1 + CALL2, "stop")[0]["tool_calls"]) == 1
    none = _plan("none")
    assert assistant_message(none, CALL1, "stop") == ({"role": "assistant", "content": CALL1}, "stop")
    assert none.constraint() is None and none.template_tools() == [WEATHER, TIME]


def test_required_schema_forces_parseable_calls() -> None:
    plan = _plan("required")
    so = plan.constraint()
    assert so is not None and so.field == "tool_choice"
    schema = so.json
    assert isinstance(schema, dict) and schema["$defs"] == {"tz": {"type": "string", "enum": ["UTC", "CET"]}}
    good = [{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", "parameters": {"city": "X"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_time", "parameters": {"tz": "PST"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    message, finish = assistant_message(plan, json.dumps(good), "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"tz": "UTC"}, {"city": "X"}]
    assert _plan("required", parallel=False).constraint().json["maxItems"] == 1  # type: ignore[union-attr,index]
    streamer = plan.streamer()
    assert streamer.feed(json.dumps(good)[:10], False) == {}
    assert len(streamer.feed(json.dumps(good)[10:], True)["tool_calls"]) == 2


def test_named_choice_streams_arguments() -> None:
    plan = _plan({"type": "function", "function": {"name": "get_weather"}})
    so = plan.constraint()
    assert so is not None and so.json == WEATHER["function"]["parameters"]  # type: ignore[index]
    message, finish = assistant_message(plan, '{"city": "Rome"}', "stop")
    assert finish == "stop" and message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                         "arguments": '{"city": "Rome"}'}
    streamer = plan.streamer()
    first = streamer.feed('{"city"', False)["tool_calls"][0]
    assert first["index"] == 0 and first["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert streamer.feed(': "Rome"}', True) == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Rome"}'}}]}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tool_choice": "auto", "parser": None}, '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"parser": None}, '"auto" tool choice requires'),  # tools without tool_choice means auto
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope' is not in tools"),
    ({"tools": [WEATHER, WEATHER]}, "function names must be unique"),
])
def test_plan_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        _plan(**kwargs)
    assert message in e.value.message and e.value.param in ("tool_choice", "tools")
    with pytest.raises(InvalidRequestError) as e:
        ToolCallPlan(None, "required", True, "hermes")
    assert e.value.param == "tool_choice"


def test_history_messages_for_the_template() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    msgs = req.template_messages()
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    bad = ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]})
    with pytest.raises(InvalidRequestError) as e:
        bad.template_messages()
    assert e.value.param == "messages[0].tool_calls[0].function.arguments"


def test_auto_keeps_special_tokens_and_required_adds_the_constraint() -> None:
    from kvserve.entrypoints.openai.tool_calls import with_tool_constraint
    from kvserve.structured.params import StructuredOutputsParams

    params = SamplingParams(max_tokens=8)
    assert with_tool_constraint(params, _plan("auto")).skip_special_tokens is False
    assert with_tool_constraint(params, _plan("required")).structured_outputs is not None
    assert with_tool_constraint(params, _plan("none")) is params
    with pytest.raises(InvalidRequestError) as e:
        with_tool_constraint(params.clone(structured_outputs=StructuredOutputsParams(regex="a")), _plan("required"))
    assert e.value.param == "tool_choice"
