"""Structured output without a model: params, the xgrammar backend (errors, cache), the logits processor
(masking, resynchronisation, release) and the request fields' conversion (400s naming the field)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import xgrammar as xgr

from kvserve.core.request import Request
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, validation_error
from kvserve.errors import InvalidRequestError
from kvserve.models.catalog import resolve_model_path
from kvserve.models.loader import load_hf_tokenizer
from kvserve.sampling_params import SamplingParams
from kvserve.structured.backend import StructuredOutputBackend, choice_grammar
from kvserve.structured.params import StructuredOutputsParams
from kvserve.structured.processor import StructuredOutputProcessor

VOCAB = 49152


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    return load_hf_tokenizer(resolve_model_path("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def backend() -> StructuredOutputBackend:
    tok = _tokenizer()
    return StructuredOutputBackend(tok, VOCAB, tok.eos_token_id)


def test_params_need_exactly_one_constraint() -> None:
    for kwargs in ({}, {"regex": "a", "choice": ("a",)}, {"choice": ()}, {"regex": ""}, {"json": 5}):
        with pytest.raises(InvalidRequestError) as e:
            StructuredOutputsParams(**kwargs, field="guided_regex")  # type: ignore[arg-type]
        assert e.value.param == "guided_regex"
    p = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert p.kind == "json" and p.key()[1] == '{"b": 1, "a": 2}'  # key order kept: it is generation order
    assert StructuredOutputsParams(json='{"type": "object"}').key() == StructuredOutputsParams(
        json={"type": "object"}).key()


@pytest.mark.parametrize(("spec", "what"), [
    ({"regex": "(a"}, "regex"), ({"json": {"type": 5}}, "JSON schema"), ({"json": "{"}, "JSON schema"),
    ({"json": "[1, 2]"}, "JSON schema"), ({"grammar": "root ::= "}, "grammar"), ({"grammar": "x ::= \"a\""}, "grammar"),
])
def test_invalid_specs_name_the_field(backend: StructuredOutputBackend, spec: dict[str, Any], what: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        backend.compile(StructuredOutputsParams(**spec, field="response_format"))
    assert e.value.param == "response_format"
    assert e.value.message.startswith(f"response_format: invalid {what}: ") and "/project/" not in e.value.message


def test_compile_cache_and_choice_escaping(backend: StructuredOutputBackend) -> None:
    choices = ("yes", 'say "hi"', "a\\b", "ünï\ncode")
    assert choice_grammar(choices[:2]) == 'root ::= "yes" | "say \\"hi\\""'
    p = StructuredOutputsParams(choice=choices)
    n = backend.num_compiles
    g = backend.compile(p)
    assert backend.compile(StructuredOutputsParams(choice=choices)) is g and backend.num_compiles == n + 1
    for c in choices:
        m = xgr.GrammarMatcher(g)
        assert m.accept_string(c) and m.is_completed()
    m = xgr.GrammarMatcher(g)
    assert not m.accept_string("no")


def _request(rid: str, output: list[int], so: StructuredOutputsParams | None) -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(structured_outputs=so), eos_token_id=2, max_tokens=50)
    for t in output:
        r.append_output_token(t)
    return r


def test_processor_masks_only_structured_rows_and_resyncs(backend: StructuredOutputBackend) -> None:
    tok = _tokenizer()
    proc = StructuredOutputProcessor(backend)
    so = StructuredOutputsParams(choice=("Paris", "London"))
    free = _request("free", [], None)
    req = _request("so", [], so)
    logits = torch.randn(2, VOCAB)
    original = logits.clone()
    proc(logits, [free, req])
    assert torch.equal(logits[0], original[0])  # untouched row, bit-identical
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    firsts = {tok.encode(w, add_special_tokens=False)[0] for w in ("Paris", "London")}
    assert firsts <= set(allowed) and len(allowed) < 50
    # Accept "Paris" token by token: then only EOS is allowed.
    for t in tok.encode("Paris", add_special_tokens=False):
        req.append_output_token(t)
    logits = torch.zeros(1, VOCAB)
    proc(logits, [req])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [tok.eos_token_id]
    # A request with fewer output tokens than accepted (rolled back): the matcher replays from the start.
    rolled = _request("so", [], so)
    logits = torch.zeros(1, VOCAB)
    proc(logits, [rolled])
    assert set(torch.isfinite(logits[0]).nonzero().flatten().tolist()) == set(allowed)
    # Accepting EOS terminates the matcher: the row is no longer masked.
    for t in tok.encode("London", add_special_tokens=False) + [tok.eos_token_id]:
        rolled.append_output_token(t)
    logits = torch.zeros(1, VOCAB)
    proc(logits, [rolled])
    assert torch.isfinite(logits).all()
    assert proc.num_active == 1
    proc.release(["so", "unknown"])
    assert proc.num_active == 0


def _parse(model: type[Any], body: dict[str, Any]) -> Any:
    from pydantic import ValidationError
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None


@pytest.mark.parametrize(("body", "kind", "field"), [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"},
                                                                 "strict": True}}}, "json", "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs"),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}}, "json",
     "structured_outputs"),
    ({"guided_json": {"type": "object"}}, "json", "guided_json"),
    ({"guided_regex": "a+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"}, "grammar", "guided_grammar"),
])
def test_request_fields_become_params(body: dict[str, Any], kind: str, field: str) -> None:
    for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest,
                                                               {"messages": [{"role": "user", "content": "x"}]})):
        so = _parse(model, {**base, **body}).sampling_params(8, None).structured_outputs
        assert so is not None and so.kind == kind and so.field == field


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": "a"}, "guided_json": {}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_malformed_fields_are_400_naming_them(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        _parse(CompletionRequest, {"prompt": "x", **body}).sampling_params(8, None)
    assert e.value.param == param and param in e.value.message
