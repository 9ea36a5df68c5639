"""KVOffloadConfig validation (errors name the field) and build_tiers (cpu, disk, redis, in order)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from offload_helpers import META, key, payload

from kvserve.errors import InvalidRequestError
from kvserve.kv_offload.config import KVOffloadConfig, build_tiers
from kvserve.kv_offload.cpu import CPUTier
from kvserve.kv_offload.disk import DiskTier
from kvserve.kv_offload.redis_tier import RedisTier


def test_defaults_run_no_tier() -> None:
    config = KVOffloadConfig()
    assert not config.enabled
    assert (config.redis_prefix, config.redis_timeout_s, config.publish) == ("kvserve:", 0.2, True)
    assert build_tiers(config, META) == []


@pytest.mark.parametrize("kwargs, param", [
    ({"cpu_gib": -1}, "cpu_gib"),
    ({"cpu_gib": math.inf}, "cpu_gib"),
    ({"cpu_gib": math.nan}, "cpu_gib"),
    ({"disk_path": "kv-dir"}, "disk_gib"),
    ({"disk_path": "kv-dir", "disk_gib": -2}, "disk_gib"),
    ({"disk_gib": 1.0}, "disk_path"),
    ({"disk_path": "  ", "disk_gib": 1.0}, "disk_path"),
    ({"redis_url": "http://127.0.0.1:6379/0"}, "redis_url"),
    ({"redis_url": "redis://"}, "redis_url"),
    ({"redis_url": "redis://127.0.0.1:notaport/0"}, "redis_url"),
    ({"redis_prefix": ""}, "redis_prefix"),
    ({"redis_prefix": "a b:"}, "redis_prefix"),
    ({"redis_timeout_s": 0}, "redis_timeout_s"),
    ({"redis_timeout_s": 120}, "redis_timeout_s"),
    ({"redis_ttl_s": 0}, "redis_ttl_s"),
])
def test_invalid_fields_are_named(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        KVOffloadConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ")
    assert info.value.status_code == 400


def test_a_bad_redis_url_error_does_not_echo_the_password() -> None:
    with pytest.raises(InvalidRequestError) as info:
        KVOffloadConfig(redis_url="redis://:hunter2@127.0.0.1:99999/0")
    assert info.value.param == "redis_url" and "hunter2" not in str(info.value)


def test_build_tiers_in_lookup_order(tmp_path: Path) -> None:
    config = KVOffloadConfig(cpu_gib=0.5, disk_path=str(tmp_path / "kv"), disk_gib=2.0,
                             redis_url="redis://127.0.0.1:1/3", redis_prefix="prod:", redis_timeout_s=0.05,
                             redis_ttl_s=600, publish=False)
    assert config.enabled
    cpu, disk, red = build_tiers(config, META)
    assert isinstance(cpu, CPUTier) and cpu.capacity_bytes == 2**29 and cpu.name == "cpu"
    assert isinstance(disk, DiskTier) and disk.capacity_bytes == 2 * 2**30 and disk.path == tmp_path / "kv"
    assert disk.enabled and (tmp_path / "kv").is_dir()
    assert isinstance(red, RedisTier) and red.name == "redis"
    assert (red.prefix, red.timeout_s, red.ttl_ms, red.publish) == ("prod:", 0.05, 600_000, False)
    assert [t.name for t in build_tiers(KVOffloadConfig(redis_url="rediss://h:6380/0", cpu_gib=1), META)] == [
        "cpu", "redis"]
    # Nothing listens on port 1: a miss, not an error.
    assert red.load(key(0)) is None and red.stats.errors == {"connection": 1}


def test_an_unusable_disk_path_builds_a_tier_that_is_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "f").write_text("x")
    with caplog.at_level(logging.WARNING):
        (tier,) = build_tiers(KVOffloadConfig(disk_path=str(tmp_path / "f" / "kv"), disk_gib=1), META)
    assert isinstance(tier, DiskTier) and not tier.enabled
    assert not tier.store(key(0), payload(0))
    assert len(caplog.records) == 1


@pytest.mark.parametrize("kwargs, param", [
    ({"kv_offload_cpu_gib": -1.0}, "kv_offload_cpu_gib"),
    ({"kv_offload_disk_path": "kv-dir", "kv_offload_disk_gib": 0.0}, "kv_offload_disk_gib"),
    ({"kv_offload_redis_url": "http://127.0.0.1:1/0"}, "kv_offload_redis_url"),
    ({"kv_offload_redis_prefix": "a b"}, "kv_offload_redis_prefix"),
    ({"kv_offload_redis_timeout": 0.0}, "kv_offload_redis_timeout"),
])
def test_engine_flags_are_refused_naming_the_flag(kwargs: dict[str, object], param: str) -> None:
    """The engine's --kv-offload-* fields: a bad value is an InvalidRequestError (400) naming the flag's field."""
    from kvserve.config import EngineConfig

    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(**kwargs)  # type: ignore[arg-type]
    assert e.value.param == param and str(e.value).startswith(f"{param}: ")
