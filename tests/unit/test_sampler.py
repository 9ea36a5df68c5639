"""Tests of kvserve.sample.sampler: greedy, distributions (chi-square), seeding, penalties, logprobs.

Expected distributions are computed independently in numpy (float64) from the definitions, not with the
sampler's own helpers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from kvserve.sample.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    apply_penalties,
    compute_probs,
)
from kvserve.sampling_params import SamplingParams

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])

# A fixed 10-token logits vector for the distribution tests; no top-p / min-p boundary is near a test value.
BASE_LOGITS = [2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.5]
NUM_DRAWS = 20_000


def _metadata(
    params: list[SamplingParams],
    vocab: int,
    device: torch.device,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[0]] * n,
        outputs if outputs is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        vocab,
        device,
    )


# ---------------------------------------------------------------------------------------------------------
# numpy reference
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


def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------------------------------------------------
# greedy
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_all_greedy_is_argmax(device: torch.device) -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 101, device=device)
    md = _metadata([SamplingParams(temperature=0.0)] * 7, 101, device)
    assert md.all_greedy and not md.all_random
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.device.type == device.type
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_greedy_in_bf16(device: torch.device) -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0]], dtype=torch.bfloat16, device=device)
    out = Sampler()(logits, _metadata([SamplingParams(temperature=0.0)], 4, device))
    assert out.sampled_token_ids.tolist() == [2]


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_greedy_rows_unaffected_by_random_rows(device: torch.device) -> None:
    torch.manual_seed(1)
    vocab = 64
    logits = torch.randn(8, vocab, device=device)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.0, top_p=0.5, top_k=2),  # truncation is ignored for greedy rows
        SamplingParams(temperature=0.8, top_p=0.7, seed=3),
        SamplingParams(temperature=0.0, min_p=0.9),
        SamplingParams(temperature=2.0, min_p=0.1),
        SamplingParams(temperature=1e-6),  # below the greedy threshold
        SamplingParams(temperature=1.0),
    ]
    gens: list[torch.Generator | None] = [None] * 8
    gens[3] = torch.Generator(device=device).manual_seed(3)
    md = _metadata(params, vocab, device, generators=gens)
    assert not md.all_greedy and not md.all_random
    greedy_rows = [0, 2, 4, 6]
    expected = logits.argmax(dim=-1)
    for _ in range(20):
        out = Sampler()(logits, md)
        assert torch.equal(out.sampled_token_ids[greedy_rows], expected[greedy_rows])
        assert bool(((out.sampled_token_ids >= 0) & (out.sampled_token_ids < vocab)).all())


def test_logits_not_modified() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 20)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=2),
        SamplingParams(temperature=1.0, presence_penalty=0.5),
    ]
    md = _metadata(params, 20, torch.device("cpu"), prompts=[[1], [2], [3]], outputs=[[4], [5], [6]])
    Sampler()(logits, md)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------------------
# distributions (chi-square goodness of fit)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.0, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 0.7, "top_k": 6, "top_p": 0.9, "min_p": 0.05},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_distribution_chi_square(kwargs: dict[str, float]) -> None:
    vocab = len(BASE_LOGITS)
    expected = ref_probs(BASE_LOGITS, **kwargs)  # type: ignore[arg-type]
    kept = expected > 0
    # Each case must actually exercise its filter (or none, for plain temperature).
    if any(k in kwargs for k in ("top_k", "top_p", "min_p")):
        assert 0 < kept.sum() < vocab

    torch.manual_seed(1234)
    logits = torch.tensor(BASE_LOGITS).expand(NUM_DRAWS, vocab).contiguous()
    md = _metadata([SamplingParams(**kwargs)] * NUM_DRAWS, vocab, torch.device("cpu"))  # type: ignore[arg-type]
    assert md.all_random
    out = Sampler()(logits, md)
    counts = np.bincount(out.sampled_token_ids.numpy(), minlength=vocab)

    assert counts[~kept].sum() == 0, f"filtered-out tokens were drawn: {counts}"
    f_exp = expected[kept] / expected[kept].sum() * counts[kept].sum()
    result = chisquare(counts[kept], f_exp)
    assert result.pvalue > 1e-3, f"counts {counts}, expected {np.round(f_exp)}, p={result.pvalue}"


def test_top_k_keeps_exactly_k_and_top_p_keeps_top_token() -> None:
    vocab = len(BASE_LOGITS)
    logits = torch.tensor([BASE_LOGITS, BASE_LOGITS, BASE_LOGITS])
    params = [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.01),  # smaller than the top token's mass: keep just it
        SamplingParams(top_k=-1, top_p=1.0, min_p=0.0, temperature=1.0),  # everything disabled
    ]
    probs = compute_probs(logits, _metadata(params, vocab, torch.device("cpu"))).numpy()
    assert (probs[0] > 0).sum() == 3 and set(np.nonzero(probs[0])[0]) == {0, 1, 2}
    assert probs[1].tolist() == [1.0] + [0.0] * (vocab - 1)
    np.testing.assert_allclose(probs[2], ref_probs(BASE_LOGITS), atol=1e-6)


def test_top_k_larger_than_vocab_is_harmless() -> None:
    logits = torch.tensor([BASE_LOGITS])
    probs = compute_probs(logits, _metadata([SamplingParams(top_k=1000)], 10, torch.device("cpu")))
    np.testing.assert_allclose(probs[0].numpy(), ref_probs(BASE_LOGITS), atol=1e-6)


def test_disabled_top_p_keeps_tiny_tail_in_mixed_batch() -> None:
    # The top token's float32 probability rounds to 1.0, so a naive cumsum test would drop the tail of a
    # row with top_p == 1 whenever another row turns top-p on.
    row = [20.0, 0.0, -1.0, 0.0, -2.0]
    logits = torch.tensor([row, row])
    params = [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)]
    probs = compute_probs(logits, _metadata(params, 5, torch.device("cpu")))
    assert bool((probs[0] > 0).all())
    np.testing.assert_allclose(probs[0].numpy(), ref_probs(row), rtol=1e-5)
    assert probs[1].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_min_p_one_keeps_the_top_tokens() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    probs = compute_probs(logits, _metadata([SamplingParams(min_p=1.0)], 4, torch.device("cpu")))
    np.testing.assert_allclose(probs[0].numpy(), [0.0, 0.5, 0.5, 0.0], atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.7]),
    top_k=st.integers(-1, 12),
    top_p=st.sampled_from([0.1, 0.5, 0.8, 0.95, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_compute_probs_matches_reference(
    seed: int, vocab: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    x = np.random.default_rng(seed).normal(0.0, 2.0, vocab).astype(np.float32)
    xs = np.sort(x.astype(np.float64))
    assume(np.diff(xs).min() > 1e-4)  # no near-ties: tie-breaking would be arbitrary
    # Stay away from float32-vs-float64 boundary effects of min-p and top-p.
    p = _softmax(x.astype(np.float64) / temperature)
    if min_p > 0:
        assume(np.abs(p - min_p * p.max()).min() > 1e-5)
    if top_p < 1:
        cut = ref_probs(x, temperature, max(top_k, 0), 1.0, min_p)
        sorted_cut = np.sort(cut)[::-1]
        assume(np.abs(np.cumsum(sorted_cut) - top_p).min() > 1e-4)
    # Two rows so that a batch with mixed params (row 1 disabled) is exercised too.
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
        SamplingParams(temperature=1.0),
    ]
    logits = torch.from_numpy(np.stack([x, x]))
    probs = compute_probs(logits, _metadata(params, vocab, torch.device("cpu"))).numpy()
    expected = ref_probs(x, temperature, max(top_k, 0), top_p, min_p)
    np.testing.assert_allclose(probs[0], expected, atol=1e-5)
    assert ((probs[0] > 0) == (expected > 0)).all()
    np.testing.assert_allclose(probs[1], ref_probs(x), atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# seeding
# ---------------------------------------------------------------------------------------------------------

SEED_VOCAB = 50
SEED_STEPS = 50
SEED_ROW = 5


def _step_logits(step: int, device: torch.device) -> torch.Tensor:
    """Deterministic, fairly flat logits for step ``step``: ``[V]``."""
    g = torch.Generator().manual_seed(10_000 + step)
    return (torch.randn(SEED_VOCAB, generator=g) * 0.5).to(device)


def _run_alone(params: SamplingParams, seed: int, device: torch.device) -> list[int]:
    gen = torch.Generator(device=device).manual_seed(seed)
    prompt = [1, 2, 3]
    out: list[int] = []
    sampler = Sampler()
    for step in range(SEED_STEPS):
        md = _metadata([params], SEED_VOCAB, device, prompts=[prompt], outputs=[list(out)], generators=[gen])
        tok = sampler(_step_logits(step, device).unsqueeze(0), md).sampled_token_ids
        out.append(int(tok[0]))
    return out


_OTHER_ROWS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=4, seed=11),
    SamplingParams(temperature=1.2, top_p=0.6),
    SamplingParams(temperature=0.5, min_p=0.3, seed=12),
    SamplingParams(temperature=1.0, frequency_penalty=1.5, presence_penalty=-0.5),
    # (row 5 goes here)
    SamplingParams(temperature=0.0, repetition_penalty=1.8, seed=13),  # seeded greedy
    SamplingParams(temperature=0.3, top_k=2, top_p=0.9, logprobs=3),
    SamplingParams(temperature=1.0, seed=14),
    SamplingParams(temperature=1.5),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.7, top_k=10, min_p=0.05, seed=15, repetition_penalty=1.2),
    SamplingParams(temperature=2.0, top_p=0.3),
    SamplingParams(temperature=1.0, top_k=-1, seed=16),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.1, frequency_penalty=-0.7),
]


def _run_batched(params: SamplingParams, seed: int, device: torch.device) -> list[int]:
    rows = _OTHER_ROWS[:SEED_ROW] + [params] + _OTHER_ROWS[SEED_ROW:]
    assert len(rows) == 16 and rows[SEED_ROW] is params
    gens: list[torch.Generator | None] = []
    for i, p in enumerate(rows):
        if i == SEED_ROW:
            gens.append(torch.Generator(device=device).manual_seed(seed))
        elif p.seed is not None:
            gens.append(torch.Generator(device=device).manual_seed(p.seed))
        else:
            gens.append(None)
    prompts = [[1, 2, 3]] * 16
    outputs: list[list[int]] = [[] for _ in range(16)]
    # The other rows see different logits (a shifted, reversed copy), and the default RNG is disturbed
    # between steps, so nothing but row 5's own generator can make its tokens repeat.
    torch.manual_seed(999)
    sampler = Sampler()
    for step in range(SEED_STEPS):
        base = _step_logits(step, device)
        logits = torch.stack([base if i == SEED_ROW else base.flip(0) * (1 + i / 10) for i in range(16)])
        md = _metadata(rows, SEED_VOCAB, device, prompts=prompts, outputs=outputs, generators=gens)
        toks = sampler(logits, md).sampled_token_ids.tolist()
        for i, t in enumerate(toks):
            outputs[i].append(t)
        torch.rand(step + 1)
    return outputs[SEED_ROW]


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize(
    "row_params",
    [
        SamplingParams(temperature=1.0, seed=1234),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234),
        SamplingParams(temperature=1.3, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.4, seed=1234),
    ],
    ids=["plain", "topk_topp", "minp_penalties"],
)
def test_seeded_row_independent_of_batch(row_params: SamplingParams, device: torch.device) -> None:
    alone = _run_alone(row_params, 1234, device)
    batched = _run_batched(row_params, 1234, device)
    assert alone == batched
    assert len(set(alone)) > 5  # the distribution is not degenerate, so equality means something
    other_seed = _run_alone(row_params, 4321, device)
    assert other_seed != alone


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_seeded_row_consumes_one_draw_per_step(device: torch.device) -> None:
    vocab = 37
    gen = torch.Generator(device=device).manual_seed(7)
    ref = torch.Generator(device=device).manual_seed(7)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, seed=7),
        SamplingParams(temperature=0),
    ]
    logits = torch.randn(3, vocab, device=device)
    for _ in range(3):
        Sampler()(logits, _metadata(params, vocab, device, generators=[None, gen, None]))
        torch.empty(vocab, device=device).exponential_(generator=ref)
        assert torch.equal(gen.get_state(), ref.get_state())


def test_all_seeded_batch_leaves_default_rng_alone() -> None:
    params = [SamplingParams(seed=1), SamplingParams(seed=2, top_k=3)]
    gens: list[torch.Generator | None] = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    md = _metadata(params, 10, torch.device("cpu"), generators=gens)
    logits = torch.randn(2, 10)
    state = torch.get_rng_state()
    Sampler()(logits, md)
    assert torch.equal(torch.get_rng_state(), state)


def test_seeded_greedy_row_generator_is_not_used() -> None:
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    params = [SamplingParams(temperature=0.0, seed=5), SamplingParams(temperature=1.0)]
    md = _metadata(params, 10, torch.device("cpu"), generators=[gen, None])
    assert md.generators == {}
    Sampler()(torch.randn(2, 10), md)
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_two_rows_one_seeded_one_not(device: torch.device) -> None:
    vocab = 16
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=42)]

    def run() -> list[int]:
        gen = torch.Generator(device=device).manual_seed(42)
        md = _metadata(params, vocab, device, generators=[None, gen])
        return [int(Sampler()(logits, md).sampled_token_ids[1]) for _ in range(20)]

    md = _metadata(params, vocab, device, generators=[None, torch.Generator(device=device).manual_seed(42)])
    assert list(md.generators) == [1] and md.all_random
    assert md.temperature.device.type == device.type
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.shape == (2,) and out.sampled_token_ids.device.type == device.type
    torch.manual_seed(1)
    first = run()
    torch.manual_seed(2)  # the unseeded row's RNG changes; the seeded row's tokens must not
    assert run() == first


# ---------------------------------------------------------------------------------------------------------
# penalties
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_penalties_hand_computed(device: torch.device) -> None:
    vocab = 6
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
        ],
        device=device,
    )
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(),  # no penalty: unchanged even though others have one
        SamplingParams(presence_penalty=-0.5, repetition_penalty=0.5),
    ]
    prompts = [[0, 1], [0, 1, 2, 3, 4], [4]]
    outputs = [[2, 2, 3], [5, 5], [5, 5, 5]]
    md = _metadata(params, vocab, device, prompts=prompts, outputs=outputs)
    assert md.prompt_token_ids is not None and md.prompt_token_ids.shape == (3, 5)
    assert md.output_token_ids is not None and md.output_token_ids.shape == (3, 3)
    assert md.prompt_token_ids[2].tolist() == [4, 6, 6, 6, 6]  # padded with vocab_size
    # Row 0: repetition 2 on {0, 1, 2, 3} (prompt + output): 2/2, -1*2, 0.5/2, -0.5*2;
    #        then output counts {2: 2, 3: 1}: token 2: 0.25 - 2*0.5 - 0.3; token 3: -1 - 1*0.5 - 0.3.
    # Row 2: repetition 0.5 on {4, 5}: 3/0.5 = 6, 0/0.5 = 0; presence -0.5 on {5}: 0 + 0.5.
    expected = torch.tensor(
        [
            [1.0, -2.0, -1.05, -1.8, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
            [2.0, -1.0, 0.5, -0.5, 6.0, 0.5],
        ]
    )
    got = apply_penalties(logits, md)
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=1e-6)
    # The greedy choice follows the penalized logits: row 2's winner is still 4, row 0's is 4.
    greedy_params = [p.clone(temperature=0.0, logprobs=6) for p in params]
    greedy = _metadata(greedy_params, vocab, device, prompts, outputs)
    out = Sampler()(logits, greedy)
    assert out.sampled_token_ids.tolist() == [4, 4, 4]
    assert out.logprobs is not None
    lp = out.logprobs.logprobs[:, 1:].cpu().numpy()
    ids = out.logprobs.token_ids[:, 1:].cpu().numpy()
    ref = ref_log_softmax(expected.numpy())
    np.testing.assert_allclose(lp, np.take_along_axis(ref, ids, axis=1), atol=1e-5)


def test_frequency_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.2)]
    md = _metadata(params, 3, torch.device("cpu"), prompts=[[0]], outputs=[[0]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]
    # Prompt tokens are not counted by frequency/presence: with no output, token 0 wins.
    md = _metadata(params, 3, torch.device("cpu"), prompts=[[0, 0, 0]], outputs=[[]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [0]


def test_no_penalty_tensors_without_penalties() -> None:
    md = _metadata([SamplingParams(), SamplingParams(temperature=0)], 8, torch.device("cpu"))
    assert md.presence_penalties is None and md.frequency_penalties is None
    assert md.repetition_penalties is None
    assert md.prompt_token_ids is None and md.output_token_ids is None
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.max_num_logprobs is None
    logits = torch.randn(2, 8)
    assert apply_penalties(logits, md) is logits


def test_build_fields() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=5),  # greedy: its top_k alone does not turn top-k on
        SamplingParams(top_k=-1, logprobs=2),
        SamplingParams(top_k=7, top_p=0.5, min_p=0.1, logprobs=4),
    ]
    md = _metadata(params, 100, torch.device("cpu"))
    assert md.top_k is not None and md.top_k.tolist() == [5, 0, 7] and md.top_k.dtype == torch.int64
    assert md.top_p is not None and md.top_p.tolist() == [1.0, 1.0, 0.5] and md.top_p.dtype == torch.float32
    assert md.min_p is not None and md.min_p[2].item() == pytest.approx(0.1)
    assert md.max_num_logprobs == 4
    assert md.temperature.dtype == torch.float32
    only_greedy_truncation = _metadata(params[:1] + [SamplingParams()], 100, torch.device("cpu"))
    assert only_greedy_truncation.top_k is None
    with pytest.raises(ValueError):
        SamplingMetadata.build(params, [[1]], [[]] * 3, [None] * 3, 100, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------
# logprobs
# ---------------------------------------------------------------------------------------------------------


def _check_logprobs(lp: LogprobsTensors, sampled: torch.Tensor, ref: np.ndarray, n: int) -> None:
    s = sampled.cpu().numpy()
    ids = lp.token_ids.cpu().numpy()
    vals = lp.logprobs.cpu().numpy()
    assert ids.shape == vals.shape == (len(s), n + 1)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    assert lp.ranks.dtype == torch.int64
    np.testing.assert_array_equal(ids[:, 0], s)
    np.testing.assert_allclose(vals, np.take_along_axis(ref, ids, axis=1), atol=1e-5)
    # Top-N: the N most likely ids, most likely first.
    np.testing.assert_array_equal(ids[:, 1:], np.argsort(-ref, axis=1, kind="stable")[:, :n])
    assert (np.diff(vals[:, 1:], axis=1) <= 0).all()
    ranks = 1 + (ref > ref[np.arange(len(s)), s][:, None]).sum(axis=1)
    np.testing.assert_array_equal(lp.ranks.cpu().numpy(), ranks)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_logprobs_of_penalized_logits_before_temperature(device: torch.device) -> None:
    vocab = 30
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.3, logprobs=2),  # temperature must not change the logprobs
        SamplingParams(temperature=5.0, top_k=2, logprobs=None),  # neither must top-k
        SamplingParams(temperature=1.0, top_p=0.2, repetition_penalty=1.7, frequency_penalty=0.4, logprobs=1),
        SamplingParams(temperature=2.0, min_p=0.5, presence_penalty=1.0, logprobs=3),
    ]
    prompts = [[0, 1], [2], [3, 4, 5], [6, 7, 8, 9], [10]]
    outputs = [[11], [12, 12], [], [13, 13, 6], [14, 14]]
    md = _metadata(params, vocab, device, prompts, outputs)
    assert md.max_num_logprobs == 5
    torch.manual_seed(0)
    for _ in range(10):  # several draws so that sampled ranks other than 1 occur
        out = Sampler()(logits.to(device), md)
        assert out.logprobs is not None
        penalized = apply_penalties(logits.to(device), md).cpu().numpy()
        _check_logprobs(out.logprobs, out.sampled_token_ids, ref_log_softmax(penalized), 5)
    assert out.logprobs is not None and out.logprobs.ranks[0].item() == 1  # greedy row: the argmax


def test_logprobs_sampled_rank_can_exceed_one() -> None:
    vocab = 8
    logits = torch.zeros(500, vocab)  # uniform: the sampled token is usually not the top-1 id
    logits[:, 0] = 0.01
    md = _metadata([SamplingParams(logprobs=0)] * 500, vocab, torch.device("cpu"))
    torch.manual_seed(5)
    out = Sampler()(logits, md)
    assert out.logprobs is not None
    _check_logprobs(out.logprobs, out.sampled_token_ids, ref_log_softmax(logits.numpy()), 0)
    assert (out.logprobs.ranks > 1).any() and (out.logprobs.ranks == 1).any()


def test_logprobs_n_capped_at_vocab() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    out = Sampler()(logits, _metadata([SamplingParams(temperature=0, logprobs=20)], 3, torch.device("cpu")))
    assert out.logprobs is not None and out.logprobs.token_ids.tolist() == [[1, 1, 0, 2]]
    assert out.logprobs.ranks.tolist() == [1]


def test_empty_batch() -> None:
    md = _metadata([], 10, torch.device("cpu"))
    out = Sampler()(torch.empty(0, 10), md)
    assert out.sampled_token_ids.shape == (0,)
