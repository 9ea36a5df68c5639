"""Tests of kvserve.core.block_manager: exact block ids, ref counts, free-queue order, fork and copy-on-write.

The stateful property test drives the manager the way the scheduler does (a request writes its tokens in
order: ``allocate_slots(rid, num_written, n)`` then ``num_written += n``) and checks, after every step, the
invariants plus the copy-on-write rule "a shared block is never written".
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvserve.core.block_manager import BlockManager


def free_order(bm: BlockManager) -> list[int]:
    return list(bm.free_queue)


# ---------------------------------------------------------------------------------------------------------
# construction and allocation
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0), (-1, 1)])
def test_rejects_bad_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="num_blocks and block_size must be >= 1"):
        BlockManager(num_blocks, block_size)


def test_fresh_manager_allocates_ids_in_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.num_free_blocks == 8
    assert bm.num_used_blocks == 0
    assert bm.allocate_slots("a", 0, 12) is True
    assert bm.get_block_table("a") == [0, 1, 2]
    assert bm.ref_counts == [1, 1, 1, 0, 0, 0, 0, 0]
    assert free_order(bm) == [3, 4, 5, 6, 7]
    assert bm.num_used_blocks == 3
    assert bm.num_free_blocks == 5
    assert bm.allocate_slots("b", 0, 1) is True
    assert bm.get_block_table("b") == [3]
    assert bm.pending_copies == []
    bm.check_invariants()


def test_num_blocks_for_is_ceil() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert [bm.num_blocks_for(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_unknown_request_has_empty_table() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.get_block_table("nobody") == []


def test_growth_only_when_crossing_a_block_boundary() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots("a", 0, 4)
    assert bm.get_block_table("a") == [0]
    assert bm.num_used_blocks == 1
    # tokens 4.. start a new block
    assert bm.allocate_slots("a", 4, 1)
    assert bm.get_block_table("a") == [0, 1]
    assert bm.num_used_blocks == 2
    # tokens 5, 6, 7 fit in block 1
    for computed in (5, 6, 7):
        assert bm.allocate_slots("a", computed, 1)
        assert bm.get_block_table("a") == [0, 1]
        assert bm.num_used_blocks == 2
    # token 8 crosses again
    assert bm.allocate_slots("a", 8, 1)
    assert bm.get_block_table("a") == [0, 1, 2]
    assert bm.ref_counts[:4] == [1, 1, 1, 0]
    bm.check_invariants()


def test_four_tokens_one_block_five_tokens_two_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots("four", 0, 4)
    assert bm.allocate_slots("five", 0, 5)
    assert bm.get_block_table("four") == [0]
    assert bm.get_block_table("five") == [1, 2]


def test_allocate_zero_tokens_takes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate_slots("a", 0, 0) is True
    assert bm.get_block_table("a") == []
    assert bm.num_used_blocks == 0


def test_chunked_allocation_matches_whole_allocation() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots("a", 0, 3)
    assert bm.allocate_slots("a", 3, 3)
    assert bm.allocate_slots("a", 6, 4)
    assert bm.get_block_table("a") == [0, 1, 2]


def test_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate_slots("a", 0, 10)  # blocks 0, 1, 2
    refs = list(bm.ref_counts)
    order = free_order(bm)
    # 5 tokens need 2 blocks, only block 3 is free
    assert bm.allocate_slots("b", 0, 5) is False
    assert "b" not in bm.block_tables
    assert bm.get_block_table("b") == []
    # growing "a" to 17 tokens needs 2 more blocks
    assert bm.allocate_slots("a", 10, 7) is False
    assert bm.get_block_table("a") == [0, 1, 2]
    assert bm.ref_counts == refs
    assert free_order(bm) == order == [3]
    assert bm.pending_copies == []
    # exactly enough still works
    assert bm.allocate_slots("a", 10, 6)
    assert bm.get_block_table("a") == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_failure_with_existing_table_keeps_it() -> None:
    bm = BlockManager(num_blocks=1, block_size=2)
    assert bm.allocate_slots("a", 0, 2)
    assert bm.allocate_slots("a", 2, 1) is False
    assert bm.block_tables == {"a": [0]}


# ---------------------------------------------------------------------------------------------------------
# free
# ---------------------------------------------------------------------------------------------------------


def test_free_returns_blocks_tail_first_to_the_back() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate_slots("a", 0, 12)  # 0, 1, 2
    assert bm.allocate_slots("b", 0, 8)  # 3, 4
    assert free_order(bm) == [5]
    bm.free("a")
    assert free_order(bm) == [5, 2, 1, 0]
    assert bm.ref_counts == [0, 0, 0, 1, 1, 0]
    assert "a" not in bm.block_tables
    bm.free("b")
    assert free_order(bm) == [5, 2, 1, 0, 4, 3]
    # the next allocation takes from the front of the queue
    assert bm.allocate_slots("c", 0, 9)
    assert bm.get_block_table("c") == [5, 2, 1]
    assert free_order(bm) == [0, 4, 3]
    bm.check_invariants()


def test_free_unknown_request_is_a_no_op() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate_slots("a", 0, 4)
    bm.free("missing")
    assert bm.ref_counts == [1, 0, 0]
    assert free_order(bm) == [1, 2]


def test_usage_fraction() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    assert bm.usage == 0.0
    assert bm.allocate_slots("a", 0, 6)  # 3 blocks
    assert bm.usage == 3 / 8
    assert bm.allocate_slots("b", 0, 10)  # 5 blocks
    assert bm.usage == 1.0
    bm.free("a")
    assert bm.usage == 5 / 8
    bm.free("b")
    assert bm.usage == 0.0


# ---------------------------------------------------------------------------------------------------------
# fork and copy-on-write
# ---------------------------------------------------------------------------------------------------------


def test_fork_shares_every_block() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate_slots("p", 0, 10)  # 0, 1, 2
    bm.fork("p", "c")
    assert bm.get_block_table("c") == [0, 1, 2]
    assert bm.ref_counts == [2, 2, 2, 0, 0, 0]
    assert bm.num_used_blocks == 3
    # the child's table is its own list
    assert bm.block_tables["c"] is not bm.block_tables["p"]
    bm.check_invariants()
    bm.free("p")
    assert bm.ref_counts == [1, 1, 1, 0, 0, 0]
    assert bm.get_block_table("c") == [0, 1, 2]
    assert free_order(bm) == [3, 4, 5]
    assert bm.num_used_blocks == 3
    bm.free("c")
    assert bm.ref_counts == [0] * 6
    assert free_order(bm) == [3, 4, 5, 2, 1, 0]
    bm.check_invariants()


def test_fork_of_unknown_parent_gives_empty_table() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.fork("nobody", "c")
    assert bm.block_tables == {"c": []}
    assert bm.ref_counts == [0, 0]


def test_fork_onto_existing_child_is_refused() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate_slots("p", 0, 1)
    assert bm.allocate_slots("c", 0, 1)
    with pytest.raises(AssertionError, match="c already has blocks"):
        bm.fork("p", "c")


def test_copy_on_write_of_partly_filled_shared_block() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate_slots("p", 0, 6)  # 0: tokens 0-3, 1: tokens 4-5 (2 free slots)
    bm.fork("p", "c")
    assert bm.ref_counts[:3] == [2, 2, 0]
    assert bm.allocate_slots("c", 6, 1)  # token 6 lands in shared block 1
    assert bm.get_block_table("c") == [0, 2]
    assert bm.get_block_table("p") == [0, 1]
    assert bm.ref_counts == [2, 1, 1, 0, 0, 0]
    assert bm.pending_copies == [(1, 2)]
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.pending_copies == []
    assert bm.take_pending_copies() == []
    bm.check_invariants()
    # block 1 now belongs to the parent alone: it writes in place, no copy
    assert bm.allocate_slots("p", 6, 1)
    assert bm.get_block_table("p") == [0, 1]
    assert bm.pending_copies == []
    # the child's next token also goes into its private block 2
    assert bm.allocate_slots("c", 7, 1)
    assert bm.get_block_table("c") == [0, 2]
    assert bm.pending_copies == []
    bm.check_invariants()


def test_copy_on_write_and_growth_in_one_call() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate_slots("p", 0, 6)  # 0, 1
    bm.fork("p", "c")
    # tokens 6..9: the rest of shared block 1 (copied) plus a new block
    assert bm.allocate_slots("c", 6, 4)
    assert bm.get_block_table("c") == [0, 2, 3]
    assert bm.take_pending_copies() == [(1, 2)]
    assert bm.ref_counts == [2, 1, 1, 1, 0, 0]
    bm.check_invariants()


def test_copy_on_write_needs_a_free_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocate_slots("p", 0, 6)  # 0, 1: the cache is full
    bm.fork("p", "c")
    assert bm.allocate_slots("c", 6, 1) is False
    assert bm.get_block_table("c") == [0, 1]
    assert bm.ref_counts == [2, 2]
    assert bm.pending_copies == []
    bm.check_invariants()


def test_appending_after_a_full_shared_block_does_not_copy() -> None:
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate_slots("p", 0, 8)  # 0, 1 both full
    bm.fork("p", "c")
    assert bm.allocate_slots("c", 8, 1)  # token 8 goes into a new block
    assert bm.get_block_table("c") == [0, 1, 2]
    assert bm.get_block_table("p") == [0, 1]
    assert bm.ref_counts == [2, 2, 1, 0, 0, 0]
    assert bm.pending_copies == []
    bm.check_invariants()


def test_second_child_copies_again() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots("p", 0, 5)  # 0, 1 (1 token in block 1)
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    assert bm.ref_counts[:2] == [3, 3]
    assert bm.allocate_slots("c1", 5, 1)
    assert bm.allocate_slots("c2", 5, 1)
    assert bm.get_block_table("c1") == [0, 2]
    assert bm.get_block_table("c2") == [0, 3]
    assert bm.ref_counts[:4] == [3, 1, 1, 1]
    assert bm.take_pending_copies() == [(1, 2), (1, 3)]
    bm.check_invariants()


# ---------------------------------------------------------------------------------------------------------
# stateful property test
# ---------------------------------------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate_slots / fork / free / take_pending_copies against a small model of the requests."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.written: dict[str, int] = {}  # request id -> tokens written (what allocate_slots was told)
        self.copies: list[tuple[int, int]] = []  # pending copies we expect
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 5))
    def init(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)

    def _pick(self, data: st.DataObject) -> str | None:
        """An existing request id, or None when there is none."""
        return data.draw(st.sampled_from(sorted(self.written))) if self.written else None

    @rule(num_new=st.integers(0, 10))
    def allocate_new(self, num_new: int) -> None:
        self._allocate(self._new_id(), num_new)

    @rule(data=st.data(), num_new=st.integers(0, 5))
    def allocate_existing(self, data: st.DataObject, num_new: int) -> None:
        rid = self._pick(data)
        self._allocate(rid if rid is not None else self._new_id(), num_new)

    def _allocate(self, rid: str, num_new: int) -> None:
        bm = self.bm
        assert bm is not None
        computed = self.written.get(rid, 0)
        table_before = list(bm.get_block_table(rid))
        refs_before = list(bm.ref_counts)
        free_before = list(bm.free_queue)
        bs = bm.block_size
        need = bm.num_blocks_for(computed + num_new) - len(table_before)
        write_idx = computed // bs
        cow = num_new > 0 and write_idx < len(table_before) and refs_before[table_before[write_idx]] > 1
        fits = max(need, 0) + int(cow) <= len(free_before)

        ok = bm.allocate_slots(rid, computed, num_new)
        event(f"allocate: {'ok' if ok else 'refused'}{', copy-on-write' if cow else ''}")

        assert ok == fits
        if not ok:
            assert list(bm.get_block_table(rid)) == table_before
            assert bm.ref_counts == refs_before
            assert list(bm.free_queue) == free_before
            assert bm.pending_copies == self.copies
            return
        table = bm.get_block_table(rid)
        assert len(table) == bm.num_blocks_for(computed + num_new)
        # new blocks come from the front of the free queue, in order (the CoW copy first)
        taken = free_before[: max(need, 0) + int(cow)]
        if cow:
            src, dst = table_before[write_idx], taken[0]
            assert table[write_idx] == dst
            assert bm.ref_counts[src] == refs_before[src] - 1
            self.copies.append((src, dst))
            assert table[len(table_before):] == taken[1:]
        else:
            assert table[: len(table_before)] == table_before
            assert table[len(table_before):] == taken
        assert bm.pending_copies == self.copies
        # NOTE: the copy-on-write rule: every block this call lets the request write is its own
        if num_new > 0:
            for idx in range(write_idx, (computed + num_new - 1) // bs + 1):
                assert bm.ref_counts[table[idx]] == 1, f"shared block {table[idx]} would be written"
        self.written[rid] = computed + num_new

    @rule(data=st.data(), child_appends=st.integers(0, 3))
    def fork(self, data: st.DataObject, child_appends: int) -> None:
        bm = self.bm
        assert bm is not None
        parent = self._pick(data)
        if parent is None:
            return
        child = self._new_id()
        refs_before = list(bm.ref_counts)
        bm.fork(parent, child)
        assert bm.get_block_table(child) == bm.get_block_table(parent)
        for block_id in bm.get_block_table(parent):
            assert bm.ref_counts[block_id] == refs_before[block_id] + 1
        self.written[child] = self.written[parent]
        # parallel sampling: the child goes on decoding right away (copy-on-write of a partial last block)
        for _ in range(child_appends):
            self._allocate(child, 1)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        bm = self.bm
        assert bm is not None
        rid = self._pick(data)
        if rid is None:
            return
        table = list(bm.get_block_table(rid))
        free_before = list(bm.free_queue)
        refs_before = list(bm.ref_counts)
        bm.free(rid)
        del self.written[rid]
        assert rid not in bm.block_tables
        # blocks whose last reference went away join the back of the queue, tail first
        released = [b for b in reversed(table) if refs_before[b] == 1]
        assert list(bm.free_queue) == free_before + released

    @rule()
    def take_pending_copies(self) -> None:
        bm = self.bm
        assert bm is not None
        assert bm.take_pending_copies() == self.copies
        self.copies = []
        assert bm.pending_copies == []

    @invariant()
    def invariants_hold(self) -> None:
        bm = self.bm
        if bm is None:
            return
        bm.check_invariants()
        # a request whose table is empty may or may not have an entry (a failed allocation drops it)
        assert {r for r, t in bm.block_tables.items() if t} == {r for r, n in self.written.items() if n}
        assert set(bm.block_tables) <= set(self.written)
        for rid, written in self.written.items():
            assert len(bm.get_block_table(rid)) == bm.num_blocks_for(written)
        in_use = {b for table in bm.block_tables.values() for b in table}
        assert bm.num_used_blocks == len(in_use)
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks

    def teardown(self) -> None:
        bm = self.bm
        if bm is None:
            return
        for rid in sorted(self.written):
            bm.free(rid)
        bm.check_invariants()
        assert bm.num_used_blocks == 0
        assert bm.ref_counts == [0] * bm.num_blocks
        assert sorted(bm.free_queue) == list(range(bm.num_blocks))
        assert bm.block_tables == {}


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
