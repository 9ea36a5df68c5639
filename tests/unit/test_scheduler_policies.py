"""Scheduler policies of the chunked-prefill / preemption issue, with exact plans, block ids and counters.

Decodes before prefill chunks, the partial-prefill limit, the long-prefill cap, the minimum chunk, the
priority policy, swap preemption (exact swap pairs, resume before admission, host blocks reusable a step
later), the ``auto`` choice by the cost model, and a randomized test with a fake KV store that follows
swaps and copies and checks that every computed position holds the request's own token.
"""

from __future__ import annotations

import random

import pytest
from fake_kv import FakeKV  # noqa: E402  (tests/unit/fake_kv.py)

from kvserve.core.block_manager import BlockManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import PerfEstimates, Scheduler, SchedulerConfig
from kvserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvserve.sampling_params import SamplingParams


def req(request_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, arrival: float = 0.0,
        first: int = 10) -> Request:
    return Request(request_id, list(range(first, first + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, max_tokens,
                   arrival_time=arrival, priority=priority)


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_num_seqs: int = 8,
         caching: bool = False, **kwargs: object) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, budget, 256, **kwargs)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_caching=caching))


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in out.scheduled]


def run(s: Scheduler, out: SchedulerOutput) -> None:
    ids = [x.request.request_id for x in out.scheduled if x.sample]
    s.update_from_output(out, ModelRunnerOutput(ids, [[7]] * len(ids)))
    s.block_manager.check_invariants()


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    run(s, out)
    return out


# ---------------------------------------------------------------------------------------------------------
# budget, chunks, partial prefills
# ---------------------------------------------------------------------------------------------------------


def test_decodes_come_before_an_older_requests_prefill_chunk() -> None:
    s = make(budget=8)
    s.add_request(req("long", 20, arrival=0))
    s.add_request(req("short", 2, arrival=1))
    assert plan(step(s)) == [("long", 0, 8)]
    # long is still prefilling; short is admitted after it in the next steps and then decodes first
    assert plan(step(s)) == [("long", 8, 8)]
    assert plan(step(s)) == [("long", 16, 4), ("short", 0, 2)]
    assert plan(step(s)) == [("long", 20, 1), ("short", 2, 1)]
    s.add_request(req("next", 30, arrival=2))
    assert plan(step(s)) == [("long", 21, 1), ("short", 3, 1), ("next", 0, 6)]


def test_one_partial_prefill_at_a_time_by_default() -> None:
    s = make(budget=16)
    s.add_request(req("a", 40))
    s.add_request(req("b", 40))
    # a takes the whole budget; b may not start mid-prefill while a is
    assert plan(step(s)) == [("a", 0, 16)]
    assert plan(step(s)) == [("a", 16, 16)]
    assert plan(step(s)) == [("a", 32, 8), ("b", 0, 8)]
    assert s.make_stats().num_partial_prefills == 1


def test_two_partial_prefills_with_the_long_prompt_cap() -> None:
    s = make(budget=16, max_num_partial_prefills=2, long_prefill_token_threshold=6)
    s.add_request(req("a", 40))
    s.add_request(req("b", 40))
    s.add_request(req("c", 40))
    s.add_request(req("short", 3))
    out = step(s)
    # a and b each get at most 6 tokens; c would be a third partial prefill; short fits whole
    assert plan(out) == [("a", 0, 6), ("b", 0, 6), ("short", 0, 3)]
    assert s.make_stats().num_partial_prefills == 2
    assert plan(step(s)) == [("short", 3, 1), ("a", 6, 6), ("b", 6, 6)]


def test_default_long_prefill_cap_is_4_percent_of_max_model_len_with_partial_prefills() -> None:
    assert SchedulerConfig(8, 64, 1000, max_num_partial_prefills=2).long_prefill_cap == 40
    assert SchedulerConfig(8, 64, 1000).long_prefill_cap == 0
    assert SchedulerConfig(8, 64, 1000, long_prefill_token_threshold=100).long_prefill_cap == 100


def test_no_uselessly_small_chunk() -> None:
    s = make(budget=64)  # minimum chunk: 64 // 8 = 8 tokens
    assert s.config.min_prefill_chunk == 8
    s.add_request(req("a", 59))
    s.add_request(req("b", 100))
    # 5 tokens are left after a: b does not get a 5-token chunk
    assert plan(step(s)) == [("a", 0, 59)]
    assert plan(step(s)) == [("a", 59, 1), ("b", 0, 63)]
    s2 = make(budget=64)
    s2.add_request(req("a", 59))
    s2.add_request(req("c", 4))
    assert plan(step(s2)) == [("a", 0, 59), ("c", 0, 4)]  # a whole small prompt still fits


def test_min_chunk_scales_down_with_tiny_budgets() -> None:
    assert SchedulerConfig(8, 7, 256).min_prefill_chunk == 1
    assert SchedulerConfig(8, 2048, 256).min_prefill_chunk == 64


def test_burst_budget_only_while_the_backlog_fills_a_burst_step() -> None:
    s = make(budget=8, burst_batched_tokens=32)
    assert s.config.max_step_tokens == 32
    for name in "abcd":
        s.add_request(req(name, 12))
    assert s.prefill_backlog() == 48
    assert plan(step(s)) == [("a", 0, 12), ("b", 0, 12), ("c", 0, 8)]  # 48 waiting >= 32: a burst step
    assert s.prefill_backlog() == 4 + 12
    assert plan(step(s)) == [("a", 12, 1), ("b", 12, 1), ("c", 8, 4), ("d", 0, 2)]  # 16 < 32: back to 8
    assert plan(step(s)) == [("a", 13, 1), ("b", 13, 1), ("c", 12, 1), ("d", 2, 5)]
    for name in "efgh":  # a new burst arrives while four requests decode
        s.add_request(req(name, 8))
    assert s.prefill_backlog() == 5 + 32
    assert plan(step(s)) == [("a", 14, 1), ("b", 14, 1), ("c", 13, 1), ("d", 7, 5), ("e", 0, 8), ("f", 0, 8),
                             ("g", 0, 8)]  # 3 decodes + 29 prompt tokens = 32
    assert sum(x.num_scheduled_tokens for x in s.schedule().scheduled) <= 8  # h's 8 alone: not a burst


def test_burst_budget_bounds() -> None:
    cfg = SchedulerConfig(8, 8, 256, burst_batched_tokens=32)
    assert [cfg.step_budget(n) for n in (0, 31, 32, 1000)] == [8, 8, 32, 32]
    off = SchedulerConfig(8, 8, 256, burst_batched_tokens=4)  # not above the base budget: off
    assert (off.max_step_tokens, off.step_budget(1000)) == (8, 8)
    assert SchedulerConfig(8, 8, 256).step_budget(1000) == 8
    s = make(budget=8, burst_batched_tokens=0)
    s.add_request(req("a", 40))
    assert plan(step(s)) == [("a", 0, 8)]


# ---------------------------------------------------------------------------------------------------------
# priority
# ---------------------------------------------------------------------------------------------------------


def test_priority_decides_admission_order() -> None:
    s = make(budget=8, scheduling_policy="priority")
    s.add_request(req("low", 4, priority=5, arrival=0))
    s.add_request(req("high", 4, priority=-1, arrival=1))
    s.add_request(req("mid", 4, priority=0, arrival=2))
    s.add_request(req("mid-later", 4, priority=0, arrival=3))
    assert [r.request_id for r in s.waiting] == ["high", "mid", "mid-later", "low"]
    assert plan(step(s)) == [("high", 0, 4), ("mid", 0, 4)]


def test_fcfs_ignores_priority() -> None:
    s = make(budget=8)
    s.add_request(req("low", 4, priority=5, arrival=0))
    s.add_request(req("high", 4, priority=-1, arrival=1))
    assert plan(step(s)) == [("low", 0, 4), ("high", 0, 4)]


def test_priority_victim_is_the_lowest_priority_running_request() -> None:
    s = make(num_blocks=6, block_size=2, budget=32, scheduling_policy="priority")
    s.add_request(req("p0", 4, max_tokens=8, priority=0, arrival=0))
    s.add_request(req("p9", 4, max_tokens=8, priority=9, arrival=1))
    s.add_request(req("p1", 2, max_tokens=8, priority=1, arrival=2))
    assert plan(step(s)) == [("p0", 0, 4), ("p1", 0, 2), ("p9", 0, 4)]
    # 6 blocks in use; the next tokens need blocks: p9 goes first, although p1 is newer
    out = step(s)
    assert out.preempted_request_ids == ["p9"]
    assert [r.request_id for r in s.running] == ["p0", "p1"]


def test_waiting_high_priority_preempts_a_lower_one() -> None:
    s = make(num_blocks=4, block_size=4, budget=32, scheduling_policy="priority")
    s.add_request(req("low", 12, max_tokens=3, priority=5))
    step(s)  # low holds 3 blocks, then 4
    s.add_request(req("high", 8, max_tokens=2, priority=0, arrival=1))
    out = step(s)
    assert out.preempted_request_ids == ["low"]
    assert plan(out) == [("high", 0, 8)]  # low's decode was unscheduled, its budget refunded
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    assert s.block_manager.get_block_table("high") == [3, 2]


def test_max_num_seqs_is_made_room_for_a_higher_priority() -> None:
    s = make(budget=32, max_num_seqs=1, scheduling_policy="priority")
    s.add_request(req("low", 4, max_tokens=5, priority=5))
    step(s)
    s.add_request(req("high", 4, max_tokens=1, priority=0, arrival=1))
    out = step(s)
    assert out.preempted_request_ids == ["low"] and plan(out) == [("high", 0, 4)]
    s.add_request(req("equal", 4, max_tokens=1, priority=5, arrival=2))
    out = step(s)  # equal priority never preempts
    assert plan(out) == [("low", 0, 5)] and not out.preempted_request_ids


# ---------------------------------------------------------------------------------------------------------
# swap
# ---------------------------------------------------------------------------------------------------------


def test_swap_out_and_resume_before_new_requests() -> None:
    s = make(num_blocks=4, block_size=2, budget=32, preemption_mode="swap", num_host_blocks=8, block_bytes=100)
    s.add_request(req("a", 3, max_tokens=4, arrival=0))
    s.add_request(req("b", 3, max_tokens=4, arrival=1))
    out = step(s)
    assert plan(out) == [("a", 0, 3), ("b", 0, 3)]
    assert s.block_manager.block_tables == {"a": [0, 1], "b": [2, 3]}
    # a's 4th token fits block 1; b's too: no preemption yet
    out = step(s)
    assert plan(out) == [("a", 3, 1), ("b", 3, 1)]
    # both now need a third block: b (newest) is swapped out, its 2 computed blocks to host 0, 1
    out = step(s)
    assert out.preempted_request_ids == ["b"]
    assert out.blocks_to_swap_out == [(2, 0), (3, 1)]
    assert plan(out) == [("a", 4, 1)]
    assert s.requests["b"].status == RequestStatus.SWAPPED and s.host_tables == {"b": [0, 1]}
    assert s.num_preemptions_by_mode == {"recompute": 0, "swap": 1} and s.swapped_bytes == 200
    assert s.block_manager.block_tables == {"a": [0, 1, 3]}  # b's block 3 went to a in the same step
    s.add_request(req("c", 2, max_tokens=1, arrival=2))
    # while b is swapped out, c waits although a block is free; a finishes with this step
    out = step(s)
    assert plan(out) == [("a", 5, 1)] and out.blocks_to_swap_in == []
    assert [r.request_id for r in s.waiting] == ["c"]
    # b resumes first, into fresh blocks (host 0 -> device 2, host 1 -> device 3), then c is admitted
    out = step(s)
    assert plan(out) == [("b", 4, 1), ("c", 0, 2)]
    assert out.blocks_to_swap_in == [(0, 2), (1, 3)]
    assert s.block_manager.block_tables == {"b": [2, 3, 1]}  # c finished on its only token
    assert s.num_free_host_blocks == 6  # host 0, 1 are read by this step: free from the next one
    assert s.swapped_bytes == 400
    out = step(s)
    assert s.num_free_host_blocks == 8
    assert plan(out) == [("b", 5, 1)]


def test_swap_falls_back_to_recompute_without_host_room() -> None:
    s = make(num_blocks=4, block_size=2, budget=32, preemption_mode="swap", num_host_blocks=1, block_bytes=100)
    s.add_request(req("a", 3, max_tokens=4, arrival=0))
    s.add_request(req("b", 3, max_tokens=4, arrival=1))
    step(s)
    step(s)
    out = step(s)
    assert out.preempted_request_ids == ["b"] and out.blocks_to_swap_out == []
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.num_preemptions_by_mode["recompute"] == 1


@pytest.mark.parametrize(("prefill", "copy", "mode"), [
    (1000.0, 1e9, "swap"),          # swap 2*4*100/4 B... copy is fast: swap
    (1e9, 1.0, "recompute"),        # prefill is instant: recompute
    (0.0, 1e9, "recompute"),        # not measured yet: recompute
])
def test_auto_mode_uses_the_cost_model(prefill: float, copy: float, mode: str) -> None:
    s = Scheduler(SchedulerConfig(8, 32, 256, preemption_mode="auto", num_host_blocks=8, block_bytes=100),
                  BlockManager(4, 2), PerfEstimates(prefill, copy))
    s.add_request(req("a", 3, max_tokens=4, arrival=0))
    s.add_request(req("b", 3, max_tokens=4, arrival=1))
    for _ in range(3):
        out = step(s)
    assert out.preempted_request_ids == ["b"]
    assert s.num_preemptions_by_mode[mode] == 1


def test_swap_out_of_a_victim_with_a_pending_copy_reads_the_source() -> None:
    s = make(num_blocks=5, block_size=4, budget=32, preemption_mode="swap", num_host_blocks=8)
    leader = req("r#0", 6, max_tokens=6)
    sample = req("r#1", 6, max_tokens=6)
    s.add_request(leader)
    s.add_forks(leader, [sample])
    s.add_request(req("big", 8, max_tokens=6, arrival=1))
    step(s)  # r#0 [0, 1], big [2, 3]; r#1 forked from r#0 (shares 0 and 1)
    assert s.block_manager.ref_counts == [2, 2, 1, 1, 0]
    out = s.schedule()
    # r#0 copies shared block 1 into 4 (CoW); r#1 writes block 1 in place; big needs a block: the newest
    # running request (r#1) is preempted by swap... and so is the next one until big fits
    assert out.preempted_request_ids[0] == "r#1"
    for device_block, _ in out.blocks_to_swap_out:
        assert device_block not in [dst for _, dst in out.blocks_to_copy]
    run(s, out)


def test_aborts_free_device_and_host_blocks() -> None:
    s = make(num_blocks=4, block_size=2, budget=32, preemption_mode="swap", num_host_blocks=8)
    s.add_request(req("a", 3, max_tokens=4, arrival=0))
    s.add_request(req("b", 3, max_tokens=4, arrival=1))
    s.add_request(req("w", 3, max_tokens=4, arrival=2))
    for _ in range(3):
        step(s)
    assert s.requests["b"].status == RequestStatus.SWAPPED
    done = s.finish_requests(["b", "w", "a"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"a", "b", "w"}
    assert s.block_manager.num_used_blocks == 0 and not s.host_tables and not s.swapped
    s.schedule()
    assert s.num_free_host_blocks == 8


def test_failed_swap_becomes_recompute() -> None:
    s = make(num_blocks=4, block_size=2, budget=32, preemption_mode="swap", num_host_blocks=8)
    s.add_request(req("a", 3, max_tokens=4, arrival=0))
    s.add_request(req("b", 3, max_tokens=4, arrival=1))
    step(s)
    step(s)
    out = s.schedule()
    s.recompute_swapped(out.preempted_request_ids)
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert not s.host_tables


# ---------------------------------------------------------------------------------------------------------
# randomized: a fake KV store (device and host) proves every computed position holds its own token
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(16))
def test_random_preemptions_swaps_and_priorities_keep_kv_right(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(16, 40) // block_size
    num_host = rng.choice([0, 4, 64])
    mode = rng.choice(["recompute", "swap", "auto"])
    config = SchedulerConfig(rng.randint(2, 6), rng.randint(4, 24), 24, rng.random() < 0.8,
                             rng.randint(1, 3), rng.choice([0, 0, 5]), mode, rng.choice(["fcfs", "priority"]),
                             num_host, 64)
    if not config.enable_chunked_prefill:
        config = SchedulerConfig(config.max_num_seqs, 24, 24, False, 1, 0, mode, config.scheduling_policy,
                                 num_host, 64)
    s = Scheduler(config, BlockManager(num_blocks, block_size, enable_caching=rng.random() < 0.5),
                  PerfEstimates(rng.choice([0.0, 100.0]), rng.choice([1e3, 1e9])))
    kv = FakeKV(num_blocks, num_host, block_size)
    live: list[str] = []
    n = 0
    for i in range(300):
        if rng.random() < 0.3:
            n += 1
            total = rng.randint(2, min(num_blocks * block_size, 24))
            prompt = [rng.randint(0, 3) for _ in range(rng.randint(1, total - 1))]
            p = SamplingParams(max_tokens=total - len(prompt), ignore_eos=True)
            leader = Request(f"r{n}#0", prompt, p, None, p.max_tokens or 1, arrival_time=i,
                             priority=rng.randint(0, 3))
            s.add_request(leader)
            live.append(leader.request_id)
            if rng.random() < 0.2:
                forks = [Request(f"r{n}#{j}", prompt, p, None, leader.max_tokens, arrival_time=i,
                                 priority=leader.priority) for j in (1, 2)]
                s.add_forks(leader, forks)
                live += [f.request_id for f in forks]
        if rng.random() < 0.05 and live:
            s.finish_requests([rng.choice(live)], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        s.block_manager.check_invariants()
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        s.update_from_output(out, kv.run(out, rng))
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, kv.run(out, rng))
        steps += 1
        assert steps < 2000, "no progress"
    s.schedule()
    assert s.block_manager.num_used_blocks == 0
    assert s.num_free_host_blocks == num_host and not s.host_tables
