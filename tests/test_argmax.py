"""Greedy sampling's argmax (csrc/argmax.cu) against torch.argmax: every dtype, row lengths that leave a partial
pack or a single split, misaligned rows (the scalar path), ties (the first index wins), NaN (the largest), signed
zeros, the split counters left zero from call to call, a CUDA graph, opcheck and clear errors."""
import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def cuda():
    from minfer.ops import cuda as mod
    return mod


def check(cuda, logits):
    got = cuda.argmax(logits)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    torch.testing.assert_close(got, logits.float().argmax(-1), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("vocab", [1, 7, 4095, 4097, 49157, 128256])
def test_argmax(cuda, dtype, rows, vocab):
    check(cuda, torch.randn(rows, vocab, device="cuda").mul(4).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64])
def test_argmax_ties_take_the_first(cuda, dtype, rows):
    logits = torch.randint(-4, 3, (rows, 50000), device="cuda").to(dtype)  # each row's max many times over
    check(cuda, logits)
    logits[:, 4096 * 3 + 5:] = 2  # the max first in a later split
    check(cuda, logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_nan_inf_and_signed_zeros(cuda, dtype):
    logits = torch.randn(6, 30000, device="cuda").to(dtype)
    logits[0, [17, 20000, 29999]] = float("nan")  # the first NaN
    logits[1, 25000] = float("inf")
    logits[2] = float("-inf")  # all equal: index 0
    logits[3] = -1.0
    logits[3, [9000, 100]] = torch.tensor([0.0, -0.0], dtype=dtype, device="cuda")  # -0 == +0: the first, 100
    logits[4, 29999] = float("nan")  # in the row's last pack
    logits[5] = -1.0
    check(cuda, logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_strided_and_misaligned_rows(cuda, dtype):
    base = torch.randn(70, 40001, device="cuda").to(dtype)
    check(cuda, base[:, 8:8 + 39993])  # rows 16-byte aligned only for some dtypes
    check(cuda, base[:, 1:])  # misaligned: element by element
    check(cuda, base[::3, :32768])


def test_argmax_counters_left_zero_and_graph(cuda):
    for rows in (64, 1, 300, 2):  # each call's splits leave the shared counters zero for the next
        check(cuda, torch.randn(rows, 128256, device="cuda", dtype=torch.bfloat16))
    logits = torch.randn(64, 128256, device="cuda", dtype=torch.bfloat16)
    cuda.argmax(logits)  # first-call costs outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda.argmax(logits)
    for _ in range(3):
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.testing.assert_close(out, logits.float().argmax(-1), rtol=0, atol=0)


def test_argmax_opcheck(cuda):
    torch.library.opcheck(torch.ops.minfer.argmax, (torch.randn(5, 9000, device="cuda", dtype=torch.bfloat16),))
    torch.library.opcheck(torch.ops.minfer.argmax, (torch.randn(0, 10, device="cuda"),))


def test_argmax_bad_inputs(cuda):
    op = torch.ops.minfer.argmax
    x = torch.randn(4, 100, device="cuda")
    with pytest.raises(RuntimeError, match="logits must be a CUDA tensor"):
        op(x.cpu())
    with pytest.raises(RuntimeError, match="logits must be float32, float16 or bfloat16"):
        op(x.to(torch.int32))
    with pytest.raises(RuntimeError, match="logits must have 2 dimensions"):
        op(x[0])
    with pytest.raises(RuntimeError, match="logits' rows must be contiguous"):
        op(x.t())
    with pytest.raises(RuntimeError, match=r"row length must be in \[1, 2\^31\)"):
        op(x[:, :0])


# ---- gumbel_argmax: the random draw, against the reference's torch ops (the same RNG and fp32 math, bit for bit) ----

def draw_inputs(rows, vocab, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g).mul(3).to(dtype).cuda()
    seeds = torch.randint(0, 2**63 - 1, (rows,), generator=g).cuda()  # past 2^32: both halves of the key
    positions = torch.randint(0, 1 << 20, (rows,), generator=g).cuda()
    return logits, seeds, positions


def check_draw(cuda, logits, seeds, positions, temperature=None):
    from minfer.ops import reference
    got = cuda.gumbel_argmax(logits, seeds, positions, temperature)
    assert got.dtype == torch.int64 and got.shape == (logits.shape[0],)
    torch.testing.assert_close(got, reference.gumbel_argmax(logits, seeds, positions, temperature), rtol=0, atol=0)
    return got


def temperatures(rows, seed=0):
    """[rows] fp32: every third row 0 (greedy), the others in [0.05, 3)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(rows, generator=g) * 2.95 + 0.05
    t[::3] = 0
    return t.cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("vocab", [1, 7, 4097, 49157, 128256])
def test_gumbel_argmax(cuda, dtype, rows, vocab):
    check_draw(cuda, *draw_inputs(rows, vocab, dtype, seed=rows + vocab))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("vocab", [7, 4097, 49157])
def test_gumbel_argmax_temperature(cuda, dtype, rows, vocab):
    """Each row's logits times 1 / its temperature (each rounded as torch's ops), greedy where it is 0; the logits in
    their own dtype."""
    logits, seeds, positions = draw_inputs(rows, vocab, dtype, seed=rows * vocab)
    t = temperatures(rows, seed=vocab)
    got = check_draw(cuda, logits, seeds, positions, t)
    greedy = t == 0
    assert torch.equal(got[greedy], logits[greedy].float().argmax(-1))
    ones = torch.ones_like(t)  # 1 everywhere: the draw without a temperature
    assert torch.equal(cuda.gumbel_argmax(logits, seeds, positions, ones), cuda.gumbel_argmax(logits, seeds, positions))


def test_gumbel_argmax_temperature_moves_the_draw(cuda):
    """A low temperature concentrates the draws on the argmax, a high one spreads them (the division is used)."""
    logits = torch.arange(1000, device="cuda").mul(-0.5).roll(321).expand(4096, -1).contiguous()  # steps of 0.5
    seeds = torch.zeros(4096, dtype=torch.int64, device="cuda")
    positions = torch.arange(4096, device="cuda")
    top = 321  # p = 0.99995 at 0.05, 0.025 at 20
    cold = cuda.gumbel_argmax(logits, seeds, positions, torch.full((4096,), 0.05, device="cuda"))
    hot = cuda.gumbel_argmax(logits, seeds, positions, torch.full((4096,), 20.0, device="cuda"))
    assert (cold == top).float().mean() > 0.9 and (hot == top).float().mean() < 0.05


def test_sample_batch_on_the_kernels(cuda):
    """sample_batch with the cuda ops draws what the reference ops draw, bf16 logits as they are, with and without a
    filter in the batch (the two paths of the draw)."""
    from minfer.ops import reference
    from minfer.sampling import SamplingParams, SamplingTensors, sample_batch
    logits = torch.randn(6, 5000, device="cuda").mul(3).bfloat16()
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0.0, 0.6, 1.0, 0.0, 1.7, 1.0])]
    for batch in (params, params[:5] + [SamplingParams(temperature=1.0, top_p=0.9, seed=5)]):
        t = SamplingTensors.build(batch, list(range(6)), [40] * 6, [[0]] * 6, [[]] * 6, 5000, "cuda")
        ids, _ = sample_batch(logits, t, cuda)
        assert torch.equal(ids, sample_batch(logits, t, reference)[0])


def test_gumbel_argmax_filtered_rows_and_keys(cuda):
    logits, seeds, positions = draw_inputs(64, 49157)
    logits[:, 1000:] = float("-inf")  # a top-k / top-p filter's rows: the draw stays among the finite ids
    logits[5, :] = float("-inf")
    logits[5, 777] = 0.0
    got = check_draw(cuda, logits, seeds, positions)
    assert bool((got[got != 777] < 1000).all()) and got[5] == 777
    seeds[1], positions[1] = seeds[0], positions[0]  # one key, one draw: row 1 as row 0 on the same logits
    logits[1] = logits[0]
    got = check_draw(cuda, logits, seeds, positions)
    assert got[1] == got[0]
    positions[1] += 1  # another position: another draw (over 1000 ids, the same one 1 in 1000)
    flat = torch.zeros(2, 1000, device="cuda")
    assert check_draw(cuda, flat, seeds[:2].clone(), positions[:2].clone()).unique().numel() == 2


def test_gumbel_argmax_opcheck_and_bad_inputs(cuda):
    logits, seeds, positions = draw_inputs(5, 9000)
    torch.library.opcheck(torch.ops.minfer.gumbel_argmax, (logits, seeds, positions))
    torch.library.opcheck(torch.ops.minfer.gumbel_argmax, (logits.bfloat16(), seeds, positions, temperatures(5)))
    op = torch.ops.minfer.gumbel_argmax
    with pytest.raises(RuntimeError, match="temperature must be float32"):
        op(logits, seeds, positions, temperatures(5).double())
    with pytest.raises(RuntimeError, match=r"temperature must be \[rows\] \(5\), got shape \[5, 1\]"):
        op(logits, seeds, positions, temperatures(5)[:, None])
    with pytest.raises(RuntimeError, match="seeds must be int64"):
        op(logits, seeds.int(), positions)
    with pytest.raises(RuntimeError, match=r"positions must be \[rows\] \(5\), got shape \[4\]"):
        op(logits, seeds, positions[:4])
    with pytest.raises(RuntimeError, match="seeds must be on the logits' device"):
        op(logits, seeds.cpu(), positions)
    with pytest.raises(RuntimeError, match="gumbel_argmax: logits' rows must be contiguous"):
        op(logits.t(), seeds, positions)
