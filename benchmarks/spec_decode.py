#!/usr/bin/env python3
"""Speculative decoding on vs off: n-gram prompt lookup, a draft model, the adaptive k under load, step times.

What is measured, and why
-------------------------
Every run is the engine in-process (``kvserve.LLM`` / its ``LLMEngine``), offline, closed loop: the
requests of a run are queued in order, at most C are in the engine at once, and a new one is added as soon
as one finishes (``closed_loop``: ``engine.add_request`` + ``engine.step()``, so that every step can be
recorded). Every variant is a fresh engine with the same settings (``speculative_config`` is fixed at start
up), warmed up on an unrelated prompt first. Greedy everywhere, so a speculative run must emit exactly the
tokens of the run without it (``identical``: requests whose tokens equal spec-off's).

* ``ngram`` (``--model``, SmolLM2-135M by default): an editing workload (``EDIT_TASKS``: "Rewrite this
  function with type hints", "Fix the typo in this paragraph", "Add docstrings to", ...: answers that repeat
  most of the prompt) through the chat template, EOS honoured, ``--max-tokens`` (256), concurrency 1.
  Variants: off, ngram with fixed k in ``--ngram-ks`` (2, 4, 6; ``adaptive: false``) and adaptive with k_max
  ``--ngram-kmax`` (6). Target: >= 2x output tok/s.
* ``draft``: draft ``--draft-model`` (qwen2.5-coder-0.5b-instruct) -> target ``--target-model``
  (qwen2.5-coder-1.5b-instruct) on ``CODE_TASKS`` ("Write a Python function that ..."), concurrency 1,
  ``--draft-max-tokens`` (128). Variants: off, draft k in ``--draft-ks`` (2, 3, 4) fixed, adaptive with k_max
  ``--draft-kmax`` (4). Target >= 1.5x. Skipped, with the reason printed, when a model is not installed.
* ``load``: workload A (``kvserve.bench.offline.make_mixed_workload``: prompts of U[50, 800] random ids,
  outputs from {16, ..., 256}, EOS ignored) on ``--model`` at each concurrency of ``--concurrency`` (16, 64)
  with ``--num-prompts`` requests (default 4 x C: 64 and 128). Variants: off, ngram fixed k=4
  (``adaptive: false``), ngram adaptive (k_max 4). Per step (``StepRecorder``: ``scheduler.schedule`` and the
  controller's ``observe`` wrapped on the instance) the number of decoding requests B, the k each of them got,
  the prefill tokens and the seconds of ``engine.step()``, and after it ``engine.spec.stats.last_mean_k``
  (the controller's own gauge: the mean k of the step *before*, as ``begin_step`` computes it) and
  ``scheduler.num_running``. The batch at which k drops to 0 (``measured_off_batch``: the smallest B whose
  decoding requests mostly got k = 0, from pure-decode steps when there are enough of them) stands next to
  the prediction (``predict_off_batch``): the smallest B at which no k in 1..k_max gains >= 5 % by
  ``cost_model.spec_decode_step_speedup`` with the controller's measured ``target_time`` after the run, the
  run's measured per-token acceptance and proposal rate, no prefill. Targets: adaptive >= 0.95x off; fixed k
  regresses.
* ``steptime``: the target forward time at M = 1..8, 16, 32 tokens (``runner.measure_forward_times``, best
  of ``--steptime-repeats``) for each of ``--steptime-models`` that is installed: verifying k + 1 tokens
  should cost about one decode step while the step is memory-bound.

Acceptance numbers (from the verification rounds themselves, ``round_stats``):
``acceptance_rate`` = accepted / draft tokens (vLLM's "draft acceptance rate"); ``mean_accepted_len`` =
1 + accepted / rounds with drafts (tokens emitted per round); ``alpha_token`` = the geometric model's
per-token acceptance, accepted / (accepted + rounds that stopped at a rejection): the alpha of
``cost_model.spec_decode_expected_tokens`` and the controller's estimator. The JSON's top-level
``acceptance`` holds, per section, the numbers of its adaptive variant: ``kvserve plan --bench-json FILE``
reads them.

The machine is shared and noisy: every row records the load average before/after and other processes' CPU
(``other_cpu_frac`` > ~0.05: contaminated; from _bench_common.Contention), the JSON lscpu's model name and
flags. Default 1 thread. The JSON (``results/spec_decode_<host>_<timestamp>.json`` or ``--out``) is
rewritten after every variant; ``--resume FILE`` reloads one and runs only the variants it lacks.

Usage::

    .venv/bin/python benchmarks/spec_decode.py                                  # every section (long)
    .venv/bin/python benchmarks/spec_decode.py --sections ngram
    .venv/bin/python benchmarks/spec_decode.py --sections draft
    .venv/bin/python benchmarks/spec_decode.py --sections load --concurrency 16 --num-prompts 64
    .venv/bin/python benchmarks/spec_decode.py --sections steptime
    .venv/bin/python benchmarks/spec_decode.py --resume results/spec_decode_host_20260101-120000.json
    # smoke: one prompt, 16 tokens, one k
    .venv/bin/python benchmarks/spec_decode.py --sections ngram --num-edit-prompts 1 --max-tokens 16 --ngram-ks 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import RESULTS, Contention, environment, machine_info, set_thread_env, table  # noqa: E402

SECTIONS = ("ngram", "draft", "load", "steptime")
MIN_GAIN = 0.05  # the controller's default: speculate only for a predicted step gain of at least 5 %

# ---- workloads ---------------------------------------------------------------------------------------------
_CODE_MERGE = '''def merge_intervals(intervals):
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
'''

_CODE_STATS = '''def summarize(values, precision=2):
    count = len(values)
    if count == 0:
        return {"count": 0, "mean": None, "min": None, "max": None}
    total = sum(values)
    mean = total / count
    ordered = sorted(values)
    middle = count // 2
    median = ordered[middle] if count % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"count": count, "mean": round(mean, precision), "median": round(median, precision),
            "min": ordered[0], "max": ordered[-1]}
'''

_CODE_CACHE = '''class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
'''

_CODE_FORMAT = '''def describe_order(order):
    name = order["customer"]["name"]
    total = 0
    for item in order["items"]:
        total += item["price"] * item["quantity"]
    lines = ["Order for " + name + ":"]
    for item in order["items"]:
        lines.append("  " + str(item["quantity"]) + " x " + item["title"] + " at " + str(item["price"]))
    lines.append("Total: " + str(round(total, 2)))
    return "\\n".join(lines)
'''

_CODE_TMP = '''def read_records(path):
    tmp = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split(",")
            tmp.append({"id": int(fields[0]), "name": fields[1], "score": float(fields[2])})
    tmp.sort(key=lambda record: record["score"], reverse=True)
    return tmp
'''

_PARA_RIVER = ("The river winds through the valley for nearly forty miles before it reaches the sea. In the spring, "
               "melting snow from the mountains swells the current, and the farmers along its banks watch the water "
               "rise with a mixture of hope and worry. A good flood leaves rich soil behind; a bad one carries away "
               "fences, bridges and sometimes whole feilds of young wheat. Over the centuries the people of the "
               "valley have learned to read the river the way sailors read the sky.")

_PARA_LIBRARY = ("Our public library opened in 1911 with three hundred books and a single reading room. Today it lends "
                 "more than two hundred thousand items a year, from novels and cookbooks to telescopes and sewing "
                 "machines. The staff runs weekly story hours for children, free computer classes for adults and a "
                 "quiet study hall that stays open untill midnight during exam season. Everyone who lives or works in "
                 "the county can get a card at the front desk in a few minutes.")

# (instruction, the text it applies to): an answer that repeats most of the text, as editing tasks do.
EDIT_TASKS: tuple[tuple[str, str], ...] = (
    ("Rewrite this function with type hints:", _CODE_MERGE),
    ("Fix the typo in this paragraph:", _PARA_RIVER),
    ("Add docstrings to:", _CODE_CACHE),
    ("Rewrite this function with type hints:", _CODE_STATS),
    ("Fix the typo in this paragraph:", _PARA_LIBRARY),
    ("Rewrite this function to use f-strings:", _CODE_FORMAT),
    ("Rename the variable tmp to records in this function:", _CODE_TMP),
)

CODE_TASKS: tuple[str, ...] = (
    "Write a Python function that checks whether a string is a palindrome, ignoring case, spaces and punctuation.",
    "Write a Python function that merges two sorted lists into one sorted list without using sort().",
    "Write a Python function that counts the words in a text and returns the five most common ones with counts.",
    "Write a Python function that parses a duration such as '1h30m15s' into a number of seconds.",
)


def edit_messages(instruction: str, text: str) -> list[dict[str, str]]:
    """The chat messages of one editing task."""
    return [{"role": "user", "content": f"{instruction}\n\n{text}"}]


def chat_prompts(tokenizer: Any, user_messages: Sequence[str]) -> list[list[int]]:
    """Token ids of each user message through the model's chat template (generation prompt added)."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": m}])) for m in user_messages]


def edit_user_messages(n: int | None = None) -> list[str]:
    """The first ``n`` editing tasks (all by default) as user-message text."""
    tasks = EDIT_TASKS if n is None else EDIT_TASKS[:n]
    return [edit_messages(i, t)[0]["content"] for i, t in tasks]


# ---- variants ---------------------------------------------------------------------------------------------
def spec_dict(method: str, k: int, adaptive: bool, model: str | None = None) -> dict[str, Any]:
    """The ``speculative_config`` of one variant, as ``LLM(speculative_config=...)`` takes it."""
    d: dict[str, Any] = {"method": method, "num_speculative_tokens": k, "adaptive": adaptive}
    if model is not None:
        d["model"] = model
    return d


def variants(method: str, fixed_ks: Sequence[int], k_max: int | None, model: str | None = None
             ) -> list[tuple[str, dict[str, Any] | None]]:
    """``(label, speculative_config)`` pairs: spec off, each fixed k, then adaptive with ``k_max`` (None: none).
    Labels: ``off``, ``ngram k=4``, ``draft k=3``, ``ngram adaptive k<=6``."""
    name = "draft" if method == "draft_model" else method
    out: list[tuple[str, dict[str, Any] | None]] = [("off", None)]
    out += [(f"{name} k={k}", spec_dict(method, k, False, model)) for k in fixed_ks]
    if k_max is not None:
        out.append((f"{name} adaptive k<={k_max}", spec_dict(method, k_max, True, model)))
    return out


# ---- per-step and per-round recording -----------------------------------------------------------------
class StepRecorder:
    """Per-step and per-round data of one engine, recorded by wrapping two instance methods.

    ``engine.scheduler.schedule`` is wrapped to read the step's rows: a decoding row (its own one token,
    then ``num_spec_tokens`` draft slots) contributes its k; every other row's tokens are prefill.
    ``engine.spec.observe`` (the controller) is wrapped to record every round's ``(slots, drafts, accepted)``.
    Nothing else is changed; call :meth:`detach` to restore both.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.rounds: list[tuple[int, int, int]] = []
        self.steps: dict[str, list[float]] = {key: [] for key in (
            "decodes", "sum_k", "num_k0", "prefill_tokens", "tokens", "seconds", "num_running_after",
            "last_mean_k_after")}
        self._this: dict[str, int] | None = None
        sched = engine.scheduler
        self._schedule = sched.schedule
        sched.schedule = self._wrapped_schedule
        self._observe: Callable[..., None] | None = None
        if engine.spec is not None:
            self._observe = engine.spec.observe
            engine.spec.observe = self._wrapped_observe

    def _wrapped_schedule(self) -> Any:
        so = self._schedule()
        ks: list[int] = []
        prefill = 0
        for s in so.scheduled:
            if s.num_scheduled_tokens - s.num_spec_tokens == 1 and s.num_computed_tokens + 1 == s.request.num_tokens:
                ks.append(s.num_spec_tokens)
            else:
                prefill += s.num_scheduled_tokens
        self._this = {"decodes": len(ks), "sum_k": sum(ks), "num_k0": sum(1 for k in ks if k == 0),
                      "prefill_tokens": prefill, "tokens": so.total_num_scheduled_tokens}
        return so

    def _wrapped_observe(self, request_id: str, num_slots: int, num_drafts: int, num_accepted: int) -> None:
        assert self._observe is not None
        self._observe(request_id, num_slots, num_drafts, num_accepted)
        if num_slots > 0:
            self.rounds.append((num_slots, num_drafts, num_accepted))

    def after_step(self, seconds: float) -> None:
        """Called after each ``engine.step()`` with its wall seconds."""
        this, self._this = self._this, None
        if this is None or this["tokens"] == 0:
            return
        spec = self.engine.spec
        for key, value in this.items():
            self.steps[key].append(value)
        self.steps["seconds"].append(round(seconds, 6))
        self.steps["num_running_after"].append(self.engine.scheduler.num_running)
        self.steps["last_mean_k_after"].append(round(spec.stats.last_mean_k, 4) if spec is not None else 0.0)

    def detach(self) -> None:
        sched = self.engine.scheduler
        sched.schedule = self._schedule
        if self._observe is not None:
            self.engine.spec.observe = self._observe


def closed_loop(engine: Any, requests: Sequence[tuple[list[int], Any]], concurrency: int,
                on_step: Callable[[float], None] | None = None, tag: str = "r",
                max_idle_steps: int = 1000) -> dict[str, Any]:
    """Run ``requests`` (``(prompt ids, SamplingParams)``) with at most ``concurrency`` in the engine at once.

    Requests are added in order; a new one as soon as one finishes. ``on_step(seconds)`` runs after every
    ``engine.step()``. Returns the output token ids per request (in request order), errors, wall seconds
    and the number of steps.

    Raises:
        RuntimeError: ``max_idle_steps`` steps in a row without any output (a stuck engine).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = deque(enumerate(requests))
    in_flight: dict[str, int] = {}
    outputs: list[list[int]] = [[] for _ in requests]
    errors: dict[int, str] = {}

    def fill() -> None:
        while pending and len(in_flight) < concurrency:
            i, (ids, params) = pending.popleft()
            rid = engine.add_request(f"{tag}{i}", {"prompt_token_ids": list(ids)}, params)
            in_flight[rid] = i

    t0 = time.perf_counter()
    fill()
    steps = idle = 0
    while in_flight:
        ts = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - ts
        steps += 1
        idle = 0 if outs else idle + 1
        if idle > max_idle_steps:
            raise RuntimeError(f"{max_idle_steps} engine steps without output, {len(in_flight)} requests in flight")
        for o in outs:
            if o.finished and o.request_id in in_flight:
                i = in_flight.pop(o.request_id)
                outputs[i] = list(o.outputs[0].token_ids) if o.outputs else []
                if o.error:
                    errors[i] = o.error
        if on_step is not None:
            on_step(seconds)
        fill()
    return {"outputs": outputs, "errors": errors, "wall_s": time.perf_counter() - t0, "steps": steps}


# ---- statistics (pure) ---------------------------------------------------------------------------------------
def round_stats(rounds: Sequence[tuple[int, int, int]]) -> dict[str, Any]:
    """Acceptance statistics of verification rounds ``(slots, drafts, accepted)``.

    Returns ``num_rounds`` (rounds with draft slots), ``num_drafts`` (rounds with >= 1 draft token),
    ``num_draft_tokens``, ``num_accepted_tokens``, ``acceptance_rate`` (accepted / draft tokens),
    ``mean_accepted_len`` (1 + accepted / num_drafts: tokens emitted per round), ``alpha_token`` (accepted /
    (accepted + rounds ended by a rejection): the geometric model's per-token acceptance), ``proposal_rate``
    (num_drafts / num_rounds: how often a proposal existed), ``mean_slots``. Ratios are None without data.
    """
    with_drafts = [r for r in rounds if r[1] > 0]
    draft_tokens = sum(r[1] for r in with_drafts)
    accepted = sum(r[2] for r in with_drafts)
    trials = sum(r[2] + (1 if r[2] < r[1] else 0) for r in with_drafts)
    return {
        "num_rounds": len(rounds), "num_drafts": len(with_drafts), "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "mean_accepted_len": 1 + accepted / len(with_drafts) if with_drafts else None,
        "alpha_token": accepted / trials if trials else None,
        "proposal_rate": len(with_drafts) / len(rounds) if rounds else None,
        "mean_slots": sum(r[0] for r in rounds) / len(rounds) if rounds else None,
    }


def compare_outputs(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How many requests' tokens equal the reference's, and where each differing one first diverges."""
    first_diff: dict[int, int] = {}
    for i, (a, b) in enumerate(zip(reference, other, strict=True)):
        if list(a) != list(b):
            first_diff[i] = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return {"identical": len(reference) - len(first_diff), "total": len(reference), "first_diff": first_diff}


def k_by_batch(steps: dict[str, list[float]], k_max: int) -> list[dict[str, Any]]:
    """Per number of decoding requests B: steps, mean k over the decodes, share of decodes with k = 0, both
    over all steps and over pure-decode steps (no prefill tokens), and the mean step seconds."""
    by_b: dict[int, list[int]] = {}
    for i, b in enumerate(steps["decodes"]):
        if b > 0:
            by_b.setdefault(int(b), []).append(i)
    rows = []
    for b in sorted(by_b):
        idx = by_b[b]
        pure = [i for i in idx if steps["prefill_tokens"][i] == 0]

        def agg(ix: list[int], b: int = b) -> tuple[float | None, float | None]:
            n = b * len(ix)
            if not ix:
                return None, None
            return (sum(steps["sum_k"][i] for i in ix) / n, sum(steps["num_k0"][i] for i in ix) / n)

        mk, z = agg(idx)
        pmk, pz = agg(pure)
        rows.append({"batch": b, "steps": len(idx), "mean_k": mk, "k0_share": z, "pure_steps": len(pure),
                     "pure_mean_k": pmk, "pure_k0_share": pz, "k_max": k_max,
                     "mean_step_s": statistics.fmean(steps["seconds"][i] for i in idx)})
    return rows


def measured_off_batch(rows: Sequence[dict[str, Any]], min_steps: int = 3) -> int | None:
    """The smallest B at which most decoding requests got k = 0: over pure-decode steps where at least
    ``min_steps`` of them have that B, else over all its steps (B with fewer steps are skipped). None: never."""
    for r in rows:
        if r["pure_steps"] >= min_steps:
            share = r["pure_k0_share"]
        elif r["steps"] >= min_steps:
            share = r["k0_share"]
        else:
            continue
        if share is not None and share > 0.5:
            return int(r["batch"])
    return None


def predict_off_batch(alpha: float, k_max: int, target_time: Callable[[float], float], budget: int,
                      proposal_rate: float = 1.0, min_gain: float = MIN_GAIN, max_batch: int = 256,
                      draft_time: Callable[[float], float] | None = None) -> int | None:
    """The smallest batch B (pure decode) at which no k in 1..k_max is predicted to gain more than ``min_gain``
    (``cost_model.spec_decode_step_speedup``; the controller's rule). None: speculation pays up to ``max_batch``."""
    from kvserve.cost_model import spec_decode_step_speedup

    alpha = min(max(alpha, 0.0), 0.99)  # the controller's cap (an estimate of 1.0 would promise k + 1 tokens)
    for b in range(1, max_batch + 1):
        best = max(spec_decode_step_speedup(alpha, k, b, 0, budget, target_time, draft_time, proposal_rate)
                   for k in range(1, k_max + 1))
        if best <= 1 + min_gain:
            return b
    return None


def acceptance_summary(section: dict[str, Any]) -> dict[str, Any] | None:
    """The section's acceptance for ``kvserve plan --bench-json``: its adaptive variant's numbers (the first
    concurrency that has one for ``load``), else all its speculative variants pooled. None without drafts."""
    groups = [section] if "variants" in section else [v for k, v in sorted(section.items()) if isinstance(v, dict)
                                                     and "variants" in v]
    candidates: list[tuple[str, dict[str, Any]]] = []
    for g in groups:
        candidates += [(label, v) for label, v in g["variants"].items() if v.get("spec")]
    adaptive = [(label, v) for label, v in candidates if v["spec"].get("adaptive")]
    chosen = adaptive[:1] or candidates
    draft = sum(v["rounds"]["num_draft_tokens"] for _, v in chosen)
    if not draft:
        return None
    accepted = sum(v["rounds"]["num_accepted_tokens"] for _, v in chosen)
    drafts = sum(v["rounds"]["num_drafts"] for _, v in chosen)
    out: dict[str, Any] = {"alpha": accepted / draft, "num_accepted_tokens": accepted, "num_draft_tokens": draft,
                           "num_drafts": drafts, "mean_accepted_len": 1 + accepted / drafts if drafts else None,
                           "variants": [label for label, _ in chosen]}
    if len(chosen) == 1:
        out["alpha_token"] = chosen[0][1]["rounds"]["alpha_token"]
    return out


def _f(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def section_table(variants_: dict[str, Any], with_c: bool = False) -> str:
    """One table row per variant: tokens, wall, tok/s, speedup vs off, acceptance, mean accepted length."""
    rows = []
    for label, v in variants_.items():
        r = v["rounds"]
        same = v.get("identical")
        rows.append(([v["concurrency"]] if with_c else []) + [
            label, v["output_tokens"], f"{v['wall_s']:.1f}", f"{v['output_tok_s']:.1f}",
            _f(v.get("speedup"), ".2f", "x"), _f(r["acceptance_rate"], ".1%"), _f(r["mean_accepted_len"]),
            _f(r["alpha_token"]), _f(v.get("mean_k")),
            "-" if same is None else f"{same['identical']}/{same['total']}", v["contention"]["other_cpu_frac"]])
    header = (["c"] if with_c else []) + ["variant", "out tok", "wall s", "tok/s", "vs off", "accept",
                                          "mean acc len", "alpha/token", "mean k", "same as off", "other cpu"]
    return table(rows, header)


# ---- machine -------------------------------------------------------------------------------------------------


# ---- running variants ---------------------------------------------------------------------------------------
class Bench:
    """Holds the arguments and the result, builds engines, runs variants, writes the JSON after each."""

    def __init__(self, args: argparse.Namespace, result: dict[str, Any], path: Path) -> None:
        self.args = args
        self.result = result
        self.path = path

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1) + "\n")
        tmp.replace(self.path)

    def make_llm(self, model: str, spec: dict[str, Any] | None, **extra: Any) -> Any:
        from kvserve import LLM

        a = self.args
        kwargs: dict[str, Any] = dict(num_threads=a.num_threads, dtype=a.dtype, seed=a.seed,
                                      kv_cache_memory=a.kv_cache_memory, max_model_len=a.max_model_len)
        kwargs.update(extra)
        return LLM(model, speculative_config=spec, **kwargs)

    def warmup(self, llm: Any) -> None:
        from kvserve import SamplingParams

        tok = llm.engine.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": "Say hello to the team."}])
        closed_loop(llm.engine, [(ids, SamplingParams(temperature=0, max_tokens=8))], 1, tag="warmup")

    def run_variant(self, model: str, label: str, spec: dict[str, Any] | None,
                    requests: Sequence[tuple[list[int], Any]], concurrency: int, keep_steps: bool = False,
                    engine_extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
        """One variant: a fresh engine, a warm-up, the closed loop under Contention; returns (row, llm)."""
        t = time.perf_counter()
        llm = self.make_llm(model, spec, **(engine_extra or {}))
        load_s = time.perf_counter() - t
        self.warmup(llm)
        engine = llm.engine
        rec = StepRecorder(engine)
        ctrl0 = engine.spec.stats.snapshot() if engine.spec is not None else None
        pre0 = engine.num_preemptions
        with Contention() as c:
            run = closed_loop(engine, requests, concurrency, rec.after_step, tag=f"{label}-")
        rec.detach()
        produced = sum(len(o) for o in run["outputs"])
        rs = round_stats(rec.rounds)
        decodes = sum(rec.steps["decodes"])
        row: dict[str, Any] = {
            "model": model, "spec": spec, "concurrency": concurrency, "num_requests": len(requests),
            "load_s": round(load_s, 2), "wall_s": run["wall_s"], "steps": run["steps"], "output_tokens": produced,
            "output_tok_s": produced / run["wall_s"], "rounds": rs, "errors": run["errors"],
            "mean_k": sum(rec.steps["sum_k"]) / decodes if decodes else 0.0,
            "preemptions": engine.num_preemptions - pre0, "contention": c.as_dict(),
            "outputs": run["outputs"]}
        if ctrl0 is not None:
            s = engine.spec.stats
            row["controller_stats"] = {"num_drafts": s.num_drafts - ctrl0.num_drafts,
                                       "num_draft_tokens": s.num_draft_tokens - ctrl0.num_draft_tokens,
                                       "num_accepted_tokens": s.num_accepted_tokens - ctrl0.num_accepted_tokens}
            row["target_time"] = [[n, t] for n, t in engine.spec.target_time.table()]
            if engine.spec.draft_time.known:
                row["draft_time"] = [[n, t] for n, t in engine.spec.draft_time.table()]
        if keep_steps:
            row["step_log"] = rec.steps
        print(f"  {label}: {produced} tokens in {run['wall_s']:.1f} s = {row['output_tok_s']:.1f} tok/s"
              + (f", acceptance {rs['acceptance_rate']:.1%}, mean accepted length {rs['mean_accepted_len']:.2f}"
                 if rs["acceptance_rate"] is not None else "")
              + f" (load {c.load_before[0]} -> {c.load_after[0]}, other cpu {c.other_cpu_frac:.3f})", flush=True)
        return row, llm

    def run_serial_section(self, name: str, model: str, requests: Sequence[tuple[list[int], Any]],
                           vs: list[tuple[str, dict[str, Any] | None]], info: dict[str, Any],
                           engine_extra: dict[str, Any] | None = None) -> dict[str, Any]:
        sec = self.result["sections"].setdefault(name, {"variants": {}})
        sec.update(info)
        for label, spec in vs:
            if label in sec["variants"]:
                print(f"  {label}: already in {self.path.name}, skipped")
                continue
            row, llm = self.run_variant(model, label, spec, requests, 1, engine_extra=engine_extra)
            del llm
            gc.collect()
            sec["variants"][label] = row
            finish_rows(sec["variants"])
            self.save()
        finish_rows(sec["variants"])
        acc = acceptance_summary(sec)
        if acc is not None:
            self.result.setdefault("acceptance", {})[name] = acc
        self.save()
        print(section_table(sec["variants"]))
        return sec


def finish_rows(vs: dict[str, Any]) -> None:
    """Speedup vs ``off`` and greedy equality with ``off`` for every other variant (where ``off`` exists)."""
    off = vs.get("off")
    if off is None:
        return
    for label, v in vs.items():
        v["speedup"] = v["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else None
        if label != "off":
            v["identical"] = compare_outputs(off["outputs"], v["outputs"])


# ---- sections ------------------------------------------------------------------------------------------------
def bench_ngram(b: Bench) -> None:
    from kvserve import SamplingParams

    a = b.args
    print(f"== ngram: {a.model}, editing prompts, c=1, greedy, max_tokens {a.max_tokens}")
    tok = _tokenizer(a.model)
    prompts = chat_prompts(tok, edit_user_messages(a.num_edit_prompts))
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    vs = variants("ngram", a.ngram_ks, a.ngram_kmax)
    sec = b.run_serial_section("ngram", a.model, [(p, params) for p in prompts], vs, {
        "model": a.model, "max_tokens": a.max_tokens, "prompt_tokens": [len(p) for p in prompts],
        "tasks": [t[0] for t in EDIT_TASKS[:len(prompts)]], "target_speedup": 2.0})
    _report_target(sec, 2.0)


def bench_draft(b: Bench) -> None:
    from kvserve import SamplingParams
    from kvserve.models.catalog import resolve_model_path

    a = b.args
    print(f"== draft: {a.draft_model} -> {a.target_model}, code prompts, c=1, greedy, max_tokens {a.draft_max_tokens}")
    for m in (a.target_model, a.draft_model):
        try:
            resolve_model_path(m)
        except Exception as e:  # noqa: BLE001 - ModelNotFoundError and friends: report and skip
            reason = f"{m} is not installed: {e}"
            print(f"  skipped: {reason}")
            b.result["sections"]["draft"] = {"skipped": reason}
            b.save()
            return
    tok = _tokenizer(a.target_model)
    prompts = chat_prompts(tok, CODE_TASKS[:a.num_code_prompts])
    params = SamplingParams(temperature=0, max_tokens=a.draft_max_tokens)
    vs = variants("draft_model", a.draft_ks, a.draft_kmax, a.draft_model)
    sec = b.run_serial_section("draft", a.target_model, [(p, params) for p in prompts], vs, {
        "model": a.target_model, "draft_model": a.draft_model, "max_tokens": a.draft_max_tokens,
        "prompt_tokens": [len(p) for p in prompts], "target_speedup": 1.5})
    _report_target(sec, 1.5)


def bench_load(b: Bench) -> None:
    from kvserve import SamplingParams
    from kvserve.bench.offline import make_mixed_workload

    a = b.args
    k = a.load_k
    sec = b.result["sections"].setdefault("load", {})
    sec.update(model=a.model, workload="mixed (workload A, kvserve.bench.offline.make_mixed_workload)", k=k,
               target="adaptive >= 0.95x off; fixed k regresses")
    for c in a.concurrency:
        n = a.num_prompts or 4 * c
        print(f"== load: workload A, {n} requests, c={c}, {a.model}: off, ngram k={k} fixed, ngram adaptive k<={k}")
        reqs = make_mixed_workload(n, a.seed)
        if a.load_max_tokens:
            reqs = [(p, min(o, a.load_max_tokens)) for p, o in reqs]
        requests = [(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)) for p, o in reqs]
        group = sec.setdefault(f"c{c}", {"concurrency": c, "num_prompts": n, "variants": {}})
        for label, spec in (("off", None), (f"ngram k={k}", spec_dict("ngram", k, False)),
                            (f"ngram adaptive k<={k}", spec_dict("ngram", k, True))):
            if label in group["variants"]:
                print(f"  {label}: already in {b.path.name}, skipped")
                continue
            row, llm = b.run_variant(a.model, label, spec, requests, c, keep_steps=True,
                                     engine_extra={"max_num_seqs": max(c, 64)})
            if spec is not None:
                row["k_by_batch"] = k_by_batch(row["step_log"], k)
                row["measured_off_batch"] = measured_off_batch(row["k_by_batch"])
            if spec is not None and spec["adaptive"]:
                ctrl = llm.engine.spec
                budget = llm.engine.config.max_num_batched_tokens
                rs = row["rounds"]
                rate = rs["proposal_rate"] if rs["proposal_rate"] is not None else 1.0
                pred: dict[str, Any] = {"budget": budget, "k_max": k, "proposal_rate": rate, "min_gain": MIN_GAIN,
                                        "target_time": row["target_time"]}
                for key in ("alpha_token", "acceptance_rate"):
                    al = rs[key]
                    pred[key] = al
                    pred[f"off_batch_at_{key}"] = (None if al is None else
                                                   predict_off_batch(al, k, ctrl.target_time, budget, rate))
                row["prediction"] = pred
            del llm
            gc.collect()
            group["variants"][label] = row
            finish_rows(group["variants"])
            b.save()
        finish_rows(group["variants"])
        print(section_table(group["variants"], with_c=True))
        ad = group["variants"].get(f"ngram adaptive k<={k}")
        if ad is not None and "k_by_batch" in ad:
            print(k_table(ad["k_by_batch"]))
            p = ad.get("prediction", {})
            print(f"  k drops to 0 at batch {ad['measured_off_batch']} (measured, adaptive); predicted "
                  f"{p.get('off_batch_at_alpha_token')} at alpha/token {_f(p.get('alpha_token'))}, "
                  f"{p.get('off_batch_at_acceptance_rate')} at acceptance rate {_f(p.get('acceptance_rate'))} "
                  f"(proposal rate {_f(p.get('proposal_rate'))})")
            if ad.get("speedup") is not None:
                print(f"  adaptive vs off: {ad['speedup']:.2f}x (target >= 0.95x)")
    acc = acceptance_summary(sec)
    if acc is not None:
        b.result.setdefault("acceptance", {})["load"] = acc
    b.save()


def k_table(rows: Sequence[dict[str, Any]]) -> str:
    """Mean k per power-of-two range of the decode batch size B (the JSON has every B)."""
    edges = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    out = []
    lo = 1
    for hi in edges:
        sel = [r for r in rows if lo <= r["batch"] <= hi]
        lo = hi + 1
        if not sel:
            continue
        steps = sum(r["steps"] for r in sel)
        mk = sum((r["mean_k"] or 0) * r["steps"] * r["batch"] for r in sel) / sum(r["steps"] * r["batch"] for r in sel)
        z = sum((r["k0_share"] or 0) * r["steps"] * r["batch"] for r in sel) / sum(r["steps"] * r["batch"] for r in sel)
        ps = sum(r["pure_steps"] for r in sel)
        t = sum(r["mean_step_s"] * r["steps"] for r in sel) / steps
        rng_ = f"{sel[0]['batch']}" if sel[0]["batch"] == sel[-1]["batch"] else f"{sel[0]['batch']}-{sel[-1]['batch']}"
        out.append([rng_, steps, ps, f"{mk:.2f}", f"{z:.0%}", f"{1000 * t:.1f}"])
    return table(out, ["decodes B", "steps", "pure-decode steps", "mean k", "k=0 share", "step ms"])


def bench_steptime(b: Bench) -> None:
    from kvserve.models.catalog import resolve_model_path

    a = b.args
    sec = b.result["sections"].setdefault("steptime", {"models": {}})
    sizes = a.steptime_sizes
    for model in a.steptime_models:
        if model in sec["models"]:
            print(f"  {model}: already in {b.path.name}, skipped")
            continue
        try:
            resolve_model_path(model)
        except Exception as e:  # noqa: BLE001
            print(f"== steptime: {model} skipped: {e}")
            sec["models"][model] = {"skipped": str(e)}
            b.save()
            continue
        print(f"== steptime: {model}, forward of M tokens, best of {a.steptime_repeats}")
        llm = b.make_llm(model, None)
        with Contention() as c:
            times = llm.engine.runner.measure_forward_times(list(sizes), repeats=a.steptime_repeats)
        del llm
        gc.collect()
        t1 = dict(times).get(1)
        rows = [{"tokens": n, "seconds": t, "vs_1": t / t1 if t1 else None} for n, t in times]
        sec["models"][model] = {"rows": rows, "contention": c.as_dict()}
        b.save()
        print(table([[r["tokens"], f"{1000 * r['seconds']:.2f}", _f(r["vs_1"], ".2f", "x"),
                      f"{r['tokens'] / r['seconds']:.0f}"] for r in rows],
                    ["M tokens", "forward ms", "vs M=1", "tok/s"]))


def _report_target(sec: dict[str, Any], target: float) -> None:
    best = max(((label, v["speedup"]) for label, v in sec["variants"].items()
                if label != "off" and v.get("speedup") is not None), key=lambda x: x[1], default=None)
    if best is not None:
        print(f"  best: {best[0]} {best[1]:.2f}x (target >= {target:g}x)")


def _tokenizer(model: str) -> Any:
    from kvserve.models.catalog import resolve_model_path
    from kvserve.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_path(resolve_model_path(model))


# ---- main ----------------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", type=_names, default=list(SECTIONS), help=f"comma-separated: {','.join(SECTIONS)}")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="ngram, load and steptime target")
    ap.add_argument("--target-model", default="qwen2.5-coder-1.5b-instruct", help="draft section target")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--kv-cache-memory", type=float, default=4.0, help="GiB (c=64 of workload A needs ~3 in fp32)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=256, help="ngram section")
    ap.add_argument("--num-edit-prompts", type=int, default=None, help=f"ngram prompts (default all {len(EDIT_TASKS)})")
    ap.add_argument("--ngram-ks", type=_ints, default=[2, 4, 6])
    ap.add_argument("--ngram-kmax", type=int, default=6, help="adaptive variant's k_max (0: no adaptive variant)")
    ap.add_argument("--draft-max-tokens", type=int, default=128)
    ap.add_argument("--num-code-prompts", type=int, default=len(CODE_TASKS))
    ap.add_argument("--draft-ks", type=_ints, default=[2, 3, 4])
    ap.add_argument("--draft-kmax", type=int, default=4, help="adaptive variant's k_max (0: none)")
    ap.add_argument("--concurrency", type=_ints, default=[16, 64], help="load section")
    ap.add_argument("--num-prompts", type=int, default=None, help="load requests per concurrency (default 4 x c)")
    ap.add_argument("--load-k", type=int, default=4)
    ap.add_argument("--load-max-tokens", type=int, default=None, help="cap workload A's output lengths (smoke runs)")
    ap.add_argument("--steptime-models", type=_names, default=["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"])
    ap.add_argument("--steptime-sizes", type=_ints, default=[1, 2, 3, 4, 5, 6, 7, 8, 16, 32])
    ap.add_argument("--steptime-repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON path (default results/spec_decode_<host>_<timestamp>.json)")
    ap.add_argument("--resume", default=None, metavar="FILE", help="continue a JSON: run only what it lacks")
    args = ap.parse_args(argv)
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {', '.join(bad)} (known: {', '.join(SECTIONS)})")
    args.ngram_kmax = args.ngram_kmax or None
    args.draft_kmax = args.draft_kmax or None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_thread_env(args.num_threads)
    if args.resume:
        path = Path(args.resume)
        result = json.loads(path.read_text())
        result.setdefault("runs", []).append({"args": vars(args), "loadavg_at_start": list(os.getloadavg())})
    else:
        host = socket.gethostname().split(".")[0] or "host"
        path = Path(args.out) if args.out else RESULTS / f"spec_decode_{host}_{time.strftime('%Y%m%d-%H%M%S')}.json"
        result = {"benchmark": "spec_decode", "machine": machine_info(), "env": environment(args.num_threads),
                  "args": vars(args), "sections": {}}
    b = Bench(args, result, path)
    runners = {"ngram": bench_ngram, "draft": bench_draft, "load": bench_load, "steptime": bench_steptime}
    for s in SECTIONS:
        if s in args.sections:
            runners[s](b)
    b.save()
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
