"""Structured-output request fields: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` (and its
older ``guided_*`` spellings), turned into one :class:`StructuredOutputsParams`.

    response_format: {"type": "json_object"}
    response_format: {"type": "json_schema", "json_schema": {"name": "x", "schema": {...}, "strict": true}}
    structured_outputs: {"json": {...}} | {"regex": "..."} | {"choice": ["a", "b"]} | {"grammar": "root ::= ..."}
    guided_json / guided_regex / guided_choice / guided_grammar (vLLM before 0.11)

At most one of them per request. The grammar is compiled by the engine's backend (cached); a schema,
regex or grammar that does not compile is a 400 naming the field it came from.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from kvserve.errors import InvalidRequestError
from kvserve.structured.backend import StructuredOutputBackend
from kvserve.structured.params import StructuredOutputsParams

_Str = Annotated[str, Strict()]
_Bool = Annotated[bool, Strict()]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema`` (OpenAI's shape)."""

    name: _Str | None = None
    description: _Str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: _Bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsSpec(_Strict):
    """vLLM's ``structured_outputs`` request field (its ``StructuredOutputsParams``)."""

    json_: dict[str, Any] | _Str | None = Field(None, alias="json")
    regex: _Str | None = None
    choice: list[_Str] | None = None
    grammar: _Str | None = None
    json_object: _Bool | None = None
    disable_any_whitespace: _Bool = False
    disable_fallback: _Bool = False  # kvserve has one backend and never falls back: honoured as given


class StructuredOutputFields(BaseModel):
    """The structured-output fields of completion and chat requests (mixed into their models)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | _Str | None = None
    guided_regex: _Str | None = None
    guided_choice: list[_Str] | None = None
    guided_grammar: _Str | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, or None.

        Raises:
            InvalidRequestError: more than one constraint field, or a malformed one (``param`` names it).
        """
        found: list[StructuredOutputsParams] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutputsParams(json_object=True, field="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidRequestError("response_format.json_schema: field required with type 'json_schema'",
                                          param="response_format.json_schema")
            spec = rf.json_schema
            found.append(StructuredOutputsParams(json=spec.json_schema, strict=spec.strict is not False,
                                                 field="response_format"))
        so = self.structured_outputs
        if so is not None:
            found.append(StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=tuple(so.choice) if so.choice is not None else None,
                grammar=so.grammar, json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace,
                field="structured_outputs"))
        guided: list[tuple[str, dict[str, Any]]] = [
            ("guided_json", {"json": self.guided_json}), ("guided_regex", {"regex": self.guided_regex}),
            ("guided_choice", {"choice": tuple(self.guided_choice) if self.guided_choice is not None else None}),
            ("guided_grammar", {"grammar": self.guided_grammar})]
        for name, given in guided:
            if next(iter(given.values())) is not None:
                found.append(StructuredOutputsParams(**given, field=name))
        if len(found) > 1:
            names = ", ".join(p.field for p in found)
            raise InvalidRequestError(f"{found[1].field}: only one output constraint per request, got {names}",
                                      param=found[1].field)
        return found[0] if found else None


async def check_compiles(backend: StructuredOutputBackend | None, params: StructuredOutputsParams | None) -> None:
    """Compile ``params`` off the event loop (the engine then finds it cached); 400 when it does not compile.

    Raises:
        InvalidRequestError: an invalid schema, regex or grammar, or no tokenizer to compile against.
    """
    if params is None:
        return
    if backend is None:
        raise InvalidRequestError(f"{params.field}: needs a tokenizer (--skip-tokenizer-init is set)",
                                  param=params.field)
    await asyncio.to_thread(backend.compile, params)
