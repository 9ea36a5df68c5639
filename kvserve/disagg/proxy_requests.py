"""The proxy's request bodies and response pieces: what it refuses, what it sends a prefill (P) and a decode
(D) instance for choice ``i``, and how it joins their answers. Pure functions on JSON values; torch-free.

A client request with ``n`` choices becomes, per choice, one P request (``max_tokens: 1``, ``n: 1``, not
streamed, ``kv_transfer_params: {"do_remote_decode": true}``) and one D request (``n: 1``, P's
``kv_transfer_params``); with ``seed`` choice ``i`` uses ``seed + i``, as the engine seeds its ``n`` samples.
D's output starts after P's token, so a choice's text is P's text followed by D's.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from kvserve.disagg.protocol import RemotePrefill, parse_transfer_params
from kvserve.errors import InvalidRequestError

MAX_N = 128  # the server's bound on n (kvserve.entrypoints.openai.protocol.MAX_N, not imported: it needs torch)


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def check_request(body: Any, chat: bool) -> dict[str, Any]:
    """Refuse what the proxy cannot split correctly; returns the body (a client ``kv_transfer_params: null``
    dropped).

    Raises:
        InvalidRequestError: not a JSON object; non-empty ``tools``/``functions``; ``echo: true``;
            ``prompt_logprobs``; ``best_of`` > 1; several completions prompts; a ``kv_transfer_params``
            (``param`` names the field).
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("body: must be a JSON object")

    def refuse(name: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(f"{name}: {why} (not supported through the prefill/decode proxy)", param=name)

    for name in ("tools", "functions"):
        if body.get(name):
            raise refuse(name, "a tool call cannot be split between a prefill and a decode instance")
    if body.get("echo") is True:
        raise refuse("echo", "echo: true")
    if body.get("prompt_logprobs") is not None:
        raise refuse("prompt_logprobs", "prompt logprobs")
    best_of = body.get("best_of")
    if _is_int(best_of) and best_of > 1:
        raise refuse("best_of", f"best_of {best_of}")
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise refuse("prompt", f"a list of {len(prompt)} prompts; send one prompt per request")
    if "kv_transfer_params" in body:
        if body["kv_transfer_params"] is not None:
            raise refuse("kv_transfer_params", "the proxy sets kv_transfer_params itself")
        body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    return body


def max_tokens_of(body: dict[str, Any], chat: bool) -> Any:
    """The client's max tokens: ``max_completion_tokens`` (chat, when set) else ``max_tokens``; None if unset."""
    if chat and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]
    return body.get("max_tokens")


def splittable(body: dict[str, Any], chat: bool) -> bool:
    """Whether the request goes through P then D: max tokens unset or an integer > 1, and the fields the proxy
    reads well-typed (``n`` in 1..128, ``stream`` a bool, ``stream_options`` an object or null). Anything else
    goes to a P as is (a P answers ``max_tokens: 1`` right, and refuses a bad value naming it)."""
    m, n = max_tokens_of(body, chat), body.get("n", 1)
    options = body.get("stream_options")
    return ((m is None or (_is_int(m) and m > 1)) and (n is None or (_is_int(n) and 1 <= n <= MAX_N))
            and isinstance(body.get("stream", False), bool | None) and isinstance(options, dict | None))


def num_choices(body: dict[str, Any]) -> int:
    """The request's ``n`` (1 when unset)."""
    n = body.get("n")
    return n if _is_int(n) else 1


def include_usage(body: dict[str, Any]) -> bool:
    """``stream_options.include_usage`` of a streamed request."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _per_choice(body: dict[str, Any], i: int) -> dict[str, Any]:
    out = dict(body)  # a shallow copy: only top-level keys are ever set
    out["n"] = 1
    if _is_int(out.get("seed")):
        out["seed"] += i
    return out


def prefill_body(body: dict[str, Any], chat: bool, i: int) -> dict[str, Any]:
    """Choice ``i``'s P request: one token, not streamed, with ``kv_transfer_params: {"do_remote_decode": true}``."""
    out = _per_choice(body, i)
    out["max_tokens"] = 1
    if chat:
        out.pop("max_completion_tokens", None)
    out["stream"] = False
    out.pop("stream_options", None)
    if _is_int(out.get("min_tokens")) and out["min_tokens"] > 1:
        out["min_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict[str, Any], i: int, stream: bool,
                kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """Choice ``i``'s D request: streamed with usage or not; ``kv_transfer_params`` as P returned it (None: D
    recomputes the prompt)."""
    out = _per_choice(body, i)
    out["stream"] = stream
    if stream:
        out["stream_options"] = {"include_usage": True}
    else:
        out.pop("stream_options", None)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


@dataclass
class Prefilled:
    """P's answer for one choice.

    Attributes:
        choice: P's choice object (``text`` or ``message``, ``logprobs``, ``finish_reason``, ...).
        text: P's text (chat: the message content).
        kv_transfer_params: P's dict, verbatim (None: P's token ended the choice).
        remote: the same, parsed (where to send a Release).
        prompt_tokens, completion_tokens: P's usage (completion 1 when P gave none).
        model: the model name P answered with.
    """

    choice: dict[str, Any]
    text: str
    kv_transfer_params: dict[str, Any] | None
    remote: RemotePrefill | None
    prompt_tokens: int | None
    completion_tokens: int
    model: str | None


@dataclass
class Job:
    """One client request on its way through P and D: its body, the response's ``id``/``created``/``model``,
    the prompt's token count (from the first backend that tells it) and the P results not yet handed over."""

    body: dict[str, Any]
    chat: bool
    headers: dict[str, str]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    model: str | None = None
    prompt_tokens: int | None = None
    pinned: dict[int, RemotePrefill] = field(default_factory=dict)  # P results no D has completed yet

    @property
    def path(self) -> str:
        """The backends' route for this request."""
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def head(self, stream: bool) -> dict[str, Any]:
        """``id``, ``object``, ``created``, ``model`` of the response (or of each chunk when ``stream``)."""
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        model = self.model if self.model is not None else self.body.get("model")
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": obj, "created": self.created,
                "model": model}

    def note(self, model: Any, prompt_tokens: int | None) -> None:
        """Keep the first model name and prompt token count a backend answered with."""
        if self.model is None and isinstance(model, str):
            self.model = model
        if self.prompt_tokens is None:
            self.prompt_tokens = prompt_tokens


def remote_of(data: Any) -> RemotePrefill | None:
    """The parsed ``kv_transfer_params`` of a P response (None: absent, null or not a RemotePrefill)."""
    if not isinstance(data, dict):
        return None
    try:
        parsed = parse_transfer_params(data.get("kv_transfer_params"))
    except InvalidRequestError:
        return None
    return parsed if isinstance(parsed, RemotePrefill) else None


def _usage_int(data: dict[str, Any], key: str) -> int | None:
    usage = data.get("usage")
    v = usage.get(key) if isinstance(usage, dict) else None
    return v if _is_int(v) else None


def parse_prefill(data: Any, chat: bool) -> Prefilled:
    """Read a P response (HTTP 200).

    Raises:
        ValueError: no single choice; a ``kv_transfer_params`` that is neither null nor a RemotePrefill dict;
            null with ``finish_reason`` "length" (the P kept nothing for a D: not a producer).
    """
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or len(data["choices"]) != 1 \
            or not isinstance(data["choices"][0], dict):
        raise ValueError("the prefill answer has no single choice")
    choice = data["choices"][0]
    raw = data.get("kv_transfer_params")
    remote = remote_of(data)
    if raw is not None and remote is None:
        raise ValueError(f"the prefill answer's kv_transfer_params is not a remote prefill: {raw!r}")
    if raw is None and choice.get("finish_reason") == "length":
        raise ValueError("the prefill answer stopped by length without kv_transfer_params (is the instance "
                         "started with a kv_producer --kv-transfer-config?)")
    if chat:
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
    else:
        text = choice.get("text")
    model = data.get("model")
    return Prefilled(choice, text if isinstance(text, str) else "", raw, remote, _usage_int(data, "prompt_tokens"),
                     _usage_int(data, "completion_tokens") or 1, model if isinstance(model, str) else None)


def first_chunk_choice(pre: Prefilled, chat: bool, i: int) -> dict[str, Any]:
    """The streamed choice that carries P's token (with P's finish_reason when P ended the choice)."""
    ended = pre.kv_transfer_params is None
    out: dict[str, Any] = {"index": i}
    if chat:
        out["delta"] = {"role": "assistant", "content": pre.text}
    else:
        out["text"] = pre.text
    out["logprobs"] = pre.choice.get("logprobs")
    out["finish_reason"] = pre.choice.get("finish_reason") if ended else None
    if ended:
        out["stop_reason"] = pre.choice.get("stop_reason")
    return out


def shift_offsets(logprobs: Any, shift: int) -> Any:
    """Completions logprobs with ``text_offset`` moved by ``shift`` characters (a copy; other values as is)."""
    if not shift or not isinstance(logprobs, dict) or not isinstance(logprobs.get("text_offset"), list):
        return logprobs
    return {**logprobs, "text_offset": [o + shift if _is_int(o) else o for o in logprobs["text_offset"]]}


def relay_choice(choice: dict[str, Any], chat: bool, i: int, shift: int, drop_role: bool) -> dict[str, Any] | None:
    """One of D's streamed choices as the proxy sends it: index ``i``, completions offsets after P's text, chat
    without ``role`` (sent with P's token) when ``drop_role``; None for a choice left with nothing to say."""
    out = {**choice, "index": i}
    if chat:
        delta = dict(choice.get("delta") or {})
        if drop_role:
            delta.pop("role", None)
        out["delta"] = delta
        empty = not any(v for k, v in delta.items())
    else:
        out["logprobs"] = shift_offsets(choice.get("logprobs"), shift)
        empty = not choice.get("text")
    if empty and choice.get("logprobs") is None and choice.get("finish_reason") is None:
        return None
    return out


def _joined(a: Any, b: Any) -> Any:
    if isinstance(a, list) or isinstance(b, list):
        return (a if isinstance(a, list) else []) + (b if isinstance(b, list) else [])
    return None


def merge_choice(pre: Prefilled, d_choice: dict[str, Any], chat: bool, i: int) -> dict[str, Any]:
    """A non-streamed choice from P's token and D's continuation: P's text + D's, logprobs joined (completions:
    D's offsets after P's text), finish_reason and stop_reason from D."""
    p_lp, d_lp = pre.choice.get("logprobs"), d_choice.get("logprobs")
    out = {**d_choice, "index": i}
    if chat:
        message = dict(d_choice.get("message") or {})
        message["role"] = "assistant"
        message["content"] = pre.text + (message.get("content") or "")
        out["message"] = message
        if isinstance(p_lp, dict) or isinstance(d_lp, dict):
            out["logprobs"] = {"content": _joined((p_lp or {}).get("content"), (d_lp or {}).get("content"))}
    else:
        out["text"] = pre.text + (d_choice.get("text") or "")
        if isinstance(p_lp, dict) or isinstance(d_lp, dict):
            d_lp = shift_offsets(d_lp, len(pre.text)) or {}
            out["logprobs"] = {k: _joined((p_lp or {}).get(k), d_lp.get(k))
                               for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    return out


def ended_choice(pre: Prefilled, i: int) -> dict[str, Any]:
    """A non-streamed choice P's token ended (EOS or a stop string): P's own, re-indexed."""
    return {**pre.choice, "index": i}


def usage_json(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage_of(data: Any) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a response or usage chunk (None where absent)."""
    if not isinstance(data, dict):
        return None, None
    return _usage_int(data, "prompt_tokens"), _usage_int(data, "completion_tokens")
