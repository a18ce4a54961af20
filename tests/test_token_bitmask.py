"""Structured outputs' mask on the logits (csrc/token_bitmask.cu) against the reference (the words unpacked, a
masked_fill): every float dtype, row lengths off multiples of 32 and of a CTA's 256, bits past the vocabulary (unread),
NaN and inf logits kept where allowed, strided rows left alone past the vocabulary, opcheck and clear errors; the
reference against a loop, and pack_ids' bits, on the CPU."""
import numpy as np
import pytest
import torch

from minfer.ops import reference
from minfer.sampling import pack_ids

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_words(rows: int, vocab: int, extra: int = 0, density: float = 0.5, seed: int = 0) -> torch.Tensor:
    """[rows, ceil(vocab / 32) + extra] int32, each bit set with probability density (past vocab too)."""
    rng = np.random.default_rng(seed)
    bits = rng.random((rows, (-(-vocab // 32) + extra) * 32)) < density
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32).copy())


def test_reference_matches_a_loop():
    words = random_words(3, 70, extra=1, seed=1)
    logits = torch.randn(3, 70)
    want = logits.clone()
    for r in range(3):
        for i in range(70):
            if not (int(words[r, i // 32]) >> (i % 32)) & 1:
                want[r, i] = float("-inf")
    reference.apply_token_bitmask(logits, words)
    assert torch.equal(logits, want)


def test_pack_ids():
    words = pack_ids([[0, 31, 32, 39, 31], None, [5]], 40)
    assert words.dtype == np.int32 and words.shape == (3, 2)
    allowed = reference.unpack_bitmask(torch.from_numpy(words), 40)
    assert [torch.nonzero(r).flatten().tolist() for r in allowed] == [[0, 31, 32, 39], list(range(40)), [5]]


@pytest.fixture(scope="module")
def cuda():
    from minfer.ops import cuda as mod
    return mod


def check(cuda, logits, words):
    want = logits.clone()
    reference.apply_token_bitmask(want, words)
    cuda.apply_token_bitmask(logits, words)
    torch.testing.assert_close(logits, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("vocab", [1, 31, 33, 255, 257, 4097, 49152, 151936])
def test_apply_token_bitmask(cuda, dtype, rows, vocab):
    logits = torch.randn(rows, vocab, device="cuda").mul(4).to(dtype)
    check(cuda, logits, random_words(rows, vocab, extra=vocab % 3, seed=rows * vocab).cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_token_bitmask_all_none_and_specials(cuda, dtype):
    logits = torch.randn(4, 1000, device="cuda").to(dtype)
    logits[:, 10], logits[:, 11], logits[:, 12] = float("nan"), float("inf"), float("-inf")
    words = random_words(4, 1000, seed=3).cuda()
    words[0], words[1] = -1, 0  # every id allowed; none
    words[2, 0] = 0b1 << 10  # of the first 32 ids only the NaN
    before = logits.clone()
    check(cuda, logits, words)
    torch.testing.assert_close(logits[0], before[0], rtol=0, atol=0, equal_nan=True)  # untouched, NaN and inf kept
    assert bool((logits[1] == float("-inf")).all())
    assert torch.isnan(logits[2, 10]) and bool((logits[2, :10] == float("-inf")).all())


@pytest.mark.gpu
def test_apply_token_bitmask_strided_rows(cuda):
    base = torch.randn(5, 3000, device="cuda")
    logits = base[:, 8:8 + 2777]  # rows 3000 apart
    untouched = torch.cat([base[:, :8], base[:, 8 + 2777:]], 1).clone()
    check(cuda, logits, random_words(5, 2777, seed=4).cuda())
    assert torch.equal(torch.cat([base[:, :8], base[:, 8 + 2777:]], 1), untouched)


@pytest.mark.gpu
def test_apply_token_bitmask_opcheck(cuda):
    torch.library.opcheck(torch.ops.minfer.apply_token_bitmask,
                          (torch.randn(5, 900, device="cuda"), random_words(5, 900, seed=5).cuda()))
    torch.library.opcheck(torch.ops.minfer.apply_token_bitmask,
                          (torch.randn(0, 10, device="cuda"), torch.zeros(0, 1, dtype=torch.int32, device="cuda")))


@pytest.mark.gpu
def test_apply_token_bitmask_bad_inputs(cuda):
    op = torch.ops.minfer.apply_token_bitmask
    x, w = torch.randn(4, 100, device="cuda"), random_words(4, 100).cuda()
    with pytest.raises(RuntimeError, match="logits must be a CUDA tensor"):
        op(x.cpu(), w.cpu())
    with pytest.raises(RuntimeError, match="logits must be float32, float16 or bfloat16"):
        op(x.to(torch.int32), w)
    with pytest.raises(RuntimeError, match="logits must have 2 dimensions"):
        op(x[0], w)
    with pytest.raises(RuntimeError, match="logits must have a contiguous last dimension"):
        op(x.t(), w)
    with pytest.raises(RuntimeError, match="must be on the same device"):
        op(x, w.cpu())
    with pytest.raises(RuntimeError, match="bitmask must be int32"):
        op(x, w.long())
    with pytest.raises(RuntimeError, match="bitmask must have a row per logits row"):
        op(x, w[:3])
    with pytest.raises(RuntimeError, match="bitmask must have a bit per logit: 4 words a row for 100 logits, got 3"):
        op(x, w[:, :3].contiguous())
