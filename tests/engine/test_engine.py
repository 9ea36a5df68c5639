"""LLMEngine behaviour on the real default model: seeds, stops, aborts, failures, bad input."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.request import RequestStatus
from kvserve.errors import InvalidRequestError, ModelNotFoundError, PromptTooLongError

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m-instruct", kv_cache_memory=0.1, max_model_len=512)


def _no_blocks_in_use(llm: LLM) -> None:
    llm.engine.block_manager.check_invariants()
    assert llm.engine.block_manager.num_used_blocks == 0
    assert not llm.engine.scheduler.requests and not llm.engine.groups


def test_seeded_sampling_is_batch_invariant(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == again and len(alone) == 24
    others = [
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),            # unseeded
        SamplingParams(temperature=0.7, top_k=5, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.1, frequency_penalty=0.5, max_tokens=16, ignore_eos=True),
    ]
    texts = ["The capital of France is", "def add(a, b):", "用中文写三句关于大海的话", "1, 2, 3, 4,"]
    prompts: list[str] = []
    params: list[SamplingParams] = []
    for i in range(15):
        prompts.append(texts[i % len(texts)] * (1 + i % 3))
        params.append(others[i % len(others)])
    prompts.insert(5, PROMPT)
    params.insert(5, seeded)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[5].outputs[0].token_ids == alone
    different = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True)
    assert llm.generate([PROMPT], different, use_tqdm=False)[0].outputs[0].token_ids != alone
    _no_blocks_in_use(llm)


def test_n_samples_are_seeded_and_distinct(llm: LLM) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    a = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    b = llm.generate([PROMPT], sp, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    _no_blocks_in_use(llm)


def test_stop_string_and_stop_token(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.engine.tokenizer
    assert tok is not None
    # A stop string that starts mid-output and spans several tokens.
    start = len(tok.decode(base.token_ids[:6]))
    stop = tok.decode(base.token_ids[:10])[start:]
    assert len(stop) >= 3
    out = llm.generate([PROMPT], greedy.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == base.text[: base.text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # A stop token id ends generation and is kept in token_ids.
    out = llm.generate([PROMPT], greedy.clone(stop_token_ids=[base.token_ids[3]]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:4] and out.stop_reason == base.token_ids[3]
    # min_tokens bans the stop token until then: the first token can no longer be it.
    sp = greedy.clone(stop_token_ids=[base.token_ids[0]], min_tokens=2, max_tokens=4)
    out = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != base.token_ids[0]
    _no_blocks_in_use(llm)


def test_max_tokens_zero_and_logprobs(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0), use_tqdm=False)[0]
    assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    sp = SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    c = llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 5
    for tid, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp is not None and lp.token_id == tid and lp.rank == 1 and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == tid
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    _no_blocks_in_use(llm)


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"abort-{i}", PROMPT * (i + 1), sp)
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request(["abort-0", "abort-3"])
    engine.step()
    engine.abort_request([f"abort-{i}" for i in range(6)] + ["unknown-id"])
    _no_blocks_in_use(llm)
    engine.step()  # aborted requests produce no more outputs
    assert not engine.has_unfinished_requests()


def test_failed_step_fails_only_its_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("doomed", PROMPT, sp)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected failure")

    with monkeypatch.context() as m:
        m.setattr(engine.runner, "execute_model", boom)
        outs = engine.step()
    assert [o.request_id for o in outs] == ["doomed"]
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "error"
    assert outs[0].error is not None and "injected failure" in outs[0].error
    _no_blocks_in_use(llm)
    # The engine keeps serving.
    assert len(llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("kwargs,param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_k": -3}, "top_k"),
    ({"n": 0}, "n"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logprobs": -2}, "logprobs"),  # above --max-logprobs is the engine's 400 (test_prompt_logprobs)
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.param == param and param in str(e.value)


def test_bad_prompts(llm: LLM) -> None:
    engine = llm.engine
    for bad in ("", [], [1, -2], [10**9], [1.5], {"foo": 1}):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request(None, bad, SamplingParams())  # type: ignore[arg-type]
        assert e.value.param == "prompt"
    with pytest.raises(PromptTooLongError) as e:
        engine.add_request(None, [5] * 512, SamplingParams())
    assert "512" in str(e.value)
    _no_blocks_in_use(llm)


def test_unknown_model_names_the_install_or_choices() -> None:
    with pytest.raises(ModelNotFoundError) as e:
        LLM("no-such-model")
    assert "smollm2-135m-instruct" in str(e.value)


def test_request_status_finish_reasons() -> None:
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH_CAPPED.finish_reason == "length"
    assert RequestStatus.RUNNING.finish_reason is None and not RequestStatus.PREEMPTED.finished
