"""The real Qwen2.5-Coder-0.5B-Instruct (14 query / 2 KV heads, hidden 896, QKV biases, untied head) in fp32:
``--tensor-parallel-size 2`` gives the same greedy tokens as one process on the reference prompts of
test_hf_equivalence.py, and under teacher forcing every position's top token of each is in the other's top 5.

Each rank sums half of every row-parallel dot product and the all-reduce adds the halves, so logits differ from
one process's in the last bits. A greedy choice flips only at a near-tie. Measured here (Zen 5, AVX-512 kernels):
the teacher-forced log-probabilities of the top 5 tokens differ by at most 1.5e-5 nats, and the closest top-1 /
top-2 race along the 8 continuations is 9.06e-5 nats, at prompt 4 ("List three colors of the rainbow:\n1."),
output token 45: six times the perturbation, so no prompt flips and all 8 are compared token for token. A host
whose kernels round differently could flip that race; the test then names the prompt, the token and the gap,
and that prompt moves to the top-5 containment check alone.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import pytest

from kvserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_equivalence import CHAT_PROMPTS, MAX_NEW, TEXT_PROMPTS  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b-instruct"
MAX_LOGPROB_DIFF = 1e-4  # measured 1.5e-5


def _run(tp: int) -> tuple[list[list[int]], list[list[int]], list[list[dict[int, float]]]]:
    """(prompt ids, greedy continuations, teacher-forced top-5 log-probabilities of prompt + the continuation
    of the ``tp`` = 1 run, which the caller passes back in through ``_REFERENCE``)."""
    llm = LLM(MODEL, dtype="float32", num_threads=1, kv_cache_memory=0.25, tensor_parallel_size=tp)
    tok = llm.engine.tokenizer
    assert tok is not None
    ids = [tok.encode(p) for p in TEXT_PROMPTS] + [tok.apply_chat_template(m) for m in CHAT_PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=MAX_NEW),
                        use_tqdm=False)
    greedy = [o.outputs[0].token_ids for o in outs]
    forced = _REFERENCE.get("greedy", greedy)
    scored = llm.generate([{"prompt_token_ids": p + g} for p, g in zip(ids, forced, strict=True)],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    top5 = [[{t: lp.logprob for t, lp in list(d.items())[1:]} if d else {} for d in o.prompt_logprobs or []]
            for o in scored]  # (entry 0 of each position is the scored token itself)
    llm.engine.close()
    del llm
    gc.collect()
    return ids, greedy, top5


_REFERENCE: dict[str, Any] = {}


def test_qwen_coder_at_size_2_equals_one_process() -> None:
    ids, ref, top_one = _run(1)
    _REFERENCE["greedy"] = ref
    ids2, got, top_two = _run(2)
    assert ids2 == ids
    assert [len(r) for r in ref] == [48, 48, 48, 48, 48, 11, 16, 14]  # (3 end with EOS)
    worst, closest = 0.0, (float("inf"), -1, -1)
    for i, (p, a5, b5) in enumerate(zip(ids, top_one, top_two, strict=True)):
        for pos in range(len(p), len(a5)):  # the continuation's positions, forced to the tp = 1 tokens
            a, b = a5[pos], b5[pos]
            assert max(a, key=a.__getitem__) in b and max(b, key=b.__getitem__) in a, (i, pos - len(p))
            worst = max([worst] + [abs(a[t] - b[t]) for t in a.keys() & b.keys()])
            first, second = sorted(a.values(), reverse=True)[:2]
            closest = min(closest, (first - second, i, pos - len(p)))
    print(f"max |logprob difference| {worst:.2e}; closest top-1 / top-2 race {closest[0]:.2e} nats at prompt "
          f"{closest[1]}, output token {closest[2]}")
    assert worst < MAX_LOGPROB_DIFF
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        race = sorted(top_one[i][len(ids[i]) + j].values(), reverse=True)[:2] if a != b else [0.0, 0.0]
        # (a prompt that flips a near-tie on other hardware belongs in the docstring, checked by containment only)
        assert a == b, f"prompt {i} diverges at output token {j}, top-1 / top-2 gap {race[0] - race[1]:.2e} nats"
