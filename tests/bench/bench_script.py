"""Load a script of benchmarks/ as a module, for the tests of its functions (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(filename: str, name: str) -> ModuleType:
    """``benchmarks/<filename>`` imported as module ``name`` (registered in ``sys.modules`` first: dataclasses
    look their module up while the class is built)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / filename)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
