"""OpenAI request bodies as pydantic models, their conversion to SamplingParams, and the error shape.

Every scalar is *strict*: ``"10"`` is not an integer, ``true`` is not a number, ``1.5`` is not an integer,
NaN and infinities are refused; integers are bounded so that no value can overflow an int64 tensor in the
engine. A field kvserve does not know is a 400 naming it (never silently ignored). A pydantic error becomes a
400 whose ``param`` is the field's path (``temperature``, ``messages[0].content``, ``stream_options.include_usage``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BaseModel, ConfigDict, Field, Strict, ValidationError

from kvserve.entrypoints.openai.structured import StructuredOutputFields
from kvserve.entrypoints.openai.tool_calls import ChatTool, ToolCallIn, ToolChoice, template_message
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams

# Bounds. n and the number of prompts bound the memory one request can ask for.
MAX_N = 128
MAX_PROMPTS = 128
_I64_MAX = 2**63 - 1
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # the engine seeds sample i with seed + i

Int = Annotated[int, Strict(), Field(ge=-_I64_MAX, le=_I64_MAX)]
NonNegInt = Annotated[int, Strict(), Field(ge=0, le=_I64_MAX)]
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
TokenIds = list[NonNegInt]


class _Body(BaseModel):
    """A request body or part of one: an unknown field is an error naming it (see :func:`validation_error`)."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM: every chunk carries the usage so far


class _SamplingRequest(StructuredOutputFields, _Body):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's extras)."""

    model: Str | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    temperature: Float = 1.0
    top_p: Float = 1.0
    top_k: Annotated[int, Strict(), Field(ge=-1, le=2**31 - 1)] = 0
    min_p: Float = 0.0
    presence_penalty: Float = 0.0
    frequency_penalty: Float = 0.0
    repetition_penalty: Float = 1.0
    seed: Annotated[int, Strict(), Field(ge=_SEED_MIN, le=_SEED_MAX)] | None = None
    stop: Str | list[Str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: Bool = False
    min_tokens: NonNegInt = 0
    skip_special_tokens: Bool = True
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Str | None = None
    priority: Int = 0
    cache_salt: Str | None = None
    prompt_logprobs: Annotated[int, Strict(), Field(ge=-1, le=_I64_MAX)] | None = None  # vLLM's; -1: all
    logit_bias: dict[str, Float] | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[Str] | None = None
    include_stop_str_in_output: Bool = False
    truncate_prompt_tokens: Annotated[int, Strict(), Field(ge=-1, le=_I64_MAX)] | None = None
    # PD disaggregation (vLLM's field, kvserve/disagg/protocol.py): validated by the engine
    kv_transfer_params: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        """Raises InvalidRequestError for fields kvserve accepts but cannot honour."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed with stream=true", param="stream_options")
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequestError("cache_salt: must be a non-empty string", param="cache_salt")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs: not available with stream=true (as vLLM)",
                                      param="prompt_logprobs")
        if self.stream and (self.kv_transfer_params or {}).get("do_remote_decode"):
            raise InvalidRequestError("kv_transfer_params: do_remote_decode needs stream=false (the response "
                                      "carries the parameters for the decode instance)", param="kv_transfer_params")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters; ``max_tokens`` None means until ``max_model_len``.

        Args:
            defaults: SamplingParams values for the fields this request did not set (the model's
                generation config, ``--generation-config``); ``max_tokens`` among them applies when the
                request set neither ``max_tokens`` nor ``max_completion_tokens``.

        Raises:
            InvalidRequestError: a value out of range (``param`` names it).
        """
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values: dict[str, Any] = dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs, prompt_logprobs=self.num_prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.token_logit_bias(), allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_outputs_params(), kv_transfer_params=self.kv_transfer_params)
        given = self.model_fields_set
        for name, value in (defaults or {}).items():
            unset = not ({"max_tokens", "max_completion_tokens"} & given) if name == "max_tokens" else name not in given
            if unset:
                values[name] = value
        return SamplingParams(**values)

    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its JSON keys as token ids.

        Raises:
            InvalidRequestError: a key that is not a non-negative integer.
        """
        if self.logit_bias is None:
            return None
        bad = next((k for k in self.logit_bias if not (k.isascii() and k.isdigit() and len(k) <= 18)), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias: keys must be token ids, got {bad!r}", param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top log-probabilities per prompt token the engine computes (None: none)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or lists of token ids."""

    prompt: Str | list[Str] | TokenIds | list[TokenIds]
    max_tokens: NonNegInt | None = 16
    echo: Bool = False
    logprobs: Annotated[int, Strict(), Field(ge=-1, le=_I64_MAX)] | None = None  # the engine caps it
    best_of: Int | None = None
    suffix: Str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise InvalidRequestError("suffix: not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(f"best_of: only best_of == n is supported (n={self.n}, got {self.best_of})",
                                      param="best_of")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` + ``logprobs`` that many for the echoed prompt (as vLLM)."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request.

        Raises:
            InvalidRequestError: no prompt, an empty one, or more than ``MAX_PROMPTS``.
        """
        p = self.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(t, int) for t in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items:
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        if len(items) > MAX_PROMPTS:
            raise InvalidRequestError(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(items)}",
                                      param="prompt")
        if any(len(x) == 0 for x in items):
            raise InvalidRequestError("prompt: must not be empty", param="prompt")
        return items


class TextPart(_Body):
    type: Literal["text"]
    text: Str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextPart] | None = None
    name: Str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages (OpenAI's shape)
    tool_call_id: Str | None = None  # tool messages

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` wins over the deprecated ``max_tokens``."""

    messages: list[ChatMessage]
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[int, Strict(), Field(ge=-1, le=_I64_MAX)] | None = None  # the engine caps it
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    echo: Bool = False
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Bool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise InvalidRequestError("messages: must be a non-empty list", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs=true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message: cannot be combined with add_generation_prompt=true "
                                      "(send add_generation_prompt: false)", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequestError("continue_final_message: the last message must be an assistant message",
                                      param="continue_final_message")

    @property
    def echo_text(self) -> str:
        """vLLM's chat ``echo``: the last message's text when it is the assistant's (the reply continues it)."""
        last = self.messages[-1] if self.messages else None
        return last.text() if self.echo and last is not None and last.role == "assistant" else ""

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages for the chat template (tool calls' arguments parsed into objects, as vLLM)."""
        return [template_message(i, m.role, m.text(), m.tool_calls, m.tool_call_id, m.name)
                for i, m in enumerate(self.messages)]


class TokenizeRequest(_Body):
    """``POST /tokenize``: ``prompt`` or ``messages`` (through the chat template)."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(_Body):
    model: Str | None = None
    tokens: TokenIds


# ---- errors ----------------------------------------------------------------------------------------
def error_body(message: str, err_type: str, param: str | None = None, code: int | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


def error_param(loc: tuple[int | str, ...]) -> str:
    """A field path from a pydantic error location; union member tags end it.

    ``('messages', 0, 'content', 'str')`` -> ``messages[0].content``; ``('prompt', 'list[int]', 3)`` -> ``prompt``.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out


def validation_error(e: ValidationError) -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError naming the field."""
    err = e.errors(include_url=False)[0]
    param = error_param(tuple(err["loc"]))
    value = err.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    if err["type"] == "extra_forbidden":  # the unknown name itself, even when it is not an identifier
        parent, name = error_param(tuple(err["loc"][:-1])), str(err["loc"][-1])
        param = f"{parent}.{name}" if parent else name
        message = f"{param}: unsupported field (kvserve does not implement it; see docs/parameters.md)"
    elif err["type"] == "missing":
        message = f"{param}: field required"
    else:
        message = f"{param}: {err['msg'].lower()}, got {shown}"
    return InvalidRequestError(message, param=param or None)
