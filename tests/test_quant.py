"""The torch dequantizers of every GGUF format minfer keeps quantized, against gguf's own."""
import numpy as np
import pytest
import torch

from minfer import quant
from minfer.errors import MinferError

gguf = pytest.importorskip("gguf")

# Byte offsets of each format's fp16 scales, which get finite values (random bytes can spell NaN).
SCALES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208]}


def random_blocks(kind: str, blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(blocks, quant.BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in SCALES[kind]:
        raw[:, at:at + 2] = rng.standard_normal((blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("kind", quant.QUANTIZED)
@pytest.mark.parametrize("blocks", [1, 37])
def test_dequantize_matches_gguf(kind, blocks):
    raw = random_blocks(kind, blocks, seed=blocks)
    expected = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(-1)
    n = blocks * quant.BLOCK_ELEMS[kind]
    ours = quant.dequantize(kind, torch.from_numpy(raw.copy()), n)
    assert ours.dtype == torch.float32 and ours.shape == (n,)
    np.testing.assert_array_equal(ours.numpy(), expected.astype(np.float32))


def test_dequantize_rejects_a_partial_block():
    raw = torch.zeros(quant.BLOCK_BYTES["Q4_K"] - 1, dtype=torch.uint8)
    with pytest.raises(MinferError, match="Q4_K"):
        quant.dequantize("Q4_K", raw, 256)


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0"])
def test_quantized_weight_rows_and_matrix(kind):
    rows, cols = 5, 2 * quant.BLOCK_ELEMS[kind]
    raw = torch.from_numpy(random_blocks(kind, rows * 2, seed=3)).view(rows, -1)
    w = quant.QuantizedWeight(kind, raw, (rows, cols))
    dense = w.dequantize()
    assert dense.shape == (rows, cols)
    ids = torch.tensor([4, 0, 4])
    torch.testing.assert_close(w.rows(ids, torch.float32), dense[ids], rtol=0, atol=0)


def test_quantized_weight_checks_its_shape():
    with pytest.raises(MinferError, match="blocks must be uint8"):
        quant.QuantizedWeight("Q8_0", torch.zeros(3, 33, dtype=torch.uint8), (3, 32))
    with pytest.raises(MinferError, match="multiple of 256"):
        quant.QuantizedWeight("Q6_K", torch.zeros(3, 210, dtype=torch.uint8), (3, 200))


def test_fused_linear_over_formats():
    """A fused q|k|v whose parts differ in format (Q4_K_M keeps v in Q6_K) runs each stack into its columns of
    one output: the same as the linear of the dequantized rows stacked, bias included."""
    from minfer.model import fuse, fused_linear
    from minfer.ops import get_backend

    k = 256
    parts = []
    for i, (kind, n) in enumerate([("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16)]):
        raw = torch.from_numpy(random_blocks(kind, n * k // quant.BLOCK_ELEMS[kind], seed=i).copy())
        parts.append(quant.QuantizedWeight(kind, raw.view(n, -1), (n, k)))
    fused = fuse(parts)
    assert [w.kind for w in fused] == ["Q4_K", "Q6_K"]
    x, bias = torch.randn(3, k) / k, torch.randn(64)
    dense = torch.cat([w.dequantize(torch.float32) for w in parts])  # [64, k]
    ours = fused_linear(get_backend("ref", "cpu"), x, fused, bias)
    torch.testing.assert_close(ours, torch.nn.functional.linear(x, dense, bias), rtol=1e-5, atol=1e-6)
