"""Speculative decoding's torch-free core: config parsing, n-gram proposals, the k controller and its cost
model, and the scheduler's draft slots (budget, caps, rollback, prefix cache, preemption), exact values."""

from __future__ import annotations

import random

import pytest
from fake_kv import FakeKV  # noqa: E402  (tests/unit/fake_kv.py)

from kvserve.core.block_manager import BlockManager
from kvserve.core.request import Request, RequestStatus
from kvserve.core.scheduler import Scheduler, SchedulerConfig
from kvserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvserve.cost_model import spec_decode_expected_tokens, spec_decode_step_speedup
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.controller import SpecController, StepTimeModel
from kvserve.spec_decode.ngram import NgramProposer


def req(request_id: str, prompt: list[int], max_tokens: int = 8, **params: object) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), None,
                   max_tokens)


def spec(k: int = 3, adaptive: bool = False) -> SpecController:
    return SpecController(SpeculativeConfig("ngram", k, adaptive=adaptive), 64)


# ---- config ---------------------------------------------------------------------------------------------
def test_config_parses_vllm_spellings() -> None:
    c = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert c == SpeculativeConfig("ngram", 4, None, 2, 3, True, None)
    assert SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    c = SpeculativeConfig.from_value({"model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 3,
                                      "adaptive": False})
    assert (c.method, c.model, c.adaptive) == ("draft_model", "qwen2.5-coder-0.5b-instruct", False)
    assert SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2,
                                         "prompt_lookup_min": 7}).prompt_lookup_max == 7


@pytest.mark.parametrize(("value", "needle"), [
    ('{"method": "ngram"', "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 2, "eagle_head": 1}, "speculative_config.eagle_head"),
    ({"method": "ngram"}, "num_speculative_tokens: is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive"),
])
def test_config_errors_name_the_field(value: object, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        SpeculativeConfig.from_value(value)  # type: ignore[arg-type]


# ---- n-gram -------------------------------------------------------------------------------------------
def test_ngram_most_recent_longest_match() -> None:
    p = NgramProposer(2, 3)
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 5, 1, 2, 3], 4) == [7, 8, 4, 5]  # 3-gram, latest
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 5, 1, 2, 3], 1) == [7]
    assert p.propose([5, 6, 0, 4, 6, 1, 2, 6, 0], 3) == [4, 6, 1]  # no 3-gram "2 6 0"; 2-gram "6 0"
    assert p.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert p.propose([1, 2, 1, 2], 5) == [1, 2]  # the continuation stops at the end
    assert p.propose([7, 7], 2) == []  # shorter than min_n + 1
    assert p.propose([1, 2, 1, 2], 0) == []
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# ---- cost model and controller ------------------------------------------------------------------------
def flat(t: float) -> StepTimeModel:
    m = StepTimeModel()
    for n in (1, 64):
        m.observe(n, t)
    return m


def linear(per_token: float) -> StepTimeModel:
    m = StepTimeModel()
    for n in (1, 8, 64, 512):
        m.observe(n, per_token * n)
    return m


def test_step_speedup_limits() -> None:
    e = spec_decode_expected_tokens(0.8, 3)
    # batch 1, memory-bound (flat step time), no draft model: the speedup is E(alpha, k) exactly
    assert spec_decode_step_speedup(0.8, 3, 1, 0, 2048, flat(0.01)) == pytest.approx(e)
    # compute-bound (time linear in tokens): every k loses
    for k in (1, 2, 4):
        assert spec_decode_step_speedup(0.8, k, 32, 0, 2048, linear(1e-3)) < 1
    # budget full of prefill: drafts displace prefill tokens, never a gain on a linear model
    assert spec_decode_step_speedup(0.9, 2, 8, 2040, 2048, linear(1e-3)) < 1
    # a draft model costing half a step per forward at batch 1: E / (1 + 0.5 + 2 * 0.5)
    assert spec_decode_step_speedup(0.8, 3, 1, 0, 2048, flat(0.02), flat(0.01)) == pytest.approx(e / 2.5)


def test_step_time_model_interpolates_and_extrapolates() -> None:
    m = StepTimeModel()
    assert m(5) == 0.0 and not m.known
    m.observe(4, 0.010)
    m.observe(16, 0.022)
    assert m(1) == pytest.approx(0.010)  # flat below the smallest point
    assert m(10) == pytest.approx(0.016)
    assert m(32) == pytest.approx(0.044)  # linear beyond the largest
    m.observe(0, 1.0)  # ignored
    assert m.table() == [(4.0, 0.010), (16.0, 0.022)]


def test_controller_turns_off_under_load_and_on_at_batch_one() -> None:
    c = SpecController(SpeculativeConfig("ngram", 4), 2048)
    # roofline-shaped step times: flat (weights read) to 64 tokens, then compute-bound
    for n in (1, 8, 64):
        c.target_time.observe(n, 0.01)
    for n in (256, 1024, 2048):
        c.target_time.observe(n, 0.01 * n / 64)
    for _ in range(10):
        c.observe("a", 4, 4, 3)  # 3 of 4 accepted, every round
    alpha = c.alpha("a")
    assert alpha == pytest.approx(0.75, abs=0.02)
    assert c.num_spec_tokens("a", 1, 0, 4) == 4  # batch 1: memory-bound, the largest k pays
    assert c.num_spec_tokens("a", 64, 0, 4) == 0  # 64 decodes: verifying 64 k more tokens is compute
    assert c.num_spec_tokens("a", 1, 2000, 4) == 0  # the step is full of prefill
    assert c.num_spec_tokens("a", 1, 0, 2) == 2  # the request's limit caps k
    assert c.num_spec_tokens("a", 1, 0, 4, eligible=False) == 0
    # where does k drop to 0? the smallest batch with no k gaining 5 %
    off_at = next(b for b in range(1, 65) if c.num_spec_tokens("a", b, 0, 4) == 0)
    assert 8 <= off_at <= 64
    assert all(c.num_spec_tokens("a", b, 0, 4) == 0 for b in range(off_at, 65))
    c.observe("b", 4, 0, 0)  # no proposal: the proposal rate drops, no acceptance trial
    assert c.stats.num_drafts == 10 and c.stats.num_draft_tokens == 40 and c.stats.num_accepted_tokens == 30
    assert c.stats.accepted_per_pos == [10, 10, 10, 0]
    c.release(["a"])
    assert c.alpha("a") == c._global.alpha and 0.6 < c.alpha("a") < 0.75  # all requests' estimate, learnt


def test_controller_probes_new_and_idle_requests() -> None:
    """A draft model whose cost makes k = 0 look best at the prior acceptance: a new request still gets one
    round of k_max drafts at batch 1 (never at a compute-bound batch), then every PROBE_EVERY steps."""
    c = SpecController(SpeculativeConfig("draft_model", 4, model="d"), 2048)
    for n, t in ((1, 0.085), (2, 0.096), (4, 0.111), (8, 0.163), (64, 0.54), (512, 3.4)):
        c.target_time.observe(n, t)
    for n, t in ((1, 0.038), (8, 0.05), (64, 0.17)):
        c.draft_time.observe(n, t)
    c._global = type(c._global)(0.4, 2.0)  # prior acceptance 0.2: no k pays
    assert c.num_spec_tokens("new", 64, 0, 4) == 0  # compute-bound: no probe
    assert c.num_spec_tokens("new2", 1, 0, 4) == 4  # batch 1: probe round
    c.observe("new2", 4, 4, 4)  # all accepted
    assert c.alpha("new2") > 0.5
    ks = [c.num_spec_tokens("new2", 1, 0, 4) for _ in range(3)]
    assert ks[0] >= 2, ks
    c.observe("bad", 4, 4, 0)  # rejected at once: back to k = 0, probed again after PROBE_EVERY steps
    ks = [c.num_spec_tokens("bad", 1, 0, 4) for _ in range(c.PROBE_EVERY)]
    assert ks[:-1] == [0] * (c.PROBE_EVERY - 1) and ks[-1] == 4


def test_controller_fixed_k_and_batch_size_switch() -> None:
    c = SpecController(SpeculativeConfig("ngram", 3, adaptive=False, disable_by_batch_size=4), 64)
    assert c.num_spec_tokens("x", 4, 0, 10) == 3
    assert c.num_spec_tokens("x", 5, 0, 10) == 0
    assert c.stats.last_mean_k == 1.5  # this step's decodes so far
    c.begin_step()
    assert c.stats.last_mean_k == 0.0


# ---- scheduler ----------------------------------------------------------------------------------------
def step_with(s: Scheduler, out: SchedulerOutput, emitted: dict[str, list[int]],
              drafts: dict[str, int] | None = None) -> None:
    ids = [x.request.request_id for x in out.scheduled if x.sample]
    tokens = [emitted.get(i, [5]) for i in ids]
    nd = [(drafts or {}).get(i, len(emitted.get(i, [5])) - 1) for i in ids]
    s.update_from_output(out, ModelRunnerOutput(ids, tokens, num_draft_tokens=nd))
    s.block_manager.check_invariants()


def test_draft_slots_rollback_exact_blocks() -> None:
    bm = BlockManager(16, 4)
    s = Scheduler(SchedulerConfig(4, 64, 64), bm, spec=spec(3))
    r = req("r", [1, 2, 3, 4, 5, 6], max_tokens=20)
    s.add_request(r)
    out = s.schedule()  # prefill 6 tokens: no drafts for a prompt
    assert [(x.num_scheduled_tokens, x.num_spec_tokens) for x in out.scheduled] == [(6, 0)]
    step_with(s, out, {"r": [7]})
    assert bm.get_block_table("r") == [0, 1] and r.num_computed_tokens == 6
    out = s.schedule()  # decode: its token + 3 draft slots, positions 6..9 -> blocks 1, 2
    x = out.scheduled[0]
    assert (x.num_computed_tokens, x.num_scheduled_tokens, x.num_spec_tokens, x.sample) == (6, 4, 3, True)
    assert bm.get_block_table("r") == [0, 1, 2]
    step_with(s, out, {"r": [8, 9]}, {"r": 3})  # 1 of 3 drafts accepted, one more token
    assert r.output_token_ids == [7, 8, 9] and r.num_computed_tokens == 8  # 7 and 8 have KV, 9 not yet
    assert bm.get_block_table("r") == [0, 1]  # block 2 held only rejected drafts' slots: freed
    assert bm.ref_counts[:3] == [1, 1, 0]
    out = s.schedule()
    assert out.scheduled[0].num_computed_tokens == 8 and out.scheduled[0].num_scheduled_tokens == 4
    step_with(s, out, {"r": [10, 11, 12, 13]}, {"r": 3})  # all accepted + bonus
    assert r.num_computed_tokens == 12 and bm.get_block_table("r") == [0, 1, 3]  # block 2 went to the back
    s.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert bm.num_used_blocks == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5])
def test_max_tokens_caps_drafts_and_output(max_tokens: int) -> None:
    s = Scheduler(SchedulerConfig(4, 64, 64), BlockManager(16, 4), spec=spec(3))
    r = req("r", [1, 2, 3], max_tokens=max_tokens)
    s.add_request(r)
    step_with(s, s.schedule(), {"r": [7]})
    while not r.is_finished:
        out = s.schedule()
        x = out.scheduled[0]
        assert x.num_spec_tokens == min(3, max_tokens - r.num_output_tokens - 1)
        step_with(s, out, {"r": [9] * (x.num_spec_tokens + 1)})  # the runner accepts everything
    assert r.num_output_tokens == max_tokens and r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.block_manager.num_used_blocks == 0


def test_stop_token_inside_accepted_run_drops_the_rest() -> None:
    s = Scheduler(SchedulerConfig(4, 64, 64), BlockManager(16, 4), spec=spec(3))
    r = req("r", [1, 2, 3], max_tokens=20, stop_token_ids=[42])
    s.add_request(r)
    step_with(s, s.schedule(), {"r": [7]})
    out = s.schedule()
    updates = s.update_from_output(out, ModelRunnerOutput(["r"], [[8, 42, 9, 10]], num_draft_tokens=[3]))
    assert out.scheduled[0].num_spec_tokens == 3
    assert r.output_token_ids == [7, 8, 42] and r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 42
    assert updates[0].new_token_ids == [8, 42]
    assert s.block_manager.num_used_blocks == 0


def test_budget_and_blocks_bound_the_drafts() -> None:
    s = Scheduler(SchedulerConfig(4, 6, 64), BlockManager(3, 4), spec=spec(4))
    a, b = req("a", [1, 2, 3]), req("b", [4, 5, 6])
    s.add_request(a)
    s.add_request(b)
    step_with(s, s.schedule(), {"a": [7], "b": [8]})
    out = s.schedule()  # budget 6: a gets 1 + 4, b its one token; a's drafts need blocks: 2 free blocks
    got = {x.request.request_id: (x.num_scheduled_tokens, x.num_spec_tokens) for x in out.scheduled}
    assert got == {"a": (1, 0), "b": (1, 0)} or got["a"][1] + got["b"][1] <= 4
    assert sum(x.num_scheduled_tokens for x in out.scheduled) <= 6
    assert s.num_preemptions == 0  # drafts never preempt anybody


def test_grammar_requests_are_not_speculated() -> None:
    s = Scheduler(SchedulerConfig(4, 64, 64), BlockManager(16, 4), spec=spec(3))
    r = req("r", [1, 2, 3], bad_words_token_ids=[[1, 2]])
    s.add_request(r)
    step_with(s, s.schedule(), {"r": [7]})
    assert s.schedule().scheduled[0].num_spec_tokens == 0


class SpecFakeKV(FakeKV):
    """The fake KV store with a speculating runner: random drafts, a random accepted prefix, one more token."""

    def run(self, out: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
        self.copy_blocks(out)
        ids, tokens, drafts = [], [], []
        for s in out.scheduled:
            r, table, c = s.request, s.block_table, s.num_computed_tokens
            self.check_reads(s)
            m = rng.randint(0, s.num_spec_tokens)
            own = s.num_scheduled_tokens - s.num_spec_tokens
            draft = [rng.randint(0, 3) for _ in range(m)]
            seq = r.all_token_ids[c:c + own] + draft
            for i, tok in enumerate(seq):
                t = c + i
                self.device[table[t // self.bs]][t % self.bs] = (tok, t)
            if s.sample:
                a = rng.randint(0, m)
                ids.append(r.request_id)
                tokens.append(draft[:a] + [rng.randint(0, 3)])
                drafts.append(m)
        return ModelRunnerOutput(ids, tokens, num_draft_tokens=drafts)


@pytest.mark.parametrize("seed", range(10))
def test_random_speculation_reads_only_verified_tokens(seed: int) -> None:
    """Drafts (rejected ones overwrite slots past the verified tokens), prefix caching, forks, aborts and
    preemption by recompute and swap: every computed position a request reads holds its own verified token,
    the committed blocks hold only verified tokens, and all blocks come back."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    num_blocks = rng.randint(24, 48) // bs
    num_host = rng.choice([0, 8])
    mode = rng.choice(["recompute", "swap"]) if num_host else "recompute"
    s = Scheduler(SchedulerConfig(rng.randint(2, 6), rng.randint(4, 16), 28, preemption_mode=mode,
                                  num_host_blocks=num_host // bs * bs, block_bytes=1),
                  BlockManager(num_blocks, bs, enable_caching=True), spec=spec(rng.randint(1, 5)))
    kv = SpecFakeKV(num_blocks, num_host, bs)
    prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    live: list[str] = []
    n = 0
    for _ in range(250):
        if rng.random() < 0.3:
            n += 1
            prompt = (rng.choice(prefixes) + [rng.randint(0, 3) for _ in range(rng.randint(0, 6))])[:16] or [1]
            leader = req(f"r{n}#0", prompt, max_tokens=rng.randint(1, 9))
            s.add_request(leader)
            live.append(leader.request_id)
            if rng.random() < 0.2:
                forks = [req(f"r{n}#{i}", prompt, max_tokens=leader.max_tokens) for i in (1, 2)]
                s.add_forks(leader, forks)
                live += [f.request_id for f in forks]
        if rng.random() < 0.05 and live:
            s.finish_requests([rng.choice(live)], RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        s.block_manager.check_invariants()
        s.update_from_output(out, kv.run(out, rng))
        bm = s.block_manager
        bm.check_invariants()
        for r in s.running:  # committed blocks hold verified tokens only
            table = bm.get_block_table(r.request_id)
            for i in range(bm._num_committed.get(r.request_id, 0)):
                for t in range(i * bs, (i + 1) * bs):
                    assert kv.device[table[i]][t % bs] == (r.all_token_ids[t], t)
            assert len(table) <= bm.num_blocks_for(r.num_tokens)  # rejected drafts' blocks were freed
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, kv.run(out, rng))
    assert s.block_manager.num_used_blocks == 0
    assert s.spec is not None and s.spec.stats.num_accepted_tokens <= s.spec.stats.num_draft_tokens
