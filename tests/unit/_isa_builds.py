"""The kernel library built for one ISA path (the host's native build, x86-64-v3 = AVX2, plain x86-64), shared by
the int8 and GGUF GEMM tests: each test runs every path the host can execute and skips, naming the CPU flags it
lacks, the others."""

from __future__ import annotations

import platform
from collections.abc import Callable

import pytest

from kvserve import cpu_features
from kvserve.layers import cpu_kernels

X86 = platform.machine() in ("x86_64", "AMD64")
EXPECTED = {"vnni": {"avx512_vnni"}, "avx2": {"avx2"}, "portable": set()}


def library_for(path: str, paths: dict[str, tuple[str, tuple[str, ...]]],
                features: Callable[[object], set[str]]) -> object:
    """``paths[path]`` = (``-march``, CPU flags it needs): the library of that build, checked to have compiled
    the path it names (``features(lib)``, e.g. ``cpu_kernels.int8_features``); skips where it cannot run."""
    if not cpu_kernels.native_available():
        pytest.skip("no C compiler: native kernels unbuilt")
    arch, need = paths[path]
    missing = [f for f in need if f not in cpu_features.host_flags()]
    if missing:
        pytest.skip(f"CPU lacks {' '.join(missing)}")
    if arch != "native" and not X86:
        pytest.skip(f"the {path} build is x86-only (host: {platform.machine()})")
    lib = cpu_kernels._library() if arch == "native" else cpu_kernels.build_library(arch)
    assert lib is not None
    assert features(lib) == EXPECTED[path]
    return lib
