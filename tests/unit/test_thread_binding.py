"""--cpu-threads-bind: the CPU-list syntax, its validation, and the native pinning of an OpenMP team (each test
pins a throwaway thread's team, never the test process's main thread)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.cpu_features import parse_cpu_list
from kvserve.errors import InvalidRequestError
from kvserve.layers import cpu_kernels


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3") == [0, 1, 2, 3]
    assert parse_cpu_list("0,2,5-6") == [0, 2, 5, 6]
    assert parse_cpu_list("3, 1") == [3, 1]  # the given order: thread 0 on CPU 3
    for bad in ("", "a", "1-", "3-1", "0,0", "1-2,2", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_config_validates_the_flag() -> None:
    assert EngineConfig(cpu_threads_bind="0-1").cpu_threads_bind == "0-1"
    assert EngineConfig().cpu_threads_bind == "auto"
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(cpu_threads_bind="fast")
    assert e.value.param == "cpu_threads_bind" and "CPU list" in str(e.value)


def _in_thread(fn: Any) -> Any:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _allowed_by_task() -> dict[int, str]:
    """Each live thread's ``Cpus_allowed_list``; a thread that exits while the list is read is left out."""
    tasks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        tasks[int(tid)] = line.split(":", 1)[1].strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
    return tasks


@pytest.mark.skipif(not cpu_kernels.native_available(), reason="no C compiler: native kernels unbuilt")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not os.path.isdir("/proc/self/task"),
                    reason="needs Linux and at least 2 CPUs")
def test_pin_omp_threads_pins_each_team_thread() -> None:
    a, b = sorted(os.sched_getaffinity(0))[:2]
    main_mask = os.sched_getaffinity(0)
    before = _allowed_by_task()

    def pin() -> tuple[int, set[int], dict[int, str]]:
        torch.set_num_threads(2)
        team = cpu_kernels.pin_omp_threads([b, a])  # thread 0 (this one) on b, thread 1 on a
        torch.zeros(1 << 16).add_(1)  # the same team runs torch's parallel work afterwards
        # Read while this thread lives: libgomp frees a thread's pool (its worker exits) when the thread ends.
        new = {tid: cpus for tid, cpus in _allowed_by_task().items()
               if tid not in before and tid != threading.get_native_id()}
        return team, os.sched_getaffinity(0), new

    team, mine, new = _in_thread(pin)
    assert team == 2 and mine == {b}
    assert str(a) in new.values(), new  # the team's other thread (an OpenMP worker) is pinned to a
    assert os.sched_getaffinity(0) == main_mask  # the main thread keeps its CPUs
    with pytest.raises(ValueError):
        cpu_kernels.pin_omp_threads([])
