"""sample_batch: every row with its own parameters, a counter-based RNG keyed by (seed, position), so that a
seeded row draws the same token alone or in any batch; statistical checks of the draws; penalties and
logprobs by hand."""
import pytest
import torch

from minfer.ops.reference import uniform_noise, unit_interval
from minfer.sampling import SamplingParams, SamplingTensors, filter_logits, sample_batch
from test_sampling import LOGITS, assert_matches, softmax_by_hand

VOCAB = 5


def tensors(params, seeds=None, positions=None, prompts=None, outputs=None, vocab=VOCAB, banned=None):
    n = len(params)
    return SamplingTensors.build(params, seeds or list(range(n)), positions or [0] * n, prompts or [[0]] * n,
                                 outputs or [[]] * n, vocab, "cpu", banned)


def draws(logits_row, params, n=40_000):
    """n draws of one distribution: the same logits in n rows, each row at its own position (counter)."""
    t = tensors([params] * n, seeds=[1234] * n, positions=list(range(n)))
    ids, _ = sample_batch(logits_row.expand(n, -1).contiguous(), t)
    return torch.bincount(ids, minlength=logits_row.numel()).double()


def test_uniforms_are_uniform_and_keyed():
    u = uniform_noise(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]), 100_000)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    again = uniform_noise(torch.tensor([6, 5]), torch.tensor([0, 0]), 100_000)
    assert torch.equal(again[0], u[2]) and torch.equal(again[1], u[0])
    # neighbouring ids are not correlated
    assert abs(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1].item()) < 0.02


def test_uniforms_stay_inside_the_open_interval():
    """The largest and smallest hashes map strictly inside (0, 1), so every Gumbel draw is finite."""
    h = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1])
    u = unit_interval(h)
    assert 0 < u.min() and u.max() < 1 and (-torch.log(-torch.log(u))).isfinite().all()


def test_frequencies_match_the_target():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    assert_matches(draws(logits, SamplingParams(temperature=1.0)), softmax_by_hand(logits.tolist()))
    assert_matches(draws(logits, SamplingParams(temperature=0.5)), softmax_by_hand(logits.tolist(), 0.5))
    assert_matches(draws(LOGITS, SamplingParams(temperature=1.0, top_k=3)), torch.tensor([0.0, 0.5, 0.0, 0.2, 0.15]))
    assert_matches(draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.55)), torch.tensor([0.0, 0.5, 0.0, 0.2, 0.0]))
    assert_matches(draws(LOGITS, SamplingParams(temperature=1.0, min_p=0.15)),
                   torch.tensor([0.0, 0.5, 0.1, 0.2, 0.15]))


def test_each_row_uses_its_own_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    from minfer.ops.reference import filter_rows
    mixed = [(0, 1.0, 0.0), (7, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.2), (50, 0.9, 0.02), (1, 1.0, 0.0)]
    # batches where only one filter is on (the others skipped), or none
    single = [[(0, 1.0, 0.0), (7, 1.0, 0.0), (1, 1.0, 0.0), (0, 1.0, 0.0), (300, 1.0, 0.0), (299, 1.0, 0.0)],
              [(0, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.01, 0.0), (0, 0.99, 0.0), (0, 1.0, 0.0), (0, 0.9, 0.0)],
              [(0, 1.0, 0.2), (0, 1.0, 0.0), (0, 1.0, 0.9), (0, 1.0, 0.01), (0, 1.0, 0.0), (0, 1.0, 0.5)],
              [(0, 1.0, 0.0)] * 6]
    for settings in [mixed] + single:
        params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, min_p=m) for k, p, m in settings]
        t = tensors(params, vocab=300)
        out = filter_rows(logits, t.top_k, t.top_p, t.min_p)
        for row, (k, p, m) in enumerate(settings):
            assert torch.equal(out[row], filter_logits(logits[row:row + 1], k, p, m)[0]), (settings, row)


def test_a_top_p_under_fp32_keeps_the_top_token():
    """top_p = 1e-300 passes the check (> 0) and is 0 in the rows' fp32 tensor: the nucleus still holds the most
    likely token, so every draw is it (a nucleus of nothing gave NaN probabilities)."""
    params = SamplingParams(temperature=1.0, top_p=1e-300)
    assert torch.equal(draws(LOGITS, params, n=1000), torch.tensor([0.0, 1000, 0, 0, 0], dtype=torch.float64))
    assert torch.equal(filter_logits(LOGITS[None], 0, 1e-300, 0.0).isfinite()[0], LOGITS == LOGITS.max())


def test_seeded_row_is_the_same_alone_or_in_a_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 1000, generator=g)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(8)]
    params[3] = SamplingParams(temperature=0.0, top_p=0.01)  # a greedy row in the batch changes nothing
    params[5] = SamplingParams(temperature=1.3, top_k=20, repetition_penalty=1.2, presence_penalty=0.5, seed=77)
    # no filter: alone, the draw divides by the temperature itself (gumbel_argmax); in the batch, the filters' path
    params[1], params[6] = SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.9, seed=6)
    seeds, positions = [p.seed or 0 for p in params], [10 + 3 * i for i in range(8)]
    prompts, outputs = [[i, i + 1] for i in range(8)], [[i * 7 % 1000] * (i % 3) for i in range(8)]
    batched, _ = sample_batch(logits, tensors(params, seeds, positions, prompts, outputs, vocab=1000))
    for i in range(8):
        alone, _ = sample_batch(logits[i:i + 1], tensors(params[i:i + 1], seeds[i:i + 1], positions[i:i + 1],
                                                         prompts[i:i + 1], outputs[i:i + 1], vocab=1000))
        assert alone.item() == batched[i].item()
    # the draw depends on the position: the same seed at other positions gives other tokens
    many = tensors([params[0]] * 64, [0] * 64, list(range(64)), vocab=1000)
    assert len(set(sample_batch(logits[:1].expand(64, -1), many)[0].tolist())) > 10


def test_the_draw_takes_the_logits_in_their_dtype():
    """bf16 logits (the lm_head's output as it is) draw what their fp32 values draw, greedy rows (argmax) and
    sampled rows alike, with and without a filter in the batch; the logprobs are taken in fp32."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 700, generator=g) * 3).bfloat16()
    params = [SamplingParams(temperature=t, seed=i, logprobs=1 if i == 2 else None)
              for i, t in enumerate([0.0, 0.6, 1.0, 0.0, 1.7, 1.0])]
    got = []
    for batch in (params, params[:5] + [SamplingParams(temperature=1.0, top_k=5, seed=5)]):
        t = tensors(batch, seeds=list(range(6)), positions=[9] * 6, vocab=700)
        ids, lp = sample_batch(logits, t)
        want, want_lp = sample_batch(logits.float(), t)
        assert torch.equal(ids, want) and ids[0] == logits[0].float().argmax() and ids[3] == logits[3].float().argmax()
        assert lp.chosen.dtype == torch.float32 and torch.equal(lp.chosen, want_lp.chosen)
        got.append(ids)
    assert torch.equal(got[0][:5], got[1][:5])  # a filter in the batch (the other path) changes no other row


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 50)
    t = tensors([SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=1.0)] * 2, vocab=50)
    ids, lp = sample_batch(logits, t)
    assert torch.equal(ids[:2], logits[:2].argmax(-1)) and lp is None


def test_penalties_by_hand():
    """Each row's penalty decides its greedy token: without it (or with another rule) the argmax would be id 3."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]] * 4)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 3.0 -> 1.5 (seen in the output)
              SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 3.0 -> 1.5 (seen in the prompt)
              SamplingParams(temperature=0.0, presence_penalty=2.0),  # 3.0 -> 1.0 (once or more)
              SamplingParams(temperature=0.0, frequency_penalty=0.6)]  # 3.0 -> 1.2 (three times; 2.4 if once)
    t = tensors(params, prompts=[[2], [3], [0], [0]], outputs=[[3], [], [3], [3, 3, 3]])
    ids, _ = sample_batch(logits, t)
    # every row: id 0 (2.0) wins over the penalized id 3; presence / frequency count the output only (id 0 is in
    # the prompt of rows 2 and 3, and stays at 2.0)
    assert ids.tolist() == [0, 0, 0, 0]
    # a negative logit is multiplied by the penalty (HF's rule): -1.0 -> -2.0, below -1.5
    negative = torch.tensor([[-1.0, -1.5, -4.0, -3.0, -2.0]])
    assert sample_batch(negative, tensors(params[:1], prompts=[[0]]))[0].item() == 1


def test_repetition_penalty_matches_transformers():
    """Greedy rows with a repetition penalty take the argmax of transformers' RepetitionPenaltyLogitsProcessor over
    the row's prompt and output ids; each row's own argmax is among them, so most rows change their token."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 300, generator=g) * 3
    prompts = [torch.randint(0, 300, (7,), generator=g).tolist() + [int(logits[b].argmax())] for b in range(16)]
    outputs = [torch.randint(0, 300, (b % 5,), generator=g).tolist() for b in range(16)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0)] * 16
    ids, _ = sample_batch(logits, tensors(params, prompts=prompts, outputs=outputs, vocab=300))
    want = torch.cat([lp.RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([p + o]), logits[b:b + 1].clone())
                      for b, (p, o) in enumerate(zip(prompts, outputs))]).argmax(-1)
    assert torch.equal(ids, want)
    assert (want != logits.argmax(-1)).sum() >= 8  # the penalty moved the choice: the check can fail


def test_logprobs_chosen_and_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0, 0.0]])
    t = tensors([SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.0, logprobs=0)])
    ids, lp = sample_batch(logits, t)
    want = logits.log_softmax(-1)
    assert ids.tolist() == [1, 2]
    torch.testing.assert_close(lp.chosen, want[[0, 1], [1, 2]])
    assert lp.top_ids[0].tolist() == [1, 2]
    torch.testing.assert_close(lp.top[0], want[0, [1, 2]])


def test_logit_bias_by_hand():
    """Each row's bias is added to its own logits before the penalties and the draw; logprobs stay the raw
    logits'; a row without a bias is as it was."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]] * 4)
    params = [SamplingParams(temperature=0.0, logit_bias={3: -100}),  # 3 banned: 0 wins
              SamplingParams(temperature=0.0, logit_bias={1: 4.5}),  # -1.0 -> 3.5: 1 wins
              SamplingParams(temperature=0.0, logprobs=1),  # no bias: 3
              # 3: 3.8, then 1.9 < 2.0 (the penalty first would give 1.5 + 0.8 = 2.3, no penalty 3.8: 3 wins)
              SamplingParams(temperature=0.0, logit_bias={3: 0.8}, repetition_penalty=2.0)]
    ids, lp = sample_batch(logits, tensors(params, prompts=[[0]] * 3 + [[3]]))
    assert ids.tolist() == [0, 1, 3, 0]
    torch.testing.assert_close(lp.chosen, logits.log_softmax(-1)[torch.arange(4), ids])  # the raw logits'
    assert tensors([SamplingParams(temperature=0.0, logit_bias={2: 1})]).plain_greedy is False
    # sampled: the bias shifts the distribution as softmax(logits + bias) says
    biased = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    bias = {0: 1.0, 3: -2.0}
    shifted = [x + bias.get(i, 0.0) for i, x in enumerate(biased.tolist())]
    assert_matches(draws(biased, SamplingParams(temperature=1.0, logit_bias=bias)), softmax_by_hand(shifted))


def test_banned_ids_are_never_drawn():
    """A row's banned ids (its stop ids before min_tokens) are out of its draw, greedy or sampled, whatever their
    bias; the logprobs stay the raw logits'; the other rows are as they were."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0.0, logprobs=0, logit_bias={3: 100}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=1)]
    ids, lp = sample_batch(logits, tensors(params, banned=[[3, 0], [], [3]]))
    assert ids[:2].tolist() == [2, 3] and lp.chosen[0] == logits.log_softmax(-1)[0, 2]
    t = tensors([SamplingParams(temperature=1.0)] * 2000, seeds=list(range(2000)), banned=[[3]] * 2000)
    assert 3 not in sample_batch(logits[:1].expand(2000, -1).contiguous(), t)[0].tolist()
