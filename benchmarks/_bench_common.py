"""Small helpers shared by the scripts in benchmarks/: machine state, contention accounting, result files.

The machine these benchmarks run on has 2 shared, noisy cores. With another process busy, torch with 2
threads can be 10-20x slower than with 1 (OpenMP threads spin waiting for a core that is taken), so every
result records the thread count, the 1-minute load average before and after, this process's CPU seconds,
and the CPU seconds used by everything else on the machine during the run ("other_cpu_frac").
"""

from __future__ import annotations

import json
import os
import platform
import resource
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"


def set_thread_env(num_threads: int) -> None:
    """Call before importing torch: pins OpenMP/MKL pools to ``num_threads`` (torch.set_num_threads is
    also called later; the env vars make the OpenMP runtime agree from its first parallel region)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(num_threads)


def total_busy_s() -> float:
    """CPU seconds all processes spent busy since boot (from /proc/stat); 0.0 where unavailable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Contention:
    """Measure one phase: wall time, own CPU, other processes' CPU, load averages.

    ``other_cpu_frac`` = CPU seconds used by other processes / (wall × ncpu); above ~0.05 the phase's
    numbers are contaminated by someone else's work.
    """

    def __enter__(self) -> Contention:
        self.load_before = [round(x, 2) for x in os.getloadavg()]
        self.busy0, self.self0 = total_busy_s(), self_cpu_s()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.self_cpu = self_cpu_s() - self.self0
        busy = total_busy_s() - self.busy0
        self.load_after = [round(x, 2) for x in os.getloadavg()]
        ncpu = os.cpu_count() or 1
        self.other_cpu = max(busy - self.self_cpu, 0.0)
        self.other_cpu_frac = self.other_cpu / (self.wall_s * ncpu) if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(wall_s=round(self.wall_s, 3), self_cpu_s=round(self.self_cpu, 2),
                    other_cpu_s=round(self.other_cpu, 2), other_cpu_frac=round(self.other_cpu_frac, 4),
                    load_before=self.load_before, load_after=self.load_after)


def environment(num_threads: int) -> dict[str, Any]:
    import torch

    return dict(python=platform.python_version(), torch=torch.__version__, torch_threads=torch.get_num_threads(),
                requested_threads=num_threads, ncpu=os.cpu_count(), machine=platform.machine(),
                cpu=_cpu_model(), loadavg_at_start=[round(x, 2) for x in os.getloadavg()])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def measure_read_bandwidth(mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """Read (``sum``) and copy bandwidth of a ``mib`` MiB float32 tensor with torch's current thread count,
    best of ``repeats``, in GB/s (decimal). The tensor is far larger than any cache, so DRAM is measured; a
    copy moves 2 bytes (read + write) per byte of the tensor."""
    import torch

    n = mib * (1 << 20) // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    x.sum()
    y.copy_(x)  # touch both (page faults out of the timed region)
    best_read = best_copy = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best_read = min(best_read, time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        best_copy = min(best_copy, time.perf_counter() - t)
    del x, y
    return dict(read_gbs=round(nbytes / best_read / 1e9, 2), copy_gbs=round(2 * nbytes / best_copy / 1e9, 2),
                tensor_mib=mib, repeats=repeats)


def write_result(name: str, result: dict[str, Any], out: str | None) -> Path:
    """Write ``result`` as JSON to ``out`` or to results/<name>-<timestamp>.json; returns the path."""
    path = Path(out) if out else RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def table(rows: list[list[Any]], header: list[str]) -> str:
    """A plain left-aligned text table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """lscpu's model name, flags and a few more fields, the key SIMD flags, nproc, hostname, load average."""
    info: dict[str, Any] = {"host": socket.gethostname(), "loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        k, _, v = line.partition(":")
        if k.strip() in ("Model name", "Flags", "Architecture", "CPU(s)", "Thread(s) per core", "L3"):
            info[k.strip()] = v.strip()
    flags = set(info.get("Flags", "").split())
    info["key_flags"] = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
                         if f in flags]
    try:
        info["nproc"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["nproc"] = os.cpu_count()
    return info
