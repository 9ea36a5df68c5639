"""Tests of kvserve.core.scheduler with a fake runner: exact token budgets, block tables, preemption, stops.

The fake runner samples, for every scheduled request with ``sample=True``, a token chosen by a script
(``FakeRunner.script``) or else ``token_for(request_id, index of the output token)``, so that every output
sequence is predictable and a dropped or duplicated token after a preemption shows up.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest

from kvserve.core.block_manager import BlockManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import RequestUpdate, Scheduler, SchedulerConfig
from kvserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvserve.sampling_params import SamplingParams


def token_for(request_id: str, index: int) -> int:
    """The default token of output position ``index``: distinct per request and position."""
    return 1000 + 100 * int(request_id.lstrip("r") or 0) + index


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int,
    *,
    eos_token_id: int | None = None,
    ignore_eos: bool = True,
    min_tokens: int = 0,
    stop_token_ids: list[int] | None = None,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=min_tokens,
                            stop_token_ids=stop_token_ids or [])
    return Request(request_id, list(range(10, 10 + prompt_len)), params, eos_token_id, max_tokens)


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill)
    return Scheduler(config, BlockManager(num_blocks, block_size))


class FakeRunner:
    """Samples a token for every ``sample=True`` request: from ``script`` while it lasts, else token_for."""

    def __init__(self, script: dict[str, list[int]] | None = None,
                 token: Callable[[str, int], int] = token_for) -> None:
        self.script = script or {}
        self.token = token

    def run(self, output: SchedulerOutput) -> ModelRunnerOutput:
        req_ids, tokens = [], []
        for s in output.scheduled:
            if s.sample:
                rid = s.request.request_id
                index = s.request.num_output_tokens
                script = self.script.get(rid, [])
                req_ids.append(rid)
                tokens.append(script[index] if index < len(script) else self.token(rid, index))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[t] for t in tokens])


def step(scheduler: Scheduler, runner: FakeRunner | None = None
         ) -> tuple[SchedulerOutput, list[RequestUpdate]]:
    output = scheduler.schedule()
    updates = scheduler.update_from_output(output, (runner or FakeRunner()).run(output))
    scheduler.block_manager.check_invariants()
    return output, updates


def plan(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, num_computed_tokens, num_scheduled_tokens, sample) of each scheduled request."""
    return [(s.request.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.sample)
            for s in output.scheduled]


def tables(output: SchedulerOutput) -> dict[str, list[int]]:
    return {s.request.request_id: list(s.block_table) for s in output.scheduled}


def run_to_completion(scheduler: Scheduler, runner: FakeRunner | None = None, max_steps: int = 1000) -> int:
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
        steps += 1
        assert steps <= max_steps, "the scheduler made no progress"
    return steps


# ---------------------------------------------------------------------------------------------------------
# torch-free core
# ---------------------------------------------------------------------------------------------------------


_BLOCK_TORCH = """
import sys


class NoTorch:
    \"\"\"Fails any import of torch, so that the probe is fast and names the importer in its traceback.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is imported: {name}")
        return None


sys.meta_path.insert(0, NoTorch())
"""


def _import_scheduler_without_torch(setup: str = "") -> subprocess.CompletedProcess[str]:
    probe = _BLOCK_TORCH + textwrap.dedent(setup) + textwrap.dedent("""
        import kvserve.core.scheduler
        assert "kvserve.core.scheduler" in sys.modules
        assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
        print("ok")
    """)
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)


def test_core_modules_do_not_import_torch() -> None:
    """kvserve/core/* itself is torch-free (the package ``__init__`` is bypassed with a bare package)."""
    result = _import_scheduler_without_torch("""
        import importlib.util, types
        spec = importlib.util.find_spec("kvserve")
        pkg = types.ModuleType("kvserve")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["kvserve"] = pkg
    """)
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr


def test_importing_the_scheduler_does_not_import_torch() -> None:
    result = _import_scheduler_without_torch()
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr


# ---------------------------------------------------------------------------------------------------------
# token budget and chunked prefill
# ---------------------------------------------------------------------------------------------------------


def test_budget_is_shared_running_first_then_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("r1", 7, 3))
    sched.add_request(make_request("r2", 6, 3))

    out, updates = step(sched)
    assert plan(out) == [("r1", 0, 7, True), ("r2", 0, 3, False)]
    assert tables(out) == {"r1": [0, 1], "r2": [2]}
    assert out.total_num_scheduled_tokens == 10
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("r1", [1100])]
    assert (sched.requests["r1"].num_computed_tokens, sched.requests["r1"].num_tokens) == (7, 8)
    assert (sched.requests["r2"].num_computed_tokens, sched.requests["r2"].num_tokens) == (3, 6)

    out, updates = step(sched)
    assert plan(out) == [("r1", 7, 1, True), ("r2", 3, 3, True)]
    assert tables(out) == {"r1": [0, 1], "r2": [2, 3]}
    assert out.total_num_scheduled_tokens == 4
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("r1", [1101]), ("r2", [1200])]

    out, _ = step(sched)
    assert plan(out) == [("r1", 8, 1, True), ("r2", 6, 1, True)]
    assert tables(out) == {"r1": [0, 1, 4], "r2": [2, 3]}
    assert sched.requests == {"r2": sched.requests["r2"]}  # r1 reached max_tokens 3

    r1 = out.scheduled[0].request
    assert r1.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r1.output_token_ids == [1100, 1101, 1102]
    out, _ = step(sched)
    assert plan(out) == [("r2", 7, 1, True)]
    assert out.finished_request_ids == ["r1"]
    r2 = out.scheduled[0].request
    assert r2.output_token_ids == [1200, 1201, 1202]
    assert r2.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not sched.has_unfinished_requests()
    assert sched.block_manager.num_used_blocks == 0
    assert step(sched)[0].finished_request_ids == ["r2"]


def test_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    sched = make_scheduler(max_num_batched_tokens=4, block_size=4)
    sched.add_request(make_request("r1", 10, 1))
    assert plan(step(sched)[0]) == [("r1", 0, 4, False)]
    assert plan(step(sched)[0]) == [("r1", 4, 4, False)]
    out, updates = step(sched)
    assert plan(out) == [("r1", 8, 2, True)]
    assert tables(out) == {"r1": [0, 1, 2]}
    assert [u.new_token_ids for u in updates] == [[1100]]
    assert out.scheduled[0].request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_decodes_are_scheduled_before_waiting_requests() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("r1", 4, 5))
    assert plan(step(sched)[0]) == [("r1", 0, 4, True)]
    sched.add_request(make_request("r2", 20, 1))
    out, _ = step(sched)
    # the decode takes its token first; the new prompt gets what is left of the budget
    assert plan(out) == [("r1", 4, 1, True), ("r2", 0, 9, False)]
    out, _ = step(sched)
    assert plan(out) == [("r1", 5, 1, True), ("r2", 9, 9, False)]
    out, _ = step(sched)
    assert plan(out) == [("r1", 6, 1, True), ("r2", 18, 2, True)]


def test_max_num_seqs_limits_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("r1", 2, 1))
    sched.add_request(make_request("r2", 2, 3))
    sched.add_request(make_request("r3", 2, 1))
    out, _ = step(sched)
    assert plan(out) == [("r1", 0, 2, True), ("r2", 0, 2, True)]
    # r1 finished on its only token; r3 was held back by max_num_seqs
    assert (sched.num_running, sched.num_waiting) == (1, 1)
    assert sched.requests["r3"].status == RequestStatus.WAITING
    out, _ = step(sched)
    assert plan(out) == [("r2", 2, 1, True), ("r3", 0, 2, True)]
    assert out.finished_request_ids == ["r1"]
    assert (sched.num_running, sched.num_waiting) == (1, 0)


def test_without_chunked_prefill_only_whole_prompts_are_admitted() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_request(make_request("r1", 7, 3))
    sched.add_request(make_request("r2", 6, 3))
    sched.add_request(make_request("r3", 2, 3))
    out, _ = step(sched)
    # r2 does not fit the 3 tokens left whole, and r3 may not overtake it
    assert plan(out) == [("r1", 0, 7, True)]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    out, _ = step(sched)
    assert plan(out) == [("r1", 7, 1, True), ("r2", 0, 6, True), ("r3", 0, 2, True)]


def test_admission_stops_at_the_first_request_that_gets_no_blocks() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4)
    sched.add_request(make_request("r1", 8, 1))  # 2 blocks
    sched.add_request(make_request("r2", 8, 1))  # 2 blocks: only 1 left
    sched.add_request(make_request("r3", 4, 1))  # would fit, but waits its turn
    out, _ = step(sched)
    assert plan(out) == [("r1", 0, 8, True)]
    assert "r2" not in sched.block_manager.block_tables
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    out, _ = step(sched)
    assert plan(out) == [("r2", 0, 8, True), ("r3", 0, 4, True)]
    # block 2 was never used; r1 gave back 1 then 0 (tail first)
    assert tables(out) == {"r2": [2, 1], "r3": [0]}


# ---------------------------------------------------------------------------------------------------------
# preemption by recompute
# ---------------------------------------------------------------------------------------------------------


def test_preemption_takes_the_most_recently_admitted_request() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add_request(make_request("r1", 3, 4))
    sched.add_request(make_request("r2", 3, 4))

    out, _ = step(sched)
    assert plan(out) == [("r1", 0, 3, True), ("r2", 0, 3, True)]
    assert tables(out) == {"r1": [0, 1], "r2": [2, 3]}
    out, _ = step(sched)
    assert plan(out) == [("r1", 3, 1, True), ("r2", 3, 1, True)]
    assert out.preempted_request_ids == []

    # r1 needs a third block: r2 (admitted last) is preempted and its blocks go to r1
    out, _ = step(sched)
    assert plan(out) == [("r1", 4, 1, True)]
    assert tables(out) == {"r1": [0, 1, 3]}
    assert out.preempted_request_ids == ["r2"]
    r2 = sched.requests["r2"]
    assert r2.status == RequestStatus.PREEMPTED
    assert r2.num_computed_tokens == 0
    assert r2.output_token_ids == [1200, 1201]
    assert r2.num_tokens == 5
    assert r2.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [r2]
    assert [r.request_id for r in sched.running] == ["r1"]
    assert "r2" not in sched.block_manager.block_tables
    assert list(sched.block_manager.free_queue) == [2]

    # r2 needs 3 blocks for its 5 tokens; only block 2 is free
    out, _ = step(sched)
    assert plan(out) == [("r1", 5, 1, True)]
    assert out.preempted_request_ids == []
    assert sched.requests.keys() == {"r2"}

    # r1 finished: r2 recomputes prompt + kept output in one go and samples its third token
    out, updates = step(sched)
    assert plan(out) == [("r2", 0, 5, True)]
    assert tables(out) == {"r2": [2, 3, 1]}
    assert out.finished_request_ids == ["r1"]
    assert [u.new_token_ids for u in updates] == [[1202]]
    assert r2.status == RequestStatus.RUNNING

    out, _ = step(sched)
    assert plan(out) == [("r2", 5, 1, True)]
    assert r2.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r2.output_token_ids == [1200, 1201, 1202, 1203]
    assert r2.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert sched.block_manager.num_used_blocks == 0


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_newest() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add_request(make_request("r1", 3, 2))
    sched.add_request(make_request("r2", 4, 2))
    out, _ = step(sched)
    assert tables(out) == {"r1": [0, 1], "r2": [2, 3]}
    # r1's 4th token fits block 1; r2's 5th token needs a block and r2 is the newest: it preempts itself
    out, _ = step(sched)
    assert plan(out) == [("r1", 3, 1, True)]
    assert out.preempted_request_ids == ["r2"]
    assert sched.requests["r2"].status == RequestStatus.PREEMPTED
    assert sched.requests["r2"].output_token_ids == [1200]
    out, _ = step(sched)
    assert plan(out) == [("r2", 0, 5, True)]
    assert tables(out) == {"r2": [3, 2, 1]}
    assert sched.requests == {}
    assert out.scheduled[0].request.output_token_ids == [1200, 1201]


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=3)
    sched.add_request(make_request("r1", 3, 4))
    sched.add_request(make_request("r2", 2, 4))
    assert plan(step(sched)[0]) == [("r1", 0, 3, True)]
    out, _ = step(sched)
    assert plan(out) == [("r1", 3, 1, True), ("r2", 0, 2, True)]
    assert tables(out) == {"r1": [0, 1], "r2": [2]}
    # r1 takes the last free block; r2 (3 tokens) needs a second one and preempts itself. A 2-token chunk
    # of r2 would fit block 2 again, but nothing is admitted in a step that had to preempt.
    out, _ = step(sched)
    assert plan(out) == [("r1", 4, 1, True)]
    assert tables(out) == {"r1": [0, 1, 3]}
    assert out.preempted_request_ids == ["r2"]
    assert list(sched.block_manager.free_queue) == [2]
    out, _ = step(sched)
    assert plan(out) == [("r1", 5, 1, True), ("r2", 0, 2, False)]
    assert tables(out) == {"r1": [0, 1, 3], "r2": [2]}
    out, _ = step(sched)
    assert plan(out) == [("r2", 2, 1, True)]
    assert tables(out) == {"r2": [2, 3]}
    assert out.finished_request_ids == ["r1"]
    run_to_completion(sched)
    assert sched.num_preemptions == 1
    assert sched.block_manager.num_used_blocks == 0


def test_preempted_request_goes_in_front_of_older_waiting_requests() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    sched.add_request(make_request("r1", 3, 4))
    sched.add_request(make_request("r2", 3, 4))
    sched.add_request(make_request("r3", 1, 1))
    step(sched)
    step(sched)
    out, _ = step(sched)
    assert out.preempted_request_ids == ["r2"]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    run_to_completion(sched)
    assert sched.num_preemptions == 1
    assert sched.block_manager.num_used_blocks == 0


# ---------------------------------------------------------------------------------------------------------
# stop conditions
# ---------------------------------------------------------------------------------------------------------


def finish_one(request: Request, script: list[int], max_model_len: int = 256) -> Request:
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(request)
    run_to_completion(sched, FakeRunner({request.request_id: script}))
    assert sched.block_manager.num_used_blocks == 0
    return request


def test_eos_stops() -> None:
    r = finish_one(make_request("r1", 3, 10, eos_token_id=2, ignore_eos=False), [5, 2, 5])
    assert r.output_token_ids == [5, 2]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.status.finish_reason == "stop"
    assert r.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    r = finish_one(make_request("r1", 3, 4, eos_token_id=2, ignore_eos=True), [5, 2, 2, 6, 7])
    assert r.output_token_ids == [5, 2, 2, 6]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.status.finish_reason == "length"


def test_no_eos_token_id_never_stops_on_eos() -> None:
    r = finish_one(make_request("r1", 3, 3, eos_token_id=None, ignore_eos=False), [2, 0, 1])
    assert r.output_token_ids == [2, 0, 1]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_delays_eos() -> None:
    r = finish_one(make_request("r1", 3, 10, eos_token_id=2, ignore_eos=False, min_tokens=3), [2, 2, 2, 9])
    assert r.output_token_ids == [2, 2, 2]
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_min_tokens_eos_after_the_minimum() -> None:
    r = finish_one(make_request("r1", 3, 10, eos_token_id=2, ignore_eos=False, min_tokens=2), [2, 5, 6, 2, 9])
    assert r.output_token_ids == [2, 5, 6, 2]
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_stop_token_ids_record_the_stop_reason() -> None:
    r = finish_one(make_request("r1", 3, 10, stop_token_ids=[42, 43]), [5, 43, 7])
    assert r.output_token_ids == [5, 43]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 43


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    r = finish_one(make_request("r1", 3, 10, eos_token_id=42, ignore_eos=True, stop_token_ids=[42]), [42])
    assert r.output_token_ids == [42]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 42


def test_min_tokens_delays_stop_token_ids() -> None:
    r = finish_one(make_request("r1", 3, 10, stop_token_ids=[42], min_tokens=2), [42, 42, 1])
    assert r.output_token_ids == [42, 42]
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == 42


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    r = finish_one(make_request("r1", 3, 2, eos_token_id=2, ignore_eos=False), [5, 2])
    assert r.output_token_ids == [5, 2]
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens() -> None:
    r = finish_one(make_request("r1", 3, 5), [])
    assert r.output_token_ids == [1100, 1101, 1102, 1103, 1104]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_max_model_len_caps_the_sequence() -> None:
    r = finish_one(make_request("r1", 5, 10), [], max_model_len=8)
    assert r.output_token_ids == [1100, 1101, 1102]
    assert r.num_tokens == 8
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.status.finish_reason == "length"


# ---------------------------------------------------------------------------------------------------------
# finish_requests (abort)
# ---------------------------------------------------------------------------------------------------------


def test_abort_waiting_and_running_requests_frees_every_block() -> None:
    sched = make_scheduler(max_num_seqs=1)
    r1, r2 = make_request("r1", 9, 5), make_request("r2", 4, 5)
    sched.add_request(r1)
    sched.add_request(r2)
    step(sched)
    assert sched.block_manager.get_block_table("r1") == [0, 1, 2]
    assert (r1.status, r2.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)

    done = sched.finish_requests(["r2", "missing", "r1"], RequestStatus.FINISHED_ABORTED)
    assert done == [r2, r1]
    assert (r1.status, r2.status) == (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ABORTED)
    assert r1.status.finish_reason == "abort"
    assert sched.block_manager.num_used_blocks == 0
    assert sched.block_manager.block_tables == {}
    assert sched.block_manager.ref_counts == [0] * 64
    assert (sched.num_running, sched.num_waiting) == (0, 0)
    assert not sched.has_unfinished_requests()
    # a second abort, and an abort of a finished request, are no-ops
    assert sched.finish_requests(["r1", "r2"], RequestStatus.FINISHED_ABORTED) == []
    out = sched.schedule()
    assert out.is_empty
    assert out.finished_request_ids == ["r2", "r1"]
    assert sched.schedule().finished_request_ids == []


def test_abort_of_a_preempted_request() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add_request(make_request("r1", 3, 4))
    sched.add_request(make_request("r2", 3, 4))
    step(sched)
    step(sched)
    assert step(sched)[0].preempted_request_ids == ["r2"]
    (r2,) = sched.finish_requests(["r2"], RequestStatus.FINISHED_ABORTED)
    assert r2.status == RequestStatus.FINISHED_ABORTED
    assert sched.num_waiting == 0
    out, _ = step(sched)
    assert plan(out) == [("r1", 5, 1, True)]
    assert out.finished_request_ids == ["r2"]
    assert sched.block_manager.num_used_blocks == 0


def test_abort_while_the_step_runs_drops_its_token() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r1", 4, 3))
    sched.add_request(make_request("r2", 4, 3))
    out = sched.schedule()
    runner_output = FakeRunner().run(out)
    assert runner_output.req_ids == ["r1", "r2"]
    sched.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    updates = sched.update_from_output(out, runner_output)
    assert [(u.request.request_id, u.new_token_ids) for u in updates] == [("r2", [1200])]
    r1 = out.scheduled[0].request
    assert r1.output_token_ids == []
    assert r1.num_computed_tokens == 0
    assert sched.block_manager.block_tables == {"r2": [1]}
    sched.block_manager.check_invariants()


# ---------------------------------------------------------------------------------------------------------
# randomized
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_random_adds_aborts_and_steps(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.randint(1, 4)
    num_blocks = rng.randint(12, 32) // block_size  # 12-32 tokens of KV cache
    chunked = seed % 3 != 2
    budget = rng.randint(4, 16) if chunked else 24
    max_model_len = 24
    capacity = num_blocks * block_size
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=rng.randint(2, 6),
                           max_num_batched_tokens=budget, max_model_len=max_model_len,
                           enable_chunked_prefill=chunked)
    bm = sched.block_manager
    runner = FakeRunner()
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    next_id = 0
    reported_finished: list[str] = []

    def plan_step() -> SchedulerOutput:
        """Schedule and check the plan, before update_from_output moves the requests on."""
        running_before = [r.request_id for r in sched.running]
        out = sched.schedule()
        bm.check_invariants()
        assert out.total_num_scheduled_tokens <= budget
        assert len(out.scheduled) <= sched.config.max_num_seqs
        assert sched.num_running <= sched.config.max_num_seqs
        for s in out.scheduled:
            assert s.num_scheduled_tokens >= 1
            assert len(s.block_table) == bm.num_blocks_for(s.num_computed_tokens + s.num_scheduled_tokens)
            assert s.sample == (s.num_computed_tokens + s.num_scheduled_tokens == s.request.num_tokens)
        used = {b for table in bm.block_tables.values() for b in table}
        assert bm.num_used_blocks == len(used)
        # victims are the most recently admitted, newest first, and go to the front of waiting in order
        k = len(out.preempted_request_ids)
        if k:
            assert out.preempted_request_ids == running_before[::-1][:k]
            assert [r.request_id for r in list(sched.waiting)[:k]] == running_before[-k:]
        kept = len(running_before) - k
        assert [r.request_id for r in sched.running][:kept] == running_before[:kept]
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
            assert r.request_id not in bm.block_tables
        reported_finished.extend(out.finished_request_ids)
        return out

    for _ in range(200):
        if rng.random() < 0.35:
            next_id += 1
            rid = f"r{next_id}"
            total = rng.randint(2, min(capacity, max_model_len))  # prompt + max_tokens must fit the cache
            prompt_len = rng.randint(1, total - 1)
            requests[rid] = make_request(rid, prompt_len, total - prompt_len)
            sched.add_request(requests[rid])
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            done = sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            assert [r.request_id for r in done] == [victim]
            aborted.add(victim)
        out = plan_step()
        runner_output = runner.run(out)
        if rng.random() < 0.05 and out.scheduled:
            victim = rng.choice(out.scheduled).request.request_id  # aborted while the step runs
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        sched.update_from_output(out, runner_output)
        bm.check_invariants()

    steps = 0
    while sched.has_unfinished_requests():
        out = plan_step()
        sched.update_from_output(out, runner.run(out))
        bm.check_invariants()
        steps += 1
        assert steps <= 2000, "the scheduler made no progress"
    plan_step()  # reports the last finished ids

    assert bm.num_used_blocks == 0
    assert bm.ref_counts == [0] * num_blocks
    assert bm.block_tables == {}
    assert next_id >= 40
    assert len(aborted) >= 1
    assert sched.num_preemptions >= 1  # the cache is small enough that every seed preempts
    assert sum(r.num_preemptions for r in requests.values()) == sched.num_preemptions
    assert sorted(reported_finished) == sorted(requests)  # each request reported finished exactly once
    for rid, request in requests.items():
        if rid in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            continue
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED, rid
        assert request.output_token_ids == [token_for(rid, i) for i in range(request.max_tokens)], rid
        assert request.all_token_ids == request.prompt_token_ids + request.output_token_ids
