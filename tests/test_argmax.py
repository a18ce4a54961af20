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
