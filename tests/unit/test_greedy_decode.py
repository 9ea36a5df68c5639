"""The native greedy decode path (worker/greedy_decode.py) and its kernels (csrc/decode_io.c).

* ``argmax_rows`` equals ``torch.argmax`` (NaN first, first of equal maxima, -0.0 == 0.0, all -inf) on every
  compiled path the host can run; ``embed_rows`` equals the embedding lookup and its cast.
* Through the engine, on tiny random models (float32 and bfloat16): the path gives the general path's token ids
  exactly, at batch sizes 1 to 6; it runs for plain greedy decode steps only, and a step with any row that
  needs its logits (logprobs, a penalty, a logit bias, ``min_tokens`` still pending, sampling) goes the general way.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams, cpu_features
from kvserve.core.request import Request
from kvserve.layers import cpu_kernels
from kvserve.sample.logits_processor import LogitsProcessors
from kvserve.sample.token_constraints import TokenConstraints
from kvserve.worker.greedy_decode import GreedyDecode, plain_greedy

pytestmark = pytest.mark.skipif(not cpu_kernels.native_available(), reason="no C compiler: native kernels unbuilt")

X86 = platform.machine() in ("x86_64", "AMD64")


def _lib_for(path: str) -> object:
    if path == "native":
        return cpu_kernels._library()
    if not X86:
        pytest.skip(f"the {path} build is x86-only (host: {platform.machine()})")
    if path == "avx2" and not {"avx2", "fma"} <= cpu_features.host_flags():
        pytest.skip("CPU lacks avx2 fma")
    lib = cpu_kernels.build_library({"avx2": "x86-64-v3", "sse2": "x86-64"}[path])
    assert lib is not None
    return lib


@pytest.mark.parametrize("path", ["native", "avx2", "sse2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 600, 49152])
def test_argmax_rows_equals_torch(path: str, dtype: torch.dtype, n: int) -> None:
    lib = _lib_for(path)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g).to(dtype)
    x[1, :] = float("-inf")  # all -inf: index 0
    x[2, n // 2] = float("nan")  # a NaN wins over everything
    x[3, n - 1] = 1e4  # the maximum last
    x[4, :] = 0.0
    x[4, n // 3] = -0.0  # -0.0 == 0.0: the first index wins
    x[5, :] = 7.0  # all equal: index 0
    if n > 4:
        x[6, 1], x[6, 3] = float("nan"), float("nan")  # the first NaN
        x[7, 2], x[7, n - 2] = 1e4, 1e4  # tied maxima: the first
    x[8, 0] = float("nan")
    got = cpu_kernels.argmax_rows(x, lib=lib)  # type: ignore[arg-type]
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    strided = x[:, : max(1, n // 2)]  # a strided view is copied first
    assert torch.equal(cpu_kernels.argmax_rows(strided, lib=lib), strided.argmax(dim=-1))  # type: ignore[arg-type]


def test_embed_rows_equals_lookup() -> None:
    g = torch.Generator().manual_seed(1)
    table = torch.randn(50, 24, generator=g)
    ids = torch.tensor([3, 49, 0, 3], dtype=torch.int64)
    assert torch.equal(cpu_kernels.embed_rows(table, ids, torch.float32), table[ids])
    bf = table.bfloat16()
    assert torch.equal(cpu_kernels.embed_rows(bf, ids, torch.bfloat16), bf[ids])
    assert torch.equal(cpu_kernels.embed_rows(bf, ids, torch.float32), bf[ids].float())
    with pytest.raises(IndexError, match="50 rows"):
        cpu_kernels.embed_rows(table, torch.tensor([50]), torch.float32)
    with pytest.raises(IndexError):
        cpu_kernels.embed_rows(table, torch.tensor([-1]), torch.float32)
    with pytest.raises(TypeError, match="no torch.float32 -> torch.bfloat16 path"):
        cpu_kernels.embed_rows(table, ids, torch.bfloat16)


def test_plain_greedy_and_processor_hooks() -> None:
    assert plain_greedy(SamplingParams(temperature=0))
    for kw in ({"temperature": 0.7}, {"logprobs": 0}, {"prompt_logprobs": 1}, {"presence_penalty": 0.5},
               {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}):
        assert not plain_greedy(SamplingParams(**{"temperature": 0, **kw})), kw  # type: ignore[arg-type]
    plain = Request("a", [1, 2], SamplingParams(temperature=0), eos_token_id=None, max_tokens=4)
    biased = Request("b", [1, 2], SamplingParams(temperature=0, logit_bias={5: 1.0}), eos_token_id=None,
                     max_tokens=4)
    procs = LogitsProcessors()
    assert not procs.act_on_any([plain, biased])
    procs.add(TokenConstraints())
    assert not procs.act_on_any([plain]) and procs.act_on_any([plain, biased])

    class Opaque:  # no acts_on: assumed to act on every row
        def __call__(self, logits: torch.Tensor, requests: object) -> None:
            pass

        def release(self, request_ids: object) -> None:
            pass

    procs.add(Opaque())
    assert procs.act_on_any([plain])


PROMPTS = [[5, 17, 300], [(7 * i + 3) % 600 for i in range(19)], [(11 * i + 1) % 600 for i in range(40)],
           [9], [(13 * i + 2) % 600 for i in range(33)], [(3 * i + 5) % 600 for i in range(16)]]


class _Counter:
    """Counts the fast path's steps (wraps ``GreedyDecode.run``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = 0
        self.rows: list[int] = []
        real = GreedyDecode.run

        def run(path: GreedyDecode, scheduled: list[object]) -> list[int]:
            self.steps += 1
            self.rows.append(len(scheduled))
            return real(path, scheduled)  # type: ignore[arg-type]

        monkeypatch.setattr(GreedyDecode, "run", run)


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], fast: bool) -> list[list[int]]:
    llm.engine.runner.greedy_fast_path = fast
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_path_gives_the_general_paths_tokens(tiny_model: Path, dtype: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if dtype == "bfloat16" and "avx512_bf16" not in cpu_kernels.gemm_features():
        pytest.skip("CPU lacks avx512_bf16 (bf16 runs the torch paths here)")
    llm = LLM(str(tiny_model), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype=dtype,
              enable_prefix_caching=False, num_threads=2)
    count = _Counter(monkeypatch)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for batch in (1, 2, 6):
        prompts = PROMPTS[:batch]
        general = _generate(llm, prompts, [sp] * batch, fast=False)
        assert count.steps == 0
        fast = _generate(llm, prompts, [sp] * batch, fast=True)
        assert fast == general, batch
        assert count.steps >= 23 - 1 and max(count.rows) == batch  # every decode step once all prompts are in
        count.steps, count.rows = 0, []
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_rows_that_need_logits_take_the_general_path(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32",
              enable_prefix_caching=False, num_threads=2)
    count = _Counter(monkeypatch)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for other in (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
                  SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
                  SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={7: 5.0}),
                  SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3)):
        expected = _generate(llm, PROMPTS[:2], [greedy, other], fast=False)
        got = _generate(llm, PROMPTS[:2], [greedy, other], fast=True)
        assert got == expected and count.steps == 0, other
    # min_tokens: general steps while it is pending (eos is masked there), then the fast path
    eos = SamplingParams(temperature=0, max_tokens=12, min_tokens=5)
    expected = _generate(llm, PROMPTS[:1], [eos], fast=False)
    assert _generate(llm, PROMPTS[:1], [eos], fast=True) == expected
    assert count.steps == len(expected[0]) - 5


def test_a_failing_fast_step_fails_its_requests_and_frees_their_blocks(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32",
              enable_prefix_caching=False, num_threads=2)
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("doomed", {"prompt_token_ids": PROMPTS[1]}, sp)
    outs = engine.step()  # the prefill (general path) samples the first token
    path = engine.runner._greedy_path()
    assert path is not None and outs and not outs[0].finished
    real = path.embedding
    path.embedding = real[:1]  # every id but 0 is now outside the table: embed_rows refuses the step
    try:
        outs = engine.step()
    finally:
        path.embedding = real
    assert [o.request_id for o in outs] == ["doomed"] and outs[0].finished
    assert outs[0].outputs[0].finish_reason == "error" and "outside the embedding table" in (outs[0].error or "")
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    # the engine keeps serving, on the fast path again
    assert len(_generate(llm, PROMPTS[:1], [sp], fast=True)[0]) == 8
