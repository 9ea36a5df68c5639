"""The ZMQ KV connector inside two in-process engines (issue 14): a prefill engine (P) pins and serves a
finished prompt's blocks, a decode engine (D) pulls them and continues; tiny random-weight Qwen2, fp32.

Geometry: blocks of 4 tokens. Prompt lengths 4 (one block), 13 (several blocks and a partial last one) and
16 (full blocks only). Every D output is compared with one engine running the whole request; D must compute
none of the prompt (``prompt_tokens_computed``), receive exactly the prompt's blocks (block bytes x blocks),
and neither side may keep a pinned or used block afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError

BS = 4
MAX_TOKENS = 8
_gen = torch.Generator().manual_seed(3)
PROMPTS = {n: torch.randint(0, 512, (n,), generator=_gen).tolist() for n in (4, 13, 16, 29)}


def _save_tiny_qwen2(path: Path, seed: int) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.2, rope_theta=10000.0)  # type: ignore[call-arg]
    hf = Qwen2ForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny_qwen2(tmp_path_factory.mktemp("qwen2-pd"), seed=0)


def _llm(model: Path, role: str | None = None, timeout_s: float = 30.0, **kw: Any) -> LLM:
    cfg = None if role is None else {"kv_role": role, "kv_port": 0, "kv_transfer_timeout_s": timeout_s}
    return LLM(str(model), skip_tokenizer_init=True, dtype="float32", block_size=BS, num_gpu_blocks_override=64,
               swap_space=0.01, kv_transfer_config=cfg, **kw)


@pytest.fixture(scope="module")
def single(model: Path) -> LLM:
    return _llm(model)


@pytest.fixture(scope="module")
def prefill(model: Path) -> LLM:
    return _llm(model, "kv_producer")


@pytest.fixture(scope="module")
def decode(model: Path) -> LLM:
    return _llm(model, "kv_consumer")


def _greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw})


def _drain(llm: LLM, timeout_s: float = 10.0) -> None:
    """Step an idle engine until its connector has freed what D released (a release arrives on a thread)."""
    e = llm.engine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        e.scheduler.schedule()  # frees released pins
        if e.connector is None or e.connector.num_pinned_blocks == 0:
            return
        time.sleep(0.01)


def _pd(prefill: LLM, decode: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], dict[str, Any]]:
    p_out = prefill.generate([{"prompt_token_ids": prompt}],
                             params.clone(max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                             use_tqdm=False)[0]
    kv = p_out.kv_transfer_params
    assert kv is not None and p_out.outputs[0].finish_reason == "length"
    assert kv["num_prompt_tokens"] == len(prompt) and kv["first_token_ids"] == p_out.outputs[0].token_ids
    d_out = decode.generate([{"prompt_token_ids": prompt}], params.clone(kv_transfer_params=kv), use_tqdm=False)[0]
    assert d_out.error is None
    return d_out.outputs[0].token_ids, kv


@pytest.mark.parametrize("n", [4, 13, 16, 29])
def test_decode_instance_continues_the_prefill_exactly(single: LLM, prefill: LLM, decode: LLM, n: int) -> None:
    prompt = PROMPTS[n]
    ref = single.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    d = decode.engine
    computed0 = d.scheduler.prompt_tokens_computed
    pulled0 = d.connector.snapshot().bytes_received  # type: ignore[union-attr]
    tokens, kv = _pd(prefill, decode, prompt, _greedy())
    assert tokens == ref
    assert d.scheduler.prompt_tokens_computed == computed0  # D ran none of the prompt through the model
    nbytes = d.connector.block_nbytes  # type: ignore[union-attr]
    assert d.connector.snapshot().bytes_received - pulled0 == -(-n // BS) * nbytes  # type: ignore[union-attr]
    _drain(prefill)
    assert prefill.engine.connector.num_pinned_blocks == 0  # type: ignore[union-attr]
    assert prefill.engine.block_manager.usage == 0.0 and d.block_manager.usage == 0.0


def test_decode_prefix_hits_are_not_pulled(prefill: LLM, decode: LLM, single: LLM) -> None:
    prompt = PROMPTS[29]
    ref = single.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    _pd(prefill, decode, prompt, _greedy())  # D has the prompt's 7 full blocks cached now
    pulled0 = decode.engine.connector.snapshot().bytes_received  # type: ignore[union-attr]
    tokens, _ = _pd(prefill, decode, prompt, _greedy())
    assert tokens == ref
    # 29 tokens: 7 full blocks hit on D, only the partial 8th is pulled
    assert decode.engine.connector.snapshot().bytes_received - pulled0 == decode.engine.connector.block_nbytes  # type: ignore[union-attr]
    _drain(prefill)
    assert prefill.engine.connector.num_pinned_blocks == 0  # type: ignore[union-attr]


def test_unreachable_prefill_instance_means_recompute(model: Path, single: LLM) -> None:
    decode = _llm(model, "kv_consumer", timeout_s=0.5)  # gives up a pull after 0.5 s without an answer
    p = _llm(model, "kv_producer")
    prompt = PROMPTS[13]
    ref = single.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    out = p.generate([{"prompt_token_ids": prompt}],
                     _greedy(max_tokens=1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)[0]
    kv = out.kv_transfer_params
    assert kv is not None
    p.engine.close()  # P is gone before D pulls
    d = decode.engine
    before = d.connector.snapshot()  # type: ignore[union-attr]
    computed0 = d.scheduler.prompt_tokens_computed
    d_out = decode.generate([{"prompt_token_ids": prompt}], _greedy(kv_transfer_params=kv), use_tqdm=False)[0]
    assert d_out.outputs[0].token_ids == ref
    after = d.connector.snapshot()  # type: ignore[union-attr]
    assert after.recomputed_requests == before.recomputed_requests + 1 and after.failures == {"timeout": 1}
    assert d.scheduler.prompt_tokens_computed - computed0 == 13
    assert d.block_manager.usage == 0.0
    decode.engine.close()


def test_pins_expire_when_nobody_pulls(model: Path) -> None:
    p = _llm(model, "kv_producer", timeout_s=0.2)
    out = p.generate([{"prompt_token_ids": PROMPTS[16]}],
                     _greedy(max_tokens=1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)[0]
    assert out.kv_transfer_params is not None
    c = p.engine.connector
    assert c is not None and c.num_pinned_blocks == 4  # the prompt's KV, copied out
    assert p.engine.block_manager.usage == 0.0  # the device blocks are free at once (cached, evictable)
    time.sleep(0.3)
    p.engine.scheduler.schedule()
    assert c.num_pinned_blocks == 0 and c.snapshot().pins_expired == 1 and p.engine.block_manager.usage == 0.0
    p.engine.close()


def test_a_request_that_stops_on_p_pins_nothing(prefill: LLM) -> None:
    out = prefill.generate([{"prompt_token_ids": PROMPTS[4]}],
                           SamplingParams(temperature=0.0, max_tokens=1, stop_token_ids=list(range(512)),
                                          kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.kv_transfer_params is None
    assert prefill.engine.connector.num_pinned_blocks == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("params, match", [
    ({"do_remote_decode": True}, "needs an instance started with --kv-transfer-config"),
    ({"do_remote_prefill": True}, "remote_host is missing"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "exactly one of"),
    ({"do_remote_decode": True, "x": 1}, "unsupported key 'x'"),
])
def test_bad_transfer_params_are_refused(single: LLM, params: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        single.engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, _greedy(kv_transfer_params=params))


def test_decode_params_must_match_the_prompt(decode: LLM) -> None:
    kv = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "r",
          "remote_engine_id": "e", "num_prompt_tokens": 5, "first_token_ids": [7]}
    with pytest.raises(InvalidRequestError, match="computed 5 prompt tokens, this request has 3"):
        decode.engine.add_request("x", {"prompt_token_ids": [1, 2, 3]}, _greedy(kv_transfer_params=kv))
    with pytest.raises(InvalidRequestError, match="n > 1"):
        decode.engine.add_request("y", {"prompt_token_ids": [1, 2, 3, 4, 5]}, _greedy(n=2, kv_transfer_params=kv))
    with pytest.raises(InvalidRequestError, match="leaves nothing to decode"):
        decode.engine.add_request("z", {"prompt_token_ids": [1, 2, 3, 4, 5]},
                                  _greedy(kv_transfer_params=kv).clone(max_tokens=1))


def test_kv_of_another_model_is_refused_and_recomputed(model: Path, tmp_path: Path) -> None:
    other = _save_tiny_qwen2(tmp_path / "other", seed=1)  # same shapes, other weights: another fingerprint
    p = _llm(other, "kv_producer")
    d = _llm(model, "kv_consumer")
    ref_llm = _llm(model)
    try:
        prompt = PROMPTS[13]
        ref = ref_llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
        out = p.generate([{"prompt_token_ids": prompt}],
                         _greedy(max_tokens=1, kv_transfer_params={"do_remote_decode": True}), use_tqdm=False)[0]
        kv = out.kv_transfer_params
        assert kv is not None
        kv = {**kv, "first_token_ids": [ref[0]]}  # the token this model would have sampled
        got = d.generate([{"prompt_token_ids": prompt}], _greedy(kv_transfer_params=kv), use_tqdm=False)[0]
        assert got.outputs[0].token_ids == ref  # recomputed with its own weights, not the other model's KV
        snap = d.engine.connector.snapshot()  # type: ignore[union-attr]
        assert snap.failures == {"fingerprint": 1} and snap.recomputed_requests == 1
        assert d.engine.scheduler.prompt_tokens_computed == 13
        _drain(p)  # D released it after the failed pull
        assert p.engine.connector.num_pinned_blocks == 0  # type: ignore[union-attr]
    finally:
        for llm in (p, d, ref_llm):
            llm.engine.close()


def test_an_8bit_cache_moves_codes_and_scales(model: Path) -> None:
    """int8 KV on both sides: the payloads carry the codes and their scales (head_dim 16: one float16 per row),
    and D continues exactly as one engine with the same int8 cache."""
    single, p, d = (_llm(model, role, kv_cache_dtype="int8") for role in (None, "kv_producer", "kv_consumer"))
    try:
        prompt = PROMPTS[29]
        ref = single.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)[0].outputs[0].token_ids
        tokens, _ = _pd(p, d, prompt, _greedy())
        assert tokens == ref
        c = d.engine.connector
        assert c is not None and c.snapshot().bytes_received == 8 * c.block_nbytes
        assert c.block_nbytes == BS * 2 * 3 * 2 * (16 + 2)  # tokens x K,V x layers x kv heads x (head_dim + scale)
    finally:
        for llm in (single, p, d):
            llm.engine.close()
