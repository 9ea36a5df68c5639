"""benchmarks/spec_decode.py: its pure functions (acceptance statistics, k by batch, the off-batch prediction,
the closed loop on a stub engine, the tables) and one tiny real run of the ngram section end to end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from bench_script import load_benchmark

from kvserve.cost_model import spec_decode_step_speedup
from kvserve.spec_decode.config import SpeculativeConfig

sd = load_benchmark("spec_decode.py", "spec_decode_bench")


def test_variants_are_valid_speculative_configs() -> None:
    vs = sd.variants("ngram", [2, 4, 6], 6)
    assert [label for label, _ in vs] == ["off", "ngram k=2", "ngram k=4", "ngram k=6", "ngram adaptive k<=6"]
    assert vs[0][1] is None
    parsed = [SpeculativeConfig.from_value(c) for _, c in vs[1:]]
    assert [(p.num_speculative_tokens, p.adaptive) for p in parsed] == [(2, False), (4, False), (6, False), (6, True)]
    dv = sd.variants("draft_model", [3], None, "qwen2.5-coder-0.5b-instruct")
    assert [label for label, _ in dv] == ["off", "draft k=3"]
    p = SpeculativeConfig.from_value(dv[1][1])
    assert (p.method, p.model, p.adaptive) == ("draft_model", "qwen2.5-coder-0.5b-instruct", False)


def test_round_stats_by_hand() -> None:
    # (slots, drafts, accepted): 4 of 4; 1 of 4 (a rejection); 0 of 2 (a rejection); no proposal at all
    rs = sd.round_stats([(4, 4, 4), (4, 4, 1), (2, 2, 0), (4, 0, 0)])
    assert rs["num_rounds"] == 4 and rs["num_drafts"] == 3
    assert rs["num_draft_tokens"] == 10 and rs["num_accepted_tokens"] == 5
    assert rs["acceptance_rate"] == pytest.approx(0.5)
    assert rs["mean_accepted_len"] == pytest.approx(1 + 5 / 3)
    assert rs["alpha_token"] == pytest.approx(5 / 7)  # 5 successes in 5 + 2 Bernoulli trials
    assert rs["proposal_rate"] == pytest.approx(0.75)
    assert rs["mean_slots"] == pytest.approx(3.5)
    empty = sd.round_stats([])
    assert empty["acceptance_rate"] is None and empty["alpha_token"] is None and empty["num_drafts"] == 0


def test_compare_outputs() -> None:
    c = sd.compare_outputs([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [6, 7]])
    assert c["identical"] == 1 and c["total"] == 3 and c["first_diff"] == {1: 1, 2: 1}


def _steps(rows: list[tuple[int, list[int], int]]) -> dict[str, list[float]]:
    """(decodes, ks, prefill tokens) per step -> a StepRecorder-shaped log."""
    log: dict[str, list[float]] = {k: [] for k in ("decodes", "sum_k", "num_k0", "prefill_tokens", "tokens",
                                                   "seconds", "num_running_after", "last_mean_k_after")}
    for b, ks, prefill in rows:
        log["decodes"].append(b)
        log["sum_k"].append(sum(ks))
        log["num_k0"].append(sum(1 for k in ks if k == 0))
        log["prefill_tokens"].append(prefill)
        log["tokens"].append(b + sum(ks) + prefill)
        log["seconds"].append(0.01 * b)
        log["num_running_after"].append(b)
        log["last_mean_k_after"].append(0.0)
    return log


def test_k_by_batch_and_measured_off_batch() -> None:
    log = _steps([(1, [4], 0)] * 3 + [(2, [4, 0], 0)] * 3 + [(4, [0, 0, 0, 4], 0)] * 3
                 + [(8, [4] * 8, 100)] * 3 + [(8, [0] * 8, 0)] * 3)
    rows = {r["batch"]: r for r in sd.k_by_batch(log, 4)}
    assert rows[1]["mean_k"] == 4 and rows[1]["k0_share"] == 0
    assert rows[2]["mean_k"] == 2 and rows[2]["k0_share"] == 0.5
    assert rows[4]["k0_share"] == 0.75
    assert rows[8]["steps"] == 6 and rows[8]["pure_steps"] == 3
    assert rows[8]["mean_k"] == 2 and rows[8]["pure_mean_k"] == 0 and rows[8]["pure_k0_share"] == 1
    assert sd.measured_off_batch(list(rows.values())) == 4  # 2 is a tie (half), not "most"
    # only B=8 has >= 4 steps, but only 3 pure-decode ones: its 6 steps together are a tie (half k = 0)
    assert sd.measured_off_batch(list(rows.values()), min_steps=4) is None
    assert sd.measured_off_batch(list(rows.values()), min_steps=3) == 4
    assert sd.measured_off_batch(sd.k_by_batch(_steps([(1, [4], 0)] * 5), 4)) is None


def test_predict_off_batch() -> None:
    # flat step time (memory-bound at every size): speculation always pays
    assert sd.predict_off_batch(0.8, 4, lambda n: 0.02, 2048, max_batch=64) is None
    # linear (compute-bound): no k ever gains, so it is off from batch 1
    assert sd.predict_off_batch(0.8, 4, lambda n: 0.001 * n, 2048) == 1

    # a weight read then compute: the answer is the first B where the best k's speedup is <= 1.05
    def t(n: float) -> float:
        return 0.02 + 0.0005 * n

    b = sd.predict_off_batch(0.7, 4, t, 2048, proposal_rate=0.9)
    assert b is not None and b > 1
    best = [max(spec_decode_step_speedup(0.7, k, x, 0, 2048, t, None, 0.9) for k in range(1, 5)) for x in (b - 1, b)]
    assert best[0] > 1.05 >= best[1]
    assert sd.predict_off_batch(1.0, 4, t, 2048) == sd.predict_off_batch(0.99, 4, t, 2048)  # capped as the controller


def _variant(spec: dict[str, Any] | None, accepted: int, draft: int, drafts: int, tok_s: float,
             outputs: list[list[int]]) -> dict[str, Any]:
    per = (draft // drafts, draft // drafts, accepted // drafts) if drafts else None
    rs = sd.round_stats([per] * drafts if per else [])
    return {"spec": spec, "rounds": rs, "output_tok_s": tok_s, "output_tokens": sum(map(len, outputs)), "wall_s": 1.0,
            "concurrency": 1, "mean_k": 1.0, "contention": {"other_cpu_frac": 0.0}, "outputs": outputs}


def test_acceptance_summary_and_table() -> None:
    vs = {"off": _variant(None, 0, 0, 0, 10.0, [[1, 2]]),
          "ngram k=4": _variant(sd.spec_dict("ngram", 4, False), 6, 8, 2, 20.0, [[1, 2]]),
          "ngram adaptive k<=6": _variant(sd.spec_dict("ngram", 6, True), 9, 12, 3, 25.0, [[1, 3]])}
    sd.finish_rows(vs)
    assert vs["ngram adaptive k<=6"]["speedup"] == pytest.approx(2.5)
    assert vs["ngram adaptive k<=6"]["identical"]["identical"] == 0 and vs["ngram k=4"]["identical"]["identical"] == 1
    acc = sd.acceptance_summary({"variants": vs})
    assert acc is not None and acc["variants"] == ["ngram adaptive k<=6"]
    assert acc["alpha"] == pytest.approx(9 / 12) and acc["num_drafts"] == 3 and acc["mean_accepted_len"] == 4
    assert "alpha_token" in acc
    # no adaptive variant: the fixed ones pooled; the load section's groups by concurrency are searched too
    del vs["ngram adaptive k<=6"]
    pooled = sd.acceptance_summary({"model": "m", "c16": {"concurrency": 16, "variants": vs}})
    assert pooled is not None and pooled["alpha"] == pytest.approx(6 / 8)
    assert sd.acceptance_summary({"variants": {"off": vs["off"]}}) is None
    text = sd.section_table(vs)
    assert "ngram k=4" in text and "2.00x" in text and "75.0%" in text and "1/1" in text
    rows = sd.k_by_batch(_steps([(1, [4], 0)] * 2 + [(3, [0, 0, 2], 0)] * 2), 4)
    kt = sd.k_table(rows).splitlines()
    assert kt[-2].split()[:5] == ["1", "2", "2", "4.00", "0%"]
    assert kt[-1].split()[:5] == ["3", "2", "2", "0.67", "67%"]


class _StubEngine:
    """add_request / step: each request finishes after ``max_tokens`` steps, one token per step."""

    def __init__(self) -> None:
        self.live: dict[str, list[int]] = {}
        self.max_live = 0
        self.order: list[str] = []

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> str:
        self.live[request_id] = [params.max_tokens, prompt["prompt_token_ids"][0]]
        self.order.append(request_id)
        self.max_live = max(self.max_live, len(self.live))
        return request_id

    def step(self) -> list[Any]:
        outs = []
        for rid, state in list(self.live.items()):
            state[0] -= 1
            if state[0] == 0:
                del self.live[rid]
                outs.append(SimpleNamespace(request_id=rid, finished=True, error=None,
                                            outputs=[SimpleNamespace(token_ids=[state[1]] * 2)]))
        return outs


def test_closed_loop_keeps_concurrency_and_order() -> None:
    eng = _StubEngine()
    reqs = [([10 + i], SimpleNamespace(max_tokens=1 + i % 3)) for i in range(7)]
    seen: list[float] = []
    run = sd.closed_loop(eng, reqs, 3, seen.append, tag="t")
    assert eng.max_live == 3 and eng.order == [f"t{i}" for i in range(7)]
    assert run["outputs"] == [[10 + i] * 2 for i in range(7)] and run["errors"] == {}
    assert run["steps"] == len(seen) > 0
    with pytest.raises(ValueError):
        sd.closed_loop(eng, reqs, 0)


def test_parse_args_defaults_are_the_real_measurement() -> None:
    a = sd.parse_args([])
    assert a.sections == list(sd.SECTIONS) and a.ngram_ks == [2, 4, 6] and a.ngram_kmax == 6
    assert a.draft_ks == [2, 3, 4] and a.concurrency == [16, 64] and a.max_tokens == 256 and a.num_threads == 1
    assert sd.parse_args(["--ngram-kmax", "0"]).ngram_kmax is None
    with pytest.raises(SystemExit):
        sd.parse_args(["--sections", "ngram,bogus"])


def test_edit_prompts_repeat_their_text() -> None:
    msgs = sd.edit_user_messages()
    assert 6 <= len(msgs) <= 8 and len(sd.CODE_TASKS) == 4
    assert all(text in m for m, (_, text) in zip(msgs, sd.EDIT_TASKS, strict=True))


@pytest.mark.slow
def test_tiny_ngram_run_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sd.json"
    assert sd.main(["--sections", "ngram", "--num-edit-prompts", "1", "--max-tokens", "8", "--ngram-ks", "2",
                    "--ngram-kmax", "0", "--kv-cache-memory", "0.25", "--max-model-len", "1024",
                    "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ngram k=2" in text and "saved" in text
    res = json.loads(out.read_text())
    assert res["benchmark"] == "spec_decode" and "host" in res["machine"] and "key_flags" in res["machine"]
    vs = res["sections"]["ngram"]["variants"]
    assert set(vs) == {"off", "ngram k=2"}
    k2 = vs["ngram k=2"]
    assert k2["identical"]["identical"] == 1  # greedy: exactly spec-off's tokens
    assert k2["output_tokens"] == vs["off"]["output_tokens"] > 0
    assert k2["contention"]["load_before"] and k2["contention"]["load_after"]
    rs = k2["rounds"]
    assert rs["num_draft_tokens"] == k2["controller_stats"]["num_draft_tokens"]
    assert rs["num_accepted_tokens"] == k2["controller_stats"]["num_accepted_tokens"]
    if rs["num_draft_tokens"]:
        assert res["acceptance"]["ngram"]["alpha"] == pytest.approx(rs["acceptance_rate"])
    # resume: nothing left to run, the file is kept and a run is appended
    assert sd.main(["--sections", "ngram", "--num-edit-prompts", "1", "--max-tokens", "8", "--ngram-ks", "2",
                    "--ngram-kmax", "0", "--resume", str(out)]) == 0
    assert "already in" in capsys.readouterr().out
    again = json.loads(out.read_text())
    assert len(again["runs"]) == 1 and set(again["sections"]["ngram"]["variants"]) == {"off", "ngram k=2"}
