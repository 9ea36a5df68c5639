"""Tool calling as vLLM serves it: ``tools``, ``tool_choice``, tool messages, and the hermes parser.

- ``none``: the chat template renders the tools; the output is plain ``content``.
- ``auto`` (the default when tools are given; needs ``--enable-auto-tool-choice --tool-call-parser hermes``,
  else 400 as vLLM): free generation; ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks
  become ``tool_calls`` (``finish_reason: tool_calls``), the text before them ``content``. A reply that is
  only one ``{"name": <a tool's name>, "arguments": {...}}`` object (bare or in a json code fence) is read as
  a call too: Qwen2.5-Coder answers that way, without the tags it was never trained to emit.
- ``required``: structured output forces a JSON array of ``{"name", "parameters"}`` objects (one schema
  per tool, as vLLM), so the calls always parse; ``finish_reason: tool_calls``.
- ``{"type": "function", "function": {"name": N}}``: structured output forces JSON valid against N's
  ``parameters``; the response is one call to N (``finish_reason: stop``, as OpenAI).

History: assistant messages with ``tool_calls`` (their ``arguments`` JSON text is parsed into an object for
the template, as vLLM does) and ``role: "tool"`` messages with ``tool_call_id`` go to the chat template.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams
from kvserve.structured.params import StructuredOutputsParams

_Str = Annotated[str, Strict()]
_Bool = Annotated[bool, Strict()]
TOOL_CALL_PARSERS = ("hermes",)
_START, _END = "<tool_call>", "</tool_call>"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: Annotated[str, Strict(), Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: _Str | None = None
    parameters: dict[str, Any] | None = None
    strict: _Bool | None = None


class ChatTool(_Strict):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: _Str


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Strict):
    name: _Str
    arguments: _Str


class ToolCallIn(_Strict):
    """An assistant message's ``tool_calls`` entry in the history."""

    id: _Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


def template_message(index: int, role: str, text: str, tool_calls: list[ToolCallIn] | None,
                     tool_call_id: str | None, name: str | None) -> dict[str, Any]:
    """One history message as the chat template expects it (``developer`` becomes ``system``).

    Raises:
        InvalidRequestError: a tool call's ``arguments`` is not a JSON object.
    """
    msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
    if name is not None:
        msg["name"] = name
    if tool_call_id is not None:
        msg["tool_call_id"] = tool_call_id
    if tool_calls:
        calls = []
        for j, call in enumerate(tool_calls):
            param = f"messages[{index}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                raise InvalidRequestError(f"{param}: not valid JSON", param=param) from None
            if not isinstance(arguments, dict):
                raise InvalidRequestError(f"{param}: must be a JSON object", param=param)
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        msg["tool_calls"] = calls
    return msg


class ToolCallPlan:
    """What a chat request's ``tools`` / ``tool_choice`` mean for its prompt, generation and response.

    Args:
        tools: the request's tools (None or empty: tool calling is off).
        tool_choice: the request's choice (None: ``auto`` when tools are given, as OpenAI).
        parallel_tool_calls: False: at most one call per response.
        tool_call_parser: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is set, else None.

    Raises:
        InvalidRequestError: a choice without tools, an unknown function name, duplicate names, or ``auto``
            on a server started without ``--enable-auto-tool-choice --tool-call-parser``.
    """

    def __init__(self, tools: list[ChatTool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool,
                 tool_call_parser: str | None) -> None:
        self.tools = list(tools or [])
        self.names = frozenset(t.function.name for t in self.tools)
        self.parallel = parallel_tool_calls
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools: function names must be unique", param="tools")
        if tool_choice is not None and not self.tools:
            raise InvalidRequestError("tool_choice: needs tools (when using tool_choice, tools must be set)",
                                      param="tool_choice")
        self.named: FunctionDefinition | None = None
        if isinstance(tool_choice, NamedToolChoice):
            self.named = next((t.function for t in self.tools if t.function.name == tool_choice.function.name), None)
            if self.named is None:
                raise InvalidRequestError(f"tool_choice: function {tool_choice.function.name!r} is not in tools",
                                          param="tool_choice")
            self.mode = "named"
        elif not self.tools:
            self.mode = "off"
        else:
            self.mode = tool_choice or "auto"
        if self.mode == "auto" and tool_call_parser is None:
            raise InvalidRequestError('tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                      "--tool-call-parser to be set", param="tool_choice")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (OpenAI's shape), or None."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint that makes a ``required`` / named call always parse."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutputsParams(json=_parameters(self.named), field="tool_choice")
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        variants = []
        for t in self.tools:
            params = dict(_parameters(t.function))
            defs.update(params.pop("$defs", {}))
            variants.append({"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                            "parameters": params}, "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return StructuredOutputsParams(json=schema, field="tool_choice")

    @property
    def parses(self) -> bool:
        """Whether the output is turned into ``tool_calls``."""
        return self.mode in ("auto", "required", "named")

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A finished output -> (content, tool_calls)."""
        if self.mode == "named":
            assert self.named is not None
            return None, [tool_call(self.named.name, text)]
        if self.mode == "required":
            calls = _required_calls(text)
            return (None, calls) if calls else (text, [])
        if self.mode == "auto":
            content, calls = parse_hermes(text, self.names)
            return content, calls if self.parallel else calls[:1]
        return text, []

    def finish_reason(self, finish_reason: str | None, num_calls: int) -> str | None:
        """``tool_calls`` when a completed output called tools (``auto`` / ``required``), else as given."""
        if finish_reason == "stop" and num_calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def streamer(self) -> ToolCallStreamer:
        """A per-choice stream parser."""
        return ToolCallStreamer(self)


def _parameters(f: FunctionDefinition) -> dict[str, Any]:
    return f.parameters if f.parameters else {"type": "object", "properties": {}}


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` entry (vLLM's id spelling)."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _required_calls(text: str) -> list[dict[str, Any]]:
    try:
        items = json.loads(text)
    except ValueError:  # cut short by max_tokens
        return []
    return [tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*(?:```)?", re.DOTALL)


def bare_call(text: str, names: frozenset[str]) -> dict[str, Any] | None:
    """``{"name": N, "arguments": {...}}`` alone (optionally in a json code fence) with N in ``names``, as a
    call; else None. Example: ``'```json\n{"name": "f", "arguments": {"x": 1}}\n```'`` -> a call to ``f``."""
    body = text.strip()
    fenced = _FENCE.fullmatch(body)
    if fenced:
        body = fenced.group(1)
    call = _one_hermes_call(body)
    if call is None or call["function"]["name"] not in names or not body.startswith("{"):
        return None
    if not isinstance(json.loads(body).get("arguments", {}), dict):
        return None
    return call


def _one_hermes_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return tool_call(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (the last one may be
    unclosed at the end of the output). Returns (the text before the first block or None, the calls); when a
    block does not parse, the whole text is content and there are no calls (as vLLM). Without any block, a
    text that is just one call object to a tool in ``names`` (see :func:`bare_call`) is that call."""
    start = text.find(_START)
    if start < 0:
        call = bare_call(text, names)
        return (None, [call]) if call is not None else (text, [])
    calls = []
    pos = start
    while pos >= 0:
        end = text.find(_END, pos)
        body = text[pos + len(_START): end if end >= 0 else len(text)]
        call = _one_hermes_call(body.strip())
        if call is None:
            return text, []
        calls.append(call)
        pos = text.find(_START, end) if end >= 0 else -1
    return text[:start] or None, calls


class ToolCallStreamer:
    """Turns one choice's streamed text into delta fields (``content`` and/or ``tool_calls``).

    ``auto``: text streams as content until ``<tool_call>`` starts (a possible partial tag is held back);
    each call is sent as one ``tool_calls`` delta once its ``</tool_call>`` arrives (or the output ends).
    Named: the arguments stream as they are generated (the first delta carries id and name).
    ``required``: the calls are sent when the output ends (the JSON array must be complete to parse).
    """

    def __init__(self, plan: ToolCallPlan) -> None:
        self.plan = plan
        self.text = ""
        self._sent = 0  # characters of ``text`` already handled
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> dict[str, Any]:
        """Add ``delta``; returns the delta fields to send now (possibly empty)."""
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            return self._named(delta)
        if mode == "required":
            if not finished:
                return {}
            content, calls = self.plan.message(self.text)
            return self._calls(calls, content)
        if mode != "auto":
            return {"content": delta} if delta else {}
        return self._auto(finished)

    def _named(self, delta: str) -> dict[str, Any]:
        assert self.plan.named is not None
        if self.num_calls == 0:
            self.num_calls = 1
            call = tool_call(self.plan.named.name, delta)
            return {"tool_calls": [{"index": 0, **call}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta else {}

    def _calls(self, calls: list[dict[str, Any]], content: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [{"index": self.num_calls + i, **c} for i, c in enumerate(calls)]
            self.num_calls += len(calls)
        return out

    def _auto(self, finished: bool) -> dict[str, Any]:
        if self._sent == 0 and self.num_calls == 0 and _START not in self.text and \
                self.text.lstrip()[:1] in ("", "{", "`"):
            # Maybe a bare call (see bare_call): decided once the output is complete.
            if not finished:
                return {}
            call = bare_call(self.text, self.plan.names)
            if call is not None:
                self._sent = len(self.text)
                return self._calls([call], None)
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            rest = self.text[self._sent:]
            start = rest.find(_START)
            if start < 0:
                # Hold back a tail that could still become "<tool_call>".
                keep = 0 if finished else _partial_tag(rest)
                content.append(rest[:len(rest) - keep])
                self._sent += len(rest) - keep
                break
            content.append(rest[:start])
            end = rest.find(_END, start)
            if end < 0 and not finished:
                self._sent += start
                break
            body = rest[start + len(_START): end if end >= 0 else len(rest)]
            call = _one_hermes_call(body.strip())
            consumed = (end + len(_END)) if end >= 0 else len(rest)
            if call is None:
                content.append(rest[start:consumed])
            elif self.plan.parallel or self.num_calls + len(calls) == 0:
                calls.append(call)
            self._sent += consumed
        text = "".join(content)
        if self.num_calls or calls:  # after a call, only whitespace is left between calls: drop it
            text = text if text.strip() else ""
        return self._calls(calls, text or None)


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for k in range(min(len(_START) - 1, len(text)), 0, -1):
        if _START.startswith(text[-k:]):
            return k
    return 0


def assistant_message(plan: ToolCallPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A finished choice's ``message`` and ``finish_reason`` (tool calls parsed out when the plan says so)."""
    if not plan.parses:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = plan.message(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, plan.finish_reason(finish_reason, len(calls))


def with_tool_constraint(params: SamplingParams, plan: ToolCallPlan) -> SamplingParams:
    """``params`` for the plan: a ``required`` / named choice gets its structured-output constraint; ``auto``
    keeps special tokens in the text (some models' ``<tool_call>`` tags are special tokens; as vLLM).

    Raises:
        InvalidRequestError: the request also asked for another output constraint.
    """
    if plan.mode == "auto":
        return params.clone(skip_special_tokens=False)
    constraint = plan.constraint()
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise InvalidRequestError(f"tool_choice: a required or named tool choice cannot be combined with "
                                  f"{params.structured_outputs.field}", param="tool_choice")
    return params.clone(structured_outputs=constraint)
