"""Prefix caching in the torch-free core: block hashes, lookup, commit, LRU eviction, forks and CoW.

Block ids, ref counts and free-queue orders are asserted exactly. The randomized test at the end drives
the scheduler with a fake KV store that records which token each slot holds, and checks before every
step that each request's computed positions hold exactly its own tokens: the property that makes a cache
hit (or a fork, or a copy-on-write) indistinguishable from computing the tokens.
"""

from __future__ import annotations

import random

import pytest
from fake_kv import FakeKV  # noqa: E402  (tests/unit/fake_kv.py)

from kvserve.core.block_hash import BlockHash, extend_block_hashes, get_hash_fn, hash_block, root_hash
from kvserve.core.block_manager import BlockManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvserve.sampling_params import SamplingParams


def req(request_id: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, max_tokens,
                   cache_salt=salt)


def computed(bm: BlockManager, request: Request, num_tokens: int | None = None) -> list[int]:
    """Allocate and "compute" a request's whole prompt (or ``num_tokens``), commit it; its block table."""
    n = request.num_tokens if num_tokens is None else num_tokens
    hits = bm.get_computed_blocks(request)
    start = len(hits) * bm.block_size
    assert bm.allocate_slots(request.request_id, start, n - start, hits)
    request.num_computed_tokens = n
    bm.cache_blocks(request, n)
    return list(bm.get_block_table(request.request_id))


# ---------------------------------------------------------------------------------------------------------
# hashing
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_hash_is_deterministic_and_chained(algo: str) -> None:
    fn = get_hash_fn(algo)
    root = root_hash(fn, "model-a")
    assert root == root_hash(fn, "model-a")
    h0 = hash_block(fn, root, [1, 2, 3, 4])
    assert h0 == hash_block(fn, root, [1, 2, 3, 4])
    assert hash_block(fn, root, [1, 2, 4, 3]) != h0  # order matters
    other_parent = hash_block(fn, root, [9, 9, 9, 9])
    # same tokens, different parent -> different hash
    assert hash_block(fn, other_parent, [5, 6, 7, 8]) != hash_block(fn, h0, [5, 6, 7, 8])
    assert len(h0) == (32 if algo == "sha256" else 16)


def test_salt_and_fingerprint_change_every_block_hash() -> None:
    fn = get_hash_fn("sha256")
    tokens = list(range(12))

    def chain(fingerprint: str, salt: str | None) -> list[BlockHash]:
        out: list[BlockHash] = []
        extend_block_hashes(fn, out, root_hash(fn, fingerprint, salt), tokens, 4)
        return out

    base = chain("m", None)
    assert len(base) == 3
    for variant in (chain("m", "tenant-1"), chain("m", ""), chain("m2", None), chain("m", "tenant-2")):
        assert all(a != b for a, b in zip(base, variant, strict=True))
    assert chain("m", "tenant-1") != chain("m", "tenant-2")
    assert chain("m", "t") == chain("m", "t")
    # field boundaries are unambiguous: ("ab", "c") is not ("a", "bc")
    assert root_hash(fn, "ab", "c") != root_hash(fn, "a", "bc")


def test_unknown_hash_algo_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown prefix caching hash algorithm 'md5'"):
        get_hash_fn("md5")


def test_request_hashes_are_extended_incrementally() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    r = req("a", list(range(6)))
    assert len(bm.request_block_hashes(r)) == 1
    first = r.block_hashes[0]
    r.append_output_token(100)
    r.append_output_token(101)
    hashes = bm.request_block_hashes(r)
    assert len(hashes) == 2 and hashes[0] is first


# ---------------------------------------------------------------------------------------------------------
# lookup and commit
# ---------------------------------------------------------------------------------------------------------


def test_second_request_hits_full_blocks_only() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    a = req("a", list(range(10)))
    assert computed(bm, a) == [0, 1, 2]
    assert bm.num_cached_blocks == 2  # block 2 holds 2 tokens: not full, not cached
    b = req("b", list(range(10)))
    assert bm.get_computed_blocks(b) == [0, 1]
    assert bm.allocate_slots("b", 8, 2, [0, 1])
    assert bm.get_block_table("b") == [0, 1, 3]
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.check_invariants()


def test_last_token_is_always_computed() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    computed(bm, req("a", list(range(8))))  # two full blocks, both cached
    assert bm.num_cached_blocks == 2
    # an identical 8-token prompt may reuse only (8 - 1) // 4 = 1 block: its last token needs logits
    assert bm.get_computed_blocks(req("b", list(range(8)))) == [0]
    assert bm.get_computed_blocks(req("c", list(range(9)))) == [0, 1]
    assert bm.get_computed_blocks(req("d", list(range(7)))) == [0]
    assert bm.get_computed_blocks(req("e", list(range(3)))) == []


def test_hit_stops_at_the_first_different_block() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    computed(bm, req("a", list(range(13))))
    prompt = list(range(4)) + [99] + list(range(5, 13))  # differs in block 1
    assert bm.get_computed_blocks(req("b", prompt)) == [0]


def test_different_salt_never_hits() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    computed(bm, req("a", list(range(9)), salt="tenant-1"))
    assert bm.get_computed_blocks(req("b", list(range(9)), salt="tenant-2")) == []
    assert bm.get_computed_blocks(req("c", list(range(9)))) == []
    assert bm.get_computed_blocks(req("d", list(range(9)), salt="tenant-1")) == [0, 1]


def test_different_fingerprint_never_hits() -> None:
    a = BlockManager(8, 4, enable_caching=True, fingerprint="model-a")
    b = BlockManager(8, 4, enable_caching=True, fingerprint="model-b")
    computed(a, req("x", list(range(9))))
    assert a.get_computed_blocks(req("y", list(range(9)))) == [0, 1]
    # a request hashed under model-b finds nothing in model-a's cache (as a shared remote pool would)
    foreign = req("z", list(range(9)))
    b.request_block_hashes(foreign)
    assert not set(foreign.block_hashes) & set(a.cached_blocks)


def test_caching_off_never_hits_and_never_hashes() -> None:
    bm = BlockManager(8, 4, enable_caching=False)
    computed(bm, req("a", list(range(9))))
    assert bm.num_cached_blocks == 0
    assert bm.get_computed_blocks(req("b", list(range(9)))) == []


def test_generated_tokens_are_committed_too() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    a = req("a", list(range(6)))
    computed(bm, a)
    for t in (50, 51, 52):
        a.append_output_token(t)
    assert bm.allocate_slots("a", 6, 3)
    bm.cache_blocks(a, 9)
    assert bm.num_cached_blocks == 2
    follow_up = req("b", list(range(6)) + [50, 51, 52, 60, 61])  # the next turn of the conversation
    assert bm.get_computed_blocks(follow_up) == [0, 1]


def test_same_prompt_computed_twice_keeps_the_first_copy() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    a, b = req("a", list(range(5))), req("b", list(range(5)))
    assert bm.allocate_slots("a", 0, 5) and bm.allocate_slots("b", 0, 5)  # same step: neither can hit
    bm.cache_blocks(a, 5)
    bm.cache_blocks(b, 5)
    assert bm.cached_blocks == {a.block_hashes[0]: 0}
    assert bm.block_hashes[2] is None  # b's copy stays uncached
    bm.check_invariants()


# ---------------------------------------------------------------------------------------------------------
# eviction
# ---------------------------------------------------------------------------------------------------------


def test_freed_blocks_stay_cached_uncached_ones_are_reused_first() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    a = req("a", list(range(10)))
    computed(bm, a)  # [0, 1, 2]; 0 and 1 cached
    b = req("b", list(range(10)))
    computed(bm, b)  # hits [0, 1], gets 3
    assert bm.get_block_table("b") == [0, 1, 3]
    bm.free("b")
    assert bm.ref_counts[:4] == [1, 1, 1, 0]
    bm.free("a")
    # uncached blocks (2, 3) in front, then the cached chain tail first (1 before 0)
    assert list(bm.free_queue) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    # a later identical prompt still hits both blocks, taken back out of the free queue
    c = req("c", list(range(10)))
    assert computed(bm, c) == [0, 1, 2]
    assert list(bm.free_queue) == [3, 4, 5, 6, 7]
    bm.check_invariants()


def test_eviction_is_lru_and_tail_first() -> None:
    bm = BlockManager(4, 2, enable_caching=True)
    computed(bm, req("a", [1, 2, 3, 4]))  # blocks 0, 1
    computed(bm, req("b", [5, 6, 7, 8]))  # blocks 2, 3
    bm.free("a")
    bm.free("b")
    assert list(bm.free_queue) == [1, 0, 3, 2]
    # touch chain a again (a hit), then free it: it becomes the most recently used
    a2 = req("a2", [1, 2, 3, 4, 9])
    assert computed(bm, a2, 4) == [0, 1]
    bm.free("a2")
    assert list(bm.free_queue) == [3, 2, 1, 0]
    # new blocks evict b's chain (tail 3 first), then a's tail
    assert bm.allocate_slots("new", 0, 6)
    assert bm.get_block_table("new") == [3, 2, 1]
    assert bm.num_evictions == 3
    assert bm.get_computed_blocks(req("a3", [1, 2, 3, 4, 5])) == [0]
    assert bm.get_computed_blocks(req("b3", [5, 6, 7, 8, 9])) == []
    bm.check_invariants()


def test_a_block_in_use_is_never_evicted() -> None:
    bm = BlockManager(4, 2, enable_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    computed(bm, a)  # 0, 1 cached and in use, 2 partial
    assert bm.allocate_slots("filler", 0, 2)  # takes block 3
    assert not bm.allocate_slots("more", 0, 2)  # nothing free: refused, nothing evicted
    assert bm.num_cached_blocks == 2 and bm.num_evictions == 0
    assert bm.get_computed_blocks(req("b", [1, 2, 3, 4, 5])) == [0, 1]


def test_allocation_counts_free_hits_against_capacity() -> None:
    bm = BlockManager(3, 2, enable_caching=True)
    computed(bm, req("a", [1, 2, 3, 4, 5]))  # 0, 1 cached, 2 partial
    bm.free("a")  # all free: [2, 1, 0]
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8])  # hits 0, 1; needs 2 more blocks, only 1 (block 2) is left
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    free_before, refs_before = list(bm.free_queue), list(bm.ref_counts)
    assert not bm.allocate_slots("b", 4, 4, hits)
    assert list(bm.free_queue) == free_before and bm.ref_counts == refs_before
    assert bm.allocate_slots("b", 4, 2, hits)  # a smaller chunk fits
    assert bm.get_block_table("b") == [0, 1, 2]
    bm.check_invariants()


def test_reset_prefix_cache_drops_only_unused_blocks() -> None:
    bm = BlockManager(8, 2, enable_caching=True)
    computed(bm, req("a", [1, 2, 3, 4, 5]))
    computed(bm, req("b", [7, 8, 9]))
    bm.free("b")
    assert bm.num_cached_blocks == 3
    assert bm.reset_prefix_cache() == 1
    assert bm.num_cached_blocks == 2
    assert bm.get_computed_blocks(req("c", [7, 8, 9])) == []
    bm.check_invariants()


# ---------------------------------------------------------------------------------------------------------
# fork and copy-on-write with caching
# ---------------------------------------------------------------------------------------------------------


def test_fork_shares_cached_blocks_and_copies_the_partial_one() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    a = req("a", list(range(6)))
    computed(bm, a)  # [0, 1]: 0 cached, 1 partial
    bm.fork("a", "s1")
    bm.fork("a", "s2")
    assert bm.ref_counts[:2] == [3, 3]
    # each sample recomputes the last prompt token (position 5): copy-on-write of block 1
    assert bm.allocate_slots("s1", 5, 1)
    assert bm.allocate_slots("s2", 5, 1)
    assert bm.get_block_table("s1") == [0, 2] and bm.get_block_table("s2") == [0, 3]
    assert bm.take_pending_copies() == [(1, 2), (1, 3)]
    assert bm.ref_counts[:4] == [3, 1, 1, 1]
    bm.check_invariants()


def test_a_cached_block_is_copied_before_it_is_written_even_unshared() -> None:
    bm = BlockManager(8, 4, enable_caching=True)
    a = req("a", list(range(8)))
    computed(bm, a)  # [0, 1] both full and cached
    bm.fork("a", "s")
    bm.free("a")  # the sample alone holds block 1 (ref 1), which is cached
    assert bm.ref_counts[:2] == [1, 1]
    assert bm.allocate_slots("s", 7, 1)  # rewrite position 7 (last prompt token)
    assert bm.get_block_table("s") == [0, 2]
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.block_hashes[1] is not None and bm.ref_counts[1] == 0  # the cached original survives, free
    bm.check_invariants()


# ---------------------------------------------------------------------------------------------------------
# scheduler: admission with hits, counters (BC-16), forks
# ---------------------------------------------------------------------------------------------------------


def sched(num_blocks: int = 32, block_size: int = 4, budget: int = 64, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256),
                     BlockManager(num_blocks, block_size, enable_caching=True))


def run(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    ids = [x.request.request_id for x in out.scheduled if x.sample]
    s.update_from_output(out, ModelRunnerOutput(ids, [[token]] * len(ids)))
    s.block_manager.check_invariants()


def test_admission_starts_after_the_cached_prefix_and_counts_tokens() -> None:
    s = sched()
    a = req("a", list(range(10)), max_tokens=1)
    s.add_request(a)
    run(s, s.schedule())
    assert a.is_finished and a.num_cached_tokens == 0
    b = req("b", list(range(10)), max_tokens=1)
    s.add_request(b)
    out = s.schedule()
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(8, 2)]
    assert out.scheduled[0].block_table[:2] == [0, 1]
    assert b.num_cached_tokens == 8
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (20, 8)
    run(s, out)


def test_a_prompt_sharing_an_uncached_prefix_waits_a_step_for_the_cache() -> None:
    """Two prompts with a common 12-token prefix arrive together: the second is held back one step (its first
    block is being computed for the first), then admitted after the 3 cached blocks; an unrelated prompt, a
    prompt of another tenant and one that asks for prompt logprobs are not held back."""
    s = sched(block_size=4, budget=64)
    prefix = list(range(100, 112))
    a, b = req("a", prefix + [1, 2, 3], max_tokens=2), req("b", prefix + [4, 5, 6], max_tokens=2)
    c = req("c", list(range(200, 210)), max_tokens=2)
    d = req("d", prefix + [7, 8, 9], max_tokens=2, salt="tenant-2")
    e = Request("e", prefix + [1, 1, 1], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1), None, 2)
    for r in (a, b, c, d, e):
        s.add_request(r)
    out = s.schedule()
    assert [(x.request.request_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [
        ("a", 0, 15), ("c", 0, 10), ("d", 0, 15), ("e", 0, 15)]
    assert [r.request_id for r in s.waiting] == ["b"]
    run(s, out)
    out = s.schedule()
    assert [(x.request.request_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [
        ("a", 15, 1), ("c", 10, 1), ("d", 15, 1), ("e", 15, 1), ("b", 12, 3)]
    assert out.scheduled[-1].block_table[:3] == out.scheduled[0].block_table[:3]  # a's blocks, shared
    assert b.num_cached_tokens == 12 and (s.prefix_cache_queries, s.prefix_cache_hits) == (5 * 15 - 5, 12)
    run(s, out)


def test_a_prompt_waits_while_a_partial_prefill_computes_its_prefix() -> None:
    """The prefix is prefilled in chunks (budget 12): in step 2 the sharer would find 3 cached blocks and compute
    the 4th again beside the first prompt; it waits a step and finds all 4."""
    s = sched(block_size=4, budget=12)
    prefix = list(range(100, 116))
    a, b = req("a", prefix + [1, 2], max_tokens=1), req("b", prefix + [3, 4], max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    plans = []
    while s.has_unfinished_requests():
        out = s.schedule()
        plans.append([(x.request.request_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled])
        run(s, out)
    assert plans == [[("a", 0, 12)], [("a", 12, 6)], [("b", 16, 2)]]
    assert b.num_cached_tokens == 16


def test_recompute_after_preemption_is_not_a_new_hit() -> None:
    """BC-16 in the core: a preempted request finds its own blocks again, uncounted."""
    s = sched(num_blocks=5, block_size=2, budget=16)
    a, b = req("a", [1, 2, 3], max_tokens=6), req("b", [11, 12, 13], max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    steps, resumed_from_cache = 0, 0
    while s.has_unfinished_requests():
        out = s.schedule()
        resumed_from_cache += sum(1 for x in out.scheduled if x.request.num_preemptions and x.num_computed_tokens
                                  and x.num_scheduled_tokens > 1)
        run(s, out, token=3 + steps)
        steps += 1
        assert steps < 100
    assert s.num_preemptions > 0
    assert resumed_from_cache > 0  # the victim did find its own blocks again...
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (6, 0)  # ...and that is not a hit
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0


def test_samples_fork_the_leaders_prompt() -> None:
    s = sched(block_size=4)
    leader = req("r#0", list(range(6)), max_tokens=3)
    samples = [req(f"r#{i}", list(range(6)), max_tokens=3) for i in (1, 2)]
    s.add_request(leader)
    s.add_forks(leader, samples)
    out = s.schedule()
    assert [(x.request.request_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [
        ("r#0", 0, 6)]
    run(s, out)
    assert [r.request_id for r in s.running] == ["r#0", "r#1", "r#2"]
    assert all(r.num_computed_tokens == 5 and r.status == RequestStatus.RUNNING for r in samples)
    out = s.schedule()
    assert [(x.request.request_id, x.num_computed_tokens, x.num_scheduled_tokens, x.sample)
            for x in out.scheduled] == [("r#0", 6, 1, True), ("r#1", 5, 1, True), ("r#2", 5, 1, True)]
    # block 1 (tokens 4-5, partial) was shared by three: the first two writers got copies, the last one
    # is then its only user and writes it in place
    assert {x.request.request_id: x.block_table for x in out.scheduled} == {
        "r#0": [0, 2], "r#1": [0, 3], "r#2": [0, 1]}
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    run(s, out)
    assert s.block_manager.ref_counts[:5] == [3, 1, 1, 1, 0]
    while s.has_unfinished_requests():
        run(s, s.schedule())
    assert all(r.num_output_tokens == 3 for r in [leader, *samples])
    assert s.block_manager.num_used_blocks == 0


def test_samples_fork_even_when_the_leader_stops_at_its_first_token() -> None:
    s = sched()
    leader = req("r#0", list(range(6)), max_tokens=1)
    sample = req("r#1", list(range(6)), max_tokens=2)
    s.add_request(leader)
    s.add_forks(leader, [sample])
    run(s, s.schedule())
    assert leader.is_finished and sample.status == RequestStatus.RUNNING
    while s.has_unfinished_requests():
        run(s, s.schedule())
    assert sample.num_output_tokens == 2 and s.block_manager.num_used_blocks == 0


def test_aborting_a_leader_before_its_prompt_finishes_its_samples() -> None:
    s = sched(budget=4)
    leader = req("r#0", list(range(6)))
    samples = [req(f"r#{i}", list(range(6))) for i in (1, 2)]
    s.add_request(leader)
    s.add_forks(leader, samples)
    run(s, s.schedule())  # a 4-token chunk: no fork yet
    done = s.finish_requests(["r#2"], RequestStatus.FINISHED_ABORTED)  # one pending sample alone
    assert done == [samples[1]] and samples[1].status == RequestStatus.FINISHED_ABORTED
    done = s.finish_requests(["r#0"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"r#0", "r#1"}
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in [leader, *samples])
    assert not s.has_unfinished_requests() and s.block_manager.num_used_blocks == 0
    out = s.schedule()
    assert sorted(out.finished_request_ids) == ["r#0", "r#1", "r#2"]


# ---------------------------------------------------------------------------------------------------------
# randomized: a fake KV store proves every computed position holds the request's own token
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_reads_only_its_own_tokens(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4])
    num_blocks = rng.randint(24, 48) // block_size
    s = Scheduler(SchedulerConfig(rng.randint(2, 6), rng.randint(3, 16), 24),
                  BlockManager(num_blocks, block_size, enable_caching=True, hash_algo=rng.choice(["sha256", "xxhash"])))
    kv = FakeKV(num_blocks, 0, block_size)
    prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    live: list[str] = []
    n = 0
    for _ in range(300):
        if rng.random() < 0.3:
            n += 1
            prompt = rng.choice(prefixes) + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))]
            prompt = prompt[: num_blocks * block_size - 6] or [1]
            salt = rng.choice([None, None, "t1"])
            leader = req(f"r{n}#0", prompt, max_tokens=rng.randint(1, 5), salt=salt)
            s.add_request(leader)
            live.append(leader.request_id)
            if rng.random() < 0.3:
                forks = [req(f"r{n}#{i}", prompt, max_tokens=leader.max_tokens, salt=salt) for i in (1, 2)]
                s.add_forks(leader, forks)
                live += [f.request_id for f in forks]
        if rng.random() < 0.05 and live:
            s.finish_requests([rng.choice(live)], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        s.block_manager.check_invariants()
        s.update_from_output(out, kv.run(out, rng))
        s.block_manager.check_invariants()
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, kv.run(out, rng))
    assert s.block_manager.num_used_blocks == 0
    assert 0 <= s.prefix_cache_hits <= s.prefix_cache_queries
