"""The router's approximate view of each replica's prefix cache: which prompt blocks it sent where. Torch-free.

A request's prompt becomes a chain of block hashes, as the engine's prefix cache hashes it
(``kvserve/core/block_hash.py``), with the tenant's ``cache_salt`` in the root so that two tenants never
match each other's blocks:

    root    = H("kvserve-prefix-v1" | "router:<unit>" | cache_salt)
    hash[i] = H(hash[i-1] | unit ids of block i)

The units are the token ids of a prompt given as ids (``block_size`` per block, the replicas' block size), or
else the code points of the prompt's text (``block_chars`` per block; chat: the messages rendered as
``role\\ncontent\\n`` each, after the tools). Only full blocks count, so a prompt shorter than one block never
matches. The hash is xxh3-128: a collision only sends a request to a replica that may not hold its prefix
(the replicas hash with their own algorithm before they share any KV).

Each replica's index is an LRU set of hashes bounded by ``max_blocks``. A routed chain is touched tail first,
head last, so that the LRU end holds chain tails: eviction shortens a cached prefix from its end, as the
engine's free queue does, and never leaves a tail whose head is gone. The index is approximate by design:
the replica may have evicted blocks the router still lists, or hold blocks another router sent there.
"""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeGuard

from kvserve.core.block_hash import BlockHash, extend_block_hashes, get_hash_fn, root_hash

_HASH = get_hash_fn("xxhash")


def _is_token_ids(v: Any) -> TypeGuard[list[int]]:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts (others as JSON)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                parts.append(json.dumps(p, sort_keys=True, separators=(",", ":")))
        return "".join(parts)
    return "" if content is None else json.dumps(content, sort_keys=True, separators=(",", ":"))


def render_chat(messages: Any, tools: Any = None) -> str:
    """A chat request's prompt as the router sees it: the tools (JSON), then ``role\\ncontent\\n`` per message.

    Not the model's chat template (the router has no tokenizer), but a function of the same inputs in the same
    order, so two requests share a rendered prefix exactly when they share leading messages (and tools).
    """
    out = [json.dumps(tools, sort_keys=True, separators=(",", ":")) + "\n"] if tools else []
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict):
            out.append(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n")
    return "".join(out)


def prompt_units(body: dict[str, Any], chat: bool) -> tuple[str, Sequence[int]]:
    """(unit, ids) of a request's prompt: ``("token", ids)`` for a prompt of token ids, else ``("char", code
    points)`` of its text. A completions request with several prompts is keyed by its first."""
    if chat:
        text = render_chat(body.get("messages"), body.get("tools"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and (isinstance(prompt[0], str) or _is_token_ids(prompt[0])):
            prompt = prompt[0]
        if _is_token_ids(prompt):
            return "token", prompt
        text = prompt if isinstance(prompt, str) else ""
    return "char", array("I", text.encode("utf-32-le"))


def request_block_hashes(body: dict[str, Any], chat: bool, block_size: int, block_chars: int) -> list[BlockHash]:
    """The chained hashes of the full blocks of a request's prompt (see the module docstring)."""
    unit, ids = prompt_units(body, chat)
    salt = body.get("cache_salt")
    root = root_hash(_HASH, f"router:{unit}", salt if isinstance(salt, str) else None)
    hashes: list[BlockHash] = []
    extend_block_hashes(_HASH, hashes, root, ids, block_size if unit == "token" else block_chars)
    return hashes


class PrefixIndex:
    """One replica's LRU set of block hashes (at most ``max_blocks``).

    >>> idx = PrefixIndex(max_blocks=3)
    >>> a, b, c, d = (BlockHash(bytes([i])) for i in range(4))
    >>> idx.insert([a, b, c]); idx.match([a, b, d])
    2
    >>> idx.insert([d]); idx.match([a, b, c])  # c (the old chain's tail) was least recently used
    2
    """

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks: must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()  # first: least recently used
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` the index holds (stops at the first it lacks)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[BlockHash]) -> None:
        """Record a chain sent to this replica: touched tail first (head most recent), then evict past the bound."""
        lru = self._lru
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.max_blocks:
            lru.popitem(last=False)
            self.evicted += 1

    def clear(self) -> None:
        """Forget everything (the replica died: its cache is gone)."""
        self._lru.clear()
