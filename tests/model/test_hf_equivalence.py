"""kvserve's greedy output must equal HF transformers' ``generate(do_sample=False)`` token for token.

SmolLM2-135M-Instruct in fp32 on CPU, 8 varied prompts × 48 new tokens, under every scheduling regime
that changes how the KV cache is laid out or filled: alone, batched, block sizes 1/16/32, prompts split
across steps by a tiny token budget, no chunking, and a KV pool so small that preemption happens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 48
TEXT_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "用中文写三句关于大海的话",
    "List three colors of the rainbow:\n1.",
    "SELECT name, COUNT(*) FROM orders GROUP BY",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the boiling point of water in Celsius?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m-instruct", kv_cache_memory=0.25, num_threads=None)


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer
    assert tok is not None
    return [tok.encode(p) for p in TEXT_PROMPTS] + [tok.apply_chat_template(m) for m in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    """HF greedy continuations (up to and including EOS, if it comes within MAX_NEW tokens)."""
    eos = 2
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf_smollm2.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW,
                                      eos_token_id=eos, pad_token_id=eos, attention_mask=torch.ones(1, len(ids)))
            gen = out[0, len(ids):].tolist()
            if eos in gen:
                gen = gen[: gen.index(eos) + 1]
            refs.append(gen)
    assert sum(len(r) == MAX_NEW for r in refs) >= 5, "most prompts should run the full 48 tokens"
    assert all(len(r) >= 8 for r in refs)
    return refs


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def _generate(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_no_blocks_in_use(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert not llm.engine.scheduler.requests


def test_each_prompt_alone(llm: LLM, prompt_ids: list[list[int]], hf_reference: list[list[int]]) -> None:
    for ids, ref in zip(prompt_ids, hf_reference, strict=True):
        assert _generate(llm, [ids]) == [ref]
    _assert_no_blocks_in_use(llm)


def test_all_in_one_batch(llm: LLM, prompt_ids: list[list[int]], hf_reference: list[list[int]]) -> None:
    assert _generate(llm, prompt_ids) == hf_reference
    _assert_no_blocks_in_use(llm)


def test_text_and_chat_apis(llm: LLM, hf_reference: list[list[int]]) -> None:
    outs = llm.generate(TEXT_PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference[:2]
    tok = llm.engine.tokenizer
    assert tok is not None
    assert outs[0].outputs[0].text == tok.decode(hf_reference[0])
    chat = llm.chat(CHAT_PROMPTS[0], GREEDY, use_tqdm=False)
    assert chat[0].outputs[0].token_ids == hf_reference[len(TEXT_PROMPTS)]


@pytest.mark.parametrize("kwargs", [
    {"block_size": 1},
    {"block_size": 32},
    {"max_num_batched_tokens": 7},          # prompts split over many steps, mixed with decodes
    {"max_num_batched_tokens": 33, "block_size": 8},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192},
    {"max_num_seqs": 3},
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_scheduling_regimes(kwargs: dict[str, Any], prompt_ids: list[list[int]],
                            hf_reference: list[list[int]]) -> None:
    llm = LLM("smollm2-135m-instruct", kv_cache_memory=0.25, **kwargs)
    assert _generate(llm, prompt_ids) == hf_reference
    _assert_no_blocks_in_use(llm)


def test_preemption_keeps_greedy_output(prompt_ids: list[list[int]], hf_reference: list[list[int]]) -> None:
    longest = max(len(p) for p in prompt_ids) + MAX_NEW
    blocks = -(-longest // 16) + 2  # room for one long request and a bit: the rest must be preempted
    llm = LLM("smollm2-135m-instruct", num_gpu_blocks_override=blocks, block_size=16)
    assert _generate(llm, prompt_ids) == hf_reference
    assert llm.engine.num_preemptions > 0
    _assert_no_blocks_in_use(llm)


def test_tiny_qwen2_matches_transformers(tmp_path: Path) -> None:
    """A random-weight Qwen2 (QKV bias, untied head, GQA) saved as an HF folder, vs transformers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.2, rope_theta=10000.0)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random biases (the default init zeroes them, which would not test them)
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                              attention_mask=torch.ones(1, len(ids)), pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(ids):].tolist())
    for kwargs in ({}, {"block_size": 4, "max_num_batched_tokens": 10}):
        llm = LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=0.01, **kwargs)
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs
        _assert_no_blocks_in_use(llm)
