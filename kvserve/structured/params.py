"""StructuredOutputsParams: what the output must match (vLLM's ``SamplingParams.structured_outputs``).

Torch- and xgrammar-free: it is plain data, validated for shape here; the grammar itself is compiled (and
refused when invalid) by :class:`kvserve.structured.backend.StructuredOutputBackend`.
"""

from __future__ import annotations

import contextlib
import json as _json
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text.

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid against it.
        regex: the output matches this regular expression (whole output).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's / GBNF syntax, with a ``root`` rule).
        json_object: the output is any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        disable_any_whitespace: JSON without free whitespace between tokens (vLLM's flag of that name).
        strict: JSON schema only: ``False`` lets objects carry properties the schema does not name
            (JSON Schema's default); ``True`` (default) allows only the named ones unless the schema says
            ``additionalProperties``.
        field: the request field the constraint came from, for error messages (``response_format``...).

    Raises:
        InvalidRequestError: none or more than one constraint, or a value of the wrong type.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    strict: bool = True
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"{self.field}: give exactly one of {', '.join(KINDS)}, got {', '.join(given) or 'none'}",
                param=self.field)
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            ok = isinstance(value, dict | str)
        elif kind == "choice":
            ok = bool(value) and all(isinstance(c, str) and c for c in value)
        elif kind == "json_object":
            ok = value is True
        else:  # regex, grammar
            ok = isinstance(value, str) and bool(value.strip())
        if not ok:
            raise InvalidRequestError(f"{self.field}: {kind} has the wrong type or is empty", param=self.field)

    @property
    def kind(self) -> str:
        """Which constraint: one of :data:`KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool, bool]:
        """A hashable cache key: the kind, the spec as text, and the JSON options.

        A schema keeps its key order (it is the order the properties are generated in), so two schemas that
        differ only in key order are two grammars.
        """
        kind = self.kind
        value: Any = getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            with contextlib.suppress(ValueError):  # compiling reports it
                value = _json.loads(value)
        text = value if isinstance(value, str) else _json.dumps(value, ensure_ascii=False)
        return kind, text, self.disable_any_whitespace, self.strict
