"""The router's prefix index and prompt hashing (kvserve/distributed/prefix_index.py), and its routing rules
(router_pool.py) on replicas whose load is set by hand. No server, no model."""

from __future__ import annotations

import pytest

from kvserve.core.block_hash import BlockHash
from kvserve.disagg.proxy_backends import parse_load
from kvserve.distributed.prefix_index import PrefixIndex, render_chat, request_block_hashes
from kvserve.distributed.router import first_token_seen
from kvserve.distributed.router_pool import ReplicaPool, RouterMetrics, RoutingConfig

TEXT = "".join(chr(ord("a") + i % 26) for i in range(200))  # 3 full blocks of 64 characters


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(4, "little"))


def test_index_match_stops_at_the_first_missing_block() -> None:
    idx = PrefixIndex(max_blocks=10)
    idx.insert([h(0), h(1), h(2)])
    assert idx.match([h(0), h(1), h(2), h(3)]) == 3
    assert idx.match([h(0), h(9), h(2)]) == 1
    assert idx.match([h(9), h(1)]) == 0
    assert idx.match([]) == 0


def test_index_lru_bound_evicts_chain_tails_first() -> None:
    idx = PrefixIndex(max_blocks=4)
    idx.insert([h(0), h(1), h(2)])  # LRU order (oldest first): 2, 1, 0
    idx.insert([h(10), h(11)])  # 2 then 1 go: the old chain keeps its head
    assert len(idx) == 4 and idx.evicted == 1
    assert idx.match([h(0), h(1), h(2)]) == 2
    assert idx.match([h(10), h(11)]) == 2
    idx.insert([h(0)])  # touched: the head is the most recent again
    idx.insert([h(20), h(21), h(22)])
    assert len(idx) == 4 and idx.evicted == 4
    assert idx.match([h(0)]) == 1 and idx.match([h(10)]) == 0
    idx.clear()
    assert len(idx) == 0 and idx.match([h(0)]) == 0
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(0)


def test_block_hashes_of_text_ids_and_chat() -> None:
    hashes = request_block_hashes({"prompt": TEXT}, False, 16, 64)
    assert len(hashes) == 3  # 200 // 64; the partial last block never counts
    assert request_block_hashes({"prompt": TEXT[:63]}, False, 16, 64) == []
    longer = request_block_hashes({"prompt": TEXT[:130] + "something else entirely"}, False, 16, 64)
    assert longer[:2] == hashes[:2] and len(longer) == 2
    assert request_block_hashes({"prompt": [TEXT, "x"]}, False, 16, 64) == hashes  # keyed by the first prompt
    ids = list(range(40))
    by_ids = request_block_hashes({"prompt": ids}, False, 16, 64)
    assert len(by_ids) == 2 and request_block_hashes({"prompt": [ids]}, False, 16, 64) == by_ids
    # the same code points as text are another chain (another unit)
    assert request_block_hashes({"prompt": "".join(map(chr, ids))}, False, 16, 16) != by_ids
    # the salt is in the root: every block differs
    salted = request_block_hashes({"prompt": TEXT, "cache_salt": "tenant-a"}, False, 16, 64)
    other = request_block_hashes({"prompt": TEXT, "cache_salt": "tenant-b"}, False, 16, 64)
    assert len(salted) == 3 and not set(salted) & set(hashes) and not set(salted) & set(other)
    # chat: requests sharing the leading messages share the rendered prefix
    system = {"role": "system", "content": TEXT}
    a = request_block_hashes({"messages": [system, {"role": "user", "content": "one"}]}, True, 16, 64)
    b = request_block_hashes({"messages": [system, {"role": "user", "content": "two, longer"}]}, True, 16, 64)
    assert len(a) == 3 and a[:3] == b[:3]
    assert render_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) == "user\nhi\n"
    assert render_chat([{"role": "user", "content": "hi"}], tools=[{"a": 1}]) == '[{"a":1}]\nuser\nhi\n'
    assert request_block_hashes({"prompt": 7}, False, 16, 64) == []  # unreadable: no affinity


def test_first_token_seen() -> None:
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    token = b'data: {"choices": [{"index": 0, "delta": {"content": " hi"}, "finish_reason": null}]}\n\n'
    assert not first_token_seen(role)
    assert not first_token_seen(role + token[:-2])  # an event counts once complete
    assert first_token_seen(role + token)
    assert first_token_seen(b'data: {"choices": [{"index": 0, "text": " x"}]}\n\n')
    assert not first_token_seen(b'data: {"choices": [{"index": 0, "text": ""}]}\n\n')
    assert first_token_seen(b'data: {"error": {"message": "boom"}}\n\n')
    assert first_token_seen(b"data: [DONE]\n\n")


def test_parse_load_reads_kv_usage() -> None:
    text = ('kvserve:num_requests_running{model_name="m"} 3\nkvserve:num_requests_waiting{model_name="m"} 2\n'
            'kvserve:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert parse_load(text) == (3.0, 2.0, 0.25)


def _pool(policy: str = "cache-aware", **kw: float) -> ReplicaPool:
    return ReplicaPool(["http://a:1", "http://b:1"], RoutingConfig(policy=policy, **kw), RouterMetrics())


def test_cache_aware_follows_the_prefix_then_balances() -> None:
    pool = _pool()
    a, b = pool.backends
    p1 = request_block_hashes({"prompt": TEXT}, False, 16, 64)
    p2 = request_block_hashes({"prompt": TEXT[::-1]}, False, 16, 64)
    first = pool.pick(p1)
    assert first is not None and first.reason == "least-loaded"
    again = pool.pick(p1)
    assert again is not None and again.replica is first.replica and again.reason == "prefix"
    assert again.matched_blocks == 3
    other = pool.pick(p2)  # a new prefix goes to the replica with the smaller index
    assert other is not None and other.replica is not first.replica
    # the owner is overloaded: max - min > 8 and max > 1.5 min -> the least loaded
    first.replica.running = 20
    moved = pool.pick(p1)
    assert moved is not None and moved.replica is not first.replica and moved.reason == "balance"
    first.replica.running, other.replica.running = 0, 0
    # a replica whose KV cache is nearly full never wins on affinity
    first.replica.kv_usage = 0.95
    assert (r := pool.pick(request_block_hashes({"prompt": TEXT[:100]}, False, 16, 64))) is not None
    assert r.reason != "prefix" or r.replica is not first.replica
    # an unhealthy replica forgets its index and is skipped
    pool.set_health(a, False, "test")
    assert pool.indexes[a.url].match(p1) == 0
    assert all((r := pool.pick(p1)) is not None and r.replica is b for _ in range(3))
    assert pool.pick(p1, exclude=[b]) is None


def test_round_robin_and_least_loaded() -> None:
    pool = _pool("round-robin")
    p1 = request_block_hashes({"prompt": TEXT}, False, 16, 64)
    got = [r.replica.url for _ in range(4) if (r := pool.pick(p1)) is not None]
    assert got in (["http://a:1", "http://b:1"] * 2, ["http://b:1", "http://a:1"] * 2)
    pool = _pool("least-loaded")
    pool.backends[0].waiting = 3
    assert all((r := pool.pick(p1)) is not None and r.replica.url == "http://b:1" for _ in range(3))


def test_routing_config_errors_name_the_field() -> None:
    for kw, name in (({"policy": "random"}, "policy"), ({"cache_threshold": 1.5}, "cache_threshold"),
                     ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
                     ({"max_index_blocks": 0}, "max_index_blocks")):
        with pytest.raises(ValueError, match=name):
            RoutingConfig(**kw)  # type: ignore[arg-type]
