"""benchmarks/kv8_agreement.py: its metric (the test_kv8_quality one) and its prompt selection."""

from __future__ import annotations

from bench_script import load_benchmark

ka = load_benchmark("kv8_agreement.py", "kv8_agreement")


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
