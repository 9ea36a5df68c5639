"""BlockManager: the paged KV cache's bookkeeping (which block holds which request's tokens).

The physical K/V tensors live in the model runner; this class only hands out block ids. Layout of one
request's ``block_table`` with ``block_size = 4`` and 10 tokens::

    block_table = [7, 2, 9]     tokens 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 9 (2 free slots)
    slot(token t) = block_table[t // block_size] * block_size + t % block_size

Prefix caching (``enable_caching``): once a full block's K/V are computed, ``cache_blocks`` records its
chained hash (``block_hash.py``: all previous tokens, its tokens, model fingerprint, tenant salt). A freed
hashed block stays in the free queue with its contents and hash, so a later request with the same prefix
finds it (``get_computed_blocks``) and takes it back ("touch") instead of computing it; it is evicted
only when ``_take`` hands it out as a fresh block. The free queue is the LRU order: blocks are taken from
the front and freed to the back, a request's tail block first, so within a chain the tail is evicted
before its parents (a child is useless without its parent). Freed blocks that hold no cached prefix (no
hash) go to the front: they are reused before any cached block is evicted.

Invariants (checked by ``check_invariants`` and the property tests):
  * a block is in the free queue iff its ref_count == 0;
  * an allocated block has ref_count == number of block tables that contain it;
  * a shared block (ref_count > 1) or a cached block (it has a hash) is never written: ``allocate_slots``
    copies it first (copy-on-write);
  * ``cached_blocks`` maps each hash to exactly the block whose ``block_hashes`` entry is that hash.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NewType

from kvserve.core.block_hash import BlockHash, extend_block_hashes, get_hash_fn, root_hash
from kvserve.core.request import Request

BlockId = NewType("BlockId", int)


class BlockManager:
    """Allocates fixed-size KV blocks to requests, with ref counts, fork and copy-on-write.

    Args:
        num_blocks: number of physical blocks in the KV cache (>= 1).
        block_size: tokens per block (>= 1).
        enable_caching: keep computed full blocks reusable by hash (prefix caching).
        hash_algo: ``sha256`` | ``xxhash`` (see ``block_hash.get_hash_fn``).
        fingerprint: the model fingerprint mixed into every hash (weights, config, tokenizer, KV dtype):
            blocks of one model can never be served to another.

    The free queue is ordered: blocks are taken from its front and returned to its back, tail blocks of a
    request first, so eviction takes the least recently used chains from their tails.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` < 1, or an unknown ``hash_algo``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, hash_algo: str = "sha256",
                 fingerprint: str = "") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[BlockId, None] = OrderedDict((BlockId(i), None) for i in range(num_blocks))
        self.block_tables: dict[str, list[BlockId]] = {}
        # (src, dst) copies the runner must perform before this step's forward (copy-on-write).
        self.pending_copies: list[tuple[BlockId, BlockId]] = []
        self.enable_caching = enable_caching
        self.fingerprint = fingerprint
        self.hash_fn = get_hash_fn(hash_algo)
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.cached_blocks: dict[BlockHash, BlockId] = {}
        # Per request: how many leading blocks of its table are already committed to the cache.
        self._num_committed: dict[str, int] = {}
        self.num_evictions = 0
        # KV offload (kv_offload/): cached blocks evicted since the last ``take_offload`` (their contents are
        # still intact until this step's forward) and blocks committed since then (to publish).
        self.record_evictions = False
        self.record_commits = False
        self._evicted: list[tuple[BlockId, BlockHash]] = []
        self._committed: list[tuple[BlockId, BlockHash]] = []

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

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a committed prefix (in use or free-but-reusable)."""
        return len(self.cached_blocks)

    # ---- prefix caching ------------------------------------------------------------------------
    def request_block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of every full block of ``request.all_token_ids`` (computed once each)."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            root = root_hash(self.hash_fn, self.fingerprint, request.cache_salt)
            extend_block_hashes(self.hash_fn, request.block_hashes, root, request.all_token_ids, self.block_size)
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> list[BlockId]:
        """The longest run of cached blocks that starts the request's tokens (changes nothing).

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed, so that
        there are logits to sample from. Empty when caching is off, and for a request that asks for prompt
        logprobs (as vLLM): a cached block has no logits to score its tokens with, so the whole prompt is
        computed (its blocks are still committed to the cache for others).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        hashes = self.request_block_hashes(request)
        hits: list[BlockId] = []
        for block_hash in hashes[:(request.num_tokens - 1) // self.block_size]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_blocks(self, request: Request, num_computed_tokens: int, publish: bool = True) -> None:
        """Commit the request's blocks that became full and computed (``num_computed_tokens`` in tokens).

        ``publish`` False: not logged for the offload tiers (``record_commits``), e.g. blocks loaded from them.

        A block whose hash is already cached in another block (two equal prompts computed in the same
        step) stays uncached and is simply reused when freed.
        """
        table = self.block_tables.get(request.request_id)
        if not self.enable_caching or not table:
            return
        num_full = num_computed_tokens // self.block_size
        start = self._num_committed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.request_block_hashes(request)
        for i in range(start, num_full):
            block_id, block_hash = table[i], hashes[i]
            if self.block_hashes[block_id] is None and block_hash not in self.cached_blocks:
                self.block_hashes[block_id] = block_hash
                self.cached_blocks[block_hash] = block_id
                if self.record_commits and publish:
                    self._committed.append((block_id, block_hash))
        self._num_committed[request.request_id] = num_full

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request uses (vLLM's ``reset_prefix_cache``); returns how many."""
        dropped = 0
        for block_id in self.free_queue:
            block_hash = self.block_hashes[block_id]
            if block_hash is not None:
                del self.cached_blocks[block_hash]
                self.block_hashes[block_id] = None
                dropped += 1
        return dropped

    # ---- mutation ------------------------------------------------------------------------------
    def _take(self) -> BlockId:
        block_id, _ = self.free_queue.popitem(last=False)
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:  # evict: its contents are about to be overwritten
            del self.cached_blocks[block_hash]
            self.block_hashes[block_id] = None
            self.num_evictions += 1
            if self.record_evictions:
                self._evicted.append((block_id, block_hash))
        return block_id

    def _touch(self, block_id: BlockId) -> None:
        """Take a cached block for one more user (from the free queue when nobody used it)."""
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def _release(self, block_id: BlockId) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
        if self.ref_counts[block_id] == 0:
            self.free_queue[block_id] = None
            if self.enable_caching and self.block_hashes[block_id] is None:
                self.free_queue.move_to_end(block_id, last=False)  # holds nothing reusable: reuse it first

    def allocate_slots(self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
                       computed_blocks: list[BlockId] | None = None) -> bool:
        """Make room for ``num_new_tokens`` tokens written after ``num_computed_tokens`` cached ones.

        Grows the request's block table to ``ceil((num_computed_tokens + num_new_tokens) / block_size)``
        blocks and, if the block that the first new token lands in is shared or cached, copies it first
        (copy-on-write; the copy is queued in ``pending_copies``).

        Args:
            computed_blocks: prefix-cache hits from ``get_computed_blocks`` for a request that has no
                blocks yet; they start its block table (``num_computed_tokens`` must equal
                ``len(computed_blocks) * block_size``).

        Returns:
            False, changing nothing, when there are not enough free blocks.
        """
        hits = computed_blocks or []
        table = self.block_tables.setdefault(request_id, [])
        assert not hits or (not table and num_computed_tokens == len(hits) * self.block_size)
        need = self.num_blocks_for(num_computed_tokens + num_new_tokens) - len(table) - len(hits)
        write_idx = num_computed_tokens // self.block_size
        cow = num_new_tokens > 0 and write_idx < len(table) and (
            self.ref_counts[table[write_idx]] > 1 or self.block_hashes[table[write_idx]] is not None)
        num_free_hits = sum(1 for b in hits if self.ref_counts[b] == 0)
        if max(need, 0) + int(cow) > len(self.free_queue) - num_free_hits:
            if not table:
                del self.block_tables[request_id]
            return False
        if hits:
            for block_id in hits:
                self._touch(block_id)
            table.extend(hits)
            self._num_committed[request_id] = len(hits)
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
        self._num_committed.pop(request_id, None)
        for block_id in reversed(self.block_tables.pop(request_id, [])):
            self._release(block_id)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks of a request past the first ``ceil(num_tokens / block_size)`` (tail first).

        Speculative decoding calls it after verification: the slots of rejected draft tokens lie past the
        verified tokens. Those blocks were never committed to the prefix cache (only blocks full of
        computed, verified tokens are), so they return to the front of the free queue.
        """
        table = self.block_tables.get(request_id)
        if not table:
            return
        keep = self.num_blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())
        if self._num_committed.get(request_id, 0) > keep:
            self._num_committed[request_id] = keep

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks, shared (ref counts + 1); for parallel sampling n > 1."""
        assert child_id not in self.block_tables, f"{child_id} already has blocks"
        table = list(self.block_tables.get(parent_id, []))
        for block_id in table:
            self.ref_counts[block_id] += 1
        self.block_tables[child_id] = table
        if parent_id in self._num_committed:
            self._num_committed[child_id] = self._num_committed[parent_id]

    def take_offload(self) -> tuple[list[tuple[BlockId, BlockHash]], list[tuple[BlockId, BlockHash]]]:
        """Blocks evicted and blocks committed since the last call, ``(block, hash)`` each (KV offload).

        A committed block evicted since is left out of the second list (its contents are in the first, and
        its block may be rewritten this step): a published block always holds the KV its hash names.
        """
        evicted = self._evicted
        committed = [(b, h) for b, h in self._committed if self.block_hashes[b] == h]
        self._evicted, self._committed = [], []
        return evicted, committed

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
        assert len(self.cached_blocks) == sum(h is not None for h in self.block_hashes)
        for block_hash, block_id in self.cached_blocks.items():
            assert self.block_hashes[block_id] == block_hash, f"block {block_id} lost its hash"
