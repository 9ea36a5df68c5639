"""What the host CPU can do, read once from ``/proc/cpuinfo`` (torch-free).

Used to pick the default dtype (``--dtype auto``): bfloat16 only where the CPU has native bf16 dot
products (``avx512_bf16`` or ``amx_bf16``); elsewhere (e.g. AVX2-only hosts) bf16 matmuls are emulated
and run several times slower than float32, so float32 is chosen. ``KVSERVE_CPU_FLAGS`` (a space-separated
flag list) overrides what is read, to test both choices on any host.
"""

from __future__ import annotations

import os
import platform
from functools import cache

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# Flags worth logging next to a dtype choice or a benchmark number (the full list is ~100 names).
REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                  "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")


@cache
def _read_cpuinfo() -> tuple[str, frozenset[str], tuple[str, int, int]]:
    """``(model name, flags, (vendor_id, cpu family, model))`` of the first CPU in ``/proc/cpuinfo``."""
    model, flags = platform.processor() or platform.machine(), frozenset[str]()
    vendor, family, model_no = "", -1, -1
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                elif key == "vendor_id" and not vendor:
                    vendor = value
                elif key == "cpu family" and family < 0 and value.isdigit():
                    family = int(value)
                elif key == "model" and model_no < 0 and value.isdigit():
                    model_no = int(value)
    except OSError:
        pass
    return model, flags, (vendor, family, model_no)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where unreadable), or ``KVSERVE_CPU_FLAGS``."""
    forced = os.environ.get("KVSERVE_CPU_FLAGS")
    if forced is not None:
        return frozenset(forced.split())
    return _read_cpuinfo()[1]


def host_flags() -> frozenset[str]:
    """The flags ``/proc/cpuinfo`` reports, ignoring ``KVSERVE_CPU_FLAGS`` (what compiled code can run)."""
    return _read_cpuinfo()[1]


def cpu_signature() -> tuple[str, int, int]:
    """``(vendor_id, cpu family, model)`` from ``/proc/cpuinfo``, e.g. ``("AuthenticAMD", 25, 17)`` for a Zen 4
    EPYC; ``("", -1, -1)`` where unreadable (not Linux, or not x86)."""
    return _read_cpuinfo()[2]


def is_zen4() -> bool:
    """True on AMD Zen 4 (family 19h with AVX-512; Zen 3, the other family-19h core, has none)."""
    vendor, family, _ = cpu_signature()
    return vendor == "AuthenticAMD" and family == 0x19 and "avx512f" in host_flags()


def cpu_model() -> str:
    """The CPU's model name, e.g. ``AMD EPYC 9R14 96-Core Processor``."""
    return _read_cpuinfo()[0]


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when bf16 dot products run in hardware (``avx512_bf16`` or ``amx_bf16``)."""
    return bool(set(BF16_FLAGS) & (cpu_flags() if flags is None else flags))


def describe() -> str:
    """One line for logs and benchmark records: the model name and the flags that matter for kernels."""
    flags = cpu_flags()
    present = [f for f in REPORTED_FLAGS if f in flags]
    return f"{cpu_model()} ({os.cpu_count()} CPUs; {' '.join(present) or 'no SIMD flags read'})"


def parse_cpu_list(spec: str) -> list[int]:
    """A CPU list as Linux and vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` write it -> CPU ids in the given order:
    ``"0-3"`` -> [0, 1, 2, 3], ``"0,2,5-6"`` -> [0, 2, 5, 6].

    Raises:
        ValueError: an empty list, a malformed item, a reversed range or a CPU listed twice.
    """
    cpus: list[int] = []
    for item in spec.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {spec!r}: expected items like 3 or 0-3, comma-separated")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad CPU list {spec!r}: range {item.strip()!r} is reversed")
        cpus.extend(range(a, b + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"bad CPU list {spec!r}: a CPU appears twice")
    return cpus
