"""Prefix caching and parallel-sampling forks on the real default model (fp32, exact token equality)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import model_fingerprint

pytestmark = pytest.mark.slow

BS = 16
TEXT = ("The history of the lighthouse begins with fires lit on hilltops to guide ships home. Over centuries "
        "these fires became towers of stone, then lamps with mirrors and lenses, and finally electric beacons "
        "watched over by keepers who lived at the edge of the sea and wrote down every passing storm. ") * 30


@pytest.fixture(scope="module")
def llm_on() -> LLM:
    return LLM("smollm2-135m-instruct", kv_cache_memory=0.15, max_model_len=1280, block_size=BS)


@pytest.fixture(scope="module")
def llm_off() -> LLM:
    return LLM("smollm2-135m-instruct", kv_cache_memory=0.15, max_model_len=1280, block_size=BS,
               enable_prefix_caching=False)


def _ids(llm: LLM, n: int, offset: int = 0) -> list[int]:
    tok = llm.engine.tokenizer
    assert tok is not None
    ids = tok.encode(TEXT)
    assert len(ids) >= n + offset
    return ids[offset:offset + n]


def _greedy(llm: LLM, prompt: list[int], max_tokens: int = 24) -> tuple[list[int], int]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                     ignore_eos=True), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def _idle(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and not llm.engine.groups


@pytest.mark.parametrize("length", [3 * BS - 1, 3 * BS, 3 * BS + 1, 8 * BS - 1, 8 * BS, 8 * BS + 1])
def test_greedy_identical_with_caching_on_and_off_cold_and_warm(llm_on: LLM, llm_off: LLM, length: int) -> None:
    """BC-01 and the kind: prompt lengths at, one under and one over a block boundary."""
    prompt = _ids(llm_on, length, offset=length)  # a distinct slice per length: the first run is cold
    reference, cached = _greedy(llm_off, prompt)
    assert cached == 0 and len(reference) == 24
    cold, cached = _greedy(llm_on, prompt)
    assert (cold, cached) == (reference, 0)
    for _ in range(2):
        warm, cached = _greedy(llm_on, prompt)
        assert warm == reference
        assert cached == (length - 1) // BS * BS  # every full block but the one holding the last token
    _idle(llm_on)


def test_a_cached_prefix_with_a_new_suffix_matches(llm_on: LLM, llm_off: LLM) -> None:
    system = _ids(llm_on, 5 * BS + 7, offset=900)
    for question in ([504, 6693, 314, 11483, 47], [504, 314, 6693, 47]):
        prompt = system + question
        reference, _ = _greedy(llm_off, prompt)
        got, cached = _greedy(llm_on, prompt)
        assert got == reference
    assert cached == 5 * BS  # the shared system prompt's full blocks
    _idle(llm_on)


def test_next_turn_hits_its_own_history_including_generated_tokens(llm_on: LLM, llm_off: LLM) -> None:
    prompt = _ids(llm_on, 70, offset=500)
    reply, _ = _greedy(llm_on, prompt, max_tokens=40)
    turn2 = prompt + reply + [198, 504, 6693, 47]
    got, cached = _greedy(llm_on, turn2)
    # the KV of every token but the last sampled one was computed, and its full blocks committed
    assert cached == (len(prompt) + len(reply) - 1) // BS * BS
    assert cached > len(prompt)
    assert got == _greedy(llm_off, turn2)[0]
    _idle(llm_on)


def test_salt_isolates_tenants(llm_on: LLM) -> None:
    prompt = _ids(llm_on, 100, offset=200)
    sp = SamplingParams(temperature=0, max_tokens=4)

    def cached(salt: str | None) -> int:
        p = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}
        return llm_on.generate([p], sp, use_tqdm=False)[0].num_cached_tokens  # type: ignore[list-item]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 96
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-b") == 96
    _idle(llm_on)


def test_stats_count_each_request_once(llm_on: LLM) -> None:
    before = llm_on.get_prefix_cache_stats()
    prompt = _ids(llm_on, 64, offset=1000)
    _greedy(llm_on, prompt, max_tokens=2)
    _greedy(llm_on, prompt, max_tokens=2)
    after = llm_on.get_prefix_cache_stats()
    assert after["queries"] - before["queries"] == 128
    assert after["hits"] - before["hits"] == 48
    assert 0 < after["hit_rate"] <= 1


def test_caching_off_reports_no_queries(llm_off: LLM) -> None:
    stats = llm_off.get_prefix_cache_stats()
    assert stats["queries"] == stats["hits"] == stats["cached_blocks"] == 0


def _peak_blocks(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[int, list[list[int]]]:
    engine = llm.engine
    engine.reset_prefix_cache()
    engine.add_request("peak", {"prompt_token_ids": prompt}, params)
    peak, final = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        peak = max(peak, engine.block_manager.num_used_blocks)
    assert final is not None
    return peak, [c.token_ids for c in final.outputs]


@pytest.mark.parametrize("caching", [True, False])
def test_n4_shares_the_prompt_blocks(llm_on: LLM, llm_off: LLM, caching: bool) -> None:
    llm = llm_on if caching else llm_off
    prompt = _ids(llm, 1000)
    sp = SamplingParams(temperature=1.5, seed=11, max_tokens=8, ignore_eos=True)
    peak1, _ = _peak_blocks(llm, prompt, sp)
    peak4, samples = _peak_blocks(llm, prompt, dataclasses.replace(sp, n=4))
    assert peak1 == -(-1008 // BS)  # 63 blocks
    assert peak4 <= 1.2 * peak1, (peak1, peak4)
    # each fork samples exactly what a lone request with its seed (seed + i) samples
    alone = [llm.generate([{"prompt_token_ids": prompt}], dataclasses.replace(sp, seed=11 + i),
                          use_tqdm=False)[0].outputs[0].token_ids for i in range(4)]
    assert samples == alone
    assert len({tuple(s) for s in samples}) > 1
    _idle(llm)


def test_fingerprint_changes_with_model_config_tokenizer_and_dtype(llm_on: LLM, tmp_path: Path) -> None:
    e = llm_on.engine
    base = model_fingerprint(e.model_path, e.arch, e.tokenizer, e.dtype)
    assert base == e.fingerprint
    assert model_fingerprint(e.model_path, e.arch, e.tokenizer, torch.bfloat16) != base
    assert model_fingerprint(e.model_path, dataclasses.replace(e.arch, rope_theta=1.0), e.tokenizer,
                             e.dtype) != base
    assert model_fingerprint(e.model_path, e.arch, None, e.dtype) != base
    # The weights count by content: a copy elsewhere (another host, another install) shares KV through a
    # Redis tier; a changed byte does not.
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(e.model_path, copy)
    assert model_fingerprint(copy, e.arch, e.tokenizer, e.dtype) == base
    with copy.open("r+b") as f:
        f.seek(copy.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(copy, ns=(1, 1))  # a new (size, mtime) key for the digest cache whatever the clock's grain
    assert model_fingerprint(copy, e.arch, e.tokenizer, e.dtype) != base
