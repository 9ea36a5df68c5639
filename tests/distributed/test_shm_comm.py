"""The tensor-parallel ranks' shared-memory collectives (``kvserve/distributed/shm_comm.py``) against gloo, their
reference: two real processes in a gloo group, each op done both ways on the same tensors.

* all-reduce: float32 bitwise equal to gloo's sum on every rank, bfloat16 equal to ``bf16(a + b)``, every rank
  the same bits; odd shapes; 300 back-to-back operations of alternating sizes (the two halves of the segment
  reused by parity) each equal to its expected sum;
* gather to rank 0: equal to gloo's gather; None elsewhere;
* what takes gloo: a tensor over a slot, a non-contiguous one (``fits``), ``KVSERVE_TP_COMM=gloo``;
* a peer that dies before an operation: the survivor's operation raises RuntimeError naming the rank within
  seconds, not the 300 s timeout; a peer that never arrives: the timeout;
* the segment's file is gone once both ranks mapped it.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvserve.layers import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.native_available(), reason="no C compiler: gloo only")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join(rank: int, port: int, timeout_s: float = 60.0) -> tuple[Any, dist.Store]:
    from kvserve.distributed.shm_comm import ShmComm

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    return ShmComm.connect(rank, 2, store, timeout_s), store


def _tensors(rank: int, seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 2 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _worker(rank: int, port: int, scenario: str, out: Any) -> None:
    torch.set_num_threads(1)
    try:
        comm, _ = _join(rank, port, timeout_s=3.0 if scenario == "late" else 60.0)
        if scenario == "gloo-forced":
            out.put((rank, comm is None))
            return
        assert comm is not None
        if scenario == "equal":
            results = []
            for i, (shape, dtype) in enumerate([((1, 896), torch.float32), ((3, 577), torch.float32),
                                                ((17, 1536), torch.bfloat16), ((5,), torch.float32),
                                                ((2, 4, 33), torch.bfloat16)]):
                a = _tensors(rank, i, shape, dtype)
                ref = a.clone()
                dist.all_reduce(ref)
                got = comm.all_reduce(a.clone())
                both = (_tensors(0, i, shape, dtype).float() + _tensors(1, i, shape, dtype).float()).to(dtype)
                results.append(("reduce", i, torch.equal(got, both), torch.equal(got, ref) if dtype == torch.float32
                                else True, got.view(torch.uint8).sum().item()))
                g = comm.gather_to_driver(a)
                parts = [torch.empty_like(a) for _ in range(2)] if rank == 0 else None
                dist.gather(a, parts, dst=0)
                if rank:
                    same = g is None
                else:
                    same = g is not None and parts is not None and torch.equal(g, torch.cat(parts, dim=-1))
                results.append(("gather", i, same, True, 0))
            for j in range(300):  # alternating sizes: the halves of the segment reused by parity
                n = 7 + (j % 5) * 1000
                a = torch.full((n,), float(j * 2 + rank + 1))
                comm.all_reduce(a)
                results.append(("seq", j, bool((a == float(4 * j + 3)).all()), True, 0))
            big = torch.zeros(5 << 20)  # 20 MiB > a slot
            results.append(("fits", 0, not comm.fits(big) and not comm.fits(torch.zeros(8, 4).t())
                            and comm.fits(torch.zeros(8, 4)), True, 0))
            out.put((rank, results))
        elif rank == 1:  # "dies": gone before the operation; "late": alive but never arrives within rank 0's 3 s
            if scenario == "dies":
                os._exit(0)
            time.sleep(8)
        else:
            t = time.monotonic()
            try:
                comm.all_reduce(torch.ones(16))
                out.put((rank, "no error"))
            except RuntimeError as e:
                out.put((rank, f"{time.monotonic() - t:.1f}|{e}"))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, f"error {type(e).__name__}: {e}"))
        raise


def _run(scenario: str, env: dict[str, str] | None = None) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=_worker, args=(r, port, scenario, out)) for r in range(2)]
        for p in procs:
            p.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    expected = 1 if scenario in ("dies", "late") else 2
    results = dict(out.get(timeout=120) for _ in range(expected))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results


def test_shm_collectives_equal_gloo_and_reuse_the_segment() -> None:
    before = set(Path("/dev/shm").glob("kvserve-tp-*")) if Path("/dev/shm").exists() else set()
    res = _run("equal")
    assert set(res) == {0, 1}
    for rank in (0, 1):
        rows = res[rank]
        assert not isinstance(rows, str), rows
        assert len(rows) == 5 * 2 + 300 + 1
        bad = [r for r in rows if not (r[2] and r[3])]
        assert not bad, (rank, bad[:5])
    # every rank holds the same sums, bit for bit
    assert [r[4] for r in res[0] if r[0] == "reduce"] == [r[4] for r in res[1] if r[0] == "reduce"]
    after = set(Path("/dev/shm").glob("kvserve-tp-*")) if Path("/dev/shm").exists() else set()
    assert after <= before  # unlinked once mapped


def test_gloo_forced_by_env() -> None:
    assert _run("gloo-forced", {"KVSERVE_TP_COMM": "gloo"}) == {0: True, 1: True}


def test_a_dead_peer_fails_the_operation_at_once() -> None:
    res = _run("dies")
    seconds, message = res[0].split("|", 1)
    assert "rank 1" in message and "died" in message, message
    assert float(seconds) < 10.0


def test_a_peer_that_never_arrives_times_out() -> None:
    res = _run("late")
    seconds, message = res[0].split("|", 1)
    assert "timed out after 3 s" in message, message
    assert 2.9 <= float(seconds) < 8.0


def test_a_bad_comm_mode_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.distributed.shm_comm import shm_comm_wanted

    monkeypatch.setenv("KVSERVE_TP_COMM", "nccl")
    with pytest.raises(ValueError, match="KVSERVE_TP_COMM: must be shm or gloo, got 'nccl'"):
        shm_comm_wanted()
    monkeypatch.setenv("KVSERVE_TP_COMM", "gloo")
    assert shm_comm_wanted() is False
    monkeypatch.setenv("KVSERVE_TP_COMM", "shm")
    assert shm_comm_wanted() is True
