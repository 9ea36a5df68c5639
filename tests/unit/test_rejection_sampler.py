"""Tests of kvserve.sample.rejection_sampler: greedy verification, losslessness (chi-square), seeding, shapes.

Expected distributions are computed independently in numpy (float64) from the definitions (Leviathan et al.
2023; Chen et al. 2023): with target ``p`` and draft ``q``, a draft is accepted with probability
``beta = sum_x min(p(x), q(x))``; given acceptance it is distributed as ``min(p, q) / beta``; given rejection
the emitted token is distributed as ``max(0, p - q) / (1 - beta)``; and the first emitted token, overall, is
distributed as ``p``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kvserve.sample.rejection_sampler import RejectionOutput, rejection_sample
from kvserve.sample.sampler import SamplingMetadata, compute_probs
from kvserve.sampling_params import SamplingParams

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
CPU = torch.device("cpu")

# Fixed toy target logits (one vector per position) and a draft distribution that differs a lot from the
# target: no mass on token 0 (the target's favourite, so only the residual can emit it) and mass on tokens the
# target's top-k / top-p filters drop (such drafts must always be rejected).
BASE_LOGITS = [2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.5]
BONUS_LOGITS = [-0.5, 0.2, 1.0, -1.0, 0.7, 1.8, 0.1, 0.4, -0.2, 0.9]
THIRD_LOGITS = [0.3, -0.3, 0.6, 1.4, -0.9, 0.0, 0.8, 1.1, -0.6, 0.2]
DRAFT_LOGITS = [-1.0, 0.5, 2.0, -0.5, 1.0, 0.0, 1.5, -2.0, 0.3, 0.8]
VOCAB = len(BASE_LOGITS)
NUM_TRIALS = 20_000


# ---------------------------------------------------------------------------------------------------------
# numpy reference and helpers
# ---------------------------------------------------------------------------------------------------------


def _softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    e = np.where(finite, np.exp(x - x[finite].max()), 0.0)
    return e / e.sum()


def ref_probs(
    logits: list[float] | np.ndarray,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    """Temperature, then min-p, then top-k, then top-p (on the top-k-renormalized distribution)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    if min_p > 0:
        p = _softmax(x)
        x = np.where(p >= min_p * p.max(), x, -np.inf)
    if top_k > 0:
        order = np.argsort(-x, kind="stable")
        x = x.copy()
        x[order[top_k:]] = -np.inf
    if top_p < 1.0:
        p = _softmax(x)
        order = np.argsort(-p, kind="stable")
        mass_before = np.cumsum(p[order]) - p[order]
        keep_sorted = mass_before < top_p
        keep_sorted[0] = True
        x = x.copy()
        x[order[~keep_sorted]] = -np.inf
    return _softmax(x)


def _draft_q(logits: list[float], zero: tuple[int, ...] = (0,)) -> np.ndarray:
    q = _softmax(np.asarray(logits, dtype=np.float64))
    q[list(zero)] = 0.0
    return q / q.sum()


def _metadata(params: list[SamplingParams], device: torch.device, vocab: int = VOCAB) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[0]] * n, [[]] * n, [None] * n, vocab, device)


def _per_position(row_params: list[SamplingParams], drafts: list[list[int]]) -> list[SamplingParams]:
    """Each row's params repeated k_i + 1 times, as the caller builds the position metadata."""
    return [p for p, d in zip(row_params, drafts, strict=True) for _ in range(len(d) + 1)]


def _assert_distribution(tokens: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Chi-square goodness of fit of ``tokens`` against ``expected`` (which need not be normalised)."""
    counts = np.bincount(tokens, minlength=len(expected))
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"{what}: tokens outside the support were emitted: {counts}"
    f_exp = expected[kept] / expected[kept].sum() * counts[kept].sum()
    result = chisquare(counts[kept], f_exp)
    assert result.pvalue > 1e-3, f"{what}: counts {counts}, expected {np.round(f_exp)}, p={result.pvalue}"


def _assert_binomial(successes: int, trials: int, prob: float, what: str) -> None:
    sigma = np.sqrt(trials * prob * (1 - prob))
    assert abs(successes - trials * prob) <= 4.5 * sigma + 1e-9, f"{what}: {successes}/{trials}, expected p={prob}"


def _check_output_shape(out: RejectionOutput, drafts: list[list[int]], vocab: int) -> None:
    assert len(out.token_ids) == len(out.num_accepted) == len(drafts)
    for toks, a, d in zip(out.token_ids, out.num_accepted, drafts, strict=True):
        assert 0 <= a <= len(d) and len(toks) == a + 1
        assert toks[:a] == d[:a]
        assert 0 <= toks[-1] < vocab


# ---------------------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------------------


def _peaked_logits(argmaxes: list[int], vocab: int) -> torch.Tensor:
    """One logits row per argmax, with a distinct runner-up so that ties cannot decide anything."""
    rows = torch.arange(vocab, dtype=torch.float32).repeat(len(argmaxes), 1) * 0.1
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
    return rows


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("mixed", [False, True], ids=["all_greedy", "with_random_row"])
def test_greedy_hand_built(device: torch.device, mixed: bool) -> None:
    vocab = 6
    drafts = [
        [3, 1, 4],  # all accepted: emit them and the bonus argmax
        [5, 1],  # rejected at position 0
        [2, 2, 5, 0],  # rejected in the middle (draft 3)
        [],  # k = 0: just the argmax
        [4],  # one draft, accepted
    ]
    argmaxes = [
        [3, 1, 4, 2],
        [0, 1, 3],
        [2, 2, 1, 0, 5],
        [4],
        [4, 0],
    ]
    expected = [[3, 1, 4, 2], [0], [2, 2, 1], [4], [4, 0]]
    row_params = [SamplingParams(temperature=0.0)] * len(drafts)
    if mixed:  # a random row in the batch sends the greedy rows through the torch.where path
        drafts.append([1, 2])
        argmaxes.append([0, 0, 0])
        row_params.append(SamplingParams(temperature=1.0))
    logits = _peaked_logits([a for row in argmaxes for a in row], vocab).to(device)
    before = logits.clone()
    md = _metadata(_per_position(row_params, drafts), device, vocab)
    assert md.all_greedy is not mixed
    out = rejection_sample(logits, drafts, None, md, {})
    _check_output_shape(out, drafts, vocab)
    assert out.token_ids[: len(expected)] == expected
    assert out.num_accepted[: len(expected)] == [3, 0, 2, 0, 1]
    assert torch.equal(logits, before)


def _greedy_continuation(table: np.ndarray, start: int, length: int) -> list[int]:
    out, last = [], start
    for _ in range(length):
        last = int(np.argmax(table[last]))
        out.append(last)
    return out


def test_greedy_equals_plain_greedy_decoding() -> None:
    """A bigram "model": the target's logits after token t are ``table[t]``. Plain greedy decoding from a start
    token is known; drafts are that continuation, corrupted at a random place (or not at all). Whatever the
    drafts, the emitted tokens must be a prefix of the plain greedy continuation, ending at the first wrong
    draft (the corrected token) or one past the last draft (the bonus)."""
    vocab = 23
    rng = np.random.default_rng(0)
    table = rng.normal(0.0, 1.0, (vocab, vocab)).astype(np.float32)
    num_rows = 300
    drafts: list[list[int]] = []
    contexts: list[list[int]] = []
    continuations: list[list[int]] = []
    expected_accepted: list[int] = []
    for _ in range(num_rows):
        start = int(rng.integers(vocab))
        k = int(rng.integers(0, 6))
        cont = _greedy_continuation(table, start, k + 1)
        d = cont[:k]
        wrong_at = int(rng.integers(0, k + 1))  # == k: no corruption
        if wrong_at < k:
            d[wrong_at] = (d[wrong_at] + 1 + int(rng.integers(vocab - 1))) % vocab
        drafts.append(d)
        contexts.append([start] + d)
        continuations.append(cont)
        expected_accepted.append(wrong_at)
    logits = torch.from_numpy(table[[t for ctx in contexts for t in ctx]])
    row_params = [SamplingParams(temperature=0.0, top_k=3) if i % 3 else SamplingParams(temperature=1e-6)
                  for i in range(num_rows)]
    out = rejection_sample(logits, drafts, None, _metadata(_per_position(row_params, drafts), CPU, vocab), {})
    assert out.num_accepted == expected_accepted
    for toks, cont, a in zip(out.token_ids, continuations, expected_accepted, strict=True):
        assert toks == cont[: a + 1]
    assert set(expected_accepted) == set(range(6))  # every rejection place (and full acceptance) occurred


# ---------------------------------------------------------------------------------------------------------
# random rows: losslessness
# ---------------------------------------------------------------------------------------------------------


LOSSLESS_CASES = [
    {"temperature": 0.5},
    {"temperature": 1.0},
    {"temperature": 1.5},
    {"temperature": 1.0, "top_k": 4},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 0.7, "top_k": 6, "top_p": 0.9, "min_p": 0.05},
]


@pytest.mark.parametrize("kwargs", LOSSLESS_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_lossless_one_draft(kwargs: dict[str, float]) -> None:
    p0 = ref_probs(BASE_LOGITS, **kwargs)  # type: ignore[arg-type]
    p1 = ref_probs(BONUS_LOGITS, **kwargs)  # type: ignore[arg-type]
    q = _draft_q(DRAFT_LOGITS)
    if "top_k" in kwargs or "top_p" in kwargs:
        assert (q[p0 == 0] > 0).any()  # some drafts are tokens the target filtered out
    beta = np.minimum(p0, q).sum()
    assert 0.2 < beta < 0.8  # the draft is far from the target: both branches get thousands of trials

    rng = np.random.default_rng(1)
    draft_tokens = rng.choice(VOCAB, size=NUM_TRIALS, p=q)
    drafts = [[int(t)] for t in draft_tokens]
    logits = torch.tensor([BASE_LOGITS, BONUS_LOGITS]).repeat(NUM_TRIALS, 1)
    draft_probs = torch.tensor(q, dtype=torch.float32).expand(NUM_TRIALS, VOCAB).contiguous()
    md = _metadata([SamplingParams(**kwargs)] * (2 * NUM_TRIALS), CPU)  # type: ignore[arg-type]
    torch.manual_seed(1234)
    out = rejection_sample(logits, drafts, draft_probs, md, {})
    _check_output_shape(out, drafts, VOCAB)

    first = np.array([t[0] for t in out.token_ids])
    accepted = np.array(out.num_accepted) == 1
    _assert_distribution(first, p0, "first token")
    _assert_binomial(int(accepted.sum()), NUM_TRIALS, beta, "acceptance")
    _assert_distribution(first[accepted], np.minimum(p0, q), "accepted drafts")
    _assert_distribution(first[~accepted], np.maximum(p0 - q, 0.0), "tokens emitted at a rejection")
    bonus = np.array([t[1] for t in out.token_ids if len(t) == 2])
    _assert_distribution(bonus, p1, "bonus token")


def test_lossless_two_drafts() -> None:
    """k = 2 with a different target and draft at each position: the emitted tokens at steps 1, 2 and 3 follow
    the target at positions 0, 1 and 2, and the number of accepted drafts follows beta_0 and beta_1."""
    kwargs = {"temperature": 0.8, "top_k": 7}
    p = [ref_probs(x, **kwargs) for x in (BASE_LOGITS, BONUS_LOGITS, THIRD_LOGITS)]  # type: ignore[arg-type]
    q = [_draft_q(DRAFT_LOGITS), _draft_q(BASE_LOGITS[::-1], zero=(5,))]
    beta = [np.minimum(p[j], q[j]).sum() for j in range(2)]

    rng = np.random.default_rng(2)
    d1 = rng.choice(VOCAB, size=NUM_TRIALS, p=q[0])
    d2 = rng.choice(VOCAB, size=NUM_TRIALS, p=q[1])
    drafts = [[int(a), int(b)] for a, b in zip(d1, d2, strict=True)]
    logits = torch.tensor([BASE_LOGITS, BONUS_LOGITS, THIRD_LOGITS]).repeat(NUM_TRIALS, 1)
    draft_probs = torch.tensor(np.stack(q), dtype=torch.float32).repeat(NUM_TRIALS, 1)
    md = _metadata([SamplingParams(**kwargs)] * (3 * NUM_TRIALS), CPU)  # type: ignore[arg-type]
    torch.manual_seed(99)
    out = rejection_sample(logits, drafts, draft_probs, md, {})
    _check_output_shape(out, drafts, VOCAB)

    accepted = np.array(out.num_accepted)
    expected_accepted = np.array([1 - beta[0], beta[0] * (1 - beta[1]), beta[0] * beta[1]])
    _assert_distribution(accepted, expected_accepted, "number of accepted drafts")
    for step in range(3):
        tokens = np.array([t[step] for t in out.token_ids if len(t) > step])
        _assert_distribution(tokens, p[step], f"emitted token {step + 1}")
    # Given the first draft was accepted, the second step follows p_1 whatever the first token was.
    for first in np.argsort(-np.minimum(p[0], q[0]))[:2]:
        after = np.array([t[1] for t in out.token_ids if len(t) > 1 and t[0] == first])
        assert len(after) > 1000
        _assert_distribution(after, p[1], f"token 2 after token 1 = {first}")


def test_deterministic_drafts() -> None:
    """draft_probs None (n-gram drafts, q one-hot): a draft d is accepted with probability p(d), never when the
    target filtered it out, and the emitted token follows p."""
    kwargs = {"temperature": 1.0, "top_k": 6}
    p0 = ref_probs(BASE_LOGITS, **kwargs)  # type: ignore[arg-type]
    drafts = [[i % VOCAB] for i in range(NUM_TRIALS)]  # every token is proposed NUM_TRIALS / VOCAB times
    logits = torch.tensor([BASE_LOGITS, BONUS_LOGITS]).repeat(NUM_TRIALS, 1)
    md = _metadata([SamplingParams(**kwargs)] * (2 * NUM_TRIALS), CPU)  # type: ignore[arg-type]
    torch.manual_seed(7)
    out = rejection_sample(logits, drafts, None, md, {})
    _check_output_shape(out, drafts, VOCAB)

    first = np.array([t[0] for t in out.token_ids])
    accepted = np.array(out.num_accepted) == 1
    proposed = np.array([d[0] for d in drafts])
    _assert_distribution(first, p0, "first token")
    per_token = NUM_TRIALS // VOCAB
    for token in range(VOCAB):
        n_acc = int(accepted[proposed == token].sum())
        if p0[token] == 0:
            assert n_acc == 0, f"draft {token} was filtered out by top-k but accepted {n_acc} times"
        else:
            _assert_binomial(n_acc, per_token, float(p0[token]), f"acceptance of draft {token}")
    # At a rejection the draft itself is never emitted.
    assert not (first[~accepted] == proposed[~accepted]).any()
    # Rows that proposed the top token: a rejection must emit from p without it.
    mask = (proposed == 0) & ~accepted
    residual = p0.copy()
    residual[0] = 0.0
    _assert_distribution(first[mask], residual, "tokens emitted after rejecting draft 0")


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_p_equals_q_accepts_every_draft(device: torch.device) -> None:
    vocab = 50
    gen = torch.Generator().manual_seed(3)
    row_params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.4, top_p=0.7),
        SamplingParams(temperature=0.9, min_p=0.1, top_k=20, top_p=0.95),
    ] * 60
    ks = [1 + i % 4 for i in range(len(row_params))]
    positions = [p for p, k in zip(row_params, ks, strict=True) for _ in range(k + 1)]
    logits = (torch.randn(len(positions), vocab, generator=gen) * 2).to(device)
    md = _metadata(positions, device, vocab)
    probs = compute_probs(logits, md)  # the target distributions, exactly as the rejection sampler computes them
    starts = np.cumsum([0] + [k + 1 for k in ks[:-1]])
    verify_rows = torch.tensor([s + j for s, k in zip(starts, ks, strict=True) for j in range(k)], device=device)
    draft_probs = probs[verify_rows]
    flat = torch.multinomial(draft_probs.cpu(), 1, generator=gen).squeeze(1).tolist()
    drafts, i = [], 0
    for k in ks:
        drafts.append(flat[i : i + k])
        i += k
    torch.manual_seed(0)
    out = rejection_sample(logits, drafts, draft_probs, md, {})
    _check_output_shape(out, drafts, vocab)
    assert out.num_accepted == ks
    # The bonus tokens come from the last position's target distribution (never from a filtered-out token).
    bonus_pos = [s + k for s, k in zip(starts, ks, strict=True)]
    for toks, pos in zip(out.token_ids, bonus_pos, strict=True):
        assert probs[pos, toks[-1]].item() > 0


def test_zero_uniform_edge_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every uniform exactly 0 (possible, if rare), a draft the target filtered out is still rejected, a
    draft with q(d) == 0 but p(d) > 0 is accepted, and every other draft is accepted."""
    def zeros(*size: int, generator: torch.Generator | None = None, device: torch.device | None = None) -> torch.Tensor:
        return torch.zeros(*size, device=device)

    monkeypatch.setattr(torch, "rand", zeros)
    kwargs = {"temperature": 1.0, "top_k": 3}
    p0 = ref_probs(BASE_LOGITS, **kwargs)  # type: ignore[arg-type]
    q = _draft_q(DRAFT_LOGITS)  # q[0] == 0; p0 keeps tokens {0, 1, 2} only
    assert q[0] == 0 and p0[0] > 0 and p0[5] == 0 and q[5] > 0
    drafts = [[0], [5], [1], [2, 9]]
    draft_probs = torch.tensor(np.stack([q] * 5), dtype=torch.float32)
    logits = torch.tensor([BASE_LOGITS]).repeat(9, 1)
    md = _metadata([SamplingParams(**kwargs)] * 9, CPU)  # type: ignore[arg-type]
    out = rejection_sample(logits, drafts, draft_probs, md, {})
    assert out.num_accepted == [1, 0, 1, 1]
    assert out.token_ids[1][0] != 5 and p0[out.token_ids[1][0]] > 0


def test_mixed_batch_greedy_and_random_rows() -> None:
    """Greedy rows with drafts, random rows with k = 0 and random rows with drafts, interleaved: greedy rows are
    exact, the k = 0 random rows sample from p_0, and the random rows with drafts follow p_0 too."""
    kwargs = {"temperature": 1.2, "top_p": 0.9}
    p0 = ref_probs(BASE_LOGITS, **kwargs)  # type: ignore[arg-type]
    q = _draft_q(DRAFT_LOGITS)
    rng = np.random.default_rng(5)
    greedy_argmax = int(np.argmax(BASE_LOGITS))
    groups = 6000
    drafts: list[list[int]] = []
    row_params: list[SamplingParams] = []
    logits_rows: list[list[float]] = []
    for _ in range(groups):
        # greedy, k = 2: first draft right, second wrong (the target at position 1 is BONUS_LOGITS)
        drafts.append([greedy_argmax, 0])
        row_params.append(SamplingParams(temperature=0.0))
        logits_rows += [BASE_LOGITS, BONUS_LOGITS, THIRD_LOGITS]
        # random, k = 0
        drafts.append([])
        row_params.append(SamplingParams(**kwargs))  # type: ignore[arg-type]
        logits_rows += [BASE_LOGITS]
        # random, k = 1, draft drawn from q
        drafts.append([int(rng.choice(VOCAB, p=q))])
        row_params.append(SamplingParams(**kwargs))  # type: ignore[arg-type]
        logits_rows += [BASE_LOGITS, BONUS_LOGITS]
    # Greedy rows' draft_probs are ignored; give them something that is not q.
    draft_probs = torch.tensor(np.stack([np.full(VOCAB, 1.0 / VOCAB)] * 2 + [q] * 1), dtype=torch.float32)
    draft_probs = draft_probs.repeat(groups, 1)
    md = _metadata(_per_position(row_params, drafts), CPU)
    assert not md.all_greedy and not md.all_random
    torch.manual_seed(11)
    out = rejection_sample(torch.tensor(logits_rows), drafts, draft_probs, md, {})
    _check_output_shape(out, drafts, VOCAB)
    bonus_argmax = int(np.argmax(BONUS_LOGITS))
    assert all(t == [greedy_argmax, bonus_argmax] for t in out.token_ids[0::3])
    assert set(out.num_accepted[0::3]) == {1}
    assert set(out.num_accepted[1::3]) == {0}
    _assert_distribution(np.array([t[0] for t in out.token_ids[1::3]]), p0, "k = 0 random rows")
    _assert_distribution(np.array([t[0] for t in out.token_ids[2::3]]), p0, "k = 1 random rows")


# ---------------------------------------------------------------------------------------------------------
# seeding and randomness consumption
# ---------------------------------------------------------------------------------------------------------

SEED_VOCAB = 40
SEED_STEPS = 25
SEED_ROW = 5
SEED_K = 3
SEED_PARAMS = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)

# (params, k) of the 15 other rows; rows with a seed get their own generator.
_OTHER_ROWS: list[tuple[SamplingParams, int]] = [
    (SamplingParams(temperature=0.0), 2),
    (SamplingParams(temperature=0.9, top_k=4, seed=11), 0),
    (SamplingParams(temperature=1.2, top_p=0.6), 4),
    (SamplingParams(temperature=0.5, min_p=0.3, seed=12), 1),
    (SamplingParams(temperature=1.0), 0),
    # (row 5 goes here)
    (SamplingParams(temperature=0.0), 0),
    (SamplingParams(temperature=0.3, top_k=2, top_p=0.9), 3),
    (SamplingParams(temperature=1.0, seed=14), 5),
    (SamplingParams(temperature=1.5), 1),
    (SamplingParams(temperature=0.0), 4),
    (SamplingParams(temperature=0.7, top_k=10, min_p=0.05, seed=15), 2),
    (SamplingParams(temperature=2.0, top_p=0.3), 2),
    (SamplingParams(temperature=1.0, seed=16), 3),
    (SamplingParams(temperature=0.8), 0),
    (SamplingParams(temperature=1.1), 1),
]


def _step_inputs(step: int, k: int, salt: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Deterministic (target logits [k+1, V], drafts [k], draft probs [k, V]) for one row and step."""
    g = torch.Generator().manual_seed(10_000 * salt + step)
    logits = torch.randn(k + 1, SEED_VOCAB, generator=g) * 0.8
    # The draft is the target at a higher temperature plus noise: close enough that every outcome occurs.
    draft_probs = torch.softmax(logits[:k] * 0.6 + torch.randn(k, SEED_VOCAB, generator=g) * 0.5, dim=-1)
    drafts = torch.multinomial(draft_probs, 1, generator=g).squeeze(1).tolist() if k else []
    return logits, drafts, draft_probs


def _run_alone(seed: int, device: torch.device) -> list[list[int]]:
    gen = torch.Generator(device=device).manual_seed(seed)
    md = _metadata([SEED_PARAMS] * (SEED_K + 1), device, SEED_VOCAB)
    out: list[list[int]] = []
    for step in range(SEED_STEPS):
        logits, drafts, draft_probs = _step_inputs(step, SEED_K, salt=0)
        res = rejection_sample(logits.to(device), [drafts], draft_probs.to(device), md, {0: gen})
        out.append(res.token_ids[0])
    return out


def _run_batched(seed: int, device: torch.device) -> list[list[int]]:
    rows = _OTHER_ROWS[:SEED_ROW] + [(SEED_PARAMS, SEED_K)] + _OTHER_ROWS[SEED_ROW:]
    assert len(rows) == 16
    gens: dict[int, torch.Generator] = {SEED_ROW: torch.Generator(device=device).manual_seed(seed)}
    for i, (p, _) in enumerate(rows):
        if i != SEED_ROW and p.seed is not None:
            gens[i] = torch.Generator(device=device).manual_seed(p.seed)
    positions = [p for p, k in rows for _ in range(k + 1)]
    md = _metadata(positions, device, SEED_VOCAB)
    torch.manual_seed(999)
    out: list[list[int]] = []
    for step in range(SEED_STEPS):
        inputs = [_step_inputs(step, k, salt=0 if i == SEED_ROW else i + 1) for i, (_, k) in enumerate(rows)]
        logits = torch.cat([x[0] for x in inputs]).to(device)
        drafts = [x[1] for x in inputs]
        draft_probs = torch.cat([x[2] for x in inputs]).to(device)
        res = rejection_sample(logits, drafts, draft_probs, md, gens)
        _check_output_shape(res, drafts, SEED_VOCAB)
        out.append(res.token_ids[SEED_ROW])
        torch.rand(step + 1)  # disturb the default RNG between steps
    return out


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_seeded_row_independent_of_batch(device: torch.device) -> None:
    alone = _run_alone(1234, device)
    assert _run_batched(1234, device) == alone
    # The outcomes are varied, so equality means something: several rejection places and many tokens.
    assert len({len(t) for t in alone}) >= 3
    assert len({tok for t in alone for tok in t}) > 10
    assert _run_alone(4321, device) != alone


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_seeded_generator_consumption_is_fixed(device: torch.device) -> None:
    """Each seeded random row consumes rand(k) then one V-sized exponential per call, wherever it rejects."""
    vocab = SEED_VOCAB
    ks = [0, 3, 2, 1]
    row_params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.8, seed=2, top_k=5),
                  SamplingParams(temperature=1.0), SamplingParams(temperature=1.3, seed=3)]
    seeded = [0, 1, 3]
    gens = {i: torch.Generator(device=device).manual_seed(100 + i) for i in seeded}
    refs = {i: torch.Generator(device=device).manual_seed(100 + i) for i in seeded}
    md = _metadata([p for p, k in zip(row_params, ks, strict=True) for _ in range(k + 1)], device, vocab)
    seen_accepted: set[int] = set()
    for step in range(20):
        inputs = [_step_inputs(step, k, salt=i + 1) for i, k in enumerate(ks)]
        logits = torch.cat([x[0] for x in inputs]).to(device)
        draft_probs = torch.cat([x[2] for x in inputs]).to(device)
        out = rejection_sample(logits, [x[1] for x in inputs], draft_probs, md, gens)
        seen_accepted.update(out.num_accepted[1:2])
        for i in seeded:
            if ks[i]:
                torch.rand(ks[i], generator=refs[i], device=device)
            torch.empty(vocab, device=device).exponential_(generator=refs[i])
            assert torch.equal(gens[i].get_state(), refs[i].get_state()), f"row {i}, step {step}"
    assert len(seen_accepted) >= 3  # row 1 rejected at different places, with the same consumption


def test_all_seeded_batch_leaves_default_rng_alone_and_greedy_draws_nothing() -> None:
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    drafts = [[1, 2], [3]]
    params = [SamplingParams(seed=1)] * 3 + [SamplingParams(seed=2, top_k=3)] * 2
    gens = {0: torch.Generator().manual_seed(1), 1: torch.Generator().manual_seed(2)}
    state = torch.get_rng_state()
    rejection_sample(logits, drafts, None, _metadata(params, CPU, 12), gens)
    assert torch.equal(torch.get_rng_state(), state)

    greedy = _metadata([SamplingParams(temperature=0.0)] * 5, CPU, 12)
    gen = torch.Generator().manual_seed(5)
    gen_state = gen.get_state()
    rejection_sample(logits, drafts, None, greedy, {0: gen})
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(gen.get_state(), gen_state)


# ---------------------------------------------------------------------------------------------------------
# shapes and validation
# ---------------------------------------------------------------------------------------------------------


def test_empty_batch() -> None:
    out = rejection_sample(torch.empty(0, 10), [], None, _metadata([], CPU, 10), {})
    assert out.token_ids == [] and out.num_accepted == []


def test_all_rows_without_drafts_is_the_plain_sampler() -> None:
    """k = 0 everywhere: one token per row, greedy rows exact, random rows from p_0 (with draft_probs [0, V])."""
    n = NUM_TRIALS // 2
    kwargs = {"temperature": 0.7, "min_p": 0.1}
    params = [SamplingParams(**kwargs) if i % 2 else SamplingParams(temperature=0.0) for i in range(n)]  # type: ignore[arg-type]
    logits = torch.tensor([BASE_LOGITS]).repeat(n, 1)
    torch.manual_seed(3)
    out = rejection_sample(logits, [[] for _ in range(n)], torch.empty(0, VOCAB), _metadata(params, CPU), {})
    assert out.num_accepted == [0] * n
    assert all(t == [0] for t in out.token_ids[0::2])
    _assert_distribution(np.array([t[0] for t in out.token_ids[1::2]]), ref_probs(BASE_LOGITS, **kwargs), "k = 0")  # type: ignore[arg-type]


def _valid_inputs() -> tuple[torch.Tensor, list[list[int]], torch.Tensor, SamplingMetadata]:
    drafts = [[1, 2], [], [3]]
    logits = torch.randn(6, 8)
    return logits, drafts, torch.full((3, 8), 1 / 8), _metadata([SamplingParams(top_k=3)] * 6, CPU, 8)


def test_validation_errors() -> None:
    logits, drafts, dp, md = _valid_inputs()
    out = rejection_sample(logits, drafts, dp, md, {})  # the valid inputs are accepted
    _check_output_shape(out, drafts, 8)
    with pytest.raises(ValueError, match=r"target_logits has 5 rows but 3 rows with 3 drafts need .* = 6"):
        rejection_sample(logits[:5], drafts, dp, md, {})
    with pytest.raises(ValueError, match=r"target_logits must be \[T, V\]"):
        rejection_sample(logits.reshape(-1), drafts, dp, md, {})
    with pytest.raises(ValueError, match=r"target_logits has 6 rows but 3 rows with 4 drafts"):
        rejection_sample(logits, [[1, 2], [0], [3]], dp, md, {})
    with pytest.raises(ValueError, match=r"draft_probs has shape \(2, 8\), expected \(sum\(k_i\), V\) = \(3, 8\)"):
        rejection_sample(logits, drafts, dp[:2], md, {})
    with pytest.raises(ValueError, match=r"draft_probs has shape \(3, 7\)"):
        rejection_sample(logits, drafts, dp[:, :7], md, {})
    with pytest.raises(ValueError, match=r"position_metadata has \(3,\) temperatures, expected .* \(6\)"):
        rejection_sample(logits, drafts, dp, _metadata([SamplingParams()] * 3, CPU, 8), {})
    bad_top_k = _metadata([SamplingParams(top_k=3)] * 6, CPU, 8)
    assert bad_top_k.top_k is not None
    bad_top_k.top_k = bad_top_k.top_k[:4]
    with pytest.raises(ValueError, match=r"position_metadata.top_k has shape \(4,\)"):
        rejection_sample(logits, drafts, dp, bad_top_k, {})
    with pytest.raises(ValueError, match=r"row 2 has draft token id 8, outside \[0, 8\)"):
        rejection_sample(logits, [[1, 2], [], [8]], dp, md, {})
    with pytest.raises(ValueError, match=r"row 0 has draft token id -1"):
        rejection_sample(logits, [[-1, 2], [], [3]], None, md, {})
    with pytest.raises(ValueError, match=r"generator for row 3, but there are 3 rows"):
        rejection_sample(logits, drafts, dp, md, {3: torch.Generator()})
