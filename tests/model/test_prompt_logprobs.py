"""Prompt logprobs equal HF transformers' ``log_softmax`` at every prompt position (fp32, SmolLM2-135M).

With prefix caching on and the prompt already cached (a request with prompt logprobs does not use cached
blocks: documented choice, as vLLM), with prompts chunked over several steps by a small token budget, and
with a pool so small that the request is preempted and recomputes its prompt.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog because it wanted to see what was on the other side of the "
    "hill, where the grass was greener and the river ran clear.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "用中文写三句关于大海的话 🌊🐚",
]
TOP = 5


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A 16-token budget splits every prompt over 2-3 steps; caching is on (the default).
    return LLM("smollm2-135m-instruct", kv_cache_memory=0.05, max_model_len=512, block_size=16,
               max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer
    assert tok is not None
    ids = [tok.encode(p) for p in PROMPTS]
    assert all(len(i) > 16 for i in ids)  # chunked
    return ids


@pytest.fixture(scope="module")
def hf_logprobs(hf_smollm2: Any, prompt_ids: list[list[int]]) -> list[torch.Tensor]:
    """HF's ``log_softmax`` over the vocabulary at every prompt position, ``[P, vocab]`` float32."""
    with torch.inference_mode():
        return [torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1) for ids in prompt_ids]


def _check_against_hf(prompt_logprobs: Any, ids: list[int], ref: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        row = prompt_logprobs[i]
        expected = ref[i - 1]
        actual = row[ids[i]]
        assert abs(actual.logprob - expected[ids[i]].item()) < 1e-4, (i, actual, expected[ids[i]].item())
        assert actual.rank == int((expected > expected[ids[i]]).sum()) + 1 or abs(
            actual.logprob - expected.topk(actual.rank).values[-1].item()) < 1e-4  # a near tie may swap ranks
        top = [t for t, lp in row.items() if lp.rank is not None and lp.rank <= TOP and t != ids[i]]
        top_ref = expected.topk(TOP)
        for t in top:
            assert abs(row[t].logprob - expected[t].item()) < 1e-4
        assert abs(max(row[t].logprob for t in row) - top_ref.values[0].item()) < 1e-4
        assert len(row) in (TOP, TOP + 1)  # the prompt token first, then the top 5 (once if it is among them)


def test_prompt_logprobs_equal_hf_with_chunking_and_a_cached_prefix(
        llm: LLM, prompt_ids: list[list[int]], hf_logprobs: list[torch.Tensor]) -> None:
    # Cache every prompt first: the prompt-logprobs requests must not take those blocks as computed.
    warm = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], SamplingParams(temperature=0, max_tokens=2),
                        use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], SamplingParams(temperature=0, max_tokens=2),
                         use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again[:2])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP), use_tqdm=False)
    for out, ids, ref, w in zip(outs, prompt_ids, hf_logprobs, warm, strict=True):
        assert out.num_cached_tokens == 0  # documented: no prefix-cache lookup with prompt logprobs
        assert out.outputs[0].token_ids == w.outputs[0].token_ids
        _check_against_hf(out.prompt_logprobs, ids, ref)
        assert out.prompt_logprobs[1][ids[1]].decoded_token == llm.engine.tokenizer.decode(  # type: ignore[union-attr]
            [ids[1]], skip_special_tokens=False)
    assert llm.engine.block_manager.num_used_blocks == 0


def test_score_only_n_and_zero(llm: LLM, prompt_ids: list[list[int]], hf_logprobs: list[torch.Tensor]) -> None:
    ids, ref = prompt_ids[1], hf_logprobs[1]
    # max_tokens=0: the prompt is scored and nothing is generated (lm-eval's echo + max_tokens=0 + logprobs).
    [scored] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=TOP),
                            use_tqdm=False)
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].text == ""
    assert scored.outputs[0].finish_reason == "length"
    _check_against_hf(scored.prompt_logprobs, ids, ref)
    # n=2: one prompt_logprobs list for the request; 0 alternatives: only the prompt token per row.
    [two] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=2, max_tokens=3, prompt_logprobs=0, seed=1),
                         use_tqdm=False)
    assert len(two.outputs) == 2 and len(two.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert list(two.prompt_logprobs[i]) == [ids[i]]
        assert abs(two.prompt_logprobs[i][ids[i]].logprob - ref[i - 1, ids[i]].item()) < 1e-4


def test_max_logprobs_limits_both_fields(llm: LLM, prompt_ids: list[list[int]]) -> None:
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match="--max-logprobs") as e:
            llm.generate([{"prompt_token_ids": prompt_ids[0]}], SamplingParams(**{field: 21}), use_tqdm=False)
        assert e.value.param == field
        with pytest.raises(InvalidRequestError):  # -1 is the whole vocabulary
            llm.generate([{"prompt_token_ids": prompt_ids[0]}], SamplingParams(**{field: -1}), use_tqdm=False)


def test_whole_vocabulary_and_preemption_recompute(prompt_ids: list[list[int]],
                                                   hf_logprobs: list[torch.Tensor]) -> None:
    # 6 blocks of 16 tokens: two long prompts cannot both stay; the newer one is preempted mid-run and
    # recomputes its prompt, whose logprobs must not be reported twice.
    small = LLM("smollm2-135m-instruct", num_gpu_blocks_override=6, block_size=16, max_num_batched_tokens=32,
                max_logprobs=-1, preemption_mode="recompute")
    assert small.engine.max_model_len == 96  # lowered to the pool's capacity (no --max-model-len given)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=TOP)
    outs = small.generate([{"prompt_token_ids": p} for p in prompt_ids[:2]], params, use_tqdm=False)
    assert small.engine.num_preemptions > 0
    for out, ids, ref in zip(outs, prompt_ids[:2], hf_logprobs[:2], strict=True):
        _check_against_hf(out.prompt_logprobs, ids, ref)
    short = prompt_ids[0][:4]
    [full] = small.generate([{"prompt_token_ids": short}], SamplingParams(max_tokens=1, prompt_logprobs=-1),
                            use_tqdm=False)
    vocab = small.engine.arch.vocab_size
    for row in full.prompt_logprobs[1:]:
        assert len(row) == vocab
        assert math.isclose(sum(math.exp(lp.logprob) for lp in row.values()), 1.0, rel_tol=1e-3)
