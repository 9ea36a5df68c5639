"""benchmarks/kv8_agreement.py: its metric (the test_kv8_quality one) and its prompt selection."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv8_agreement.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kv8_agreement", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kv8_agreement"] = mod
    spec.loader.exec_module(mod)
    return mod


ka = _load()


def test_agreement_counts_tokens_before_the_first_divergence() -> None:
    refs = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]]
    gens = [[1, 2, 3, 4], [1, 9, 3, 4], [0, 6, 7, 8]]
    agree, diverged = ka.agreement(gens, refs, 4)
    assert (agree, diverged) == ((1 + 0.25 + 0) / 3, 2)
    assert ka.first_divergence([1, 2], [1, 2, 3]) == 2


def test_prompts_are_first_turn_human_messages_of_the_stated_length() -> None:
    texts = ka.sharegpt_prompts(5)
    assert len(texts) == 5 and len(set(texts)) == 5
    assert all(20 < len(t) < 1500 for t in texts)
