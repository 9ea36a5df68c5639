"""The runner's swap path and start-up measurements on the real default model.

* A request prefilled into some blocks, swapped out to the host pool, swapped back into *other* device
  blocks and decoded from there produces the same greedy tokens as an uninterrupted ``LLM.generate``.
* The dummy-prefill and copy-bandwidth measurements leave nothing behind that changes a later generation.
"""

from __future__ import annotations

import math

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.block_manager import BlockId
from kvserve.core.request import Request
from kvserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvserve.worker.kv_cache import num_host_blocks_for
from kvserve.worker.model_runner import ModelRunner

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea,"
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # No prefix caching: this test writes blocks behind the block manager's back.
    return LLM("smollm2-135m-instruct", kv_cache_memory=0.05, max_model_len=512, enable_prefix_caching=False)


def _greedy(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_measurements_leave_no_state(llm: LLM) -> None:
    before = _greedy(llm)
    runner = llm.engine.runner
    tok_s = runner.measure_prefill_speed(num_tokens=64)
    bw = runner.measure_copy_bandwidth(num_blocks=4, repeats=2)
    assert math.isfinite(tok_s) and tok_s > 0 and math.isfinite(bw) and bw > 0
    assert _greedy(llm) == before


def test_decode_after_swap_out_and_in_to_other_blocks(llm: LLM) -> None:
    expected = _greedy(llm)
    engine = llm.engine
    assert engine.tokenizer is not None
    arch, bs = engine.arch, engine.config.block_size
    num_host = num_host_blocks_for(0.01, arch, bs, engine.dtype)
    runner = ModelRunner(engine.runner.model, engine.num_blocks, bs, engine.device, num_host_blocks=num_host)
    ids = engine.tokenizer.encode(PROMPT)
    req = Request("swapped", ids, GREEDY, engine.eos_token_id, MAX_TOKENS)
    n_blocks = math.ceil((len(ids) + MAX_TOKENS) / bs)
    table = [BlockId(b) for b in range(n_blocks)]
    moved = [BlockId(b) for b in range(n_blocks, 2 * n_blocks)]

    def step(so: SchedulerOutput) -> None:
        out = runner.execute_model(so)
        req.num_computed_tokens = req.num_tokens
        req.append_output_token(out.sampled_token_ids[0][0])

    step(SchedulerOutput([ScheduledRequest(req, 0, len(ids), table, True)]))
    for _ in range(3):
        step(SchedulerOutput([ScheduledRequest(req, req.num_computed_tokens, 1, table, True)]))
    host = list(range(num_host - n_blocks, num_host))  # the far end of the pool, out of order
    host.reverse()
    out = runner.execute_model(SchedulerOutput([], blocks_to_swap_out=list(zip(table, host, strict=True))))
    assert out.swap_bytes == n_blocks * engine.kv_block_bytes()
    for k, v in runner.kv_caches:  # the old blocks are reused by someone else meanwhile
        k[:n_blocks].normal_()
        v[:n_blocks].normal_()
    # Swap back in, into other blocks, on the same step as the next decode.
    so = SchedulerOutput([ScheduledRequest(req, req.num_computed_tokens, 1, moved, True)],
                         blocks_to_swap_in=list(zip(host, moved, strict=True)))
    step(so)
    while req.num_output_tokens < len(expected):
        step(SchedulerOutput([ScheduledRequest(req, req.num_computed_tokens, 1, moved, True)]))
    assert req.output_token_ids == expected
