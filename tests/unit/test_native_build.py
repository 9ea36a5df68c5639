"""The native kernel library builds wherever a C compiler is present (no module-level skip here, unlike the kernel
tests, which skip when the library is missing)."""

from __future__ import annotations

import os
import shutil

import pytest

from kvserve.layers import cpu_kernels


def test_a_host_with_a_compiler_builds_the_native_library() -> None:
    """With a C compiler present, every source must compile: a build error would otherwise switch the engine to
    the torch path and skip every native kernel test, and CI would pass without testing them."""
    if os.environ.get("KVSERVE_DISABLE_NATIVE"):
        pytest.skip("KVSERVE_DISABLE_NATIVE is set")
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this host")
    assert cpu_kernels.native_available()
