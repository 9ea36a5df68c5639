"""``--speculative-config``: the JSON object vLLM takes, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NoReturn

from kvserve.errors import InvalidRequestError

METHODS = ("ngram", "draft_model")
_KNOWN = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive",
          "draft_tensor_parallel_size", "disable_by_batch_size"}


def _fail(name: str, message: str) -> NoReturn:
    raise InvalidRequestError(f"speculative_config.{name}: {message}", param="speculative_config")


def _int(d: dict[str, Any], name: str, default: int, lo: int, hi: int | None = None) -> int:
    v = d.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        _fail(name, f"must be an integer in [{lo}, {hi if hi is not None else 'inf'}), got {v!r}")
    return v


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, spelled as vLLM's ``--speculative-config``.

    Attributes:
        method: ``ngram`` (prompt lookup over prompt + output so far) | ``draft_model``.
        num_speculative_tokens: ``k_max``, the most draft tokens verified per step (>= 1).
        model: the draft model (catalog name, HF folder or ``.gguf``) for ``draft_model``.
        prompt_lookup_min / prompt_lookup_max: n-gram sizes tried, longest first (default 2 and 5; one
            given alone keeps the other's default unless that would invert them).
        adaptive: pick ``k`` in ``0..k_max`` per request and step from the measured acceptance and step
            times (``controller.py``); False pins ``k = k_max`` whenever a proposal exists.
        disable_by_batch_size: vLLM's switch: no speculation while more than this many requests run
            (None: only the adaptive rule decides).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive: bool = True
    disable_by_batch_size: int | None = None

    @classmethod
    def from_value(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Parse the flag's JSON text (or a dict, as ``LLM(speculative_config=...)`` takes it).

        vLLM's older spellings are accepted: ``"model": "ngram"`` / ``"[ngram]"`` without ``method``, and
        a ``model`` without ``method`` means ``draft_model``.

        Raises:
            InvalidRequestError: malformed JSON, an unknown key (named), a missing or out-of-range value.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"speculative_config: not valid JSON ({e})",
                                          param="speculative_config") from e
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config: must be a JSON object", param="speculative_config")
        unknown = sorted(set(value) - _KNOWN)
        if unknown:
            _fail(unknown[0], f"is not supported (supported: {', '.join(sorted(_KNOWN))})")
        d = dict(value)
        method, model = d.get("method"), d.get("model")
        if method is None:
            method = "ngram" if model in ("ngram", "[ngram]") else ("draft_model" if model else None)
        if method in ("ngram", "[ngram]"):
            method, model = "ngram", None
        if method not in METHODS:
            _fail("method", f"must be one of {', '.join(METHODS)}, got {method!r}")
        if "num_speculative_tokens" not in d:
            _fail("num_speculative_tokens", "is required")
        k = _int(d, "num_speculative_tokens", 0, 1, 16)
        if method == "draft_model" and not isinstance(model, str):
            _fail("model", "the draft model is required for method draft_model")
        if d.get("draft_tensor_parallel_size", 1) != 1:
            _fail("draft_tensor_parallel_size", "only 1 is supported")
        given_lo, given_hi = "prompt_lookup_min" in d, "prompt_lookup_max" in d
        lo = _int(d, "prompt_lookup_min", 2, 1)
        hi = _int(d, "prompt_lookup_max", 5, 1)
        if given_lo and not given_hi:
            hi = max(hi, lo)
        elif given_hi and not given_lo:
            lo = min(lo, hi)
        if lo > hi:
            _fail("prompt_lookup_min", f"{lo} is larger than prompt_lookup_max {hi}")
        adaptive = d.get("adaptive", True)
        if not isinstance(adaptive, bool):
            _fail("adaptive", f"must be true or false, got {adaptive!r}")
        dbs = None if d.get("disable_by_batch_size") is None else _int(d, "disable_by_batch_size", 0, 1)
        return cls(str(method), k, model if method == "draft_model" else None, lo, hi, adaptive, dbs)
