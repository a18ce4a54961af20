"""The filtered draw (csrc/draw_filtered.cu) against the reference's filter_rows + gumbel_argmax: each row's own
temperature, top-k, min-p and top-p, greedy rows, fp32 logits (no ties: the same ids) and bf16 ones (ties at a cutoff
keep every tied id: the id is one the reference's cutoff value allows), frequencies against the target distributions,
edge rows (a top-p of 0, one finite logit), a CUDA graph, opcheck and clear errors."""
import pytest
import torch

from minfer.ops import reference
from test_sampling import LOGITS, assert_matches

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def cuda():
    from minfer.ops import cuda as mod
    return mod


def inputs(rows, vocab, dtype=torch.float32, seed=0):
    """Random logits and per-row parameters: every filter on, off and mixed, and every fifth row greedy."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).mul(3).to(dtype)
    temperature = torch.rand(rows, generator=g) * 1.9 + 0.1
    temperature[::5] = 0
    top_k = torch.randint(1, max(2, vocab // 4), (rows,), generator=g)
    top_k[torch.rand(rows, generator=g) < 0.4] = vocab  # off
    top_p = torch.rand(rows, generator=g) * 0.98 + 0.01
    top_p[torch.rand(rows, generator=g) < 0.3] = 1.0
    min_p = torch.rand(rows, generator=g) * 0.2
    min_p[torch.rand(rows, generator=g) < 0.5] = 0.0
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    positions = torch.randint(0, 1 << 20, (rows,), generator=g)
    return [x.cuda() for x in (logits, seeds, positions, temperature, top_k, top_p, min_p)]


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("vocab", [7, 1000, 49157, 128256])
def test_draw_filtered_fp32(cuda, rows, vocab):
    args = inputs(rows, vocab, seed=rows + vocab)
    got = cuda.draw_filtered(*args)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    torch.testing.assert_close(got, reference.draw_filtered(*args), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 49157])
def test_draw_filtered_low_precision(cuda, dtype, vocab):
    """16-bit logits tie often: the id drawn is one the reference keeps, or tied with the reference's lowest kept
    value (the kernel keeps every id tied at a cutoff); most rows draw the reference's id."""
    args = inputs(64, vocab, dtype, seed=vocab)
    logits, temperature = args[0], args[3]
    got, want = cuda.draw_filtered(*args), reference.draw_filtered(*args)
    t = temperature[:, None]
    x = logits.float() * (1 / torch.where(t == 0, 1.0, t))
    kept = reference.filter_rows(x, *args[4:])
    floor = kept.masked_fill(kept.isinf(), float("inf")).min(-1).values  # [rows]: the lowest value kept
    assert bool((x.gather(1, got[:, None])[:, 0] >= floor).all())
    assert (got == want).float().mean() > 0.9
    greedy = temperature == 0
    assert torch.equal(got[greedy], logits[greedy].float().argmax(-1))


def draws(cuda, row, n=40_000, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """n draws of one distribution on the kernel, each row at its own position."""
    full = lambda v, dtype=torch.float32: torch.full((n,), v, dtype=dtype, device="cuda")  # noqa: E731
    vocab = row.numel()
    ids = cuda.draw_filtered(row.cuda().expand(n, -1).contiguous(), full(7, torch.int64),
                             torch.arange(n, device="cuda"), full(temperature), full(top_k or vocab, torch.int64),
                             full(top_p), full(min_p))
    return torch.bincount(ids.cpu(), minlength=vocab).double()


def test_draw_filtered_frequencies(cuda):
    """The targets test_sampling_batch checks the reference against (LOGITS: probabilities 0.05, 0.5, 0.1, 0.2,
    0.15)."""
    assert_matches(draws(cuda, LOGITS, top_k=3), torch.tensor([0.0, 0.5, 0.0, 0.2, 0.15]))
    assert_matches(draws(cuda, LOGITS, top_p=0.55), torch.tensor([0.0, 0.5, 0.0, 0.2, 0.0]))
    assert_matches(draws(cuda, LOGITS, min_p=0.15), torch.tensor([0.0, 0.5, 0.1, 0.2, 0.15]))
    assert_matches(draws(cuda, LOGITS, top_k=4, top_p=0.8, min_p=0.25), torch.tensor([0.0, 0.5, 0.0, 0.2, 0.0]))
    hot = (LOGITS / 2).softmax(-1).masked_fill(LOGITS == LOGITS.min(), 0)  # temperature 2, the smallest id out
    assert_matches(draws(cuda, LOGITS, temperature=2.0, top_k=4), hot)


def test_draw_filtered_edges(cuda):
    """top_p = 0 keeps the most likely id; a row with one finite logit draws it; a top-k of 1 is the argmax."""
    logits, seeds, positions, temperature, top_k, top_p, min_p = inputs(4, 5000)
    temperature.fill_(1.0)
    top_k.fill_(5000)
    top_p[0], top_k[1], top_p[1], min_p.zero_()[2] = 0.0, 1, 1.0, 0.5
    logits[3] = float("-inf")
    logits[3, 4321] = -50.0
    got = cuda.draw_filtered(logits, seeds, positions, temperature, top_k, top_p, min_p)
    assert got[0] == logits[0].argmax() and got[1] == logits[1].argmax() and got[3] == 4321
    torch.testing.assert_close(got, reference.draw_filtered(logits, seeds, positions, temperature, top_k, top_p, min_p),
                               rtol=0, atol=0)


def test_draw_filtered_graph_and_opcheck(cuda):
    args = inputs(16, 3000)
    cuda.draw_filtered(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda.draw_filtered(*args)
    for seed in range(3):
        args[0].copy_(inputs(16, 3000, seed=seed + 1)[0])
        out.fill_(-1)
        graph.replay()
        torch.testing.assert_close(out, reference.draw_filtered(*args), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.minfer.draw_filtered, tuple(inputs(5, 900, torch.bfloat16)))
    torch.library.opcheck(torch.ops.minfer.draw_filtered, tuple(x[:0] for x in inputs(5, 900)))


def test_draw_filtered_bad_inputs(cuda):
    op = torch.ops.minfer.draw_filtered
    logits, seeds, positions, temperature, top_k, top_p, min_p = inputs(4, 100)
    with pytest.raises(RuntimeError, match="top_k must be int64"):
        op(logits, seeds, positions, temperature, top_k.int(), top_p, min_p)
    with pytest.raises(RuntimeError, match="min_p must be float32"):
        op(logits, seeds, positions, temperature, top_k, top_p, min_p.double())
    with pytest.raises(RuntimeError, match=r"top_p must be \[rows\] \(4\), got shape \[3\]"):
        op(logits, seeds, positions, temperature, top_k, top_p[:3], min_p)
    with pytest.raises(RuntimeError, match="temperature must be on the logits' device"):
        op(logits, seeds, positions, temperature.cpu(), top_k, top_p, min_p)
    with pytest.raises(RuntimeError, match="logits must be a CUDA tensor"):
        op(logits.cpu(), seeds, positions, temperature, top_k, top_p, min_p)
    with pytest.raises(RuntimeError, match=r"row length must be in \[1, 2\^18\)"):
        op(torch.zeros(4, 1 << 18, device="cuda"), seeds, positions, temperature, top_k, top_p, min_p)
