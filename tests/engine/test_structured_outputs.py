"""Structured output in the engine (real SmolLM2): n > 1, recompute preemption, EOS, the compile cache.

Every output must parse and validate against its schema; under preemption the greedy outputs must equal
those of a run with a pool large enough to never preempt (the matcher resynchronises from the request's
output tokens, so recomputing the KV never disturbs it).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                  "minItems": 2, "maxItems": 4}},
        "required": ["tags"]}


def _chat(llm: LLM, questions: list[str], params: list[SamplingParams]) -> list[Any]:
    return llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)  # type: ignore[arg-type]


def _valid(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_n_samples_each_follow_the_schema_and_finish_on_eos() -> None:
    llm = LLM(MODEL, max_model_len=512, kv_cache_memory=0.1)
    so = StructuredOutputsParams(json=PERSON)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=120, structured_outputs=so)
    out = _chat(llm, ["Describe a person as JSON."], [params])[0]
    texts = [c.text for c in out.outputs]
    assert len(texts) == 3
    for c in out.outputs:
        _valid(c.text, PERSON)
        assert c.finish_reason == "stop" and c.token_ids[-1] == llm.engine.eos_token_id
    assert len(set(texts)) > 1, texts  # three seeds, three samples
    # The compile cache: the same schema again compiles nothing new; every matcher is released.
    before = llm.engine.structured_outputs.num_compiles  # type: ignore[union-attr]
    _chat(llm, ["Another person."], [SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)])
    assert llm.engine.structured_outputs.num_compiles == before == 1  # type: ignore[union-attr]
    processor = llm.engine.runner.logits_processors._processors[-1]
    assert processor.num_active == 1  # type: ignore[attr-defined]
    llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)  # finished ids reach the runner
    assert processor.num_active == 0  # type: ignore[attr-defined]


def test_invalid_constraints_are_refused_naming_the_field() -> None:
    llm = LLM(MODEL, max_model_len=256, kv_cache_memory=0.05)
    for so in (StructuredOutputsParams(regex="(a"), StructuredOutputsParams(json={"type": 5}),
               StructuredOutputsParams(grammar="root ::= "),
               StructuredOutputsParams(json="{not json", field="guided_json")):
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
        assert e.value.param == so.field and so.field in e.value.message
    assert not llm.engine.has_unfinished_requests()


def _preemption_workload() -> tuple[list[str], list[SamplingParams]]:
    pad = " Please answer carefully, in JSON, and keep it short." * 12
    questions = [f"Describe person number {i}.{pad}" for i in range(4)] + [f"List tags for topic {i}.{pad}"
                                                                          for i in range(3)]
    person = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON))
    tags = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=TAGS))
    params = [person] * 4 + [tags, tags.clone(n=2, temperature=1.0, seed=5), tags]
    return questions, params


def test_recompute_preemption_keeps_outputs_valid_and_identical() -> None:
    questions, params = _preemption_workload()
    reference = _chat(LLM(MODEL, max_model_len=512, kv_cache_memory=0.1), questions, params)
    small = LLM(MODEL, max_model_len=480, num_gpu_blocks_override=40, max_num_batched_tokens=128,
                preemption_mode="recompute")
    outs = _chat(small, questions, params)
    assert small.engine.num_preemptions > 0
    for ref, out, p in zip(reference, outs, params, strict=True):
        schema = p.structured_outputs.json  # type: ignore[union-attr]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        for c in out.outputs:
            _valid(c.text, schema)  # type: ignore[arg-type]
    small.engine.block_manager.check_invariants()
    assert small.engine.block_manager.num_used_blocks == 0
