"""Sampling: statistical checks of sample() against target distributions, exact masks on hand-checkable
logits, and agreement with transformers' logits processors on random logits."""
import math
import os

import pytest
import torch

from minfer.sampling import SamplingParams, apply_repetition_penalty, filter_logits, make_generator, sample

N = 40_000  # draws per distribution (one batched call)
# chi-square critical values at p = 1e-5 (a false alarm once in 100k runs), by degrees of freedom
CHI2_CRIT = {1: 19.5, 2: 23.0, 3: 25.9, 4: 28.5, 5: 30.9, 6: 33.1, 7: 35.3}


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def draw(logits_row: torch.Tensor, params: SamplingParams, n=N) -> torch.Tensor:
    """n samples from one distribution via a [n, vocab] batch; returns counts [vocab]."""
    seed = fresh_seed()
    params.seed = seed
    ids = sample(logits_row.expand(n, -1).contiguous(), params, make_generator(seed, "cpu"))
    assert ids.shape == (n,) and ids.dtype == torch.int64
    return torch.bincount(ids, minlength=logits_row.numel()).double()


def assert_matches(counts: torch.Tensor, target: torch.Tensor):
    """Pearson chi-square over the tokens with target mass; tokens without mass must never appear."""
    target = target.double()
    assert counts[target == 0].sum() == 0, f"masked tokens were sampled: {counts}"
    live = target > 0
    expected = target[live] / target[live].sum() * counts.sum()
    chi2 = ((counts[live] - expected) ** 2 / expected).sum().item()
    df = int(live.sum()) - 1
    if df == 0:
        return
    assert chi2 < CHI2_CRIT[df], f"chi2 {chi2:.1f} (df {df}); counts {counts.tolist()} vs expected {expected.tolist()}"


def softmax_by_hand(logits, t=1.0):
    e = [math.exp(x / t) for x in logits]
    return torch.tensor([x / sum(e) for x in e])


def test_frequencies_match_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -3.0])
    assert_matches(draw(logits, SamplingParams(temperature=1.0)), softmax_by_hand(logits.tolist()))


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_temperature_reshapes_the_distribution(t):
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    counts = draw(logits, SamplingParams(temperature=t))
    assert_matches(counts, softmax_by_hand(logits.tolist(), t))
    # and it is not the T=1 distribution: the top token's share moves the right way
    p1 = softmax_by_hand(logits.tolist())[3].item()
    share = counts[3].item() / N
    assert (share > p1 + 0.05) if t < 1 else (share < p1 - 0.05)


# Probabilities chosen so that every mask below is decided with a clear margin.
PROBS = [0.05, 0.5, 0.1, 0.2, 0.15]  # sorted: 0.5 (1), 0.2 (3), 0.15 (4), 0.1 (2), 0.05 (0)
LOGITS = torch.tensor([math.log(p) + 1.7 for p in PROBS])  # an offset: masks must not assume normalized logits


@pytest.mark.parametrize("k,keep", [(1, {1}), (2, {1, 3}), (4, {1, 3, 4, 2}), (5, {0, 1, 2, 3, 4}), (0, {0, 1, 2, 3, 4})])
def test_top_k_mask(k, keep):
    out = filter_logits(LOGITS[None], k, 1.0, 0.0)[0]
    assert {i for i in range(5) if out[i] > float("-inf")} == keep
    for i in keep:  # kept logits are unchanged
        assert out[i] == LOGITS[i]


# top-p keeps the smallest prefix (by descending probability) whose mass reaches top_p
@pytest.mark.parametrize("p,keep", [(0.3, {1}), (0.55, {1, 3}), (0.75, {1, 3, 4}), (0.9, {1, 3, 4, 2}),
                                    (0.99, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_mask(p, keep):
    out = filter_logits(LOGITS[None], 0, p, 0.0)[0]
    assert {i for i in range(5) if out[i] > float("-inf")} == keep


# min-p keeps tokens with probability >= min_p * max probability (0.5 here)
@pytest.mark.parametrize("m,keep", [(0.5, {1}), (0.35, {1, 3}), (0.25, {1, 3, 4}),
                                    (0.15, {1, 3, 4, 2}), (0.05, {0, 1, 2, 3, 4})])
def test_min_p_mask(m, keep):
    out = filter_logits(LOGITS[None], 0, 1.0, m)[0]
    assert {i for i in range(5) if out[i] > float("-inf")} == keep


def test_filtered_sampling_frequencies():
    # top-k 3 then sampling: the renormalized mass of the top 3
    target = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.15])
    assert_matches(draw(LOGITS, SamplingParams(temperature=1.0, top_k=3)), target)
    target = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.0])  # top-p 0.55
    assert_matches(draw(LOGITS, SamplingParams(temperature=1.0, top_p=0.55)), target)
    target = torch.tensor([0.0, 0.5, 0.1, 0.2, 0.15])  # min-p 0.15
    assert_matches(draw(LOGITS, SamplingParams(temperature=1.0, min_p=0.15)), target)


def test_filters_match_transformers_warpers():
    lp = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(fresh_seed())
    logits = torch.randn(16, 300, generator=g) * 3
    neg = torch.full_like(logits, float("-inf"))
    for k in (1, 7, 50):
        ref = lp.TopKLogitsWarper(k)(None, logits.clone())
        assert torch.equal(filter_logits(logits, k, 1.0, 0.0) > neg, ref > neg)
    for p in (0.1, 0.5, 0.9):
        ref = lp.TopPLogitsWarper(p)(None, logits.clone())
        assert torch.equal(filter_logits(logits, 0, p, 0.0) > neg, ref > neg)
    for m in (0.02, 0.2):
        ref = lp.MinPLogitsWarper(m)(None, logits.clone())
        assert torch.equal(filter_logits(logits, 0, 1.0, m) > neg, ref > neg)
    seen_ids = torch.randint(0, 300, (16, 20), generator=g)
    seen = torch.zeros(16, 300, dtype=torch.bool).scatter(1, seen_ids, True)
    ref = lp.RepetitionPenaltyLogitsProcessor(1.3)(seen_ids, logits.clone())
    torch.testing.assert_close(apply_repetition_penalty(logits, seen, 1.3), ref)


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0]]
    # in sample(): the penalty flips the greedy choice
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, params, None, torch.tensor([[True, False, False]])).item() == 1
    assert sample(logits, params, None, torch.tensor([[False, False, False]])).item() == 0
    # and the distribution when sampling: token 0 (seen) has logit 1.5 instead of 3
    counts = draw(torch.tensor([3.0, 2.0, -1.0]), SamplingParams(temperature=1.0))
    assert_matches(counts, softmax_by_hand([3.0, 2.0, -1.0]))
    seed = fresh_seed()
    ids = sample(torch.tensor([[3.0, 2.0, -1.0]]).expand(N, -1).contiguous(),
                 SamplingParams(temperature=1.0, repetition_penalty=2.0), make_generator(seed, "cpu"),
                 torch.tensor([[True, False, False]]).expand(N, -1))
    assert_matches(torch.bincount(ids, minlength=3).double(), softmax_by_hand([1.5, 2.0, -1.0]))


def test_greedy_is_argmax():
    logits = torch.randn(32, 1000)
    assert torch.equal(sample(logits, SamplingParams(temperature=0.0)), logits.argmax(-1))
    # greedy ignores the filters and the generator
    assert torch.equal(sample(logits, SamplingParams(temperature=0.0, top_k=5, top_p=0.5), make_generator(1, "cpu")),
                       logits.argmax(-1))


def test_seed_reproducible_and_seeds_differ():
    logits = torch.randn(64, 500)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    seed = fresh_seed()
    a = sample(logits, params, make_generator(seed, "cpu"))
    b = sample(logits, params, make_generator(seed, "cpu"))
    c = sample(logits, params, make_generator(seed + 1, "cpu"))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # 64 draws from ~flat 500-way distributions: equal w.p. ~0
    assert make_generator(None, "cpu") is None


def test_sample_does_not_modify_logits():
    logits = torch.randn(4, 50)
    before = logits.clone()
    sample(logits, SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
           make_generator(0, "cpu"), torch.ones(4, 50, dtype=torch.bool))
    assert torch.equal(logits, before)
