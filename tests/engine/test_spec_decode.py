"""Speculative decoding end to end: the engine emits exactly what it emits without speculation.

Greedy output with ``speculative_config`` on must equal spec off token for token (fp32), whatever the draft
(n-gram prompt lookup, a draft model that is an exact copy of the target: every draft accepted, a different
random model: almost every draft rejected), ``k``, the KV layout (block size, chunked prefill), prefix-cache
hits, preemption (recompute and swap), parallel sampling and priorities. Seeded sampled requests give the
same tokens alone and in a batch; ``max_tokens``, stop token ids, stop strings and ``min_tokens`` end a
request exactly where one token per step would have; logprobs and penalties are the target's at every
position; aborts mid-speculation free every block. The counters (``scheduler.spec.stats``) are checked
against exact values where the draft makes them predictable.

Most tests use tiny random Qwen2 models (vocabulary 600) saved as HF folders; the ones that need text
(stop strings) or real acceptance rates use SmolLM2 (fp32), one uses Qwen2.5-Coder 0.5B -> 1.5B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvserve.engine.llm_engine as llm_engine_module
from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.errors import InvalidRequestError
from kvserve.models.catalog import resolve_model_path
from kvserve.models.loader import load_weights
from kvserve.outputs import RequestOutput

VOCAB = 600
MAX_NEW = 40
SMOL = "smollm2-135m-instruct"


# ---- tiny random models ------------------------------------------------------------------------
def _save_qwen2(path: Path, seed: int, layers: int, hidden: int, head_dim: int, vocab: int = VOCAB,
                max_position: int = 512) -> Path:
    """A random Qwen2 (QKV biases, untied head, GQA) as an HF folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=max_position, tie_word_embeddings=False, initializer_range=0.2,
                      rope_theta=10000.0)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``target``; ``copy`` (its files, another folder: the ideal draft); ``other`` (a different random model,
    same vocabulary: a useless draft); ``vocab512`` (another vocabulary); ``short`` (a 64-token context)."""
    root = tmp_path_factory.mktemp("spec_tiny")
    target = _save_qwen2(root / "target", seed=0, layers=2, hidden=128, head_dim=32)
    copy = root / "copy"
    shutil.copytree(target, copy)
    return {"target": target, "copy": copy,
            "other": _save_qwen2(root / "other", seed=7, layers=1, hidden=64, head_dim=16),
            "vocab512": _save_qwen2(root / "vocab512", seed=3, layers=1, hidden=64, head_dim=16, vocab=512),
            "short": _save_qwen2(root / "short", seed=4, layers=1, hidden=64, head_dim=16, max_position=64)}


def _prompts() -> list[list[int]]:
    """Random prompts of 3..70 tokens and a repetitive one (n-gram lookup proposes from its first decode)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 19, 40, 70)] + [list(range(10, 30)) * 3]


PROMPTS = _prompts()
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
LAYOUTS: dict[str, dict[str, Any]] = {"default": {}, "chunked": {"block_size": 4, "max_num_batched_tokens": 10}}


def _spec(tiny: dict[str, Path], method: str, k: int, **extra: Any) -> dict[str, Any]:
    """The speculative config of ``method``: ``ngram``, or a draft model named by its key in ``tiny``.

    The tiny random models rarely repeat themselves: n-gram lookup from 1 token on proposes often enough
    (mostly rejected, a few accepted) to exercise verification."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 5,
                "adaptive": False, **extra}
    return {"method": "draft_model", "model": str(tiny[method]), "num_speculative_tokens": k, "adaptive": False,
            **extra}


def _tiny_llm(tiny: dict[str, Path], spec: dict[str, Any] | None = None, **kwargs: Any) -> LLM:
    if spec is not None:
        kwargs["speculative_config"] = spec
    return LLM(str(tiny["target"]), skip_tokenizer_init=True, kv_cache_memory=0.01, dtype="float32", **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY
              ) -> list[RequestOutput]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _assert_clean(llm)
    return outs


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_clean(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    assert not llm.engine.scheduler.requests


def _stats(llm: LLM) -> Any:
    spec = llm.engine.scheduler.spec
    assert spec is not None
    return spec.stats.snapshot()


def _copy_draft_counts(max_tokens: list[int], k: int) -> tuple[int, int, list[int]]:
    """Rounds, draft tokens and accepted drafts by position when every draft is accepted and nothing but
    ``max_tokens`` limits ``k``: after the prefill's token, each round verifies ``min(k, left - 1)`` drafts
    and emits one more token than that (a round of 0 drafts is a plain decode)."""
    rounds, tokens, per_pos = 0, 0, [0] * k
    for m in max_tokens:
        left = m - 1
        while left > 0:
            kk = min(k, left - 1)
            if kk:
                rounds += 1
                tokens += kk
                for j in range(kk):
                    per_pos[j] += 1
            left -= kk + 1
    return rounds, tokens, per_pos


def _drive(llm: LLM, schedule: dict[int, list[tuple[str, list[int], SamplingParams, int]]]
           ) -> dict[str, RequestOutput]:
    """Run the engine step by step: requests are added before the step their key names; block-manager
    invariants are checked after every step. Returns each request's final output."""
    eng = llm.engine
    done: dict[str, RequestOutput] = {}
    step = 0
    while step <= max(schedule) or eng.has_unfinished_requests():
        for rid, ids, params, priority in schedule.get(step, []):
            eng.add_request(rid, {"prompt_token_ids": ids}, params, priority=priority)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.block_manager.check_invariants()
        step += 1
        assert step < 10_000, "the engine does not finish"
    _assert_clean(llm)
    return done


# ---- greedy: spec on == spec off ----------------------------------------------------------------
_REFS: dict[tuple[Path, str], list[list[int]]] = {}


def _reference(tiny: dict[str, Path], layout: str) -> list[list[int]]:
    """Spec-off greedy tokens of PROMPTS under ``layout`` (cached for the module)."""
    key = (tiny["target"], layout)
    if key not in _REFS:
        _REFS[key] = _tokens(_generate(_tiny_llm(tiny, **LAYOUTS[layout]), PROMPTS))
        assert all(len(t) == MAX_NEW for t in _REFS[key])
    return _REFS[key]


def test_layouts_agree_without_speculation(tiny: dict[str, Path]) -> None:
    assert _reference(tiny, "chunked") == _reference(tiny, "default")


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["copy", "other", "ngram"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_spec_off(tiny: dict[str, Path], layout: str, method: str, k: int) -> None:
    llm = _tiny_llm(tiny, _spec(tiny, method, k), **LAYOUTS[layout])
    assert _tokens(_generate(llm, PROMPTS)) == _reference(tiny, "default")
    s = _stats(llm)
    assert s.num_draft_tokens > 0
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    if method == "copy":  # the target's own weights: every draft is the target's argmax
        assert s.num_accepted_tokens == s.num_draft_tokens
        if layout == "default":  # the budget never limits k: the counts are exact
            assert (s.num_drafts, s.num_draft_tokens, s.accepted_per_pos) == _copy_draft_counts(
                [MAX_NEW] * len(PROMPTS), k)
    elif method == "other":  # an unrelated random model: (almost) every draft rejected
        assert s.num_drafts > 50 and s.num_accepted_tokens <= s.num_draft_tokens // 20


@pytest.mark.parametrize("method", ["copy", "other", "ngram"])
def test_prefix_cache_hits(tiny: dict[str, Path], method: str) -> None:
    """The same prompts twice: the second run hits the cache and emits the same tokens. Then prompts that
    extend the first prompts by their outputs: their hits are blocks filled by verified drafts."""
    llm = _tiny_llm(tiny, _spec(tiny, method, 3))
    ref = _reference(tiny, "default")
    first = _generate(llm, PROMPTS)
    second = _generate(llm, PROMPTS)
    assert _tokens(first) == _tokens(second) == ref
    bs = llm.engine.config.block_size
    assert [o.num_cached_tokens for o in first] == [0] * len(PROMPTS)
    assert [o.num_cached_tokens for o in second] == [(len(p) - 1) // bs * bs for p in PROMPTS]
    longer = [p + t for p, t in zip(PROMPTS, ref, strict=True)]
    third = _generate(llm, longer)
    assert all(o.num_cached_tokens >= (len(p) + MAX_NEW - 1) // bs * bs - bs for o, p in zip(third, PROMPTS,
                                                                                               strict=True))
    assert _tokens(third) == _tokens(_generate(_tiny_llm(tiny, enable_prefix_caching=False), longer))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["copy", "other", "ngram"])
def test_preemption(tiny: dict[str, Path], method: str, mode: str) -> None:
    """12 blocks of 16 tokens for 5 requests of up to 110 tokens: requests are preempted in ``mode``."""
    llm = _tiny_llm(tiny, _spec(tiny, method, 3), num_gpu_blocks_override=12, max_model_len=192,
                    preemption_mode=mode, swap_space=0.01)
    assert _tokens(_generate(llm, PROMPTS)) == _reference(tiny, "default")
    by_mode = llm.engine.scheduler.num_preemptions_by_mode
    assert llm.engine.num_preemptions > 0 and by_mode[mode] > 0
    if mode == "recompute":
        assert by_mode["swap"] == 0
    assert llm.engine.scheduler.num_free_host_blocks == llm.engine.scheduler.config.num_host_blocks
    assert _stats(llm).num_draft_tokens > 0


@pytest.mark.parametrize("method", ["copy", "other", "ngram"])
def test_parallel_greedy_samples(tiny: dict[str, Path], method: str) -> None:
    llm = _tiny_llm(tiny, _spec(tiny, method, 3))
    outs = _generate(llm, PROMPTS, dataclasses.replace(GREEDY, n=3))
    ref = _reference(tiny, "default")
    for o, r in zip(outs, ref, strict=True):
        assert [c.token_ids for c in o.outputs] == [r, r, r]
    if method == "copy":
        s = _stats(llm)
        assert s.num_accepted_tokens == s.num_draft_tokens
        # a forked sample's first token already comes from a round (its prompt's last token is its decode)
        leaders, samples = [MAX_NEW] * len(PROMPTS), [MAX_NEW + 1] * 2 * len(PROMPTS)
        assert (s.num_drafts, s.num_draft_tokens) == _copy_draft_counts(leaders + samples, 3)[:2]


@pytest.mark.parametrize("method", ["copy", "other", "ngram"])
def test_priorities_with_preemption(tiny: dict[str, Path], method: str) -> None:
    """Priority policy, a pool too small for everyone: the low-priority requests start first, the urgent
    ones arrive mid-decode and preempt them."""
    llm = _tiny_llm(tiny, _spec(tiny, method, 3), scheduling_policy="priority", num_gpu_blocks_override=12,
                    max_model_len=192)
    ref = _reference(tiny, "default")
    reqs = [(f"r{i}", p, GREEDY, prio) for i, (p, prio) in enumerate(zip(PROMPTS, (5, 5, 0, 1, 5), strict=True))]
    done = _drive(llm, {0: [reqs[i] for i in (0, 1, 4)], 6: [reqs[2], reqs[3]]})
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == ref
    assert llm.engine.num_preemptions > 0
    assert _stats(llm).num_draft_tokens > 0


def test_abort_mid_speculation(tiny: dict[str, Path]) -> None:
    llm = _tiny_llm(tiny, _spec(tiny, "copy", 3))
    eng = llm.engine
    ref = _reference(tiny, "default")
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(f"a{i}", {"prompt_token_ids": p}, GREEDY)
    steps = 0
    while _stats(llm).num_drafts < 8:  # two rounds of drafts verified for each of the 4
        eng.step()
        eng.block_manager.check_invariants()
        steps += 1
        assert steps < 20
    assert eng.block_manager.num_used_blocks > 0
    eng.abort_request(["a1", "a2"])
    eng.block_manager.check_invariants()
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.block_manager.check_invariants()
    assert sorted(done) == ["a0", "a3"]
    assert done["a0"].outputs[0].token_ids == ref[0] and done["a3"].outputs[0].token_ids == ref[3]
    _assert_clean(llm)
    # the engine keeps serving: the aborted prompts again, to the end
    assert _tokens(_generate(llm, PROMPTS[1:3])) == ref[1:3]


# ---- sampling, limits and stops -------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "copy", "other"])
def test_seeded_sampling_is_batch_independent(tiny: dict[str, Path], method: str) -> None:
    """Seeded requests (temperature 0.8, top-p 0.9) alone and among 16 requests (greedy, unseeded and
    other-seeded neighbours) give the same tokens with speculation on."""
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_NEW, ignore_eos=True)
    g = torch.Generator().manual_seed(2)
    extra = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(4, 60, (11,), generator=g)]
    prompts = PROMPTS + extra
    params = [dataclasses.replace(sampled, seed=100 + i) if i % 3 != 2 else GREEDY for i in range(len(PROMPTS))]
    params += [dataclasses.replace(sampled, seed=None if i % 2 else 7 + i) for i in range(len(extra))]
    seeded = [i for i in range(len(PROMPTS)) if params[i].seed is not None]
    llm = _tiny_llm(tiny, _spec(tiny, method, 3))
    alone = [_tokens(_generate(llm, [prompts[i]], params[i]))[0] for i in seeded]
    batch = _tokens(_generate(llm, prompts, params))
    assert [batch[i] for i in seeded] == alone
    assert all(len(t) == MAX_NEW for t in batch)
    assert batch[2] == _reference(tiny, "default")[2]  # the greedy neighbour
    ref = _reference(tiny, "default")
    assert all(batch[i] != ref[i] for i in seeded)  # really sampled
    s = _stats(llm)
    assert s.num_draft_tokens > 0
    if method == "copy":  # p == q up to rounding: (nearly) every draft accepted
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens
    if method == "other":
        assert s.num_accepted_tokens < 0.5 * s.num_draft_tokens


@pytest.mark.parametrize("method", ["copy", "ngram"])
def test_max_tokens_edges(tiny: dict[str, Path], method: str) -> None:
    k = 3
    llm = _tiny_llm(tiny, _spec(tiny, method, k))
    ref = _reference(tiny, "default")
    for m in (1, 2, k, k + 1):
        before = _stats(llm)
        outs = _generate(llm, PROMPTS, dataclasses.replace(GREEDY, max_tokens=m))
        assert _tokens(outs) == [r[:m] for r in ref]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        if method == "copy":
            after = _stats(llm)
            rounds, tokens, _ = _copy_draft_counts([m] * len(PROMPTS), k)
            assert (after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
                    after.num_accepted_tokens - before.num_accepted_tokens) == (rounds, tokens, tokens)


@pytest.mark.parametrize("method", ["copy", "ngram"])
def test_max_model_len_caps_drafts(tiny: dict[str, Path], method: str) -> None:
    """A 40-token prompt under max_model_len 48 runs to exactly 8 tokens with drafts near the limit."""
    kw: dict[str, Any] = {"max_model_len": 48, "block_size": 4}
    ids = PROMPTS[2]
    off = _tokens(_generate(_tiny_llm(tiny, **kw), [ids], dataclasses.replace(GREEDY, max_tokens=None)))
    llm = _tiny_llm(tiny, _spec(tiny, method, 5), **kw)
    on = _generate(llm, [ids], dataclasses.replace(GREEDY, max_tokens=None))
    assert _tokens(on) == off and len(off[0]) == 8 and on[0].outputs[0].finish_reason == "length"


def test_stop_token_inside_accepted_run(tiny: dict[str, Path]) -> None:
    """Copy draft, k = 5: the first decode round accepts 5 drafts (output tokens 1..6); a stop token id at
    output position 3 ends the request there, the tokens after it in the same round are dropped."""
    ref = _reference(tiny, "default")[1]
    pos = next(i for i in (3, 2, 4) if ref[i] not in ref[:i])
    stop = dataclasses.replace(GREEDY, stop_token_ids=[ref[pos]])
    llm = _tiny_llm(tiny, _spec(tiny, "copy", 5))
    off = _generate(_tiny_llm(tiny), [PROMPTS[1]], stop)[0].outputs[0]
    on = _generate(llm, [PROMPTS[1]], stop)[0].outputs[0]
    assert on.token_ids == off.token_ids == ref[:pos + 1]
    assert on.finish_reason == off.finish_reason == "stop" and on.stop_reason == ref[pos]
    s = _stats(llm)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, 5, 5)
    # min_tokens = pos: the stop token is allowed where pos tokens precede it (the request itself has only
    # one output token when the round is verified; the drafts before the position count)
    on = _generate(llm, [PROMPTS[1]], dataclasses.replace(stop, min_tokens=pos))[0].outputs[0]
    assert on.token_ids == ref[:pos + 1] and on.finish_reason == "stop"
    # min_tokens past that position bans the stop token there: both continue the same way
    for m in (pos + 1, pos + 3):
        banned = dataclasses.replace(stop, min_tokens=m)
        off = _generate(_tiny_llm(tiny), [PROMPTS[1]], banned)[0].outputs[0]
        on = _generate(llm, [PROMPTS[1]], banned)[0].outputs[0]
        assert on.token_ids == off.token_ids and on.finish_reason == off.finish_reason
        assert on.token_ids[:pos] == ref[:pos] and on.token_ids[pos] != ref[pos] and len(on.token_ids) >= m


def _assert_logprobs(outs: list[RequestOutput], ref: list[RequestOutput], num: int, tol: float) -> None:
    """One entry per token, the chosen token's, values <= 0 and not all 0, ``num`` alternatives that include
    the chosen (greedy) token, within ``tol`` of the reference run's."""
    values = []
    for o, r in zip(outs, ref, strict=True):
        c, rc = o.outputs[0], r.outputs[0]
        assert c.token_ids == rc.token_ids
        assert c.logprobs is not None and rc.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for tok, lp, rlp in zip(c.token_ids, c.logprobs, rc.logprobs, strict=True):
            assert lp is not None and rlp is not None
            assert lp.token_id == tok and lp.logprob <= 0 and lp.rank == 1
            assert len(lp.top) == num and lp.top[0][0] == tok and lp.top[0][1] == lp.logprob
            assert lp.logprob == pytest.approx(rlp.logprob, abs=tol)
            assert [t for t, _ in lp.top] == [t for t, _ in rlp.top]
            assert [v for _, v in lp.top] == pytest.approx([v for _, v in rlp.top], abs=tol)
            values.append(lp.logprob)
    assert any(v < -1e-3 for v in values)


@pytest.mark.parametrize("method", ["copy", "other", "ngram"])
def test_logprobs(tiny: dict[str, Path], method: str) -> None:
    params = dataclasses.replace(GREEDY, logprobs=3)
    ref = _generate(_tiny_llm(tiny), PROMPTS, params)
    llm = _tiny_llm(tiny, _spec(tiny, method, 3))
    _assert_logprobs(_generate(llm, PROMPTS, params), ref, 3, 1e-4)
    assert _stats(llm).num_draft_tokens > 0


def test_prompt_logprobs(tiny: dict[str, Path]) -> None:
    params = dataclasses.replace(GREEDY, prompt_logprobs=2, max_tokens=12)
    ref = _generate(_tiny_llm(tiny), PROMPTS, params)
    outs = _generate(_tiny_llm(tiny, _spec(tiny, "copy", 3)), PROMPTS, params)
    assert _tokens(outs) == _tokens(ref)
    for o, r in zip(outs, ref, strict=True):
        assert o.prompt_logprobs is not None and r.prompt_logprobs is not None
        assert len(o.prompt_logprobs) == len(o.prompt_token_ids) == len(r.prompt_logprobs)
        for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and a.keys() == b.keys()
            assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-4)


PENALTIES: dict[str, dict[str, Any]] = {
    "repetition+frequency": {"repetition_penalty": 1.3, "frequency_penalty": 0.5},
    "presence+logit_bias": {"presence_penalty": 1.5, "logit_bias": {7: 4.0, 11: -100.0}},
    "allowed_token_ids": {"allowed_token_ids": list(range(0, VOCAB, 4))},
}


@pytest.mark.parametrize("which", list(PENALTIES))
@pytest.mark.parametrize("method", ["copy", "other", "ngram"])
def test_penalties_and_constraints(tiny: dict[str, Path], method: str, which: str) -> None:
    """The draft proposes without penalties or constraints; verification must apply them at every position,
    counting the accepted drafts before it."""
    params = dataclasses.replace(GREEDY, **PENALTIES[which])
    off = _tokens(_generate(_tiny_llm(tiny), PROMPTS, params))
    assert off != _reference(tiny, "default")
    llm = _tiny_llm(tiny, _spec(tiny, method, 3))
    assert _tokens(_generate(llm, PROMPTS, params)) == off
    assert _stats(llm).num_draft_tokens > 0


def test_disable_by_batch_size(tiny: dict[str, Path]) -> None:
    """vLLM's switch: no drafts while more than 2 requests decode; 5 prompts of 40 tokens decode together
    to the end, so never; 2 do from their first decode."""
    llm = _tiny_llm(tiny, _spec(tiny, "copy", 3, disable_by_batch_size=2))
    ref = _reference(tiny, "default")
    assert _tokens(_generate(llm, PROMPTS)) == ref
    assert _stats(llm).num_drafts == 0
    assert _tokens(_generate(llm, PROMPTS[:2])) == ref[:2]
    s = _stats(llm)
    rounds, tokens, _ = _copy_draft_counts([MAX_NEW] * 2, 3)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (rounds, tokens, tokens)


def test_adaptive_k_recovers_when_proposals_appear() -> None:
    """Adaptive k with measured step times that favour speculation: a request whose first 6 n-gram lookups
    find nothing (typical of an edit task's preamble) must speculate again once lookups succeed. Drives the
    controller as the scheduler does (``observe`` is called only for rounds that had draft slots)."""
    from kvserve.spec_decode.config import SpeculativeConfig
    from kvserve.spec_decode.controller import SpecController

    c = SpecController(SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4}), 2048)
    for n, t in [(1, 0.034), (2, 0.043), (4, 0.039), (8, 0.057), (16, 0.094)]:  # SmolLM2 fp32 on this CPU
        c.target_time.observe(n, t)
    ks = []
    for step in range(60):
        k = c.num_spec_tokens("r", 1, 0, 100)
        ks.append(k)
        if k:  # lookups fail for the first 6 steps, then every proposal is found and accepted
            c.observe("r", k, 0 if step < 6 else k, 0 if step < 6 else k)
    assert ks[0] > 0 and 0 in ks[:10]
    assert any(ks[10:]), ks


# ---- configuration errors -----------------------------------------------------------------------
def test_bad_configs(tiny: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequestError, match="lookahead_slots"):
        _tiny_llm(tiny, {"method": "ngram", "num_speculative_tokens": 3, "lookahead_slots": 2})
    for k in (0, -1, 17, "3", True):
        with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
            _tiny_llm(tiny, {"method": "ngram", "num_speculative_tokens": k})
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        _tiny_llm(tiny, {"method": "ngram"})
    with pytest.raises(InvalidRequestError, match="method"):
        _tiny_llm(tiny, {"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(InvalidRequestError, match="model"):
        _tiny_llm(tiny, {"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(InvalidRequestError, match="prompt_lookup_min"):
        _tiny_llm(tiny, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 6,
                         "prompt_lookup_max": 3})
    with pytest.raises(InvalidRequestError, match="JSON"):
        EngineConfig(speculative_config="{method: ngram}")
    with pytest.raises(InvalidRequestError) as e:
        _tiny_llm(tiny, _spec(tiny, "vocab512", 3))
    msg = str(e.value)
    assert str(tiny["vocab512"]) in msg and str(tiny["target"]) in msg and "512" in msg and "600" in msg
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        _tiny_llm(tiny, _spec(tiny, "short", 3), max_model_len=128)
    # the flag's JSON text is the same config as the dict
    cfg = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert cfg.spec is not None and (cfg.spec.method, cfg.spec.num_speculative_tokens, cfg.spec.prompt_lookup_min,
                                     cfg.spec.prompt_lookup_max) == ("ngram", 3, 2, 4)


# ---- SmolLM2 (fp32): real text, real acceptance ---------------------------------------------------
TEXT_PROMPTS = [  # tests/model/test_hf_equivalence.py's 8 reference prompts
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
SMOL_GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
REPETITIVE = ("Rewrite this list in the same format, keeping every line:\n"
              "- apple: red, sweet, round\n- banana: yellow, sweet, long\n- cherry: red, sour, round\n"
              "- lemon: yellow, sour, oval\n\nRewritten list:\n- apple: red, sweet, round\n- banana:")


def _smol(**kwargs: Any) -> LLM:
    return LLM(SMOL, dtype="float32", max_model_len=512, kv_cache_memory=0.05, **kwargs)


@pytest.fixture(scope="module")
def smol_off() -> LLM:
    return _smol()


@pytest.fixture(scope="module")
def smol_ids(smol_off: LLM) -> list[list[int]]:
    tok = smol_off.engine.tokenizer
    assert tok is not None
    return [tok.encode(p) for p in TEXT_PROMPTS] + [tok.apply_chat_template(m) for m in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def smol_self_draft() -> LLM:
    """SmolLM2 drafting for itself (k = 4): every draft accepted, each round emits 5 tokens."""
    return _smol(speculative_config={"method": "draft_model", "model": SMOL, "num_speculative_tokens": 4,
                                     "adaptive": False})


def _smol_ngram(k: int) -> LLM:
    return _smol(speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                     "prompt_lookup_max": 5, "adaptive": False})


@pytest.mark.slow
def test_smollm2_ngram_greedy_reference_prompts(smol_off: LLM, smol_ids: list[list[int]]) -> None:
    ref = _tokens(_generate(smol_off, smol_ids, SMOL_GREEDY))
    assert sum(len(r) == 48 for r in ref) >= 5
    for k in (1, 3, 5):
        llm = _smol_ngram(k)
        assert _tokens(_generate(llm, smol_ids, SMOL_GREEDY)) == ref, f"k={k}"
        s = _stats(llm)
        assert s.num_accepted_tokens > 0 and s.num_draft_tokens > s.num_accepted_tokens
        assert sum(s.accepted_per_pos) == s.num_accepted_tokens
        del llm
        gc.collect()


def _emission_chunks(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[RequestOutput, list[int]]:
    """Generate one request step by step; also returns how many tokens each step added."""
    eng = llm.engine
    eng.add_request("chunks", {"prompt_token_ids": ids}, params)
    sizes: list[int] = []
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            n = len(out.outputs[0].token_ids) - sum(sizes)
            if n:
                sizes.append(n)
            if out.finished:
                final = out
    assert final is not None
    _assert_clean(llm)
    return final, sizes


@pytest.mark.slow
def test_smollm2_stop_string_inside_accepted_run(smol_off: LLM, smol_self_draft: LLM) -> None:
    """A stop string completed by a token in the middle of an accepted run: text, token ids and finish
    reason equal spec off's, the run's later tokens are dropped."""
    tok = smol_off.engine.tokenizer
    assert tok is not None
    ids = tok.encode("Once upon a time, in a small village by the sea,")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full, sizes = _emission_chunks(smol_self_draft, ids, params)
    ref = smol_off.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    assert full.outputs[0].token_ids == ref.token_ids and full.outputs[0].text == ref.text
    assert sizes[:3] == [1, 5, 5]  # the prefill's token, then two rounds of 4 accepted drafts + 1
    # the stop string: the text of output tokens 7..8 (inside the second round, tokens 6..10), found first there
    pieces = [tok.decode(ref.token_ids[:i], skip_special_tokens=True) for i in range(len(ref.token_ids) + 1)]
    stop = pieces[9][len(pieces[7]):]
    assert stop.strip() and ref.text.find(stop) == len(pieces[7]), (stop, ref.text)
    sp = dataclasses.replace(params, stop=[stop])
    off = smol_off.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
    on, on_sizes = _emission_chunks(smol_self_draft, ids, sp)
    c = on.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (off.text, off.token_ids, "stop", stop)
    assert c.token_ids == ref.token_ids[:9] and c.text == pieces[7]
    assert on_sizes == [1, 5, 3]
    # include_stop_str_in_output keeps the stop string, and nothing after it
    sp = dataclasses.replace(sp, include_stop_str_in_output=True)
    off = smol_off.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
    on, _ = _emission_chunks(smol_self_draft, ids, sp)
    assert (on.outputs[0].text, on.outputs[0].token_ids) == (off.text, off.token_ids) == (pieces[9], ref.token_ids[:9])


@pytest.mark.slow
def test_smollm2_eos_and_min_tokens(smol_off: LLM, smol_self_draft: LLM, smol_ids: list[list[int]]) -> None:
    """Chat replies that end with EOS within 48 tokens (12, 30 and 34 tokens); spec on stops on the same
    token. min_tokens past the longest bans EOS there: spec on continues exactly as spec off."""
    tok = smol_off.engine.tokenizer
    assert tok is not None
    chats = [smol_ids[len(TEXT_PROMPTS)]] + [tok.apply_chat_template([{"role": "user", "content": c}])
                                              for c in ("Say hello.", "What is 2 + 2?")]
    ref = _generate(smol_off, chats, SMOL_GREEDY)
    eos = smol_off.engine.eos_token_id
    assert all(o.outputs[0].token_ids[-1] == eos and o.outputs[0].finish_reason == "stop" for o in ref)
    on = _generate(smol_self_draft, chats, SMOL_GREEDY)
    assert [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in on] == [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in ref]
    longest = max(len(o.outputs[0].token_ids) for o in ref)
    sp = dataclasses.replace(SMOL_GREEDY, min_tokens=longest + 3)
    off = _generate(smol_off, chats, sp)
    on = _generate(smol_self_draft, chats, sp)
    assert _tokens(on) == _tokens(off)
    assert all(len(t) >= longest + 3 and eos not in t[:longest + 3] for t in _tokens(on))


@pytest.mark.slow
def test_smollm2_logprobs_and_penalties(smol_off: LLM) -> None:
    tok = smol_off.engine.tokenizer
    assert tok is not None
    ids = [tok.encode(REPETITIVE), tok.encode(TEXT_PROMPTS[2])]
    llm = _smol_ngram(3)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=3)
    _assert_logprobs(_generate(llm, ids, params), _generate(smol_off, ids, params), 3, 1e-3)
    assert _stats(llm).num_accepted_tokens > 0
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5)
    off = _tokens(_generate(smol_off, ids, params))
    before = _stats(llm).num_draft_tokens
    assert _tokens(_generate(llm, ids, params)) == off
    assert _stats(llm).num_draft_tokens > before


@pytest.mark.slow
def test_smollm2_ineligible_requests_share_the_step(smol_off: LLM, smol_self_draft: LLM) -> None:
    """A JSON-schema request and a multi-token ``bad_words`` request (no speculation for either: their masks
    depend on the tokens before each position) in the same steps as rows that verify drafts: every output
    equals spec off's, the JSON parses, and only the eligible rows drafted."""
    import json

    from kvserve.structured.params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    tok = smol_off.engine.tokenizer
    assert tok is not None
    prompts = [tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}]),
               tok.encode(REPETITIVE), tok.encode(TEXT_PROMPTS[1]), tok.encode(TEXT_PROMPTS[2])]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema)),
              greedy, dataclasses.replace(greedy, bad_words=[" small village", " the sea"]), greedy]
    off = _generate(smol_off, prompts, params)
    before = _stats(smol_self_draft)
    on = _generate(smol_self_draft, prompts, params)
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in on] == [
        (o.outputs[0].token_ids, o.outputs[0].text) for o in off]
    assert set(json.loads(on[0].outputs[0].text)) == {"name", "age"}
    after = _stats(smol_self_draft)
    # the two eligible rows draft 4 per round (all accepted): 39 tokens after the prefill's = 7 rounds of 5 and
    # one of 4 (3 drafts) each; the other two rows never draft
    assert (after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens) == (16, 62)
    assert after.num_accepted_tokens - before.num_accepted_tokens == 62


# ---- Qwen2.5-Coder 0.5B drafting for 1.5B ---------------------------------------------------------
@pytest.fixture
def _uncached_weights(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The session's weight cache would keep gigabytes of Qwen weights alive for the rest of the run."""
    monkeypatch.setattr(llm_engine_module, "load_weights", load_weights)
    yield
    gc.collect()


@contextlib.contextmanager
def _speculation_off(llm: LLM) -> Iterator[None]:
    """The engine decoding without speculation (no k controller, no proposer): the spec-off reference
    from the same loaded weights, which saves loading a 1.5B model twice."""
    eng = llm.engine
    saved = eng.spec, eng.scheduler.spec, eng.runner.proposer
    eng.spec = eng.scheduler.spec = eng.runner.proposer = None
    try:
        yield
    finally:
        eng.spec, eng.scheduler.spec, eng.runner.proposer = saved


@pytest.mark.slow
def test_qwen_coder_draft_model(_uncached_weights: None) -> None:
    """Greedy, 24 tokens of a short code prompt: 1.5B alone vs 1.5B verifying 0.5B's drafts (k = 3).

    bfloat16 weights: in float32 loading the 1.5B alone needs more RAM than the test machine has (the
    conftest makes ``auto`` float32). Both runs are bfloat16, batch 1: the k + 1 = 4 verified positions run
    as decode queries through the same kernels as one-token decodes (the matmul row kernel below M = 10), so
    the tokens are equal; larger batches can take the tile kernel and round differently in bf16
    (docs/spec_decode.md, "What is exact"); float32 is exact (the tests above)."""
    try:
        resolve_model_path("qwen2.5-coder-1.5b-instruct")
        resolve_model_path("qwen2.5-coder-0.5b-instruct")
    except Exception as e:  # noqa: BLE001 - not installed (yet): nothing to compare
        pytest.skip(f"Qwen2.5-Coder models not installed: {e}")
    prompt = "def add(a: int, b: int) -> int:\n    return a + b\n\n\ndef sub(a: int, b: int) -> int:\n"
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = LLM("qwen2.5-coder-1.5b-instruct", dtype="bfloat16", max_model_len=256, kv_cache_memory=0.05,
              speculative_config={"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct",
                                  "num_speculative_tokens": 3, "adaptive": False})
    tok = llm.engine.tokenizer
    assert tok is not None
    ids = tok.encode(prompt)
    try:
        with _speculation_off(llm):
            ref = _generate(llm, [ids], sp)[0].outputs[0]
        assert _stats(llm).num_drafts == 0
        out = _generate(llm, [ids], sp)[0].outputs[0]
        s = _stats(llm)
    finally:
        del llm
        gc.collect()
    assert ref.text.startswith("    return a - b") and len(ref.token_ids) == 24
    assert out.token_ids == ref.token_ids, (out.text, ref.text)
    assert s.num_drafts > 0 and s.num_accepted_tokens > s.num_draft_tokens // 2
