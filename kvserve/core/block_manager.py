"""BlockManager: the paged KV cache's bookkeeping (which block holds which request's tokens).

The physical K/V tensors live in the model runner; this class only hands out block ids. Layout of one
request's ``block_table`` with ``block_size = 4`` and 10 tokens::

    block_table = [7, 2, 9]     tokens 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 9 (2 free slots)
    slot(token t) = block_table[t // block_size] * block_size + t % block_size

Invariants (checked by ``check_invariants`` and the property tests):
  * a block is in the free queue iff its ref_count == 0;
  * an allocated block has ref_count == number of block tables that contain it;
  * a shared block (ref_count > 1) is never written: ``allocate_slots`` copies it first (copy-on-write).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NewType

BlockId = NewType("BlockId", int)


class BlockManager:
    """Allocates fixed-size KV blocks to requests, with ref counts, fork and copy-on-write.

    Args:
        num_blocks: number of physical blocks in the KV cache (>= 1).
        block_size: tokens per block (>= 1).

    The free queue is ordered: blocks are taken from its front and returned to its back, tail blocks of a
    request first (so that, once prefix caching keeps freed blocks reusable, eviction takes the least
    recently used chains from their tails).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[BlockId, None] = OrderedDict((BlockId(i), None) for i in range(num_blocks))
        self.block_tables: dict[str, list[BlockId]] = {}
        # (src, dst) copies the runner must perform before this step's forward (copy-on-write).
        self.pending_copies: list[tuple[BlockId, BlockId]] = []

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def get_block_table(self, request_id: str) -> list[BlockId]:
        return self.block_tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ---- mutation ------------------------------------------------------------------------------
    def _take(self) -> BlockId:
        block_id, _ = self.free_queue.popitem(last=False)
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: BlockId) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free_queue[block_id] = None

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` tokens written after ``num_computed_tokens`` cached ones.

        Grows the request's block table to ``ceil((num_computed_tokens + num_new_tokens) / block_size)``
        blocks and, if the block that the first new token lands in is shared, copies it first
        (copy-on-write; the copy is queued in ``pending_copies``).

        Returns:
            False, changing nothing, when there are not enough free blocks.
        """
        table = self.block_tables.setdefault(request_id, [])
        need = self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(table)
        write_idx = num_computed_tokens // self.block_size
        cow = num_new_tokens > 0 and write_idx < len(table) and self.ref_counts[table[write_idx]] > 1
        if max(need, 0) + int(cow) > len(self.free_queue):
            if not table:
                del self.block_tables[request_id]
            return False
        if cow:
            # NOTE: the shared block is never written; the writer gets a private copy (CoW).
            src = table[write_idx]
            dst = self._take()
            self._release(src)
            table[write_idx] = dst
            self.pending_copies.append((src, dst))
        for _ in range(need):
            table.append(self._take())
        return True

    def free(self, request_id: str) -> None:
        """Release every block of a request (tail first, so tails are reused/evicted first)."""
        for block_id in reversed(self.block_tables.pop(request_id, [])):
            self._release(block_id)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (ref counts + 1); for parallel sampling n > 1."""
        assert child_id not in self.block_tables, f"{child_id} already has blocks"
        table = list(self.block_tables.get(parent_id, []))
        for block_id in table:
            self.ref_counts[block_id] += 1
        self.block_tables[child_id] = table

    def take_pending_copies(self) -> list[tuple[BlockId, BlockId]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def check_invariants(self) -> None:
        """Assert the invariants listed in the module docstring (used by tests)."""
        counts = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                counts[block_id] += 1
        assert counts == self.ref_counts, "ref counts disagree with block tables"
        for i in range(self.num_blocks):
            assert (self.ref_counts[i] == 0) == (BlockId(i) in self.free_queue)
