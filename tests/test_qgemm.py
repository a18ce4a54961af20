"""Quantized weights on the GPU (csrc/qgemm/): dequantize, dequantize_into, qlinear, qembedding, every
format, against minfer.quant's torch dequantizer.

dequantize and qembedding must match quant.dequantize(...).to(dtype) bit for bit (the kernels compute
each value in fp32 in the reference's order). Products follow the GEMM tests' rule: |ours - ref64| <=
2 |torch_lowp - ref64| + eps, with torch_lowp = the weight dequantized to fp16/bf16, then F.linear."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minfer import quant
from test_quant import random_blocks

pytestmark = pytest.mark.gpu

DEV = "cuda"
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
DTYPES = [torch.float16, torch.bfloat16]
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
KQUANTS = ["Q4_K", "Q5_K", "Q6_K"]
# k per format family: one short row, and one past a multiple of 256 where the blocks allow it
KS = {**{kind: [96, 4128] for kind in LEGACY}, **{kind: [256, 4352] for kind in KQUANTS}}


def _q():
    from minfer.ops import quantized
    return quantized


def _weight(kind: str, n: int, k: int, seed: int = 0) -> quant.QuantizedWeight:
    """Random blocks (finite fp16 scales) for W [n, k], on the GPU."""
    row_blocks = k // quant.BLOCK_ELEMS[kind]
    raw = random_blocks(kind, n * row_blocks, seed=seed)
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(n, row_blocks * quant.BLOCK_BYTES[kind]).to(DEV)
    return quant.QuantizedWeight(kind, blocks, (n, k))


def _check(ours, torch_out, ref64, dtype):
    assert ours.dtype == torch_out.dtype and ours.shape == torch_out.shape
    assert not torch.isnan(ours).any(), "NaN in output (an element was not written?)"
    ref = ref64.float()
    err, base = (ours.float() - ref).abs(), (torch_out.float() - ref).abs()
    eps = ULP[dtype] * (ref.abs() + 1e-2 * ref.abs().max() + 1e-6)
    bad = err > 2 * base + eps
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off; worst err {err.max().item():.3g} "
                           f"(torch's worst {base.max().item():.3g})")


def _product_case(kind, m, n, k, dtype, seed=0, bias=True):
    """(w, x, bias, ref64, torch_lowp): x scaled so that outputs are O(1) (fp16 does not overflow)."""
    w = _weight(kind, n, k, seed)
    w32 = w.dequantize(torch.float32)  # [n, k]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, device=DEV, generator=gen) / (w32.abs().mean() * k ** 0.5)
    x = x.to(dtype)
    b = torch.randn(n, device=DEV, generator=gen).to(dtype) if bias else None
    ref64 = x.double() @ w32.double().t() + (b.double() if bias else 0)
    torch_out = F.linear(x, w32.to(dtype), b)
    return w, x, b, ref64, torch_out


# ---- dequantize / dequantize_into ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_dequantize_matches_reference_exactly(kind, dtype):
    """Tiles of 2048 outputs span rows and end mid-row (37 x 4128 / 4352; 301 x 96 / 256: 21 / 8 rows a tile)."""
    q = _q()
    for n, k in [(1, KS[kind][0]), (37, KS[kind][1]), (301, KS[kind][0])]:
        w = _weight(kind, n, k, seed=n)
        expected = w.dequantize(torch.float32).to(dtype)
        ours = q.dequantize(w, dtype)
        assert ours.dtype == dtype and ours.shape == (n, k)
        assert torch.equal(ours, expected), f"{kind} {n}x{k}: {int((ours != expected).sum())} elements differ"
        for static_weight in (False, True):
            out = torch.full((n, k), float("nan"), device=DEV, dtype=dtype)  # poisoned: every element written
            assert q.dequantize(w, dtype, out=out, static_weight=static_weight) is out
            assert torch.equal(out, expected)


# ---- qlinear (decode, M <= 32) ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 16, 23, 32])
@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_qlinear(kind, m, dtype):
    q = _q()
    for n, k in [(200, KS[kind][1]), (33, KS[kind][0])]:  # 200, 33: a partial 16-row tile
        w, x, b, ref64, torch_out = _product_case(kind, m, n, k, dtype, seed=m)
        ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, False)
        _check(ours, torch_out, ref64, dtype)


@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_qlinear_large_grid(kind):
    """Past 2 CTAs an SM of 16-row tiles (H100/H200: 132 SMs, so n > 4224) qlinear runs its kernels without
    x loaded ahead, 3 stages a warp, Q4_K at M = 1 at 3 CTAs an SM (past 3, 18 of them loop to a second tile,
    their warps' 6 chunks by TMA boxes at k = 4352, the last box reading past the row's end) and at M > 8 in CTAs
    of two tiles; the other formats at M 5 and 13 with k from 4096, and Q6_K and Q8_0 with K of fewer chunks than a
    CTA's warps (the smaller k), run 128-row CTAs (qtile_kernel), at 23 and 32 rows too. 276 rows
    past each (4500 and 6612 on 132 SMs) end in a partial tile (the second of a CTA's two 16-row tiles holds 4
    rows; at M = 1 a tile of 4 rows, whose other 12 are never copied, or arrive as zeros in a TMA box). Q6_K at M = 1
    with K of 8 chunks and more writes its own int8 records for its int8 kernel (k 4096: its stages by TMA boxes),
    and so do Q8_0, Q4_0 and Q4_1 on sm_90 (k 4096)."""
    q = _q()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in (16 * 2 * sms + 276, 16 * 3 * sms + 276):
        for k in KS[kind] + ([4096] if kind in ("Q6_K", "Q8_0", "Q4_0", "Q4_1") else []):
            for m in (1, 5, 13) + ((23, 32) if kind in ("Q6_K", "Q8_0") and k < 2048 else ()):
                w, x, b, ref64, torch_out = _product_case(kind, m, n, k, torch.bfloat16, seed=m)
                ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, False)
                _check(ours, torch_out, ref64, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qlinear_q4k_x_held_across_tiles(dtype):
    """Q4_K at M = 1 past 4 tiles an SM with at most 2 chunks a warp (k <= 4096): each warp keeps its chunks of x in
    registers across the tiles it loops over. k 256 (one chunk: 7 warps idle), 2304 (warp 0 takes 2 chunks, the
    others 1) and 4096; 276 rows past 4 tiles an SM end in a partial tile."""
    q = _q()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 16 * 4 * sms + 276
    for k in (256, 2304, 4096):
        w, x, b, ref64, torch_out = _product_case("Q4_K", 1, n, k, dtype, seed=k)
        ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE["Q4_K"], n, k, b, False)
        _check(ours, torch_out, ref64, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["Q6_K", "Q8_0"])
def test_qlinear_x_row_in_shared_memory(kind, dtype):
    """Q6_K and Q8_0 at M = 1 on small grids stage x's row in shared memory up to K = 16384 and load x ahead
    past it: K at the bound, one chunk past it, and (Q8_0) a last chunk of one 32-element block (on sm_90 Q8_0's
    K of whole chunks take its int8 kernel instead, on its own records)."""
    q = _q()
    ks = [16384, 16640] + ([16160] if kind == "Q8_0" else [])
    for k in ks:
        w, x, b, ref64, torch_out = _product_case(kind, 1, 40, k, dtype, seed=k)
        ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], 40, k, b, True)
        _check(ours, torch_out, ref64, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qlinear_q8_0_short_k_one_row(dtype):
    """Q8_0 at M = 1 with K of fewer than 8 chunks, N whole 16-row tiles past 2 CTAs an SM (a small model's tied
    lm_head) streams its tiles by bulk copies on sm_90 (short_k_kernel): k 576 and 640 (the default model's and
    Gemma 3's), 608 (19 blocks: rows alternate between word-aligned and 2 bytes off), 96 (one partial chunk) and 2016
    (8 chunks, the last of 7 blocks; room for 3 warps); n past 2 tiles an SM, past 5 with the grid's warps wrapping
    unevenly, and past 17. Into a NaN-poisoned wider output, every element of the slice is written and nothing else;
    and the row equals itself among 5 rows (qtile_kernel) bit for bit, so greedy decoding is batch-invariant."""
    q = _q()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in (16 * (2 * sms + 1), 16 * (5 * sms + 3), 16 * 17 * sms):
        for k in (96, 576, 608, 640, 2016):
            w, x, b, ref64, torch_out = _product_case("Q8_0", 1, n, k, dtype, seed=k + n)
            ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE["Q8_0"], n, k, b, True)
            _check(ours, torch_out, ref64, dtype)
            wide = torch.full((1, n + 8), float("nan"), device=DEV, dtype=dtype)
            torch.ops.minfer.qlinear_into(wide[:, 3:3 + n], x, w.blocks, q.QTYPE["Q8_0"], b, True)
            assert torch.equal(wide[:, 3:3 + n], ours)
            assert wide[:, :3].isnan().all() and wide[:, 3 + n:].isnan().all(), "qlinear_into wrote outside its slice"
            rows = torch.cat([x.flip(1), x * 0.5, x, -x, x.roll(7, 1)])  # [5, k]
            batched = torch.ops.minfer.qlinear(rows, w.blocks, q.QTYPE["Q8_0"], n, k, b, True)
            assert torch.equal(batched[2:3], ours), f"n {n} k {k}: one row differs from the same row among 5"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 9, 16, 23, 32])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_qlinear_short_k_in_registers(kind, m, dtype):
    """The 4- and 5-bit legacy formats with K of at most 4 chunks a warp (k <= 2048) on small grids load W
    straight into registers (regs_kernel), 16 rows of x a CTA past 8 (23, 32: two blocks of x rows over the grid's
    y, 23's second partial; on 3000 x 576's 188 CTAs a block, one CTA walking both on a GPU of 94-187 SMs,
    regs_y_blocks): a small model's 576 and 1536, k at the limit, k ending in half a chunk (1568: 49 blocks), and
    2080 just past the limit (qlinear_kernel); weights static, as the engine's.
    Into a NaN-poisoned wider output, every element of the slice is written and nothing else."""
    q = _q()
    for n, k in [(576, 1536), (970, 576), (3000, 576), (37, 2048), (203, 1568), (45, 2080)]:
        w, x, b, ref64, torch_out = _product_case(kind, m, n, k, dtype, seed=m + k)
        ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, True)
        _check(ours, torch_out, ref64, dtype)
        wide = torch.full((m, n + 8), float("nan"), device=DEV, dtype=dtype)
        torch.ops.minfer.qlinear_into(wide[:, 3:3 + n], x, w.blocks, q.QTYPE[kind], b, True)
        assert torch.equal(wide[:, 3:3 + n], ours)
        assert wide[:, :3].isnan().all() and wide[:, 3 + n:].isnan().all(), "qlinear_into wrote outside its slice"


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 16, 23, 32])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K"])
def test_qlinear_act(kind, m, dtype, act):
    """act(gate) * up of the gate | up linear equals the activation's own launch after qlinear bit for bit, where the
    epilogue computes it (the 4- and 5-bit legacy formats, short K, up to 32 rows: a small model's gate | up of 2 x
    1536 x 576, whose 192 CTAs a 16-row block of x walk both blocks at 23 and 32 rows on a GPU of 96-191 SMs
    (regs_y_blocks), an intermediate of 100 (13 CTAs of 8 outputs, the last partial), K at regs_kernel's limit) and where
    the call falls back (Q8_0, Q4_K, K past the limit). Every element is written (the output is poisoned by the
    caching allocator's reuse: filled with NaN first)."""
    q = _q()
    acts = {"silu": torch.ops.minfer.silu_and_mul, "gelu_tanh": torch.ops.minfer.gelu_tanh_and_mul}
    if kind == "Q4_K":  # super-blocks of 256
        shapes = [(1536, 512), (100, 256), (40, 4096), (24, 4352)]
    else:
        k_long = 2048 if kind != "Q8_0" else 4096
        shapes = [(1536, 576), (100, 96), (40, k_long), (24, k_long + 256)]
    for inter, k in shapes:
        w, x, _, _, _ = _product_case(kind, m, 2 * inter, k, dtype, seed=m + k + inter, bias=False)
        expected = acts[act](torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], 2 * inter, k, None, True), None)
        torch.full((m, inter), float("nan"), device=DEV, dtype=dtype)  # freed: the op's output may reuse it
        ours = torch.ops.minfer.qlinear_act(x, w.blocks, q.QTYPE[kind], 2 * inter, k, act, True)
        assert ours.shape == (m, inter) and ours.dtype == dtype
        assert torch.equal(ours, expected), f"{kind} {m} x {2 * inter} x {k} {act}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [2, 8, 9, 16])
def test_qlinear_q4k_tiles_split_over_k(m, dtype):
    """Q4_K at M 2-16 runs 128-row CTAs (tile_kernel) where the tiles fill 2 CTAs an SM, and past M = 4 where
    a CTA takes more than 2 chunks, and at 9-16 rows from 4096 rows on; narrow W splits K over the grid, and the
    last CTA of a tile to arrive adds the splits' sums. 4100 x 5376 (33 tiles, the last of 4 rows: warps with no
    row; 21 chunks in 8 splits of 2-3; rows_kernel at M = 2), 2700 x 14336 (at 8-16 rows on 132 SMs 22 tiles in
    12 splits), 256 x SMs + 40 rows x 512 (one split, a partial last tile) and 224 x SMs - 100 rows x 768 (at 9-16
    rows on a card of thin DRAM an SM: one CTA of 14 warps an SM, the last tile partial). On sm_90 the stages come
    by TMA boxes, the last of a row reading 16 bytes past its end. Called twice: the arrival counters are left zero
    for the next call."""
    q = _q()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in [(4100, 5376), (2700, 14336), (256 * sms + 40, 512), (224 * sms - 100, 768)]:
        w, x, b, ref64, torch_out = _product_case("Q4_K", m, n, k, dtype, seed=m + n)
        ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE["Q4_K"], n, k, b, False)
        _check(ours, torch_out, ref64, dtype)
        again = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE["Q4_K"], n, k, b, True)
        assert torch.equal(ours, again)


@pytest.mark.parametrize("m", [2, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_qlinear_tiles_split_over_k(kind, m):
    """Every format at M 2-32 on W of 4096 x 4096 and more runs 128-row CTAs of 256-k chunks (qtile_kernel; Q4_K up
    to 16 rows its own tile_kernel): 4100 x 4352 (33 tiles, the last of 4 rows; 17 chunks in 8 splits of 2-3), 4100 x
    14336 (56 chunks in 8 splits of 7), 256 x SMs + 40 rows x 4096 (one split) and, for the 32-element formats, 4100
    x 4128 (a last chunk of one block). On sm_90 Q6_K's stages come by TMA boxes where its rows are multiples of 16 bytes
    (K = 14336 and 4096: a split's boxes start mid-row, and a partial tile's rows past N arrive as zeros), by
    cp.async pieces at K = 4352; x's chunks at 9-32 rows by TMA boxes too (rows past M and values past K arrive as
    zeros). Called twice: the arrival counters are left zero for the next call."""
    q = _q()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    short = [(4100, 4128)] if kind in LEGACY else []
    for n, k in [(4100, 4352), (4100, 14336), (256 * sms + 40, 4096)] + short:
        w, x, b, ref64, torch_out = _product_case(kind, m, n, k, torch.bfloat16, seed=m + n)
        ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, False)
        _check(ours, torch_out, ref64, torch.bfloat16)
        again = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, True)
        assert torch.equal(ours, again)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [33, 47, 64])
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_qlinear_wide_rows(kind, m, dtype):
    """Q4_K and Q6_K take 33-64 rows on W of 4096 x 4096 and more (qlinear_max_rows; qtile_kernel's 8 tiles of 8 x
    rows, one CTA an SM): 4100 x 4352 (33 tiles, the last of 4 rows; 17 chunks split over K), 4100 x 14336, 256 x
    SMs + 40 rows x 4096 (one split; on 132 SMs 265 CTAs, past two waves); into a NaN-poisoned out (every element
    written); called twice (the split counters left zero). x's rows past M arrive as zeros in its boxes (tiled
    blocks: _check_tiled)."""
    q, ops = _q(), torch.ops.minfer
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in [(4100, 4352), (4100, 14336), (256 * sms + 40, 4096)]:
        assert ops.qlinear_max_rows(q.QTYPE[kind], n, k) == 64
        w, x, b, ref64, torch_out = _product_case(kind, m, n, k, dtype, seed=m + n)
        out = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
        ops.qlinear_into(out, x, w.blocks, q.QTYPE[kind], b, False)
        _check(out, torch_out, ref64, dtype)
        again = ops.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, True)
        assert torch.equal(out, again)


def test_qlinear_max_rows():
    """qlinear's row limit: 64 for Q4_K and Q6_K (tiled or not) on W of 4096 x 4096 and more, else 32; more rows
    fail with the limit named."""
    q, ops = _q(), torch.ops.minfer
    for kind in ("Q4_K", "Q6_K"):
        assert ops.qlinear_max_rows(q.QTYPE[kind], 4096, 4096) == 64
        assert ops.qlinear_max_rows(q.QTYPE[kind] | q.TILED, 28672, 4096) == 64
        assert ops.qlinear_max_rows(q.QTYPE[kind], 4080, 4096) == 32
        assert ops.qlinear_max_rows(q.QTYPE[kind], 4096, 3840) == 32
    for kind in ("Q8_0", "Q4_0", "Q5_K"):
        assert ops.qlinear_max_rows(q.QTYPE[kind], 4096, 4096) == 32
    with pytest.raises(RuntimeError, match="qtype must be"):
        ops.qlinear_max_rows(99, 4096, 4096)
    w = _weight("Q4_K", 4096, 4096)
    with pytest.raises(RuntimeError, match=r"at most 32 rows \(64 for Q4_K and Q6_K"):
        ops.qlinear(torch.randn(65, 4096, device=DEV, dtype=torch.bfloat16), w.blocks, q.QTYPE["Q4_K"], 4096, 4096,
                    None, False)
    narrow = _weight("Q4_K", 1024, 4096)
    with pytest.raises(RuntimeError, match="at most 32 rows"):
        ops.qlinear(torch.randn(33, 4096, device=DEV, dtype=torch.bfloat16), narrow.blocks, q.QTYPE["Q4_K"], 1024,
                    4096, None, False)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_qlinear_rows_far_apart_in_scale(kind):
    """x rows at 2^13, 2^-66 and 1 (Q4_K carries x scaled per row and chunk: in fp16 together, as 22-bit integers
    alone), together and one by one: each row's output, scaled back by its factor, meets the rule on its own."""
    q = _q()
    n, k = 64, KS[kind][1]
    w, x, _, _, _ = _product_case(kind, 3, n, k, torch.bfloat16, seed=3, bias=False)
    scale = torch.tensor([[2.0 ** 13], [2.0 ** -66], [1.0]], device=DEV)  # powers of 2: exact both ways
    x = (x.float() * scale).to(torch.bfloat16)
    w32 = w.dequantize(torch.float32)
    ref64, torch_out = x.double() @ w32.double().t(), F.linear(x, w32.to(torch.bfloat16))
    together = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, None, False)
    for r in range(3):
        alone = torch.ops.minfer.qlinear(x[r:r + 1].contiguous(), w.blocks, q.QTYPE[kind], n, k, None, False)
        for ours in (together[r:r + 1], alone):
            _check(ours.float() / scale[r], torch_out[r:r + 1].float() / scale[r], ref64[r:r + 1] / scale[r].double(),
                   torch.bfloat16)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_qlinear_static_weight_and_no_bias(kind):
    q = _q()
    n, k = 4096, KS[kind][1]  # many CTAs, programmatic dependent launch
    w, x, _, ref64, torch_out = _product_case(kind, 3, n, k, torch.bfloat16, bias=False)
    ours = q.linear(x, w, None, static_weight=True)  # the seam's call
    _check(ours, torch_out, ref64, torch.bfloat16)
    again = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, None, False)
    assert torch.equal(ours, again)


def _norm_case(kind, m, n, k, dtype, seed, bias=True):
    """(w, x, bias, norm weight, normed x in fp64): x's norm scale far from 1, the norm weight sized so that the
    products are O(1) (fp16 does not overflow)."""
    w, x, b, _, _ = _product_case(kind, m, n, k, dtype, seed=seed, bias=bias)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    x = (torch.randn(m, k, device=DEV, generator=gen) * 300 + 2).to(dtype)
    size = 1 / (w.dequantize(torch.float32).abs().mean() * k ** 0.5)
    nw = ((torch.rand(k, device=DEV, generator=gen) + 0.5) * size).to(dtype)
    x64 = x.double()
    xn64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * nw.double()
    return w, x, b, nw, xn64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 8, 9, 23])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_qlinear_norm_in_the_launch(kind, m, dtype):
    """qlinear with norm_weight reads x as rms_norm(x) in regs_kernel's launch (qlinear_takes_norm: up to 8 rows): the
    product of the normed x within the GEMM rule (each row's worst error), and equal, up to the norm's scale rounded
    differently, to rms_norm's launch then qlinear; bit for bit at k 576 (rms_norm's lane groups of 32 sum in the
    same order) and where the norm runs in its own launch (past 8 rows or 2048 k). Shapes: a small model's q | k | v
    (960 x 576), k at the limit, k ending in half a chunk (1568), and 2080 past it. A row's output does not depend on
    the rows beside it."""
    q = _q()
    eps = 1e-5
    for n, k in [(960, 576), (37, 2048), (203, 1568), (45, 2080)]:
        w, x, b, nw, xn64 = _norm_case(kind, m, n, k, dtype, seed=m + k)
        fused = torch.ops.minfer.qlinear_takes_norm(x, q.QTYPE[kind], n)
        assert fused == (k <= 2048 and m <= 8), f"{kind} {m} x {n} x {k}: qlinear_takes_norm {fused}"
        torch.full((m, n), float("nan"), device=DEV, dtype=dtype)  # freed: the op's output may reuse it
        ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, True, None, nw, eps)
        # the GEMM rule by rows' worst errors: ours and torch's x round apart at a few elements (the norm's scale
        # as summed in fp32, x * scale * w), so that element by element one may be off where the other is lucky
        w32 = w.dequantize(torch.float32)
        ref = (xn64 @ w32.double().t() + b.double()).float()
        torch_out = F.linear(xn64.to(dtype), w32.to(dtype), b)
        assert ours.shape == torch_out.shape and not ours.isnan().any()
        err, base = (ours.float() - ref).abs().amax(1), (torch_out.float() - ref).abs().amax(1)
        assert (err <= 2 * base + ULP[dtype] * 1e-2 * ref.abs().amax(1)).all(), (err, base)
        apart = torch.ops.minfer.qlinear(torch.ops.minfer.rms_norm(x, nw, eps, None), w.blocks, q.QTYPE[kind], n, k,
                                         b, True)
        if fused and k > 1024:  # the norm's sum in another order than rms_norm's
            assert (ours.float() - apart.float()).abs().max() <= 4 * ULP[dtype] * apart.float().abs().max()
        else:
            assert torch.equal(ours, apart)
        one = torch.ops.minfer.qlinear(x[m - 1:].contiguous(), w.blocks, q.QTYPE[kind], n, k, b, True, None, nw, eps)
        assert torch.equal(one[0], ours[m - 1]), "a row's output depends on the rows beside it"


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_1"])
def test_qlinear_act_norm_in_the_launch(kind, m, dtype, act):
    """qlinear_act with norm_weight (a small model's gate | up of 2 x 1536 x 576, an intermediate of 100) equals
    qlinear with it, then the activation; past regs_kernel's K (2080) or 8 rows the norm's own launch first, bit for
    bit."""
    q = _q()
    acts = {"silu": torch.ops.minfer.silu_and_mul, "gelu_tanh": torch.ops.minfer.gelu_tanh_and_mul}
    eps = 1e-5
    for inter, k in [(1536, 576), (100, 96), (24, 2080)]:
        w, x, _, nw, _ = _norm_case(kind, m, 2 * inter, k, dtype, seed=m + k + inter, bias=False)
        gate_up = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], 2 * inter, k, None, True, None, nw, eps)
        expected = acts[act](gate_up, None)
        torch.full((m, inter), float("nan"), device=DEV, dtype=dtype)  # freed: the op's output may reuse it
        ours = torch.ops.minfer.qlinear_act(x, w.blocks, q.QTYPE[kind], 2 * inter, k, act, True, None, None, nw, eps)
        assert torch.equal(ours, expected), f"{kind} {m} x {2 * inter} x {k} {act}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 8, 9, 32])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_qlinear_into_accumulates(kind, m, dtype):
    """qlinear_into with accumulate adds the product into out (a residual), each rounded as its own op: equal to
    out + qlinear bit for bit, into a slice of a NaN-poisoned wider tensor that stays NaN around it; in regs_kernel's
    epilogue up to 8 rows (a small model's o and down: 576 x 576, 576 x 1536), and where no kernel takes it (Q8_0, K
    past 2048, 9 rows and more: the add's own launch)."""
    q = _q()
    for n, k in [(576, 576), (576, 1536), (40, 2080)]:
        w, x, b, _, _ = _product_case(kind, m, n, k, dtype, seed=m + n + k)
        fused = torch.ops.minfer.qlinear_takes_norm(x, q.QTYPE[kind], n)
        assert fused == (kind != "Q8_0" and k <= 2048 and m <= 8)
        residual = torch.randn(m, n, device=DEV, dtype=dtype)
        expected = residual + torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, True)
        wide = torch.full((m, n + 8), float("nan"), device=DEV, dtype=dtype)
        wide[:, 3:3 + n] = residual
        torch.ops.minfer.qlinear_into(wide[:, 3:3 + n], x, w.blocks, q.QTYPE[kind], b, True, None, True)
        assert torch.equal(wide[:, 3:3 + n], expected), f"{kind} {m} x {n} x {k}"
        assert wide[:, :3].isnan().all() and wide[:, 3 + n:].isnan().all(), "qlinear_into wrote outside its slice"


@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_qlinear_into_a_slice(kind):
    """qlinear_into writes columns [3, 3 + n) of a wider, NaN-poisoned output (the columns of a fused q|k|v whose
    parts differ in format) with qlinear's values, and nothing else. n past 3 CTAs of 16 rows an SM takes every
    kernel: Q4_K's 32-row CTAs at M = 13 and its prepared x at M = 1 and 5."""
    q = _q()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k = 16 * 3 * sms + 276, KS[kind][0]
    for m in (1, 5, 13):
        w, x, b, _, _ = _product_case(kind, m, n, k, torch.bfloat16, seed=m)
        wide = torch.full((m, n + 8), float("nan"), device=DEV, dtype=torch.bfloat16)
        torch.ops.minfer.qlinear_into(wide[:, 3:3 + n], x, w.blocks, q.QTYPE[kind], b, False)
        assert torch.equal(wide[:, 3:3 + n], torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, False))
        assert wide[:, :3].isnan().all() and wide[:, 3 + n:].isnan().all(), "qlinear_into wrote outside its slice"


@pytest.mark.parametrize("m", [1, 16, 32])
def test_fused_parts_beside_each_other(m):
    """fuse()'s stacks of two formats at decode rows (Q4_K_M's q | k and its v in Q6_K) run the smaller on a second
    stream beside the larger (ops.beside_stream): the output equals each stack's linear alone, bit for bit, called
    eagerly and replayed from a CUDA graph over new x. Both split K over the grid at 16 and 32 rows (Q4_K 6144 x 4096,
    Q6_K 4096 x 4096, tiled as loaded), so each stream's arrival counters must be its own."""
    from minfer.model import fuse, fused_linear
    from minfer.ops import get_backend

    q, ops, k = _q(), get_backend("cuda"), 4096
    parts = [quant.tile_rows(_weight("Q4_K", 6144, k, seed=1)), quant.tile_rows(_weight("Q6_K", 4096, k, seed=2))]
    fused = fuse(parts)
    assert [w.kind for w in fused] == ["Q4_K", "Q6_K"]
    gen = torch.Generator(device=DEV).manual_seed(m)
    scale = 1 / (parts[0].dequantize(torch.float32).abs().mean().item() * k ** 0.5)

    def new_x():
        return (torch.randn(m, k, device=DEV, generator=gen) * scale).to(torch.bfloat16)

    def alone(x):
        return torch.cat([q.linear(x, w) for w in parts], dim=1)

    x = new_x()
    assert ops.beside_stream(x) is not None
    ours = fused_linear(ops, x, fused)
    assert not ours.isnan().any() and torch.equal(ours, alone(x))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the capture's stream once outside it, as the engines warm up
        fused_linear(ops, x, fused)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fused_linear(ops, x, fused)
    for _ in range(3):
        x.copy_(new_x())
        graph.replay()
        assert torch.equal(out, alone(x))


# ---- prefill: dequantize into a scratch, then the dense linear ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_layer_group_linears(kind, dtype):
    """A layer group's linears (quant.group_layer) called in order, as a forward does: past 32 rows the first decodes
    every matrix of its layer in one launch and the others read theirs (as static weights); up to 32, qlinear on the
    grouped blocks. Two layers in turn, twice, so that each layer's first re-decodes what the other overwrote: every
    product equals the ungrouped weight's bit for bit (same values, same GEMM)."""
    from minfer.ops import cuda
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # the default model's q|k|v, o, gate|up, down
    layers = [[_weight(kind, n, k, seed=10 * i + j) for j, (n, k) in enumerate(shapes)] for i in range(2)]
    groups = [quant.group_layer(ws) for ws in layers]
    assert all(g.layer is not None for gs in groups for g in gs)
    for m in (40, 5):
        xs = [torch.randn(m, k, device=DEV).div(k ** 0.5).to(dtype) for _, k in shapes]
        # first, ungrouped (each decoded into the scratch the groups use too, in their own launches)
        expected = [[cuda.linear(x, w, static_weight=True) for x, w in zip(xs, ws)] for ws in layers]
        for _ in range(2):
            for gs, ys in zip(groups, expected):
                for x, g, y in zip(xs, gs, ys):
                    assert torch.equal(cuda.linear(x, g, static_weight=True), y), f"{kind} {g.shape} at {m} rows"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [113, 4097])
@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_linear_prefill(kind, m, dtype):
    q = _q()
    n, k = 200, KS[kind][1]
    w, x, b, ref64, torch_out = _product_case(kind, m, n, k, dtype, seed=m)
    scratch = torch.full((n, k), float("nan"), device=DEV, dtype=dtype)
    ours = q.linear(x, w, b, scratch=scratch)
    _check(ours, torch_out, ref64, dtype)


def test_linear_prefill_in_row_slices(monkeypatch):
    """A weight wider than the scratch (a 128k-vocabulary lm_head) runs in slices of rows, each written into its
    columns of the output: here 200 rows in slices of 64, into a fresh output and into a NaN-poisoned slice."""
    from minfer.ops import cuda
    k = KS["Q4_K"][1]
    monkeypatch.setattr(cuda, "SCRATCH_VALUES", 64 * k)
    monkeypatch.setattr(cuda, "_scratch", {})  # a buffer of the patched size, dropped after the test
    w, x, b, ref64, torch_out = _product_case("Q4_K", 113, 200, k, torch.bfloat16, seed=3)
    _check(cuda.linear(x, w, b), torch_out, ref64, torch.bfloat16)
    wide = torch.full((113, 205), float("nan"), device=DEV, dtype=torch.bfloat16)
    cuda.linear(x, w, b, out=wide[:, 2:202])
    _check(wide[:, 2:202], torch_out, ref64, torch.bfloat16)
    assert wide[:, :2].isnan().all() and wide[:, 202:].isnan().all(), "a slice was written outside its columns"


# ---- qembedding ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_qembedding(kind, dtype):
    q = _q()
    n, k = 50, KS[kind][1]
    w = _weight(kind, n, k)
    expected = w.dequantize(torch.float32).to(dtype)  # [n, k]
    for index_dtype in (torch.int32, torch.int64):
        ids = torch.tensor([[3, 0, 49], [7, 7, 12]], device=DEV, dtype=index_dtype)
        ours = q.embedding(ids, w, dtype)
        assert ours.shape == (2, 3, k) and ours.dtype == dtype
        assert torch.equal(ours, expected[ids.long()])
    bad = q.embedding(torch.tensor([1, -1, n, 2], device=DEV), w, dtype)
    assert torch.equal(bad[0], expected[1]) and torch.equal(bad[3], expected[2])
    assert torch.isnan(bad[1:3]).all(), "an out-of-range id must give a NaN row"


# ---- tiled blocks (Q4_K, Q6_K) ----

def _check_tiled(kind, shapes, record_rows, dtype, gen):
    """For each W [n, k] of shapes: the tiled weight's product gives the bits of the same weight by rows at 1-64 rows,
    and up to record_rows rows (k of 768 on) on x's records (written by rms_norm over poison) the bits of the weight
    by rows: without records for Q4_K (which converts x itself to the same records), on the same records for Q6_K
    (whose one row without them is another kernel); so does its dequantize."""
    q, ops = _q(), torch.ops.minfer
    for n, k in shapes:
        w = _weight(kind, n, k, seed=n + k)
        t = quant.tile_rows(w)
        assert t.tiled
        scale = 1 / (w.dequantize(torch.float32).abs().mean().item() * k ** 0.5)
        for m in (1, 2, 9, 16, 24, 32, 40, 64):
            x = (torch.randn(m, k, device=DEV, generator=gen) * scale).to(dtype)
            want = q.linear(x, w)
            ours = q.linear(x, t)
            assert not torch.isnan(ours).any() and torch.equal(ours, want), (n, k, m)
            if m <= record_rows and k >= 768:
                rec = _poisoned_records(m, k)
                xn = ops.rms_norm(x, torch.ones(k, device=DEV, dtype=dtype), 1e-5, rec)
                ref_rec = None if kind == "Q4_K" else rec
                assert torch.equal(q.linear(xn, t, x_records=rec), q.linear(xn, w, x_records=ref_rec)), (n, k, m)
        assert torch.equal(q.dequantize(t, dtype), q.dequantize(w, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_q4k_is_bit_identical(dtype):
    """Q4_K linears with their blocks tiled (quant.tile_rows, as the loader keeps them on the GPU) give the bits of
    the same weight by rows on every path: one row on boxes (28672 rows) and on bulk copies (4096), 2-16 rows on
    tile_kernel (split over K at 4096 x 14336) and rows_kernel, 17-32 on qtile_kernel and qlinear_kernel (1536 x
    512), 33-64 on qtile_kernel where W is 4096 x 4096 and more, more by the tiled dequantize; with x's records, and
    gate | up's pairs with the activation (inter 14336 and 1008, a last pair tile past the rows)."""
    q, ops = _q(), torch.ops.minfer
    gen = torch.Generator(device=DEV).manual_seed(5)
    _check_tiled("Q4_K", [(28672, 4096), (4096, 4096), (4096, 14336), (1536, 512)], 16, dtype, gen)
    for inter, k in ((14336, 4096), (1008, 768)):
        w = _weight("Q4_K", 2 * inter, k, seed=inter)
        t = quant.tile_rows(w)
        norm_w = (torch.randn(k, device=DEV, generator=gen) / (w.dequantize(torch.float32).abs().mean() * k ** 0.5))
        for m in (1, 9, 16):
            x_rec = _poisoned_records(m, k)
            x = ops.rms_norm(torch.randn(m, k, device=DEV, generator=gen).to(dtype), norm_w.to(dtype), 1e-5, x_rec)
            want = q.linear_act(x, w, "silu", x_records=x_rec)
            ours = q.linear_act(x, t, "silu", x_records=x_rec)
            assert not torch.isnan(ours).any() and torch.equal(ours, want), (inter, k, m)
    assert torch.equal(q.dequantize(t, dtype), q.dequantize(w, dtype))
    ids = torch.tensor([0, 2015, 17], device=DEV)
    assert torch.equal(q.embedding(ids, t, dtype), q.embedding(ids, w, dtype))
    with pytest.raises(RuntimeError, match="tiled blocks"):
        ops.qlinear(x[:, :k], w.blocks[:24], q.QTYPE["Q4_K"] | q.TILED, 24, k, None, True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiled_q6k_is_bit_identical(dtype):
    """Q6_K linears tiled as the loader keeps them give the bits of the same weight by rows on every path: one row on
    x's records (i8_kernel: a tile's chunk by one bulk copy, dense 210-byte rows in the stage, where the rows keep TMA
    boxes at K a multiple of 2048 and cp.async pieces below it: 768), with records of its own past 2 CTAs an SM
    (8192 rows), 2-32 rows on qtile_kernel (wide, and short K on a wide grid: 8192 x 768) and qlinear_kernel (1024 x
    4096 and 1536 x 512 at 2-16 rows), 33-64 on qtile_kernel on the wide W, more by the tiled dequantize (each block
    gathered from its aligned 16-byte pieces; at K 768 and 512 a tile's blocks span rows); the errors for tiled blocks
    of 24 rows or of Q8_0."""
    q, ops = _q(), torch.ops.minfer
    gen = torch.Generator(device=DEV).manual_seed(6)
    _check_tiled("Q6_K", [(4096, 14336), (1024, 4096), (8192, 4096), (8192, 768), (1536, 512)], 1, dtype, gen)
    x = torch.randn(1, 512, device=DEV, dtype=dtype)
    w = _weight("Q6_K", 24, 512)
    with pytest.raises(RuntimeError, match="tiled blocks"):  # 24 rows: no whole groups of 16
        ops.qlinear(x, w.blocks, q.QTYPE["Q6_K"] | q.TILED, 24, 512, None, True)
    with pytest.raises(RuntimeError, match="tiled blocks"):  # Q8_0 has no tiled kernels
        ops.qlinear(x, _weight("Q8_0", 32, 512).blocks, q.QTYPE["Q8_0"] | q.TILED, 32, 512, None, True)


# ---- x records written by the norms and the activations ----

def _poisoned_records(rows, k):
    """Room for x's records, every byte 0xFF (NaN as fp16 or fp32): a byte left unwritten shows."""
    return torch.full((rows, k // 256 * _q().Q4K_RECORD_BYTES), 0xFF, dtype=torch.uint8, device=DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_records_from_norms_and_activations(m, dtype):
    """rms_norm, fused_add_rms_norm, silu_and_mul and gelu_tanh_and_mul given records write x's records beside
    their output, as the Q4_K linears read them: the Q4_K product on those records is bit for bit the one on
    qlinear's own conversion, and the ops' outputs are those without records. Widths 768 (a norm row on one
    lane group), 4352 (17 chunks) and 14336; n = 16 x 3 SMs + 16 rows, and 96 rows against the reference.
    M = 1 writes and reads the int8 form, M 3 and 16 the fp16 one."""
    q, ops = _q(), torch.ops.minfer
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, eps = 16 * 3 * sms + 16, 1e-5
    gen = torch.Generator(device=DEV).manual_seed(m)
    for k in (768, 4352, 14336):
        w, small = _weight("Q4_K", n, k, seed=k), _weight("Q4_K", 96, k, seed=k + 1)
        scale = 1 / (w.dequantize(torch.float32).abs().mean().item() * k ** 0.5)  # outputs O(1)
        small32 = small.dequantize(torch.float32)

        def product_check(x, records):
            ours = ops.qlinear(x, w.blocks, q.QTYPE["Q4_K"], n, k, None, True, records)
            assert not torch.isnan(ours).any()
            assert torch.equal(ours, ops.qlinear(x, w.blocks, q.QTYPE["Q4_K"], n, k, None, True))
            ours = ops.qlinear(x, small.blocks, q.QTYPE["Q4_K"], 96, k, None, True, records)
            _check(ours, F.linear(x, small32.to(dtype)), x.double() @ small32.double().t(), dtype)

        x = torch.randn(m, k, device=DEV, generator=gen).to(dtype)
        norm_w = (torch.randn(k, device=DEV, generator=gen) * scale).to(dtype)
        rec = _poisoned_records(m, k)
        out = ops.rms_norm(x, norm_w, eps, rec)
        assert torch.equal(out, ops.rms_norm(x, norm_w, eps))
        product_check(out, rec)

        residual = torch.randn(m, k, device=DEV, generator=gen).to(dtype)
        x1, r1, x2, r2 = x.clone(), residual.clone(), x.clone(), residual.clone()
        rec = _poisoned_records(m, k)
        ops.fused_add_rms_norm(x1, r1, norm_w, eps, None, rec)
        ops.fused_add_rms_norm(x2, r2, norm_w, eps, None)
        assert torch.equal(x1, x2) and torch.equal(r1, r2)
        product_check(x1, rec)

        gate_up = (torch.randn(m, 2 * k, device=DEV, generator=gen) * scale ** 0.5).to(dtype)
        for act in (ops.silu_and_mul, ops.gelu_tanh_and_mul):
            rec = _poisoned_records(m, k)
            out = act(gate_up, rec)
            assert torch.equal(out, act(gate_up))
            product_check(out, rec)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1"])
def test_qlinear_on_int8_records(kind, dtype):
    """Q5_K, Q6_K, Q8_0, Q4_0 and Q4_1 at M = 1 given x's records (the int8 form, here written by rms_norm) multiply
    their quants as bytes against x's int8 parts: against the reference with the 2x rule on a grid of 3 tiles and on
    18 tiles more than 2 CTAs an SM hold (those CTAs loop to a second tile, the last one partial), then on 4 tiles an
    SM and 18 more (each CTA looping over 2-3 tiles; x's chunks held across them where a warp has at most 2); a
    non-finite x row gives non-finite outputs. Q5_K and Q6_K: K of 3, 17 and 56 chunks (Q5_K: on sm_90 by TMA boxes
    where a warp takes 4 chunks and more, else cp.async pieces; Q6_K: 56 by boxes from the 16-byte boundary at or
    before each chunk, its rows a multiple of 16 bytes, 3 and 17 by pieces), looping at 3, 9 and 16. The 32-element
    blocks (sm_90; other K ignore the records) by TMA boxes (Q8_0's of 2-byte elements): Q8_0 at K of 8, 17 and 56
    chunks, Q4_0 and Q4_1 at 9, 17 and 56 (8 and fewer stay on regs_kernel); looping at 9 and 16."""
    q, ops = _q(), torch.ops.minfer
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device=DEV).manual_seed(8)
    ks, looping = {"Q5_K": ((768, 4352, 14336), (768, 2304, 4096)), "Q6_K": ((768, 4352, 14336), (768, 2304, 4096)),
                   "Q8_0": ((2048, 4352, 14336), (2304, 4096))}.get(kind, ((2304, 4352, 14336), (2304, 4096)))
    cases = [(n, k) for n in (40, 16 * 2 * sms + 276) for k in ks]
    for n, k in cases + [(16 * 4 * sms + 276, k) for k in looping]:
        w = _weight(kind, n, k, seed=k)
        w32 = w.dequantize(torch.float32)
        norm_w = (torch.randn(k, device=DEV, generator=gen) / (w32.abs().mean() * k ** 0.5)).to(dtype)
        b = torch.randn(n, device=DEV, generator=gen).to(dtype)
        rec = _poisoned_records(1, k)
        x = ops.rms_norm(torch.randn(1, k, device=DEV, generator=gen).to(dtype), norm_w, 1e-5, rec)
        ours = ops.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, True, rec)
        _check(ours, F.linear(x, w32.to(dtype), b), x.double() @ w32.double().t() + b.double(), dtype)
        x[0, k // 3] = float("inf")
        rec = _poisoned_records(1, k)
        x = ops.rms_norm(x, norm_w, 1e-5, rec)
        assert not torch.isfinite(ops.qlinear(x, w.blocks, q.QTYPE[kind], n, k, b, True, rec)).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_qlinear_act_q4k_pairs(dtype, act, m):
    """Q4_K gate | up up to 16 rows on x's records (qlinear_act with x_records): on sm_90 the activation in the
    epilogue of i8_kernel (one row) or tile_kernel over tiles of 8 gate rows and their up rows (one [2, 8, 144] box
    a stage); anywhere, the bits of qlinear then the activation's launch, and the output's records those the
    activation writes. inter 1000 (a last tile past the rows: the box's zeros, unstored) and 14336 x 4096 (the 8B
    MLP; at one row 3 CTAs an SM looping over tiles) with records."""
    q, ops = _q(), torch.ops.minfer
    act_op = ops.silu_and_mul if act == "silu" else ops.gelu_tanh_and_mul
    gen = torch.Generator(device=DEV).manual_seed(11)
    for inter, k in ((1000, 768), (14336, 4096)):
        w = _weight("Q4_K", 2 * inter, k, seed=inter)
        w32 = w.dequantize(torch.float32)
        norm_w = (torch.randn(k, device=DEV, generator=gen) / (w32.abs().mean() * k ** 0.5)).to(dtype)
        x_rec = _poisoned_records(m, k)  # x's records, written by the norm as in the engine
        x = ops.rms_norm(torch.randn(m, k, device=DEV, generator=gen).to(dtype), norm_w, 1e-5, x_rec)
        gate_up = ops.qlinear(x, w.blocks, q.QTYPE["Q4_K"], 2 * inter, k, None, True, x_rec)
        rec = _poisoned_records(m, inter) if inter % 256 == 0 else None
        ref_rec = _poisoned_records(m, inter) if inter % 256 == 0 else None
        want = act_op(gate_up, ref_rec)
        ours = ops.qlinear_act(x, w.blocks, q.QTYPE["Q4_K"], 2 * inter, k, act, True, x_rec, rec)
        assert not torch.isnan(ours).any()
        assert torch.equal(ours, want)
        if rec is not None:
            assert torch.equal(rec, ref_rec)


@pytest.mark.parametrize("kind", quant.QUANTIZED)
def test_records_read_where_the_rule_says(kind):
    """qlinear_reads_records, the kernels' rule that ops.records_for asks before a norm writes records, is the
    dispatch's: given records of poison (0xFF, NaN scales) a call that reads them gives non-finite outputs, one that
    ignores them qlinear's own, bit for bit. Rows 1, 2, 16 and 17; K of 3, 8, 9 and 16 chunks (the 32-element
    blocks' int8 kernel starts at 8 chunks for Q8_0, past 8 for Q4_0 and Q4_1, on sm_90)."""
    q, ops = _q(), torch.ops.minfer
    n, seen = 64, set()
    for k in (768, 2048, 2304, 4096):
        w = _weight(kind, n, k, seed=k)
        scale = w.dequantize(torch.float32).abs().mean() * k ** 0.5
        for m in (1, 2, 16, 17):
            x = (torch.randn(m, k, device=DEV) / scale).to(torch.bfloat16)
            plain = ops.qlinear(x, w.blocks, q.QTYPE[kind], n, k, None, True)
            on_poison = ops.qlinear(x, w.blocks, q.QTYPE[kind], n, k, None, True, _poisoned_records(m, k))
            reads = ops.qlinear_reads_records(x, q.QTYPE[kind])
            assert torch.isfinite(plain).all()
            if reads:
                assert not torch.isfinite(on_poison).any(), f"{kind} {m} x {k}: the rule says it reads records"
            else:
                assert torch.equal(on_poison, plain), f"{kind} {m} x {k}: the rule says it ignores records"
            seen.add(reads)
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    assert (True in seen) == (kind in ("Q4_K", "Q5_K", "Q6_K") or sm90 and kind in ("Q8_0", "Q4_0", "Q4_1"))


@pytest.mark.parametrize("m", [1, 3])
def test_qlinear_q4k_non_finite_x(m):
    """An inf in x makes every output of its row non-finite, as in the reference (at M = 1 the int8 form carries
    it as a NaN scale: rounded to an integer it would vanish); the other rows stay finite."""
    q = _q()
    n, k = 64, 512
    w, x, _, _, _ = _product_case("Q4_K", m, n, k, torch.bfloat16, seed=5, bias=False)
    x[0, 300] = float("inf")
    ours = torch.ops.minfer.qlinear(x, w.blocks, q.QTYPE["Q4_K"], n, k, None, False)
    assert not torch.isfinite(ours[0]).any()
    assert torch.isfinite(ours[1:]).all()


def test_records_bad_inputs_raise():
    ops = torch.ops.minfer
    q = _q()
    k = 1024
    x = torch.randn(2, k, device=DEV, dtype=torch.bfloat16)
    nw = torch.ones(k, device=DEV, dtype=torch.bfloat16)
    rec = _poisoned_records(2, k)
    with pytest.raises(RuntimeError, match="records must have shape"):
        ops.rms_norm(x, nw, 1e-5, rec[:1])
    with pytest.raises(RuntimeError, match="records must be uint8"):
        ops.rms_norm(x, nw, 1e-5, rec.view(torch.int8))
    with pytest.raises(RuntimeError, match="records must be contiguous"):
        ops.fused_add_rms_norm(x, x.clone(), nw, 1e-5, None, _poisoned_records(4, k)[::2])
    with pytest.raises(RuntimeError, match="records are written for float16 or bfloat16"):
        ops.rms_norm(x.float(), nw.float(), 1e-5, rec)
    with pytest.raises(RuntimeError, match="records need hidden in"):
        ops.rms_norm(x[:, :512].contiguous(), nw[:512].contiguous(), 1e-5, _poisoned_records(2, 512))
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.silu_and_mul(torch.randn(2, 2 * 640, device=DEV, dtype=torch.bfloat16), _poisoned_records(2, 512))
    with pytest.raises(RuntimeError, match="records must have shape"):
        ops.silu_and_mul(torch.randn(2, 2 * k, device=DEV, dtype=torch.bfloat16), _poisoned_records(3, k))
    w = _weight("Q4_K", 32, k)
    with pytest.raises(RuntimeError, match="records must have shape"):
        ops.qlinear(x, w.blocks, q.QTYPE["Q4_K"], 32, k, None, False, _poisoned_records(2, 768))
    with pytest.raises(RuntimeError, match="records must be on"):
        ops.qlinear(x, w.blocks, q.QTYPE["Q4_K"], 32, k, None, False, _poisoned_records(2, k).cpu())
    misaligned = torch.full((rec.numel() + 8,), 0xFF, dtype=torch.uint8, device=DEV)[8:].view(rec.shape)  # 8 bytes in
    with pytest.raises(RuntimeError, match="records must be 16-byte aligned"):
        ops.qlinear(x, w.blocks, q.QTYPE["Q4_K"], 32, k, None, False, misaligned)
    with pytest.raises(RuntimeError, match="records must be 16-byte aligned"):
        ops.rms_norm(x, nw, 1e-5, misaligned)


# ---- the ops' registration (fakes, schemas) ----

@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0"])
def test_opcheck(kind):
    import minfer.ops.cuda  # noqa: F401  (registers the norms' and the activations' fake implementations)

    q = _q()
    qt = q.QTYPE[kind]
    n, k = 40, KS[kind][0]
    w = _weight(kind, n, k)
    x = torch.randn(5, k, device=DEV, dtype=torch.float16) / k
    bias = torch.randn(n, device=DEV, dtype=torch.float16)
    out = torch.empty(n, k, device=DEV, dtype=torch.bfloat16)
    ids = torch.tensor([2, 0, 39], device=DEV)
    ops = torch.ops.minfer
    torch.library.opcheck(ops.dequantize.default, (w.blocks, qt, n, k, torch.bfloat16))
    torch.library.opcheck(ops.dequantize_into.default, (out, w.blocks, qt, True))
    torch.library.opcheck(ops.qlinear.default, (x, w.blocks, qt, n, k, bias, True))
    torch.library.opcheck(ops.qlinear_into.default, (x.new_empty(5, n + 3)[:, 1:1 + n], x, w.blocks, qt, bias, True))
    torch.library.opcheck(ops.qembedding.default, (ids, w.blocks, qt, n, k, torch.float16))
    torch.library.opcheck(ops.qlinear_act.default, (x, w.blocks, qt, n, k, "silu", True))
    nw = torch.rand(k, device=DEV, dtype=torch.float16) + 0.5
    torch.library.opcheck(ops.qlinear.default, (x, w.blocks, qt, n, k, bias, True, None, nw, 1e-5))
    torch.library.opcheck(ops.qlinear_act.default, (x, w.blocks, qt, n, k, "silu", True, None, None, nw, 1e-5))
    torch.library.opcheck(ops.qlinear_into.default, (x.new_zeros(5, n), x, w.blocks, qt, bias, True, None, True))
    if kind == "Q4_K":  # x's records, written by the norms and the activations, read by qlinear
        x = torch.randn(5, 1024, device=DEV, dtype=torch.bfloat16)
        w = _weight(kind, n, 1024)
        nw = torch.ones(1024, device=DEV, dtype=torch.bfloat16)
        rec = _poisoned_records(5, 1024)
        torch.library.opcheck(ops.rms_norm.default, (x, nw, 1e-5, rec))
        torch.library.opcheck(ops.fused_add_rms_norm.default, (x.clone(), x.clone(), nw, 1e-5, None, rec))
        torch.library.opcheck(ops.silu_and_mul.default, (torch.cat([x, x], 1), rec))
        xn = ops.rms_norm(x, nw, 1e-5, rec)  # opcheck runs on copies: the records qlinear reads, written here
        torch.library.opcheck(ops.qlinear.default, (xn, w.blocks, qt, n, 1024, None, True, rec))


# ---- bad inputs raise, naming the argument ----

def test_bad_inputs_raise():
    q = _q()
    ops = torch.ops.minfer
    n, k = 32, 256
    w = _weight("Q4_K", n, k)
    qt = q.QTYPE["Q4_K"]
    x = torch.randn(2, k, device=DEV, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        ops.dequantize(w.blocks.view(torch.int8), qt, n, k, torch.float16)
    with pytest.raises(RuntimeError, match="blocks must have shape"):
        ops.dequantize(w.blocks[:, :100].contiguous(), qt, n, k, torch.float16)
    with pytest.raises(RuntimeError, match="blocks must have shape"):
        ops.qlinear(x, w.blocks, qt, n + 1, k, None, False)
    with pytest.raises(RuntimeError, match="n must be in"):
        ops.qlinear(x, w.blocks, qt, -1, k, None, False)
    with pytest.raises(RuntimeError, match="qtype"):
        ops.dequantize(w.blocks, 99, n, k, torch.float16)
    with pytest.raises(RuntimeError, match="qtype"):
        ops.qlinear(x, w.blocks, 1, n, k, None, False)  # F16's id: not a block format
    with pytest.raises(RuntimeError, match="k must be a positive multiple of 256"):
        ops.dequantize(w.blocks, qt, n, 128, torch.float16)
    with pytest.raises(RuntimeError, match="dtype must be float16 or bfloat16"):
        ops.dequantize(w.blocks, qt, n, k, torch.float32)
    with pytest.raises(RuntimeError, match="x must be float16 or bfloat16"):
        ops.qlinear(x.float(), w.blocks, qt, n, k, None, False)
    with pytest.raises(RuntimeError, match="at most 32 rows"):
        ops.qlinear(torch.randn(33, k, device=DEV, dtype=torch.float16), w.blocks, qt, n, k, None, False)
    with pytest.raises(RuntimeError, match="x must have k"):
        ops.qlinear(x[:, :128].contiguous(), w.blocks, qt, n, k, None, False)
    with pytest.raises(RuntimeError, match="bias must have shape"):
        ops.qlinear(x, w.blocks, qt, n, k, torch.zeros(n + 1, device=DEV, dtype=torch.float16), False)
    with pytest.raises(RuntimeError, match="act must be silu or gelu_tanh"):
        ops.qlinear_act(x, w.blocks, qt, n, k, "relu", False)
    w_odd = _weight("Q4_K", n - 1, k)
    with pytest.raises(RuntimeError, match="n must be even"):
        ops.qlinear_act(x, w_odd.blocks, qt, n - 1, k, "silu", False)
    with pytest.raises(RuntimeError, match="out must be float16 or bfloat16"):
        ops.dequantize_into(torch.empty(n, k, device=DEV), w.blocks, qt)
    wide = torch.empty(2, n + 8, device=DEV, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="out must have x's 2 rows"):
        ops.qlinear_into(wide[:1, :n], x, w.blocks, qt, None, False)
    with pytest.raises(RuntimeError, match="out must have contiguous rows"):
        ops.qlinear_into(torch.empty(n, 2, device=DEV, dtype=torch.float16).t(), x, w.blocks, qt, None, False)
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.qlinear_into(wide[:, :n].float(), x, w.blocks, qt, None, False)
    with pytest.raises(RuntimeError, match="blocks must have shape"):
        ops.qlinear_into(wide[:, :n + 1], x, w.blocks, qt, None, False)
    with pytest.raises(RuntimeError, match=r"qlinear: norm_weight must be a contiguous \[hidden\]"):
        ops.qlinear(x, w.blocks, qt, n, k, None, False, None, torch.ones(k + 8, device=DEV, dtype=torch.float16), 1e-5)
    with pytest.raises(RuntimeError, match="tensor of x's dtype and device"):
        ops.qlinear(x, w.blocks, qt, n, k, None, False, None, torch.ones(k, device=DEV), 1e-5)
    with pytest.raises(RuntimeError, match="eps must be finite"):
        ops.qlinear_act(x, w.blocks, qt, n, k, "silu", False, None, None, torch.ones(k, device=DEV,
                        dtype=torch.float16), float("nan"))
    with pytest.raises(RuntimeError, match="ids must be int32 or int64"):
        ops.qembedding(torch.zeros(3, device=DEV), w.blocks, qt, n, k, torch.float16)
