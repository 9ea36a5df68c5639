"""Tensor parallelism through the offline ``LLM`` API: ``--tensor-parallel-size 2`` (mp workers, gloo) gives the
same tokens as one process, in fp32, under every scheduling regime that touches the KV cache: chunked prefill,
prefix-cache hits, preemption by recompute and by swap, n = 2 forks (copy-on-write), prompt logprobs; with a
Qwen2 (QKV biases, untied head, padded vocabulary shard) and a Llama (tied embeddings); with an int8 KV cache.

The row-parallel all-reduces sum two partial dot products where one process sums one: logits differ in the last
bits, which on these random models never flips a greedy choice (the tests would show it: they compare every token).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams, cpu_features
from kvserve.layers import onednn
from kvserve.outputs import RequestOutput

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_helpers import alive, random_prompts, save_tiny  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED_N2 = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
SCORED = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=3)
PROMPTS = random_prompts([5, 17, 33, 64, 40, 50])
# A second wave: each repeats the first 32 tokens (8 blocks of 4) of a first-wave prompt: prefix-cache hits
FOLLOW_UPS = [PROMPTS[5][:32] + random_prompts([6], seed=9)[0], PROMPTS[4][:32] + random_prompts([9], seed=10)[0]]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tp-qwen2"), "qwen2")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tp-llama"), "llama")


def _llm(model: Path, tp: int, **kwargs: Any) -> LLM:
    return LLM(str(model), skip_tokenizer_init=True, dtype="float32", num_threads=1, tensor_parallel_size=tp, **kwargs)


def _ids(p: list[int]) -> dict[str, Any]:
    return {"prompt_token_ids": p}


def _workload(llm: LLM) -> dict[str, Any]:
    """Both waves; every output, the cached prompt tokens of the second, and the engine's preemptions."""
    first = llm.generate([_ids(p) for p in PROMPTS] + [_ids(PROMPTS[1]), _ids(PROMPTS[2])],
                         [GREEDY] * len(PROMPTS) + [SEEDED_N2, SCORED], use_tqdm=False)
    second = llm.generate([_ids(p) for p in FOLLOW_UPS], GREEDY, use_tqdm=False)
    return {"tokens": [[c.token_ids for c in o.outputs] for o in first + second],
            "cached": [o.num_cached_tokens for o in second], "scored": first[-1],
            "preemptions": llm.engine.num_preemptions}


def _close(llm: LLM) -> None:
    """No block left in use; shutdown stops every worker."""
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    pids = list(getattr(llm.engine.executor, "worker_pids", []))
    llm.engine.close()
    assert pids and not [p for p in pids if alive(p)]


def _same_logprobs(a: RequestOutput, b: RequestOutput) -> None:
    assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(PROMPTS[2])
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
        assert x is not None and y is not None and list(x) == list(y)  # the same ids, in rank order
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank for t in x)
    la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
    assert la is not None and lb is not None
    for x, y in zip(la, lb, strict=True):
        assert (x.token_id, x.rank, [t for t, _ in x.top]) == (y.token_id, y.rank, [t for t, _ in y.top])
        assert abs(x.logprob - y.logprob) < 1e-4
        assert all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(x.top, y.top, strict=True))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_size_2_equals_one_process_under_chunking_caching_preemption_and_forks(qwen: Path, mode: str) -> None:
    # 48 blocks of 4 tokens: the first wave needs ~100, so requests are preempted; 16-token steps chunk prompts
    kwargs = dict(block_size=4, num_gpu_blocks_override=48, max_num_batched_tokens=16, preemption_mode=mode,
                  swap_space=0.01)
    one = _llm(qwen, 1, **kwargs)
    ref = _workload(one)
    two = _llm(qwen, 2, **kwargs)
    got = _workload(two)
    assert got["tokens"] == ref["tokens"]
    assert got["preemptions"] == ref["preemptions"] > 0
    assert got["cached"] == ref["cached"] == [32, 32]  # the 8 shared blocks of 4 tokens
    assert len(set(map(tuple, got["tokens"][len(PROMPTS)]))) == 2  # two distinct seeded samples
    _same_logprobs(ref["scored"], got["scored"])
    _close(two)


def test_tied_llama_and_the_kv_blocks_each_rank_holds(llama: Path) -> None:
    """Default budget: each rank holds one of the 2 KV heads, so the same 0.01 GiB per rank holds twice the
    blocks: 16 tokens x 2 (K, V) x 3 layers x 16 (head_dim) x 4 bytes x KV heads per rank."""
    one = _llm(llama, 1, kv_cache_memory=0.01)
    two = _llm(llama, 2, kv_cache_memory=0.01)
    budget = int(0.01 * 2**30)
    assert one.engine.num_blocks == budget // (16 * 2 * 3 * 2 * 16 * 4) == 873
    assert two.engine.num_blocks == budget // (16 * 2 * 3 * 1 * 16 * 4) == 1747
    prompts = [_ids(p) for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)] == ref
    _close(two)


def test_int8_kv_cache_splits_by_heads_too(qwen: Path) -> None:
    """An 8-bit cache keeps a scale per token and KV head: a rank's heads carry their own scales."""
    prompts = [_ids(p) for p in PROMPTS]
    one = _llm(qwen, 1, kv_cache_memory=0.01, kv_cache_dtype="int8")
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    two = _llm(qwen, 2, kv_cache_memory=0.01, kv_cache_dtype="int8", distributed_executor_backend="mp")
    assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)] == ref
    assert two.engine.runner.kv_caches[0][0].shape[2] == 1  # one KV head per rank
    _close(two)


def test_threads_default_to_the_cpus_shared_out(qwen: Path) -> None:
    """Without --num-threads each rank gets the process's CPUs / ranks (at least 1)."""
    before = torch.get_num_threads()
    try:
        llm = LLM(str(qwen), skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=2, kv_cache_memory=0.01)
        assert llm.engine.num_threads == max(1, len(os.sched_getaffinity(0)) // 2)
        _close(llm)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not onednn._supported(), reason="needs oneDNN and a CPU with native bf16 dot products")
def test_bf16_prefill_through_the_fused_swiglu_all_reduces(qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 prompts longer than the small-M kernels' limit take the oneDNN SwiGLU path (rank 0, in this process,
    counted); its down projection's partial sums must be all-reduced like the reference path's: the prompt
    logprobs at 2 ranks equal one process's within bf16 rounding (a missing all-reduce drops half the MLP)."""
    calls = []
    real = onednn.swiglu

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(onednn, "swiglu", counted)
    # bf16 activations need the host's real flags (conftest hides bf16 dot products; the workers inherit this)
    monkeypatch.setenv("KVSERVE_CPU_FLAGS", " ".join(sorted(cpu_features.host_flags())))
    prompt = random_prompts([120], seed=5)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = {}
    for tp in (1, 2):
        llm = LLM(str(qwen), skip_tokenizer_init=True, dtype="bfloat16", num_threads=1, tensor_parallel_size=tp,
                  kv_cache_memory=0.01)
        assert llm.engine.compute_dtype == torch.bfloat16
        out[tp] = llm.generate([_ids(prompt)], sp, use_tqdm=False)[0].prompt_logprobs
        if tp == 2:
            _close(llm)
    assert calls and max(calls) > 64
    a, b = out[1], out[2]
    assert a is not None and b is not None
    diffs = [abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a[1:], b[1:], prompt[1:], strict=True)
             if x is not None and y is not None]
    assert len(diffs) == len(prompt) - 1 and max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02
