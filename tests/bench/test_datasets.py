"""Benchmark datasets: ShareGPT truncated-file recovery, determinism under a seed, length ranges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.bench import datasets as ds


def _records(n: int) -> list[dict[str, object]]:
    return [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i} " + "word " * (4 + i)},
                                              {"from": "gpt", "value": "answer " * (8 + i)}]} for i in range(n)]


def test_truncated_file_recovers_every_complete_record(tmp_path: Path) -> None:
    recs = _records(5)
    text = json.dumps(recs, indent=2)
    # cut inside the last record: the first four survive
    cut = text.index('"r4"') + 2
    p = tmp_path / "trunc.json"
    p.write_text(text[:cut])
    assert ds.read_json_records(p) == recs[:4]
    # cut right after a complete record and its comma
    p.write_text(text[:text.index('"r3"')].rstrip().rstrip("{").rstrip())
    assert ds.read_json_records(p) == recs[:3]
    # a complete file reads whole
    p.write_text(text)
    assert ds.read_json_records(p) == recs
    p.write_text("[]")
    assert ds.read_json_records(p) == []
    p.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        ds.read_json_records(p)


def test_packaged_sharegpt_file_is_truncated_and_recovered() -> None:
    path = ds.sharegpt_path()
    records = ds.read_json_records(path)
    assert len(records) > 10_000
    assert not path.read_text(encoding="utf-8", errors="replace").rstrip().endswith("]")  # truly cut off
    assert all("conversations" in r for r in records[-10:])


def test_sharegpt_sampling_is_deterministic_and_filtered() -> None:
    recs = _records(40) + [{"conversations": [{"from": "human", "value": "hi"}]}, {"bad": 1}]
    a = ds.sample_sharegpt(recs, 10, seed=3, count_tokens=lambda t: len(t.split()), max_output_len=12,
                           max_input_len=30)
    b = ds.sample_sharegpt(recs, 10, seed=3, count_tokens=lambda t: len(t.split()), max_output_len=12,
                           max_input_len=30)
    c = ds.sample_sharegpt(recs, 10, seed=4, count_tokens=lambda t: len(t.split()), max_output_len=12,
                           max_input_len=30)
    assert a == b and a != c
    assert all(4 <= r.prompt_len <= 30 and 4 <= r.output_len <= 12 for r in a)
    fixed = ds.sample_sharegpt(recs, 5, seed=0, count_tokens=lambda t: len(t.split()), output_len=7)
    assert {r.output_len for r in fixed} == {7}
    with pytest.raises(ValueError, match="pass the length filters"):
        ds.sample_sharegpt(recs, 50, seed=0, count_tokens=lambda t: len(t.split()))


def test_random_lengths_within_range_and_deterministic() -> None:
    a = ds.sample_random(200, seed=1, input_len=100, output_len=20, range_ratio=0.5, token_range=(10, 20))
    assert a == ds.sample_random(200, seed=1, input_len=100, output_len=20, range_ratio=0.5, token_range=(10, 20))
    assert a != ds.sample_random(200, seed=2, input_len=100, output_len=20, range_ratio=0.5, token_range=(10, 20))
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in a)
    assert all(len(r.prompt) == r.prompt_len and all(10 <= t < 20 for t in r.prompt) for r in a)  # type: ignore[union-attr]
    assert len({r.prompt_len for r in a}) > 20  # actually spread
    fixed = ds.sample_random(5, seed=0, input_len=64, output_len=8)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(64, 8)}
    with pytest.raises(ValueError, match="range ratio"):
        ds.sample_random(1, 0, 10, 10, range_ratio=1.0)


def test_shared_prefix_and_multi_turn() -> None:
    sp = ds.sample_shared_prefix(6, seed=0, prefix_words=50, question_words=5, output_len=16)
    assert len({r.system for r in sp}) == 1 and len({r.prompt for r in sp}) == 6
    assert sp == ds.sample_shared_prefix(6, seed=0, prefix_words=50, question_words=5, output_len=16)
    mt = ds.sample_multi_turn(3, seed=0, num_turns=4, question_words=5, output_len=8)
    assert all(len(r.turns) == 3 and r.multi_turn for r in mt)
    history = [("q1", "a1"), ("q2", "a2")]
    assert ds.transcript(history, "q3") == "User: q1\nAssistant: a1\nUser: q2\nAssistant: a2\nUser: q3\nAssistant:"
    msgs = list(ds.iter_turn_messages(history, "q3", "sys"))
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
