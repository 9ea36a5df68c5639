"""OpenAI request bodies as pydantic models, their conversion to SamplingParams, and the error shape.

Every scalar is *strict*: ``"10"`` is not an integer, ``true`` is not a number, ``1.5`` is not an integer,
NaN and infinities are refused; integers are bounded so that no value can overflow an int64 tensor in the
engine. Unknown fields are ignored (as vLLM does). A pydantic error becomes a 400 whose ``param`` is the
field's path (``temperature``, ``messages[0].content``, ``stream_options.include_usage``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BaseModel, Field, Strict, ValidationError

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams

# Bounds. n and the number of prompts bound the memory one request can ask for.
MAX_N = 128
MAX_PROMPTS = 128
MAX_LOGPROBS = 20
_I64_MAX = 2**63 - 1
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # the engine seeds sample i with seed + i

Int = Annotated[int, Strict(), Field(ge=-_I64_MAX, le=_I64_MAX)]
NonNegInt = Annotated[int, Strict(), Field(ge=0, le=_I64_MAX)]
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
TokenIds = list[NonNegInt]


class StreamOptions(BaseModel):
    include_usage: Bool = False


class _SamplingRequest(BaseModel):
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
    logit_bias: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        """Raises InvalidRequestError for fields kvserve accepts but cannot honour."""
        if self.logit_bias:
            raise InvalidRequestError("logit_bias: not supported", param="logit_bias")
        if self.response_format and self.response_format.get("type") != "text":
            raise InvalidRequestError("response_format: only {'type': 'text'} is supported", param="response_format")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed with stream=true", param="stream_options")
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidRequestError("cache_salt: must be a non-empty string", param="cache_salt")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; ``max_tokens`` None means until ``max_model_len``.

        Raises:
            InvalidRequestError: a value out of range (``param`` names it).
        """
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, token ids, or lists of token ids."""

    prompt: Str | list[Str] | TokenIds | list[TokenIds]
    max_tokens: NonNegInt | None = 16
    echo: Bool = False
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Int | None = None
    suffix: Str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise InvalidRequestError("suffix: not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(f"best_of: only best_of == n is supported (n={self.n}, got {self.best_of})",
                                      param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo: echo with logprobs needs prompt logprobs, which kvserve does not "
                                      "compute yet; drop logprobs or echo", param="echo")

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


class TextPart(BaseModel):
    type: Literal["text"]
    text: Str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Str | list[TextPart] | None = None
    name: Str | None = None

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
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: Bool = True
    tools: list[Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if not self.messages:
            raise InvalidRequestError("messages: must be a non-empty list", param="messages")
        if self.tools:
            raise InvalidRequestError("tools: tool calling is not supported", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs=true", param="top_logprobs")

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: ``prompt`` or ``messages`` (through the chat template)."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class DetokenizeRequest(BaseModel):
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
    missing = err["type"] == "missing"
    message = f"{param}: field required" if missing else f"{param}: {err['msg'].lower()}, got {shown}"
    return InvalidRequestError(message, param=param or None)
