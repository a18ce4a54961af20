"""GEMM family: linear (engine op) and the baselines gemm, tensor_core_gemm, gemm_int8, every path forced
on its own.

Low-precision results are bounded by torch's own error at the same precision (flash-attention's
rule): |ours - ref64| <= 2 |torch_lowp - ref64| + eps, elementwise, with eps one output ulp."""
import re

import pytest
import torch
import torch.nn.functional as F
from gpu_card import thin_dram
from poison import nan_freed

pytestmark = pytest.mark.gpu

DEV = "cuda"
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -20}


def _ops():
    import minfer.ops.baselines  # noqa: F401  registers the fakes of gemm, tensor_core_gemm, gemm_int8
    import minfer.ops.cuda  # noqa: F401  and of linear
    return torch.ops.minfer


def _hopper():
    return torch.cuda.get_device_capability()[0] == 9


def _by_card(plan):
    """A plan that differs by the card: (on an H100, on an H200)."""
    return plan if not isinstance(plan, tuple) else plan[0] if thin_dram() else plan[1]


def _paths(m):
    paths = ["auto", "wmma", "sm80"]
    if m <= 256:  # auto's gemv range (up to 256 rows on small W)
        paths.append("gemv")
    if _hopper():
        paths.append("sm90")
    return paths


def _check(ours, torch_out, ref64, dtype, absprod=None, slack=None):
    # absprod = |A| @ |B| (fp64): scales the fp32-accumulation slack where terms cancel (fp32 outputs).
    # slack (fp64, per element): error that every correct kernel may add beyond one output rounding.
    assert ours.dtype == torch_out.dtype and ours.shape == torch_out.shape
    assert not torch.isnan(ours).any(), "NaN in output (an element was not written?)"
    ref = ref64.float()
    err = (ours.float() - ref).abs()
    base = (torch_out.float() - ref).abs()
    eps = ULP[dtype] * (ref.abs() + 1e-2 * ref.abs().max() + 1e-6)
    if absprod is not None:
        eps = eps + 2.0 ** -16 * absprod.float()
    if slack is not None:
        eps = eps + slack.float()
    bad = err > 2 * base + eps
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off; worst err {err.max().item():.3g} "
                           f"(torch's worst {base.max().item():.3g})")


def _rand(*shape, dtype):
    return torch.randn(*shape, device=DEV, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nk", [(200, 328), (576, 576), (1536, 576)])
@pytest.mark.parametrize("m", [1, 7, 40, 113, 4097])  # 40, 113: auto's gemv past 16 rows (small W)
def test_linear_paths(m, nk, dtype):
    ops = _ops()
    n, k = nk
    x, w, bias = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype) / k ** 0.5, _rand(n, dtype=dtype)
    ref64 = x.double() @ w.double().t() + bias.double()
    torch_out = F.linear(x, w, bias)
    for path in _paths(m):
        nan_freed((m, n), dtype)  # each path's output poisoned, not the last path's correct one reused
        _check(ops.linear(x, w, bias, path), torch_out, ref64, dtype)
    nan_freed((m, n), dtype)
    _check(ops.linear(x, w, None, "auto"), F.linear(x, w), x.double() @ w.double().t(), dtype)


# gemv: 16-row W tiles, 32-wide k steps of four 8-element chunks (K % 32 != 0 leaves a partial step),
# one or two n8 tiles of A rows (M <= 8, <= 16; forced M = 40 takes a CTA per block of 16 along grid.y). Shapes
# 6136, 2040 and 28680 rows take the other launch configurations (launch_best in gemv.cu) as a 132-SM
# GPU picks them: 4-step rounds at 3 CTAs per SM, 8-step rounds at 2 and the even split of many tiles
# over one wave of warps. M = 1 with few rows and K >= 2048 runs gemv_m1_kernel on row pairs, 256-wide k
# steps: odd N leaves half a pair. On 132 SMs 2040 x 8200 and 4095 x 4088 (the 34 MB configuration: two
# 4-step rounds per warp, 4 CTAs per SM) split K over 4 and 2 warps, 2040 x 8200's last slice one step
# longer; 37 x 16392 takes 8-step rounds split over 8 warps.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nk", [(1000, 584), (4099, 56), (37, 8), (1000, 4104), (6136, 4104), (2040, 8200),
                                (4095, 4088), (28680, 1528), (1001, 2056), (37, 16392)])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 16, 40])
def test_gemv_path(m, nk, dtype):
    _check_linear_and_gemm(m, *nk, dtype, "gemv")


# gemv_kernel takes one block of 16 A rows per CTA along grid.y: more than 65535 blocks go as two launches.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gemv_path_rows_past_grid_y(dtype):
    _check_linear_and_gemm(65535 * 16 + 40, 24, 40, dtype, "gemv")


def _check_linear_and_gemm(m, n, k, dtype, gemm_path):
    """linear with bias on the gemv path, then gemm with alpha, beta and C on `gemm_path`; NaN-filled outputs."""
    ops = _ops()
    x, w, bias = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype) / k ** 0.5, _rand(n, dtype=dtype)
    for static_weight in (False, True):  # True: W's first round loads before griddepcontrol.wait
        nan_freed((m, n), dtype)
        _check(ops.linear(x, w, bias, "gemv", static_weight), F.linear(x, w, bias),
               x.double() @ w.double().t() + bias.double(), dtype)
    c = _rand(m, n, dtype=dtype)
    nan_freed((m, n), dtype)
    _check(ops.gemm(x, w, 0.5, 1.5, c, False, True, gemm_path), torch.addmm(c, x, w.t(), beta=1.5, alpha=0.5),
           0.5 * (x.double() @ w.double().t()) + 1.5 * c.double(), dtype)


# Many tiles: one warp per tile streams all of K in several rounds (no K split). The round length is
# the one of two that leaves fewer k-step slots idle at K's end: K = 1048 is 33 steps, so M = 1 takes
# rounds of 6 at 2 CTAs per SM (3 idle, where 8 would idle 7), M = 16 too (X loaded a step ahead at
# M 9..16); 28680 x 1528 above (48 steps) takes 8. K <= 1024 runs at 3 CTAs per SM with rounds of 6 or 4:
# K = 568 is 18 steps (rounds of 6, the last step partial), K = 1000 32 (rounds of 4).
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [1048, 1000, 568])
@pytest.mark.parametrize("m", [1, 16, 40])
def test_gemv_path_many_tiles(m, k, dtype):
    ops = _ops()
    n = 40000
    x, w = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype) / k ** 0.5
    for static_weight in (False, True):
        nan_freed((m, n), dtype)
        _check(ops.linear(x, w, None, "gemv", static_weight), F.linear(x, w), x.double() @ w.double().t(), dtype)


# M <= 16, K >= 4096 and at least one 16-row tile per warp of a wave (17003 rows on 132 SMs): W streams
# through per-warp shared-memory rings (gemv_ring_kernel), 3 CTAs per SM, in stages of 16 rows x 256 k
# at M <= 4 and of 32 rows x 128 k above (two n8 tiles of X rows above M = 8). At 17003 rows each CTA
# takes 42-43 rows tiled by 16 or 32 from its first row (a short last tile, tiles off multiples of 16);
# at 50701 rows and R = 16 (8+ tiles per CTA) whole tiles, the grid's last one of 13 rows; at 101399 rows
# and R = 32 whole tiles of 32, the last one of 23, with K = 2056 (17 stages of 128 k, the last of one
# chunk). A CTA's stages are split over 4 warps, so tiles shared between warps are summed through shared
# memory. K = 4104 leaves a last stage of one 16-byte chunk per row, K = 4168 of nine.
# Fewer tiles than resident warps on a W of 2^25 elements or more (M <= 8, or K >= 8192): one 12-warp CTA
# per SM, each CTA's range cut to the row (16381 rows: 124 per CTA; 4093 rows: 31).
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(m, 17003, k) for m in (1, 2, 3, 4, 5, 8, 9, 16) for k in (4104, 4168)] +
                         [(1, 50701, 4104), (4, 50701, 4168), (8, 50701, 4104), (16, 50701, 4168), (13, 101399, 2056)] +
                         [(1, 16381, 2056), (8, 16381, 2056), (16, 4093, 14344), (13, 4093, 8200)] +
                         [(9, 6136, 4104), (16, 4096, 4168)])  # a wide model's W at 9-16 rows: the ring on an H100
def test_gemv_path_ring(m, n, k, dtype):
    _check_linear_and_gemm(m, n, k, dtype, "auto")


# The kernels and configurations that the shapes above are meant to reach, as the launchers pick them on
# a 132-SM Hopper GPU (H100 / H200): linear_plan runs the same choice and launches nothing. 40 x 1536 x 576
# has too few tiles to balance the SMs: the fallback takes KS = 8 on the first variant whose 288 CTAs all
# fit at once (3 per SM). 16 x 6136 x 4104 takes the 4-step rounds of two n8 tiles at 3 CTAs per SM (X one
# step ahead), where 2-step rounds fit as many CTAs, on an H200; on an H100 the 12-warp ring (gemv_wide_rows: K and
# N of 4096 and more at 9-16 rows). A tuple: (on an H100, on an H200).
PLANS = [
    (1, 4095, 4088, "gemv: m1 U=4 4/SM ks=2"), (1, 2040, 8200, "gemv: m1 U=4 4/SM ks=4"),
    (1, 37, 16392, "gemv: m1 U=8 2/SM ks=8"), (1, 1001, 2056, "gemv: m1 U=8 2/SM ks=1"),
    (1, 17003, 4104, "gemv: ring R=16 granule=1"), (4, 17003, 4168, "gemv: ring R=16 granule=1"),
    (1, 50701, 4104, "gemv: ring R=16 granule=16"), (8, 17003, 4104, "gemv: ring R=32 granule=1"),
    (16, 50701, 4168, "gemv: ring R=32 granule=1"), (13, 101399, 2056, "gemv: ring R=32 granule=32"),
    (16, 50701, 2056, "gemv: stream U=6 2/SM"), (8, 16381, 2056, "gemv: ring R=16 12 warps granule=1"),
    (16, 4093, 14344, "gemv: ring R=16 12 warps granule=1"), (16, 16381, 2056, "gemv: tiles U=4 2/SM ks=2"),
    (1, 40000, 1048, "gemv: stream U=6 2/SM"), (16, 40000, 1048, "gemv: stream U=6 2/SM"),
    (1, 40000, 1000, "gemv: stream U=4 3/SM"), (1, 40000, 568, "gemv: stream U=6 3/SM"),
    (16, 40000, 568, "gemv: stream U=6 3/SM"), (1, 28680, 1528, "gemv: stream U=8 2/SM"),
    (8, 6136, 4104, "gemv: tiles U=4 3/SM ks=8"),
    (16, 6136, 4104, ("gemv: ring R=16 12 warps granule=1", "gemv: tiles U=4 3/SM ks=8")),
    (9, 4096, 4096, ("gemv: ring R=16 12 warps granule=1", "gemv: tiles .*")), (16, 4088, 4104, "gemv: tiles .*"),
    (8, 2040, 8200, "gemv: tiles U=8 2/SM ks=8"),
    (40, 1536, 576, "gemv: tiles U=2 3/SM ks=8"), (64, 4096, 4096, "sm90 small-M split=2 cluster=2 w_rows=64"),
    (128, 4096, 4096, "sm90 small-M split=(4 cluster=[24]|3 cluster=3)"),
    (4097, 576, 1536, "sm90"), (144, 2048, 8192, "sm90 small-M split=(8 cluster=[28]|7 cluster=7)"),
    (192, 28672, 4096, "sm90 small-M"),
    (144, 16384, 2048, "sm90"),
    (160, 6144, 4096, "sm90"), (193, 4096, 14336, "sm90 split=2 cluster=2"), (192, 3072, 576, "sm90"),
    (256, 4096, 4096, "sm90 split=2 cluster=2"), (256, 6144, 4096, "sm90"), (144, 2048, 2048, "sm90 split=[234] cluster=[234]"),
]


@pytest.mark.parametrize("m, n, k", [(113, 576, 576), (128, 3072, 576), (256, 576, 1536)])
def test_linear_plan_gemv_on_small_w(m, n, k):
    """Up to 256 rows, auto takes gemv while blocks of 16 rows x N x K stay within 2^24 (W re-read from L2)."""
    if not _hopper():
        pytest.skip("the expected plans are worked out for Hopper GPUs")
    assert _plan(m, n, k).startswith("gemv: ")


def _plan(m, n, k, dtype=torch.float16):
    """linear_plan for x [m, k] and w [n, k] (uninitialised: nothing runs), without its grid."""
    _ops()  # loads the extension
    x, w = torch.empty(m, k, device=DEV, dtype=dtype), torch.empty(n, k, device=DEV, dtype=dtype)
    return torch.ops.minfer.linear_plan(x, w).split(" grid=")[0]


# A plan is matched whole as a regular expression: split-K's cluster size depends on how many clusters fit at
# once, which the chip's GPCs decide (a tile's S CTAs where all fit, else pairs).
@pytest.mark.parametrize("m, n, k, plan", PLANS)
def test_linear_plan(m, n, k, plan):
    if not _hopper() or torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected plans are worked out for 132-SM Hopper GPUs")
    got, plan = _plan(m, n, k), _by_card(plan)
    assert re.fullmatch(plan, got), f"{m} x {n} x {k}: expected {plan!r}, the launcher picks {got!r}"


def test_linear_plan_fp32_and_empty():
    assert _plan(1, 4096, 4096, torch.float32) == "simt"
    assert _plan(0, 4096, 4096) == "none (empty output)"


# On Hopper gemv and sm90's small-M kernel launch as programmatic dependents of the previous kernel: X
# and W written by the kernel just before must still be read fresh, eagerly and inside a CUDA graph
# (gemv M = 1, K >= 2048: the row-pair kernel; M = 3: the tiles; sm90 M = 40: split-K in pairs, whose per-tile
# counters must be zero again at every replay).
@pytest.mark.parametrize("m, n, path", [(3, 1032, "gemv"), (1, 2056, "gemv"), (40, 1032, "sm90")])
def test_pdl_chained_dependencies(m, n, path):
    if path == "sm90" and not _hopper():
        pytest.skip("sm90 path needs Hopper")
    ops = _ops()
    dtype = torch.float16
    x0, w0 = _rand(m, n, dtype=dtype), _rand(n, n, dtype=dtype) / n ** 0.5

    def chain(x, w, linear):
        for i in range(4):
            w = w.neg() if i % 2 else w * 2.0  # the kernel right before the linear writes W ...
            x = linear(x, w)  # ... and the previous linear wrote X
        return x

    def gemv(x, w):
        return ops.linear(x, w, None, path)

    # Stale W or X would be off by O(1); four fp16 layers drift by a few ulps.
    ref = chain(x0.double(), w0.double(), F.linear).float()
    tol = dict(atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    torch.testing.assert_close(chain(x0, w0, gemv).float(), ref, **tol)

    static_x, static_w = x0.clone(), w0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(static_x, static_w, gemv)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_x, static_w, gemv)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), ref, **tol)


# static_weight (the engine's call): W's first round loads before griddepcontrol.wait, X only after it.
# Each linear's X is the previous linear's output, so an X read early would be stale (the NaN fill
# right before the chain would show). M = 1 and 3 on gemv: the row-pair kernel and the tiles; 16 x 30000
# x 1032: the many-tile stream; 1 x 17008 x 4104: the rings, filled before the wait.
# sm90 small-M (M = 40 and 144): the first stages' W halves load before the wait.
@pytest.mark.parametrize("m, n, k, path", [(1, 2056, 2056, "gemv"), (3, 1032, 1032, "gemv"), (16, 30000, 1032, "gemv"),
                                           (1, 17008, 4104, "gemv"), (40, 2056, 2056, "sm90"),
                                           (144, 4104, 4104, "sm90")])
def test_static_weight_chain(m, n, k, path):
    if path == "sm90" and not _hopper():
        pytest.skip("sm90 path needs Hopper")
    ops, dtype = _ops(), torch.float16
    ws = [_rand(n, k, dtype=dtype) / k ** 0.5, _rand(k, n, dtype=dtype) / n ** 0.5]  # [out, in] pairs
    x0 = _rand(m, k, dtype=dtype)
    ref = x0.double()
    for i in range(4):
        ref = ref @ ws[i % 2].double().t()
    for rep in range(3):
        x = x0.clone()
        for i in range(4):
            nan_freed((m, ws[i % 2].shape[0]), dtype)
            x = ops.linear(x, ws[i % 2], None, path, True)
        tol = dict(atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
        torch.testing.assert_close(x.double(), ref, **tol)


# sm90 above M = 128: tiles are 128 x 256 x 64 (128 x 128 where that needs fewer rounds) and the grid
# is persistent (one CTA per SM): tails in M (129: one row in the second tile), N and K, N odd
# (element-wise stores) and N % 8 == 0 (16-byte stores), one K step (40) and several, 396 tiles (3
# whole rounds on 132 SMs, so the pipeline ring runs on across tiles), partial last rounds (272 and 160
# tiles; 160 with 16 K steps and a K tail) and fewer tiles than SMs (72). N = 576 at M = 4096 and
# 8193 takes 144-wide tiles (128 tiles; 260, two per CTA with an M tail): three 48-column epilogue
# chunks per tile, so the staging buffers alternate across tiles.
SM90_SHAPES = [(129, 257, 72), (300, 2056, 40), (4097, 1000, 328), (4097, 3000, 136), (2100, 4095, 200),
               (1000, 5000, 1000), (1000, 2100, 520), (4096, 576, 200), (8193, 576, 64)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="sm90 path needs Hopper")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mnk", SM90_SHAPES)
def test_sm90_tails_persistent_epilogue(mnk, dtype):
    ops = _ops()
    m, n, k = mnk
    x, w, bias = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype) / k ** 0.5, _rand(n, dtype=dtype)
    prod64 = x.double() @ w.double().t()
    _check(ops.linear(x, w, bias, "sm90"), F.linear(x, w, bias), prod64 + bias.double(), dtype)
    _check(ops.linear(x, w, None, "sm90"), F.linear(x, w), prod64, dtype)
    # gemm: alpha, beta * C; b = w^T read weight-like (trans_b) so no copy is made.
    c = _rand(m, n, dtype=dtype)
    ours = ops.gemm(x, w, 0.5, 1.5, c, False, True, "sm90")
    _check(ours, torch.addmm(c, x, w.t(), beta=1.5, alpha=0.5), 0.5 * prod64 + 1.5 * c.double(), dtype)


def _check_sm90_split(ops, x, w, bias, dtype):
    """linear and gemm (alpha, beta * C) on the sm90 path against fp64, into NaN-poisoned outputs; a second linear
    gives the same bits (split partials are summed in a fixed order, and the counters are zero again)."""
    m, n = x.shape[0], w.shape[0]
    prod64 = x.double() @ w.double().t()
    nan_freed((m, n), dtype)
    out = ops.linear(x, w, bias, "sm90")
    _check(out, F.linear(x, w, bias), prod64 + bias.double(), dtype)
    nan_freed((m, n), dtype)
    assert torch.equal(ops.linear(x, w, bias, "sm90"), out)
    c = _rand(m, n, dtype=dtype)
    nan_freed((m, n), dtype)
    _check(ops.gemm(x, w, 0.5, 1.5, c, False, True, "sm90"), torch.addmm(c, x, w.t(), beta=1.5, alpha=0.5),
           0.5 * prod64 + 1.5 * c.double(), dtype)


# The persistent kernel's split-K (tiles that fill at most half the SMs, 2-4 CTAs a tile in a cluster, each at least
# 8 K steps): on 132 SMs 256 x 1000 x 2048 is 16 tiles x 4, 200 x 520 x 4104 10 x 4 (M, N and K tails), 144 x 2048 x
# 2048 32 x 3 (32 clusters of 4 do not fit on the H200 measured; ranges of 10 and 11 steps), 256 x 4096 x 1032 64 x 2
# (ranges of 8 and 9 steps), 129 x 257 x 1000 6 x 2 (odd N: element-wise stores), 300 x 2056 x 2056 51 x 2. Each
# rank stores its own 64-column chunks (rank 2 of 3 none), the partials summed in rank order, so a second call gives
# the same bits.
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="sm90 path needs Hopper")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mnk", [(256, 1000, 2048), (200, 520, 4104), (144, 2048, 2048), (256, 4096, 1032),
                                 (129, 257, 1000), (300, 2056, 2056)])
def test_sm90_persistent_split_k(mnk, dtype):
    ops = _ops()
    m, n, k = mnk
    x, w, bias = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype) / k ** 0.5, _rand(n, dtype=dtype)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        plan = torch.ops.minfer.linear_plan(x, w, "sm90").split(" grid=")[0]
        assert re.fullmatch(r"sm90 split=[234] cluster=[234]", plan), f"{m} x {n} x {k}: the launcher picks {plan!r}"
    _check_sm90_split(ops, x, w, bias, dtype)


# sm90 at M <= 128, and up to 192 where K is long: 128-row tiles of W against BN = 8..128,
# 144 or 192 activation rows (the smallest >= M), the tiles x K-steps iteration space split evenly over
# at most one CTA an SM, S a tile where that fills 9/10 of them (split-K). On 132 SMs: 200 x 8200 is 2
# tiles of 129 steps, each summed from 66 CTAs' partials (200 x 20488 the same above M = 128); 4100 x 4104
# is 33 x 65, 4 CTAs a tile (ranges of 16 and 17 steps; an N tail of 4 rows); 12000 x 1032 is 94 x 17 over
# 132 CTAs (ranges cross tile boundaries; an N tail); 28680 x 136 is 225 x 3 (K tail; whole and shared
# tiles mixed); 1000 x 40 is 8 tiles of one zero-padded step (8 CTAs, no sharing); 576 x 576 is SmolLM2's
# square. Up to 64 rows 8100 x 264 and 6000 x 4104 take 64-row W tiles, one a CTA over all of K (127 and 94 of
# them: N tails of 36 and 48 rows, K tails), and 4100 x 4104, 4000 x 8200, 4000 x 4104, 3000 x 12296 and 3000 x 1032
# 64-row tiles split K in whole clusters of 2 (ranges of 8 to 97 steps, odd step counts; N tails of 4, 32 and 56
# rows), 2000 x 2056 in clusters of 3 or 4 (ranges of 11, or 8 and 9 steps; an N tail of 16 rows); the gemm with C
# keeps the 128-row tiles. Past 64 rows, split-K with clusters (partials summed through
# distributed shared memory; on 132 SMs): 8100 x 264 is 64 tiles x 2, a tile one pair (ranges of 2 and 3 steps, a
# K tail), 6000 x 4104 47 x 2 (an N tail of 112 rows); 4000 x 8200 is 32 x 4 in pairs whose rank 0 sums through
# the workspace (ranges of 32 and 33 steps, an N tail of 32 rows), 4000 x 4104 32 x 3 in whole clusters of 3
# (ranges of 21 and 22 steps), 2000 x 2056 16 x 8 in pairs (16 clusters of 7 do not fit on the H200 measured);
# 3000 x 12296 is 24 x 5 without clusters (ranges of 38 and 39 steps), 3000 x 1032 24 x 4 in whole clusters of 4.
# Above M = 128 the shorter K take the persistent kernel.
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="sm90 path needs Hopper")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nk", [(200, 8200), (200, 20488), (4100, 4104), (12000, 1032), (28680, 136), (1000, 40),
                                (576, 576), (8100, 264), (6000, 4104), (4000, 8200), (4000, 4104), (2000, 2056),
                                (3000, 12296), (3000, 1032)])
@pytest.mark.parametrize("m", [1, 8, 9, 17, 64, 65, 128, 129, 144, 145, 192])
def test_sm90_small_m_stream_k(m, nk, dtype):
    ops = _ops()
    n, k = nk
    x, w, bias = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype) / k ** 0.5, _rand(n, dtype=dtype)
    _check_sm90_split(ops, x, w, bias, dtype)


# The split-K shapes above run as planned on a 132-SM Hopper GPU, so that their cases cover each way of summing
# (whole clusters of 4, 5 or 8 fit on some chips and not on others: the H200 measured holds 30, none and 15), at 128
# rows on 128-row W tiles and up to 64 rows on 64-row ones.
@pytest.mark.parametrize("n, k, plan, plan64", [
    (8100, 264, "split=2 cluster=2", "w_rows=64"), (6000, 4104, "split=2 cluster=2", "w_rows=64"),
    (4000, 8200, "split=4 cluster=[24]", "split=2 cluster=2 w_rows=64"),
    (4000, 4104, "split=(4 cluster=[24]|3 cluster=3)", "split=2 cluster=2 w_rows=64"),
    (2000, 2056, "split=(8 cluster=[28]|7 cluster=7)", "split=(4 cluster=4|3 cluster=3) w_rows=64"),
    (3000, 12296, "split=5 cluster=[15]", "split=2 cluster=2 w_rows=64"),
    (3000, 1032, "split=(5 cluster=[15]|4 cluster=4)", "split=2 cluster=2 w_rows=64")])
def test_sm90_small_m_split_plan(n, k, plan, plan64):
    if not _hopper() or torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected plans are worked out for 132-SM Hopper GPUs")
    _ops()
    for m in (1, 64, 128):
        x, w = torch.empty(m, k, device=DEV, dtype=torch.float16), torch.empty(n, k, device=DEV, dtype=torch.float16)
        got = torch.ops.minfer.linear_plan(x, w, "sm90")
        want = plan64 if m <= 64 else plan
        assert re.fullmatch(f"sm90 small-M {want}", got), f"{m} x {n} x {k}: the launcher picks {got!r}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_linear_strided_and_odd_k(m, dtype):
    ops = _ops()
    w = _rand(96, 256, dtype=dtype)
    big = _rand(m, 256 + 24, dtype=dtype)
    x = big[:, 8:8 + 256]  # row stride 280 > in, still 16-byte aligned
    ref64 = x.double() @ w.double().t()
    for path in _paths(m):
        nan_freed((m, 96), dtype)
        _check(ops.linear(x, w, None, path), F.linear(x, w), ref64, dtype)
    # K % 8 != 0: auto falls back to wmma; the cp.async paths refuse with the rule in the message.
    x2, w2 = _rand(m, 13, dtype=dtype), _rand(40, 13, dtype=dtype)
    _check(ops.linear(x2, w2), F.linear(x2, w2), x2.double() @ w2.double().t(), dtype)
    with pytest.raises(RuntimeError, match="K % 8 == 0"):
        ops.linear(x2, w2, None, "sm80")
    with pytest.raises(RuntimeError, match="K % 8 == 0"):
        ops.linear(x2, w2, None, "gemv")


def test_linear_wrapper_matches_reference():
    import inspect

    from minfer.ops import cuda, reference
    assert inspect.signature(cuda.linear) == inspect.signature(reference.linear)
    x, w, b = _rand(3, 64, dtype=torch.bfloat16), _rand(32, 64, dtype=torch.bfloat16), _rand(32, dtype=torch.bfloat16)
    _check(cuda.linear(x, w, b), reference.linear(x, w, b), x.double() @ w.double().t() + b.double(), torch.bfloat16)


@pytest.mark.parametrize("m", [1, 113])
def test_linear_fp32_simt(m):
    ops = _ops()
    x, w, b = _rand(m, 328, dtype=torch.float32), _rand(200, 328, dtype=torch.float32), _rand(200, dtype=torch.float32)
    ref64, absprod = x.double() @ w.double().t() + b.double(), x.double().abs() @ w.double().abs().t()
    _check(ops.linear(x, w, b), F.linear(x, w, b), ref64, torch.float32, absprod)
    _check(ops.linear(x, w, b, "simt"), F.linear(x, w, b), ref64, torch.float32, absprod)
    with pytest.raises(RuntimeError, match="float32 runs on the simt path"):
        ops.linear(x, w, b, "sm80")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gemm_alpha_beta_transposes(trans_a, trans_b, dtype):
    ops = _ops()
    m, n, k = 113, 200, 328
    a = _rand(k, m, dtype=dtype) if trans_a else _rand(m, k, dtype=dtype)
    b = _rand(n, k, dtype=dtype) if trans_b else _rand(k, n, dtype=dtype)
    opa, opb = (a.t() if trans_a else a), (b.t() if trans_b else b)
    c = _rand(m, n, dtype=dtype)
    paths = ["auto"] if dtype == torch.float32 else ["auto", "wmma", "sm80"]
    if dtype != torch.float32 and _hopper():
        paths.append("sm90")
    absprod = (opa.double().abs() @ opb.double().abs()) if dtype == torch.float32 else None
    for path in paths:
        ref64 = 0.5 * (opa.double() @ opb.double()) + 1.5 * c.double()
        torch_out = torch.addmm(c, opa, opb, beta=1.5, alpha=0.5)
        _check(ops.gemm(a, b, 0.5, 1.5, c, trans_a, trans_b, path), torch_out, ref64, dtype, absprod)
        # beta == 0 must ignore C entirely, NaNs included.
        nan_c = torch.full((m, n), float("nan"), device=DEV, dtype=dtype)
        out = ops.gemm(a, b, 2.0, 0.0, nan_c, trans_a, trans_b, path)
        _check(out, 2.0 * (opa @ opb), 2.0 * (opa.double() @ opb.double()), dtype,
               None if absprod is None else 2 * absprod)


def test_gemm_wrapper_and_broadcast_c():
    from minfer.ops import baselines
    a, b = _rand(7, 64, dtype=torch.float16), _rand(64, 24, dtype=torch.float16)
    c = _rand(24, dtype=torch.float16)  # broadcast over rows, as in the reference
    ours = baselines.gemm(a, b, 1.0, 1.0, c)
    _check(ours, baselines.gemm_reference(a, b, 1.0, 1.0, c), a.double() @ b.double() + c.double(), torch.float16)


@pytest.mark.parametrize("mnk", [(1, 200, 328), (113, 200, 328), (128, 128, 512), (300, 72, 40)])
def test_tensor_core_gemm(mnk):
    ops = _ops()
    m, n, k = mnk
    a, b = _rand(m, k, dtype=torch.float16), _rand(k, n, dtype=torch.float16)
    ours = ops.tensor_core_gemm(a, b)
    assert ours.dtype == torch.float32
    from minfer.ops import baselines
    ref64 = a.double() @ b.double()
    _check(ours, baselines.tensor_core_gemm_reference(a, b), ref64, torch.float32, a.double().abs() @ b.double().abs())


@pytest.mark.parametrize("mnk", [(1, 200, 328), (113, 200, 328), (4097, 64, 100), (128, 256, 4096), (7, 9, 3)])
def test_gemm_int8_exact(mnk):
    ops = _ops()
    m, n, k = mnk
    a = torch.randint(-128, 128, (m, k), device=DEV, dtype=torch.int8)
    b = torch.randint(-128, 128, (k, n), device=DEV, dtype=torch.int8)
    ours = ops.gemm_int8(a, b)
    from minfer.ops import baselines
    ref = baselines.gemm_int8_reference(a.cpu(), b.cpu())
    assert ours.dtype == torch.int32
    assert torch.equal(ours.cpu(), ref)


# ---- linear_act: the gate | up linear and its gated activation in one op ----

def _gated(gate_up, act):
    """act(gate) * up of [rows, 2 inter] in its own dtype (the activation's launch, in torch)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return (a * u).to(gate_up.dtype)


# (m, inter, k, plan): every gemv kernel, and the sm90 small-M kernel at 32-64 rows (below), applies the activation
# in its epilogue. Past 16 rows on small W the tiles (inter 100: a partial last tile of 8 outputs; 1536 x 576: the
# default model's gate | up); up to 8 rows each kernel in its turn (the plans as a 132-SM Hopper GPU makes them),
# walking gate | up in tiles of 8 gate and 8 up rows, so only where inter is a multiple of 8. 8 x 100 x 328, 9-16
# rows and 256 x 1536 x 576 (sm90) run the linear and then the activation's launch, but on an H100 a wide model's gate
# | up at 9-16 rows on the many-tiles ring (gemv_act_in_ring; a tuple: on an H100, on an H200).
ACT_PLANS = [(17, 1536, 576, "gemv: tiles "), (40, 100, 328, "gemv: tiles "), (113, 1536, 576, "gemv: tiles "),
             (128, 1536, 576, "gemv: tiles "), (8, 1536, 576, "gemv: "), (1, 1536, 576, "gemv: "),
             (1, 2048, 4096, "gemv: m1 "),  # a gate row and its up row a warp
             (2, 8448, 4096, "gemv: ring R=16 granule=16"), (5, 8448, 4096, "gemv: ring R=32 granule=16"),
             (8, 8448, 4096, "gemv: ring R=32 granule=16"),  # ranges of whole 16-row tiles, not to the row
             (1, 4096, 8192, "gemv: ring R=16 12 warps"), (7, 4096, 8192, "gemv: ring R=16 12 warps"),
             (1, 10240, 2560, "gemv: stream "),  # Gemma-3-4B's gate | up
             (1, 16384, 1024, "gemv: stream "), (8, 16384, 1024, "gemv: stream "),
             # sm90 small-M at 32-64 rows (on an H200: split-K in clusters of 3; in pairs through the workspace, with
             # inter 1000 a last tile past the rows and K past the last 64-k step; stream-K over 80 tiles); 65 and
             # more rows unfused
             (64, 2048, 2048, "sm90 small-M"), (32, 2048, 4096, "sm90 small-M"), (40, 1000, 4200, "sm90 small-M"),
             (40, 5120, 1024, "sm90 small-M"),
             # 79 tiles of 64 rows: the plain linear keeps 128-row tiles and the same splits (3 a tile through the
             # workspace), so the fused bits are the two launches'
             (48, 2504, 4096, "sm90 small-M split=3 cluster=1 "),
             (8, 100, 328, None), (9, 1536, 576, None), (16, 8448, 4096, ("gemv: ring R=32 granule=16", None)),
             (9, 8448, 4104, ("gemv: ring R=32 granule=16", None)), (16, 3072, 4096, None), (256, 1536, 576, None),
             (65, 2048, 2048, None), (144, 2048, 8192, None)]
ACT_CASES = [c[:3] for c in ACT_PLANS]


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m, inter, k", ACT_CASES)
def test_linear_act(m, inter, k, dtype, act):
    ops = _ops()
    x, w = _rand(m, k, dtype=dtype), _rand(2 * inter, k, dtype=dtype) / k ** 0.5
    gu64 = x.double() @ w.double().t()
    g64, u64 = gu64.chunk(2, dim=-1)
    g = g64.clone().requires_grad_(True)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    (da64,) = torch.autograd.grad(a.sum(), g)  # act'(g)
    ref64 = a.detach() * u64
    # gate and up are rounded to dtype before the product (ours and torch's alike): an ulp of each moves the
    # output by up to |act'(g) g u| + |act(g) u| ulps, past one output ulp where act'(g) g / act(g) is large
    # (silu at g = -5: 4x), so where torch's roundings happen to cancel ours may differ by that much
    slack = ULP[dtype] * ((da64 * g64 * u64).abs() + ref64.abs())
    nan_freed((m, inter), dtype)
    ours = ops.linear_act(x, w, act, True)
    _check(ours, _gated(F.linear(x, w), act), ref64, dtype, slack=slack)
    # the same bits as the linear and then the activation's own launch (each half rounded to dtype first), but
    # for the ring and sm90's stream-K: their CTA ranges cut the pairs' tiles elsewhere than the plain linear's
    # (the ring's are whole tiles of gate | up pairs, stream-K's fall at other k in a tile of 64 pairs than in
    # one of 128 rows), so some rows' K splits, and their fp32 sums' rounding, are not that launch's; nor where
    # the plain linear alone takes 64-row W tiles (sm90 small-M up to 64 rows), whose K splits are their own
    split = ops.silu_and_mul(ops.linear(x, w)) if act == "silu" else ops.gelu_tanh_and_mul(ops.linear(x, w))
    plan = torch.ops.minfer.linear_plan(x, w, "auto", act)
    w64 = "w_rows=64" in torch.ops.minfer.linear_plan(x, w)
    if not w64 and "ring" not in plan and not (plan.startswith("sm90 small-M") and "split=" not in plan):
        assert torch.equal(ours, split), plan


@pytest.mark.parametrize("m, inter, k, kernel", ACT_PLANS)
def test_linear_act_plan(m, inter, k, kernel):
    if not _hopper() or torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected plans are worked out for 132-SM Hopper GPUs")
    _ops()
    x, w = torch.empty(m, k, device=DEV, dtype=torch.bfloat16), torch.empty(2 * inter, k, device=DEV, dtype=torch.bfloat16)
    plan, kernel = torch.ops.minfer.linear_plan(x, w, "auto", "silu"), _by_card(kernel)
    assert plan.endswith(" +silu" if kernel else ", then silu_and_mul"), plan
    assert kernel is None or plan.startswith(kernel), plan


def test_linear_act_bad_inputs():
    ops = _ops()
    x = _rand(40, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="even number of rows"):
        ops.linear_act(x, _rand(7, 64, dtype=torch.float16), "silu")
    with pytest.raises(RuntimeError, match="unknown act"):
        ops.linear_act(x, _rand(8, 64, dtype=torch.float16), "relu")
    with pytest.raises(RuntimeError, match="in dimensions differ"):
        ops.linear_act(x, _rand(8, 32, dtype=torch.float16), "silu")


def test_opcheck():
    ops = _ops()
    x, w, b = _rand(5, 64, dtype=torch.float16), _rand(24, 64, dtype=torch.float16), _rand(24, dtype=torch.float16)
    torch.library.opcheck(ops.linear, (x, w, b))
    torch.library.opcheck(ops.linear, (x, w, None, "wmma"))
    torch.library.opcheck(ops.linear_act, (_rand(40, 64, dtype=torch.float16), w, "silu"))  # fused
    torch.library.opcheck(ops.linear_act, (x, w, "gelu_tanh"))  # the linear, then the activation (12 outputs)
    torch.library.opcheck(ops.linear_act, (x, _rand(32, 64, dtype=torch.float16), "gelu_tanh"))  # fused
    big = _rand(4096, 2048, dtype=torch.bfloat16) / 45
    torch.library.opcheck(ops.linear_act, (_rand(40, 2048, dtype=torch.bfloat16), big, "silu"))  # Hopper: sm90 small-M
    a, bb, c = _rand(16, 64, dtype=torch.bfloat16), _rand(64, 24, dtype=torch.bfloat16), _rand(16, 24, dtype=torch.bfloat16)
    torch.library.opcheck(ops.gemm, (a, bb, 0.5, 2.0, c, False, False))
    torch.library.opcheck(ops.tensor_core_gemm, (_rand(16, 32, dtype=torch.float16), _rand(32, 8, dtype=torch.float16)))
    i8 = torch.randint(-128, 128, (16, 32), device=DEV, dtype=torch.int8)
    torch.library.opcheck(ops.gemm_int8, (i8, i8.t().contiguous()))


def test_bad_inputs():
    ops = _ops()
    x, w = _rand(4, 64, dtype=torch.float16), _rand(8, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="in dimensions differ"):
        ops.linear(x, _rand(8, 32, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.linear(x, w.float())
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        ops.linear(x.to(torch.int32), w.to(torch.int32))
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        ops.linear(x, w.cpu())
    with pytest.raises(RuntimeError):
        ops.linear(x.cpu(), w.cpu())  # no CPU kernel registered
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.linear(x, w, _rand(9, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="unknown path"):
        ops.linear(x, w, None, "fast")
    with pytest.raises(RuntimeError, match="K dimensions differ"):
        ops.gemm(x, _rand(32, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="float16"):
        ops.tensor_core_gemm(x.bfloat16(), w.t().bfloat16())
    with pytest.raises(RuntimeError, match="int8"):
        ops.gemm_int8(x, w.t())
    if torch.cuda.get_device_capability()[0] != 9:
        with pytest.raises(RuntimeError, match="9.x"):
            ops.linear(x, w, None, "sm90")
