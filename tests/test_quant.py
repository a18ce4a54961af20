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


def _qweight(kind: str, n: int, k: int, seed: int) -> quant.QuantizedWeight:
    raw = torch.from_numpy(random_blocks(kind, n * k // quant.BLOCK_ELEMS[kind], seed=seed).copy())
    return quant.QuantizedWeight(kind, raw.view(n, -1), (n, k))


@pytest.mark.parametrize("kind", quant.TILED_KINDS)
def test_tiled_rows(kind):
    """tile_rows keeps a Q4_K or Q6_K linear's bytes with each 16 rows' blocks chunk-major: row 16 t + r's block c at
    block index 16 (t chunks + c) + r; its rows, row selections, stacks and matrix are the untiled weight's. Weights
    of other kinds, of out_features no multiple of 32, or in a layer group stay as they are; a stack with an untiled
    part comes back by rows; a layer group of tiled weights holds them by rows."""
    size = quant.BLOCK_BYTES[kind]
    w = _qweight(kind, 64, 768, seed=7)  # 4 groups of 16 rows, 3 chunks a row
    t = quant.tile_rows(w)
    assert t.tiled and not w.tiled and t.blocks.shape == w.blocks.shape and quant.tile_rows(t) is t
    blocks = w.blocks.view(64, 3, size)
    for row, c in [(0, 0), (5, 2), (17, 1), (63, 2)]:
        at = 16 * ((row // 16) * 3 + c) + row % 16
        assert torch.equal(t.blocks.view(-1, size)[at], blocks[row, c])
    assert torch.equal(t.dequantize(), w.dequantize())
    ids = torch.tensor([63, 0, 17, 17])
    assert torch.equal(t.rows(ids, torch.float32), w.rows(ids, torch.float32))
    picked = t.select_rows(ids)
    assert not picked.tiled and torch.equal(picked.blocks, w.blocks[ids])
    assert not t.untiled().tiled and torch.equal(t.untiled().blocks, w.blocks)
    other = quant.tile_rows(_qweight(kind, 32, 768, seed=8))
    both = quant.QuantizedWeight.cat([t, other])
    assert both.tiled and torch.equal(both.blocks, torch.cat([t.blocks, other.blocks]))
    assert torch.equal(both.dequantize(), torch.cat([w.dequantize(), other.dequantize()]))
    mixed = quant.QuantizedWeight.cat([t, _qweight(kind, 16, 768, seed=9)])
    assert not mixed.tiled and torch.equal(mixed.blocks[:64], w.blocks)
    for same in (_qweight("Q5_K", 64, 256, seed=1), _qweight(kind, 48, 256, seed=2)):
        assert quant.tile_rows(same) is same
    grouped = quant.group_layer([t, quant.tile_rows(_qweight(kind, 32, 768, seed=3))])
    assert all(g.layer is not None and not g.tiled for g in grouped)
    assert torch.equal(grouped[0].blocks, w.blocks)
    with pytest.raises(MinferError, match="tiled blocks need"):
        quant.QuantizedWeight("Q8_0", torch.zeros(16, 34, dtype=torch.uint8), (16, 32), tiled=True)


def test_qlinear_takes_rows():
    """The cuda backend's route by rows (ops.quantized.takes_rows, the kernels' qlinear_max_rows): qlinear up to 32
    rows, to 64 for Q4_K and Q6_K on W of 4096 x 4096 and more, not for a layer group's linears past 32 (the group's
    first decodes them all) nor other formats; more rows dequantize + linear."""
    from minfer.ops import quantized
    wide = _qweight("Q4_K", 4096, 4096, seed=1)
    assert [quantized.takes_rows(m, wide) for m in (1, 32, 33, 64, 65)] == [True, True, True, True, False]
    assert quantized.takes_rows(64, _qweight("Q6_K", 4096, 4096, seed=2)) and quantized.takes_rows(64, quant.tile_rows(wide))
    assert not quantized.takes_rows(33, _qweight("Q4_K", 1024, 4096, seed=3))
    assert not quantized.takes_rows(33, _qweight("Q8_0", 4096, 4096, seed=4))
    grouped = quant.group_layer([wide, _qweight("Q4_K", 4096, 256, seed=5)])
    assert grouped[0].layer is not None and not quantized.takes_rows(33, grouped[0])


def test_group_layer(monkeypatch):
    """A layer's linears of one format go back to back into one buffer: each keeps its blocks (views of it, at
    16-byte offsets) and values, the first at offset 0, and the buffer decodes to the matrices in order. Mixed
    formats, a dense weight, a part that is no multiple of 16 bytes, or more than LAYER_VALUES values stay apart."""
    shapes = [(96, 64), (64, 64), (256, 64), (64, 128)]  # q|k|v, o, gate|up, down of a tiny model
    ws = [_qweight("Q4_1", n, k, seed=i) for i, (n, k) in enumerate(shapes)]
    grouped = quant.group_layer(ws)
    layer = grouped[0].layer
    assert layer is not None and all(g.layer is layer for g in grouped) and layer.kind == "Q4_1"
    assert layer.values == sum(n * k for n, k in shapes)
    offsets = [0, 96 * 64, 96 * 64 + 64 * 64, 96 * 64 + 64 * 64 + 256 * 64]
    assert [g.layer_offset for g in grouped] == offsets
    base = layer.blocks.data_ptr()
    for w, g in zip(ws, grouped):
        assert torch.equal(g.blocks, w.blocks) and g.shape == w.shape and g.kind == w.kind
        assert g.blocks.untyped_storage().data_ptr() == layer.blocks.untyped_storage().data_ptr()  # a view
        assert (g.blocks.data_ptr() - base) % 16 == 0
    decoded = quant.dequantize(layer.kind, layer.blocks.reshape(-1), layer.values)
    for w, g in zip(ws, grouped):
        n, k = w.shape
        assert torch.equal(decoded[g.layer_offset:g.layer_offset + n * k].view(n, k), w.dequantize())

    mixed = ws[:3] + [_qweight("Q8_0", 64, 128, seed=9)]
    assert all(a is b for a, b in zip(quant.group_layer(mixed), mixed))
    dense = ws[:3] + [torch.zeros(64, 128)]
    assert all(a is b for a, b in zip(quant.group_layer(dense), dense))
    odd = ws[:3] + [_qweight("Q4_1", 3, 64, seed=5)]  # 3 rows x 40 bytes: not a multiple of 16
    assert all(a is b for a, b in zip(quant.group_layer(odd), odd))
    monkeypatch.setattr(quant, "LAYER_VALUES", layer.values - 1)
    assert all(a is b for a, b in zip(quant.group_layer(ws), ws))
