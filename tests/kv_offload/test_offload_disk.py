"""The disk tier: atomic files, LRU by access, a restart keeps the blocks, faults turn it off once."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
from offload_helpers import META, key, payload

from kvserve.kv_offload import disk as disk_module
from kvserve.kv_offload.disk import SUFFIX, DiskTier
from kvserve.kv_offload.format import decode_block, encode_block, make_header
from kvserve.kv_offload.tier import BlockMeta, KVTier

FILE = len(encode_block(make_header(key(0), META, payload(0)), payload(0)))  # bytes of one block's file


def names(path: Path) -> list[str]:
    return sorted(os.listdir(path))


def test_round_trip_one_file_per_block(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "kv", 10 * FILE, META)
    assert isinstance(tier, KVTier) and tier.enabled
    for i in range(3):
        assert tier.store(key(i), payload(i))
    assert names(tmp_path / "kv") == sorted(key(i).hex() + SUFFIX for i in range(3))
    for i in range(3):
        assert tier.load(key(i)) == payload(i)
        raw = (tmp_path / "kv" / (key(i).hex() + SUFFIX)).read_bytes()
        assert len(raw) == FILE and decode_block(raw, META, key(i)) == payload(i)
    assert tier.contains([key(0), key(1), key(2), key(3)]) == 3
    assert tier.store(key(1), payload(1))  # already there
    s = tier.stats
    assert (s.stores, s.already_present, s.loads, s.load_misses, s.queries, s.hits) == (3, 1, 3, 0, 4, 3)
    assert (s.bytes_stored, s.bytes_loaded, s.errors) == (3 * META.nbytes, 3 * META.nbytes, {})
    assert tier.used_bytes == 3 * FILE and tier.speed.samples == 3
    assert tier.load(key(9)) is None and tier.stats.load_misses == 1


def test_writes_are_atomic_under_a_concurrent_reader(tmp_path: Path) -> None:
    meta = BlockMeta("fp-big", "uint8", 16, (64, 1024))  # 64 KiB blocks: writes take a while
    tier = DiskTier(tmp_path, 1000 * (meta.nbytes + 1024), meta)
    stop = threading.Event()
    seen: list[int] = []
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            for name in os.listdir(tmp_path):
                if not name.endswith(SUFFIX):
                    continue  # a temp file: never under a block's name
                try:
                    raw = (tmp_path / name).read_bytes()
                except FileNotFoundError:
                    continue
                try:
                    decode_block(raw, meta, bytes.fromhex(name[:-len(SUFFIX)]))
                    seen.append(1)
                except Exception as e:  # a partial block under its final name
                    bad.append(f"{name}: {e}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(150):
            assert tier.store(key(i), payload(i, meta))
    finally:
        stop.set()
        t.join()
    assert bad == [] and len(seen) > 0
    assert len(names(tmp_path)) == 150 and all(n.endswith(SUFFIX) for n in names(tmp_path))  # no temp left


def test_lru_eviction_follows_access_order(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 3 * FILE, META)
    a, b, c, d, e = (key(i) for i in range(5))
    for i, k in enumerate((a, b, c)):
        tier.store(k, payload(i))
    assert tier.load(a) == payload(0)  # a touched: b is now the oldest
    assert tier.store(d, payload(3))
    assert tier.keys_lru() == [c, a, d]
    assert not (tmp_path / (b.hex() + SUFFIX)).exists()
    assert tier.used_bytes == 3 * FILE == sum(p.stat().st_size for p in tmp_path.iterdir())
    assert tier.load(c) == payload(2)
    assert tier.store(e, payload(4))  # a goes
    assert tier.keys_lru() == [d, c, e] and tier.stats.evictions == 2
    assert names(tmp_path) == sorted(k.hex() + SUFFIX for k in (c, d, e))
    assert not DiskTier(tmp_path / "tiny", FILE - 1, META).store(a, payload(0))


def test_a_restart_finds_the_blocks_in_their_lru_order(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * FILE, META)
    for i in range(4):
        tier.store(key(i), payload(i))
    tier.load(key(0))
    tier.load(key(2))
    tier.close()
    (tmp_path / "README").write_text("not a block")  # foreign files are left alone
    (tmp_path / ("zz" + SUFFIX)).write_bytes(b"x")  # not a hex name: ignored
    again = DiskTier(tmp_path, 10 * FILE, META)
    assert again.keys_lru() == [key(1), key(3), key(0), key(2)]
    assert again.used_bytes == 4 * FILE
    assert again.contains([key(0), key(1), key(2), key(3)]) == 4
    assert [again.load(key(i)) for i in range(4)] == [payload(i) for i in range(4)]
    # A smaller capacity at the next start evicts the least recently used first.
    smaller = DiskTier(tmp_path, 2 * FILE, META)
    assert smaller.keys_lru() == [key(2), key(3)] and smaller.stats.evictions == 2
    assert (tmp_path / "README").exists()


def test_stale_temp_files_of_a_crash_are_removed_at_start(tmp_path: Path) -> None:
    stale = tmp_path / ".tmp-abc.kvb.1.2"
    fresh = tmp_path / ".tmp-def.kvb.1.3"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (1, 1))
    tier = DiskTier(tmp_path, 10 * FILE, META)
    assert not stale.exists() and fresh.exists()  # a fresh one may be another writer's, in flight
    assert len(tier) == 0


def test_damaged_or_foreign_files_are_misses_and_removed(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10 * FILE, META)
    for i in range(3):
        tier.store(key(i), payload(i))
    p0 = tier.file_path(key(0))
    p0.write_bytes(p0.read_bytes()[:-10])  # torn
    p1 = tier.file_path(key(1))
    raw = bytearray(p1.read_bytes())
    raw[-1] ^= 0xFF
    p1.write_bytes(bytes(raw))
    other = BlockMeta("fp-model-b", META.dtype, META.block_size, META.shape)
    tier.file_path(key(2)).write_bytes(encode_block(make_header(key(2), other, payload(2)), payload(2)))
    assert [tier.load(key(i)) for i in range(3)] == [None, None, None]
    assert tier.stats.errors == {"header": 1, "checksum": 1, "fingerprint": 1}
    assert names(tmp_path) == [] and len(tier) == 0 and tier.used_bytes == 0
    assert tier.store(key(0), payload(0)) and tier.load(key(0)) == payload(0)  # written again
    tier.file_path(key(0)).unlink()  # removed behind the tier's back: a plain miss
    assert tier.load(key(0)) is None and len(tier) == 0 and tier.enabled


def assert_off(tier: DiskTier) -> None:
    assert not tier.enabled
    assert tier.contains([key(0)]) == 0
    assert tier.load(key(0)) is None
    assert not tier.store(key(5), payload(5))


def test_an_uncreatable_directory_turns_the_tier_off_with_one_warning(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("a file, not a directory")
    with caplog.at_level(logging.WARNING, logger="kvserve.kv_offload.disk"):
        tier = DiskTier(tmp_path / "file" / "kv", 10 * FILE, META)
        assert_off(tier)
        assert_off(tier)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "turned off" in warnings[0].getMessage()
    assert tier.off_reason is not None and "cannot use directory" in tier.off_reason
    assert tier.stats.errors == {"io": 1, "off": 4}


def test_a_directory_lost_mid_run_turns_the_tier_off_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kv"
    tier = DiskTier(path, 10 * FILE, META)
    assert tier.store(key(0), payload(0))
    shutil.rmtree(path)
    path.write_text("the directory is gone; writes fail with an OSError")
    with caplog.at_level(logging.WARNING, logger="kvserve.kv_offload.disk"):
        assert not tier.store(key(1), payload(1))
        assert_off(tier)
        assert not tier.store(key(2), payload(2))
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert tier.stats.errors == {"io": 1, "off": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["kv"]  # no temp file left anywhere


def test_disk_full_turns_the_tier_off(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, 10 * FILE, META)
    assert tier.store(key(0), payload(0))

    def full(src: object, dst: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module.os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv_offload.disk"):
        assert not tier.store(key(1), payload(1))
        assert not tier.store(key(2), payload(2))
    assert len(caplog.records) == 1 and "No space left" in caplog.records[0].getMessage()
    assert names(tmp_path) == [key(0).hex() + SUFFIX]  # the temp file was removed
    assert tier.load(key(0)) is None  # off: even the block on disk is a miss now
    assert tier.stats.errors == {"io": 1, "off": 2}
