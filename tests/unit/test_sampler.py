"""Sampler: greedy, filters, penalties, seeds, logprobs; frequencies checked against independently computed
probabilities with a chi-square test (threshold from the closed-form chi-square tail, no scipy)."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from rooflm.layers.sampler import (
    Sampler,
    SamplingMetadata,
    add_tokens_to_counts,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    logprobs_to_dicts,
    make_generator,
    token_counts,
    token_mask,
)
from rooflm.engine.stop_checker import banned_token_ids
from rooflm.sampling_params import SamplingParams

sampler = Sampler()


def md_for(params: list[SamplingParams], generators=None, outputs=None, prompts=None, eos=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        device="cpu",
        banned_token_ids=None if eos is None else [
            banned_token_ids(len(o), p, {eos}) for p, o in zip(params, outputs or [[]] * n)],
    )


# ---------------------------------------------------------------------------------------------------------------
# chi-square tail, closed form (integer degrees of freedom)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, x/2) in closed form."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    total = math.erfc(math.sqrt(h))
    for i in range(1, (df + 1) // 2):
        total += math.exp(-h) * h ** (i - 0.5) / math.gamma(i + 0.5)
    return total


def chi2_threshold(df: int, alpha: float) -> float:
    """The x with P(X > x) = alpha, by bisection."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def test_chi2_helpers_against_known_quantiles():
    # Textbook values: chi2(1) 95% = 3.841, chi2(5) 99% = 15.086, chi2(4) 99.9% = 18.467.
    assert chi2_threshold(1, 0.05) == pytest.approx(3.841, abs=1e-3)
    assert chi2_threshold(5, 0.01) == pytest.approx(15.086, abs=1e-3)
    assert chi2_threshold(4, 0.001) == pytest.approx(18.467, abs=1e-3)


def assert_frequencies_match(counts: np.ndarray, expected_p: np.ndarray, alpha: float = 1e-6) -> None:
    """Pearson chi-square goodness of fit; tokens with expected probability 0 must never be drawn."""
    total = counts.sum()
    support = expected_p > 0
    assert counts[~support].sum() == 0, f"drew filtered tokens: counts={counts}, expected={expected_p}"
    exp_counts = expected_p[support] * total
    stat = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return
    limit = chi2_threshold(df, alpha)
    assert stat < limit, f"chi2={stat:.2f} >= {limit:.2f} (df={df}); counts={counts}, expected={exp_counts}"


# Expected distributions, computed here from the definitions (float64 numpy), not by the implementation.
LOGITS6 = np.array([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    p = np_softmax(np.asarray(logits, dtype=np.float64) / temperature)
    keep = np.ones_like(p, dtype=bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    order = np.argsort(-p, kind="stable")
    if top_k > 0:
        keep = np.zeros_like(keep)
        keep[order[:top_k]] = True
        p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    if top_p < 1:
        keep = np.zeros_like(keep)
        mass = 0.0
        for i in order:  # smallest set of the best tokens reaching top_p
            keep[i] = True
            mass += p[i]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    return p


STAT_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(temperature=1.0, top_p=0.8),  # keeps 3 tokens: 0.538 + 0.198 < 0.8 <= + 0.120
    dict(temperature=0.8, top_p=0.85),  # keeps 3 tokens: 0.629 + 0.180 < 0.85 <= + 0.097
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, min_p=0.2),  # keeps 3 tokens: p >= 0.2 * 0.538
    dict(temperature=1.3, min_p=0.12, top_k=4, top_p=0.85),  # min_p drops 1, top_k 1 more, top_p 1 more
]


@pytest.mark.parametrize("case", STAT_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sampling_frequencies_match_expected_distribution(case):
    draws = 20_000
    torch.manual_seed(1234)
    params = [SamplingParams(**case)] * draws
    logits = torch.tensor(LOGITS6, dtype=torch.float32).repeat(draws, 1)  # [draws, 6]
    tokens = sampler(logits, md_for(params)).sampled_token_ids.numpy()
    counts = np.bincount(tokens, minlength=6)
    assert_frequencies_match(counts, ref_probs(LOGITS6, **case))


def test_seeded_rows_frequencies_match_expected_distribution():
    # The per-row generator path (one generator per row), not the shared global draw.
    draws = 4_000
    case = dict(temperature=0.9, top_p=0.9, seed=7)
    params = [SamplingParams(**case)] * draws
    gens = [make_generator(7, i, "cpu") for i in range(draws)]
    logits = torch.tensor(LOGITS6, dtype=torch.float32).repeat(draws, 1)
    tokens = sampler(logits, md_for(params, generators=gens)).sampled_token_ids.numpy()
    assert_frequencies_match(np.bincount(tokens, minlength=6), ref_probs(LOGITS6, temperature=0.9, top_p=0.9))


def test_statistical_test_detects_a_wrong_distribution():
    # Guard against a vacuous test: T=1 samples must fail against the T=0.6 distribution.
    draws = 20_000
    torch.manual_seed(99)
    logits = torch.tensor(LOGITS6, dtype=torch.float32).repeat(draws, 1)
    tokens = sampler(logits, md_for([SamplingParams(temperature=1.0)] * draws)).sampled_token_ids.numpy()
    with pytest.raises(AssertionError):
        assert_frequencies_match(np.bincount(tokens, minlength=6), ref_probs(LOGITS6, temperature=0.6))


# ---------------------------------------------------------------------------------------------------------------
# greedy, top_k = 1


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 300)
    out = sampler(logits, md_for([SamplingParams(temperature=0)] * 16))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None


def test_top_k_1_equals_greedy_even_at_high_temperature():
    torch.manual_seed(1)
    logits = torch.randn(64, 1000) * 0.01  # nearly flat: high temperature would scatter samples widely
    logits[5, 10] = logits[5, 20] = logits[5].max() + 1  # a tie at the top: argmax takes the first index
    greedy = sampler(logits, md_for([SamplingParams(temperature=0)] * 64)).sampled_token_ids
    for temperature in (1.0, 100.0):
        params = [SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(64)]
        gens = [make_generator(i, 0, "cpu") if i % 2 else None for i in range(64)]
        got = sampler(logits, md_for(params, generators=gens)).sampled_token_ids
        assert torch.equal(got, greedy)
    assert greedy[5].item() == 10


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(2)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    md = md_for(params)
    assert not md.all_greedy and not md.all_random
    out = sampler(logits, md).sampled_token_ids
    assert torch.equal(out[0::2], logits[0::2].argmax(dim=-1))
    assert ((out >= 0) & (out < 50)).all()


# ---------------------------------------------------------------------------------------------------------------
# seeds and batch invariance


def test_make_generator_is_deterministic_per_seed_and_index():
    def draw(seed, idx):
        return torch.empty(8).exponential_(generator=make_generator(seed, idx, "cpu"))

    assert torch.equal(draw(42, 0), draw(42, 0))
    assert not torch.equal(draw(42, 0), draw(42, 1))
    assert not torch.equal(draw(42, 0), draw(43, 0))
    assert torch.equal(draw(-5, 3), draw(-5, 3))  # negative and large seeds are fine
    draw(2**70, 0)


def run_steps(
    row_logits: list[torch.Tensor], position: int, batch: int, others_seed: int, device: str = "cpu"
) -> list[int]:
    """Sample one seeded row for several steps, at ``position`` in a batch of ``batch`` rows whose other rows are
    random (seeded and unseeded, greedy and filtered). Returns the seeded row's tokens."""
    target = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    gen = make_generator(1234, 0, device)
    rng = torch.Generator().manual_seed(others_seed)
    other_params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, seed=99),
        SamplingParams(temperature=0.7, min_p=0.1),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=1.0, top_k=5, logprobs=3),
    ]
    other_gens = {1: make_generator(99, 0, device)}
    tokens: list[int] = []
    for step_logits in row_logits:
        params, gens, rows = [], [], []
        for j in range(batch):
            if j == position:
                params.append(target), gens.append(gen), rows.append(step_logits)
            else:
                k = (j + others_seed) % len(other_params)
                params.append(other_params[k]), gens.append(other_gens.get(k))
                rows.append(torch.randn(step_logits.shape, generator=rng))
        outputs = [[1, 2, 3]] * batch
        md = SamplingMetadata.from_params(params, outputs, [[]] * batch, gens, device=device)
        out = sampler(torch.stack(rows).to(device), md)
        tokens.append(int(out.sampled_token_ids[position]))
    return tokens


def test_seeded_row_is_independent_of_the_batch():
    torch.manual_seed(3)
    row_logits = [torch.randn(500) for _ in range(6)]
    alone = run_steps(row_logits, position=0, batch=1, others_seed=0)
    for position, batch, others_seed in [(0, 4, 1), (3, 4, 2), (5, 9, 3), (2, 7, 4)]:
        torch.manual_seed(others_seed * 1000)  # the global RNG state differs too
        assert run_steps(row_logits, position, batch, others_seed) == alone
    assert len(set(alone)) > 1  # really sampled, not stuck on one token


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.zeros(1, 1000)  # uniform: any change of stream changes the token
    p = SamplingParams(temperature=1.0, seed=5)
    a = [sampler(logits, md_for([p], [g])).sampled_token_ids.item() for g in [make_generator(5, 0, "cpu")] * 5]
    b = [sampler(logits, md_for([p], [g])).sampled_token_ids.item() for g in [make_generator(5, 0, "cpu")] * 5]
    c = [sampler(logits, md_for([p], [g])).sampled_token_ids.item() for g in [make_generator(6, 0, "cpu")] * 5]
    assert a == b and a != c


# ---------------------------------------------------------------------------------------------------------------
# filters: the vectorised versions against a slow per-row twin


def slow_filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Obviously-correct twin on float64: which tokens survive min_p, then top_k, then top_p."""
    p = torch.softmax(row.double(), dim=-1).tolist()
    alive = [x >= min_p * max(p) for x in p] if min_p > 0 else [True] * len(p)
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if top_k > 0:
        survivors = [i for i in order if alive[i]][:top_k]
        alive = [i in survivors for i in range(len(p))]
    if top_p < 1:
        total = sum(p[i] for i in range(len(p)) if alive[i])
        mass, keep = 0.0, set()
        for i in order:
            if alive[i] and mass < top_p:
                keep.add(i)
                mass += p[i] / total
        alive = [i in keep for i in range(len(p))]
    return torch.tensor(alive)


def test_filters_match_slow_twin_on_random_inputs():
    g = torch.Generator().manual_seed(4)
    n, v = 40, 30
    logits = torch.randn(n, v, generator=g) * 2
    top_k = torch.randint(0, 8, (n,), generator=g)
    top_p = torch.rand(n, generator=g) * 0.9 + 0.1
    top_p[::5] = 1.0
    min_p = torch.rand(n, generator=g) * 0.3
    min_p[::3] = 0.0
    x = apply_min_p(logits, min_p)
    x = apply_top_k_top_p(x, top_k, top_p)
    for i in range(n):
        expect = slow_filter(logits[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
        assert torch.equal(torch.isfinite(x[i]), expect), f"row {i}"
        assert torch.equal(x[i][expect], logits[i][expect])  # survivors keep their logits


# ---------------------------------------------------------------------------------------------------------------
# penalties, banned tokens


def test_penalties_against_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # neutral: unchanged, bit for bit
    ]
    md = md_for(params, outputs=[[2, 2, 3], [2, 2, 3]], prompts=[[0, 1], [0, 1]])
    assert not md.no_penalties
    got = apply_penalties(logits, md)
    # token 0: prompt, positive -> 2 / 2 = 1.0
    # token 1: prompt, negative -> -1 * 2 = -2.0
    # token 2: output x2 -> 0.5 / 2 - 0.25 * 2 - 0.5 = -0.75
    # token 3: output x1 -> 3 / 2 - 0.25 * 1 - 0.5 = 0.75
    # token 4: unseen -> -2.0
    assert got[0].tolist() == pytest.approx([1.0, -2.0, -0.75, 0.75, -2.0], abs=1e-6)
    assert torch.equal(got[1], logits[1])


def test_penalties_change_the_greedy_choice_and_logprobs_stay_raw():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    p = SamplingParams(temperature=0, frequency_penalty=1.0, logprobs=2)
    out = sampler(logits, md_for([p], outputs=[[0]]))
    assert out.sampled_token_ids.tolist() == [1]  # 3.0 - 1.0 < 2.9
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprob_token_ids.tolist() == [[1, 0, 1]]
    assert torch.allclose(out.logprobs, raw[0, [1, 0, 1]].unsqueeze(0))


def random_histories(g: torch.Generator, n: int, v: int, max_len: int) -> list[list[int]]:
    """Token ids per row, with repeats and some ids outside [0, v) that every path must ignore."""
    rows = []
    for _ in range(n):
        r = torch.randint(0, v, (int(torch.randint(0, max_len + 1, (1,), generator=g)),), generator=g).tolist()
        rows.append(r + ([v + 3, -1] if len(r) % 3 == 0 else []))
    return rows


def test_token_counts_and_mask_match_python_counts():
    g = torch.Generator().manual_seed(7)
    v = 40
    rows = random_histories(g, 9, v, 30) + [[]]
    counts, mask = token_counts(rows, v, "cpu", dtype=torch.int32), token_mask(rows, v, "cpu")
    assert counts.shape == mask.shape == (10, v) and counts.is_contiguous() and mask.is_contiguous()
    assert counts.dtype == torch.int32 and mask.dtype == torch.bool
    for i, r in enumerate(rows):
        expect = Counter(t for t in r if 0 <= t < v)
        assert counts[i].tolist() == [expect[t] for t in range(v)]
        assert mask[i].tolist() == [t in expect for t in range(v)]


def test_add_tokens_to_counts_matches_python_counts():
    g = torch.Generator().manual_seed(8)
    n, v = 6, 25
    history = random_histories(g, n, v, 10)
    counts = token_counts(history, v, "cpu", dtype=torch.int32)
    expect = [Counter(t for t in r if 0 <= t < v) for r in history]
    # Every row samples (rows_index None), then a subset with a repeated row and ids to skip.
    tokens = torch.randint(0, v, (n,), generator=g)
    add_tokens_to_counts(counts, None, tokens)
    for i, t in enumerate(tokens.tolist()):
        expect[i][t] += 1
    rows_index = torch.tensor([4, 1, 4, 0, 2])
    tokens = torch.tensor([3, 7, 3, -1, v])
    add_tokens_to_counts(counts, rows_index, tokens)
    expect[4][3] += 2
    expect[1][7] += 1
    for i in range(n):
        assert counts[i].tolist() == [expect[i][t] for t in range(v)], f"row {i}"
    with pytest.raises(ValueError, match="contiguous"):
        add_tokens_to_counts(counts.t(), None, tokens)
    with pytest.raises(ValueError, match="rows_index"):
        add_tokens_to_counts(counts, rows_index[:2], tokens)


def test_penalties_from_device_state_equal_the_list_path_bit_for_bit():
    """The runner's path (counts built at admission, then one add_tokens_to_counts per step) against the id lists."""
    g = torch.Generator().manual_seed(9)
    n, v = 12, 300
    prompts, history = random_histories(g, n, v, 40), random_histories(g, n, v, 20)
    params = [SamplingParams(temperature=0.8, repetition_penalty=float(1 + torch.rand(1, generator=g)),
                             presence_penalty=float(torch.rand(1, generator=g) * 4 - 2),
                             frequency_penalty=float(torch.rand(1, generator=g) * 4 - 2)) for _ in range(n)]
    params[3] = SamplingParams()  # neutral row among penalised ones
    counts = token_counts(history, v, "cpu", dtype=torch.int32)
    prompt_mask = token_mask(prompts, v, "cpu")
    for _ in range(4):
        logits = torch.randn(n, v, generator=g) * 4
        from_lists = apply_penalties(logits, md_for(params, outputs=history, prompts=prompts))
        md = SamplingMetadata.from_params(params, history, prompts, [None] * n, "cpu",
                                          output_token_counts=counts, prompt_token_mask=prompt_mask)
        from_state = apply_penalties(logits, md)
        assert torch.equal(from_state, from_lists)
        assert not torch.equal(from_state, logits)
        sampled = torch.randint(0, v, (n,), generator=g)
        add_tokens_to_counts(counts, None, sampled)
        history = [h + [t] for h, t in zip(history, sampled.tolist())]


def test_min_tokens_bans_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]] * 3)  # eos = 1, stop token 2
    params = [
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]),
        SamplingParams(temperature=0, min_tokens=2, ignore_eos=True),
    ]
    md = md_for(params, outputs=[[0], [0, 0], [0]], eos=1)
    assert sampler(logits, md).sampled_token_ids.tolist() == [3, 1, 1]


# ---------------------------------------------------------------------------------------------------------------
# logprobs


def test_logprobs_shape_and_chosen_token_first():
    torch.manual_seed(5)
    logits = torch.randn(4, 100)
    params = [SamplingParams(temperature=0.8, logprobs=5)] * 2 + [SamplingParams(temperature=0, logprobs=2)] * 2
    out = sampler(logits, md_for(params))
    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    assert out.logprob_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs, raw.gather(1, out.logprob_token_ids))
    assert torch.equal(out.logprob_token_ids[:, 1:], raw.topk(5, dim=-1).indices)
    dicts = logprobs_to_dicts(out.logprob_token_ids, out.logprobs, [5, 5, 2, 2])
    for i, d in enumerate(dicts):
        assert out.sampled_token_ids[i].item() in d
        assert len(d) in ((5, 6) if i < 2 else (2, 3))
        assert all(lp <= 0 for lp in d.values())


def test_logprobs_zero_returns_only_the_chosen_token():
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=1.0, logprobs=0), SamplingParams(), SamplingParams(temperature=0)]
    out = sampler(logits, md_for(params))
    assert out.logprob_token_ids.shape == (3, 1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert logprobs_to_dicts(out.logprob_token_ids, out.logprobs, [0, 0, 0])[0].keys() == {
        out.sampled_token_ids[0].item()
    }


def test_compute_prompt_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(7, 40)
    nxt = torch.tensor([3, 9, 0, 39, 5, 5, 12])
    ids, lps = compute_prompt_logprobs(logits, nxt, 4)
    raw = torch.log_softmax(logits, dim=-1)
    assert ids.shape == lps.shape == (7, 5)
    assert torch.equal(ids[:, 0], nxt)
    assert torch.allclose(lps, raw.gather(1, ids))
    assert torch.all(lps[:, 1:-1] >= lps[:, 2:])  # top-k best first


def test_from_params_flags():
    md = md_for([SamplingParams(temperature=0), SamplingParams(top_k=1, temperature=2.0)])
    assert md.all_greedy and not md.all_random and md.no_penalties and not md.return_logprobs
    assert md.temperature.dtype == torch.float32 and md.top_k.dtype == torch.int64
    md = md_for([SamplingParams(logprobs=3, presence_penalty=0.1)])
    assert md.all_random and not md.no_penalties and md.max_num_logprobs == 3 and md.return_logprobs
    with pytest.raises(ValueError, match="2 params"):
        SamplingMetadata.from_params([SamplingParams()] * 2, [[]], [[]], [None], "cpu")
