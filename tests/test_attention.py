"""Attention family: the engine op (flash prefill / split-KV decode) and the baselines (naive, tiled, flash).

Error rule (flash-attention's): |ours - ref32| <= 2 * |torch_lowp - ref32| + eps, max-abs over the output,
where ref32 is the computation in fp32 and torch_lowp the same computation by torch in the low dtype.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from gpu_card import thin_dram
from poison import nan_freed

from minfer.ops import reference

pytestmark = pytest.mark.gpu

LOWP = (torch.float16, torch.bfloat16)
# eps: about two units of the dtype's last place at the output's largest value, so that a kernel that drops a tile
# of a long context (its outputs ~0.05) cannot hide under a fixed floor
EPS = {torch.float16: 2 ** -9, torch.bfloat16: 2 ** -7, torch.float32: 1e-4}


@pytest.fixture(autouse=True)
def _exact_fp32():
    # the fp32 references must not run on TF32 tensor cores
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(autouse=True)
def _prefill_path(monkeypatch):
    # On Hopper every prefill here must run the wgmma + TMA kernel: no silent fallback to the sm_80 one
    # (test_prefill_sm80_path_on_hopper keeps that kernel covered there).
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        monkeypatch.setenv("MINFER_PREFILL_PATH", "sm90")


def _cuda():
    from minfer.ops import cuda
    return cuda


def _baselines():
    from minfer.ops import baselines  # registers the fakes of the baselines
    return baselines


def _check(ours, ref32, lowp, dtype, what=""):
    assert ours.dtype == dtype and ours.shape == ref32.shape, what
    assert torch.isfinite(ours).all(), f"{what}: non-finite output"
    err = (ours.float() - ref32).abs().max().item()
    base = (lowp.float() - ref32).abs().max().item()
    eps = EPS[dtype] * (ref32.abs().max().item() if dtype in LOWP else 1.0)
    assert err <= 2 * base + eps, f"{what}: max err {err:.3e} vs torch {base:.3e} + {eps:.1e}"


def _make_cache(batch, capacity, kv_heads, hd, dtype, gen_len):
    """Random caches whose slots past each sequence's length are NaN (never read by a correct kernel)."""
    k = torch.randn(batch, capacity, kv_heads, hd, device="cuda", dtype=dtype)
    v = torch.randn(batch, capacity, kv_heads, hd, device="cuda", dtype=dtype)
    kp, vp = k.clone(), v.clone()
    for b, n in enumerate(gen_len):
        kp[b, n:] = float("nan")
        vp[b, n:] = float("nan")
    return k, v, kp, vp


def _engine_case(batch, seq, heads, kv_heads, hd, dtype, starts, capacity=None, strided=False, poison=True,
                 stable_prefix=False):
    starts_t = torch.tensor(starts, device="cuda", dtype=torch.int32)
    lens = [s + seq for s in starts]
    capacity = capacity or max(lens) + 5
    k, v, kp, vp = _make_cache(batch, capacity, kv_heads, hd, dtype, lens)
    if strided:  # q as the model passes it: a view into the fused qkv projection
        w = (heads + 2 * kv_heads) * hd
        qkv = torch.randn(batch * seq, w, device="cuda", dtype=dtype)
        q = qkv[:, : heads * hd].reshape(-1, heads, hd).view(batch, seq, heads, hd)
        assert not q.is_contiguous()
    else:
        q = torch.randn(batch, seq, heads, hd, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(hd)
    nan_freed(q.shape, dtype)  # the op's output allocation likely reuses this NaN block
    ours = _cuda().attention(q, kp if poison else k, vp if poison else v, starts_t, scale, stable_prefix)
    ref32 = reference.attention(q.float(), k.float(), v.float(), starts_t, scale)
    lowp = reference.attention(q, k, v, starts_t, scale)
    return ours, ref32, lowp


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("seq", [1, 17, 113, 1000])
def test_engine_from_zero(seq, hd, dtype):
    ours, ref32, lowp = _engine_case(2, seq, 8, 2, hd, dtype, [0, 0])
    _check(ours, ref32, lowp, dtype, f"seq={seq}")


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_engine_long_prefill(hd, dtype):
    ours, ref32, lowp = _engine_case(1, 4097, 4, 1, hd, dtype, [0])
    _check(ours, ref32, lowp, dtype)


@pytest.mark.parametrize("ratio", [1, 3, 4, 8])
@pytest.mark.parametrize("seq", [1, 113, 1000])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_engine_gqa(ratio, seq, hd):
    dtype = torch.bfloat16
    ours, ref32, lowp = _engine_case(2, seq, 2 * ratio, 2, hd, dtype, [37, 300])
    _check(ours, ref32, lowp, dtype, f"ratio={ratio}")


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("seq", [1, 17, 113, 1000])
def test_engine_mixed_offsets(seq, hd, dtype):
    # continued/chunked prefill and decode with a different position per sequence, in a roomy cache
    # (slots past each sequence are NaN: masked keys, and V rows the kernel must not let through)
    ours, ref32, lowp = _engine_case(4, seq, 8, 2, hd, dtype, [0, 5, 999, 4100], capacity=8192)
    _check(ours, ref32, lowp, dtype, f"seq={seq}")


@pytest.mark.parametrize("seq", [1, 113])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_engine_strided_q(seq, hd):
    dtype = torch.float16
    ours, ref32, lowp = _engine_case(3, seq, 8, 2, hd, dtype, [0, 64, 129], strided=True)
    _check(ours, ref32, lowp, dtype)


# stable_prefix=True: the ring starts filling before griddepcontrol.wait (the engine's decode call).
@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("ctx", [1, 17, 31, 32, 33, 63, 64, 65, 113, 1000, 2048, 4097, 20000])
def test_decode_context_lengths(ctx, stable_prefix):
    # tails of the 16-key tiles and of the split chunks, many splits, a cache far larger than the context
    dtype = torch.bfloat16
    ours, ref32, lowp = _engine_case(1, 1, 32, 8, 128, dtype, [ctx - 1], capacity=32768, stable_prefix=stable_prefix)
    _check(ours, ref32, lowp, dtype, f"ctx={ctx}")


@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("ctx", [17, 4097, 16500])
def test_decode_dtypes_dims(ctx, hd, dtype, stable_prefix):
    ours, ref32, lowp = _engine_case(2, 1, 16, 4, hd, dtype, [ctx - 1, ctx // 3], capacity=ctx + 300,
                                     stable_prefix=stable_prefix)
    _check(ours, ref32, lowp, dtype, f"ctx={ctx}")


def _rope_writer(cuda, k_cache, v_cache, k_row, v_row, slot):
    """The engine's writer of the newest cache rows, rope with its cache write, for one token whose k and v rows
    [1, n, hd] go to row `slot` of the caches seen as [rows, n, hd]. The rotation is the identity (cos 1, sin 0:
    exact), so the rows land unchanged. One token: rope lets the next kernel launch before its own wait
    (common/launch.h, pdl_early), as at the engine's batch 1. Every input is made here, so that the returned
    call launches rope alone."""
    hd = k_row.shape[-1]
    identity = torch.cat([torch.ones(1, hd // 2), torch.zeros(1, hd // 2)], 1).to("cuda")  # [1 position, cos | sin]
    q = torch.zeros(1, 1, hd, device="cuda", dtype=k_row.dtype)  # [tokens, heads, hd]: rotated, never read
    position = torch.zeros(1, device="cuda", dtype=torch.int32)
    slots = torch.tensor([slot], device="cuda")
    return lambda: cuda.rope(q, k_row, position, identity, True, v=v_row, k_cache=k_cache, v_cache=v_cache,
                             slot_mapping=slots)


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("ctx", [1, 16, 17, 48, 49, 300, 1000, 4097, 20000])
def test_decode_stable_prefix_newest_key_just_written(ctx, hd):
    # The engine's sequence: rope writes the newest key and value (over NaN slots) at start_pos, and decode,
    # launched right behind it with stable_prefix, must wait for them: only older rows may be read early. A
    # long gemv on one SM (16 rows of 2^20) runs first: rope at one token lets decode launch before it waits
    # for that gemv, so decode's CTAs start on the other SMs while the newest rows are still NaN, for about a
    # hundred microseconds. Sequences of ctx and ctx // 2 + 1 keys.
    cuda, dtype, kv_heads = _cuda(), torch.float16, 4
    x_long = torch.randn(1, 1 << 20, device="cuda", dtype=dtype)
    w_long = torch.randn(16, 1 << 20, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(hd)
    for s in sorted({ctx - 1, ctx // 2}):
        k, v, kp, vp = _make_cache(1, ctx + 40, kv_heads, hd, dtype, [s])  # NaN from the start on
        start = torch.tensor([s], device="cuda", dtype=torch.int32)
        q = torch.randn(1, 1, 4 * kv_heads, hd, device="cuda", dtype=dtype)
        ref32 = reference.attention(q.float(), k.float(), v.float(), start, scale)
        lowp = reference.attention(q, k, v, start, scale)
        write = _rope_writer(cuda, kp, vp, k[:, s].clone(), v[:, s].clone(), s)  # k, v rows [1, kv_heads, hd]
        for rep in range(20):
            kp[0, s] = float("nan")
            vp[0, s] = float("nan")
            cuda.linear(x_long, w_long)
            write()
            ours = cuda.attention(q, kp, vp, start, scale, stable_prefix=True)
            _check(ours, ref32, lowp, dtype, f"ctx={ctx} start={s} rep {rep}")


@pytest.mark.parametrize("ctx", [1, 100, 1000, 3000, 8000, 20000])
@pytest.mark.parametrize("hd", [64, 128])
def test_decode_stable_prefix_q_just_written(ctx, hd):
    # q is no part of the stable prefix: the kernel before decode may write it while decode's CTAs already
    # run (and load their first tiles). Here rope writes q (q's buffer as one cache row of batch x heads heads)
    # behind a long gemv on one SM, so decode launches, with stable_prefix, while q still holds the old values;
    # the output must be that of the new q.
    cuda, dtype, batch, kv_heads, heads = _cuda(), torch.float16, 2, 4, 16
    x_long = torch.randn(1, 1 << 20, device="cuda", dtype=dtype)
    w_long = torch.randn(16, 1 << 20, device="cuda", dtype=dtype)
    k = torch.randn(batch, ctx, kv_heads, hd, device="cuda", dtype=dtype)
    v = torch.randn(batch, ctx, kv_heads, hd, device="cuda", dtype=dtype)
    start = torch.tensor([ctx - 1, ctx // 2], device="cuda", dtype=torch.int32)
    q_new = torch.randn(batch, 1, heads, hd, device="cuda", dtype=dtype)  # [batch, 1, heads, head_dim]
    q_old = torch.randn_like(q_new)
    q, q_side = torch.empty_like(q_new), torch.empty_like(q_new)
    scale = 1.0 / math.sqrt(hd)
    ref32 = reference.attention(q_new.float(), k.float(), v.float(), start, scale)
    lowp = reference.attention(q_new, k, v, start, scale)
    rows = batch * heads  # q as one cache row of `rows` heads
    write = _rope_writer(cuda, q.view(1, 1, rows, hd), q_side.view(1, 1, rows, hd), q_new.view(1, rows, hd).clone(),
                         q_new.view(1, rows, hd).clone(), 0)
    for rep in range(20):
        q.copy_(q_old)
        cuda.linear(x_long, w_long)
        write()
        ours = cuda.attention(q, k, v, start, scale, stable_prefix=True)
        _check(ours, ref32, lowp, dtype, f"ctx={ctx} hd={hd} rep {rep}")


@pytest.mark.parametrize("ratio", [1, 3, 4, 8, 16, 20])
@pytest.mark.parametrize("hd", [64, 128])
def test_decode_gqa(ratio, hd):
    # ratio 20: more q heads per kv head than one CTA's 16 rows (a full and a partial head block)
    dtype = torch.float16
    ours, ref32, lowp = _engine_case(2, 1, 2 * ratio, 2, hd, dtype, [4500, 77], capacity=6000)
    _check(ours, ref32, lowp, dtype, f"ratio={ratio}")


# Which combine each case takes. The launcher gives a pair (batch, kv block) 132 SMs / pairs splits,
# at most one per 32 keys of the capacity (ctx + 7 here) and 128; the actual length's 16-key tiles are
# dealt evenly over as many of them as get at least two tiles (all of them from 32 keys a split up). A
# length the CTA's rings hold at once (192 keys at d 128, 384 at d 64) is one split and no combine, and
# so is one up to 384 keys in a call of at most 1.5 MiB of K/V whose second round is at most 24 KB a warp (at d
# 128 two rounds of the rings; at d 256, two 16 KB tiles a warp, one tile more: 192 keys); up
# to 16 splits merge from L2 in one round of loads (predicated past the count); more that fit in shared
# memory (small rows) come in by cp.async; more that do not are spread: every split merges a slice of
# the outputs. Depth: the tiles a warp keeps in flight, its whole ring (3 at d 128, 6 at d 64) unless
# the grid fills the GPU (7/10 of the SMs), the capacity is over 64 tiles a warp and so is split 0's first
# warp, and the card's DRAM gives an SM under 30 GB/s (the H100, not the H200): then 2 at d 128, 3 at d 64
# ("depth=FULL" below).
# attention_decode_plan runs the launcher's choice and launches nothing.
MERGE_CASES = [
    (32, 8, 128, 384, "splits=13 active=1 merge=none depth=3"),     # two rounds of the rings, 1.5 MiB: one split
    (32, 8, 128, 385, "splits=13 active=12 merge=last from L2 depth=3"),  # one key more: 25 tiles, 2-3 a split
    (32, 16, 128, 384, "splits=8 active=8 merge=last from L2 depth=3"),  # 16 kv heads, 3 MiB of K/V: not small
    (8, 4, 256, 192, "splits=7 active=1 merge=none depth=2"),       # d 256: its rings and a tile a warp
    (8, 4, 256, 193, "splits=7 active=6 merge=last from L2 depth=2"),  # one key more: 13 tiles, 2-3 a split
    (8, 4, 256, 256, "splits=9 active=8 merge=last from L2 depth=2"),  # two rounds of its rings: 2 tiles a split
    (4, 1, 256, 320, "splits=11 active=10 merge=last from L2 depth=2"),  # gemma-3-270m's heads
    (9, 3, 64, 384, "splits=13 active=1 merge=none depth=6"),       # the default model's heads
    (9, 3, 64, 385, "splits=13 active=12 merge=last from L2 depth=6"),
    (32, 8, 128, 2288, "splits=16 active=16 merge=last from L2 depth=3"),  # 143 tiles: base 8 a split
    (32, 8, 128, 2304, "splits=16 active=16 merge=last from L2 depth=3"),  # 144: 9 a split, 3 a warp
    (32, 8, 128, 4096, "splits=16 active=16 merge=last from L2 depth=3"),  # 4 tiles a warp
    (9, 3, 64, 2048, "splits=44 active=44 merge=last in smem depth=6"),  # 3-row partials
    (9, 3, 64, 9000, "splits=44 active=44 merge=last in smem depth=6"),  # 12 a split, 3 a warp
    (32, 2, 128, 4500, "splits=66 active=66 merge=spread depth=3"),  # 16-row partials: too big for shared memory
    (32, 2, 128, 32768, "splits=66 active=66 merge=spread depth=3"),  # 2048 tiles: 31 or 32 a split
    (12, 1, 64, 30000, "splits=128 active=128 merge=spread depth=6"),
    (2, 1, 64, 30000, "splits=128 active=128 merge=last in smem depth=6"),
    # 128 CTAs fill the GPU: past 64 tiles a warp, fewer tiles in flight than the ring holds (on an H100)
    (32, 8, 128, 16385, "splits=16 active=16 merge=last from L2 depth=3"),  # 17 tiles a warp: the whole ring
    (32, 8, 128, 65529, "splits=16 active=16 merge=last from L2 depth=3"),  # capacity 65536: 64 tiles a warp
    (32, 8, 128, 65537, "splits=16 active=16 merge=last from L2 depth=FULL"),  # 65 for split 0's warp 0
    (32, 8, 64, 65537, "splits=16 active=16 merge=last from L2 depth=FULL"),
    (45, 45, 128, 32768, "splits=2 active=2 merge=last from L2 depth=3"),  # 90 CTAs: under 7/10 of 132 SMs
    (47, 47, 128, 32768, "splits=2 active=2 merge=last from L2 depth=FULL"),  # 94 CTAs
]


# A full grid's depth at each head_dim: (DRAM under 30 GB/s an SM, at or over it).
FULL_DEPTH = {128: (2, 3), 64: (3, 6)}


def _decode_plan(heads, kv_heads, hd, ctx, capacity, batch=1):
    q = torch.empty(batch, 1, heads, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(batch, capacity, kv_heads, hd, device="cuda", dtype=torch.bfloat16)
    return torch.ops.minfer.attention_decode_plan(q, k, ctx)


@pytest.mark.parametrize("heads, kv_heads, hd, ctx, plan", MERGE_CASES)
def test_decode_plan(heads, kv_heads, hd, ctx, plan):
    _cuda()  # loads the extension
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected plans are worked out for 132-SM GPUs (H100 / H200)")
    if "depth=FULL" in plan:
        plan = plan.replace("FULL", str(FULL_DEPTH[hd][0 if thin_dram() else 1]))
    got = _decode_plan(heads, kv_heads, hd, ctx, ctx + 7)
    assert got == plan, f"{heads} / {kv_heads} heads, d {hd}, {ctx} keys: expected {plan!r}, the launcher picks {got!r}"


# d 64 takes a short ring (4 tiles a warp, 3 CTAs an SM) where the grid has more than 2 and at most 6 CTAs an
# SM: then a pair (batch, kv head) has one split. (batch, heads, kv heads, d, keys, plan)
RING_CASES = [
    (88, 9, 3, 64, 824, "splits=1 active=1 merge=none depth=6"),    # 264 CTAs: 2 an SM, the long ring
    (89, 9, 3, 64, 824, "splits=1 active=1 merge=none depth=4"),    # 267
    (128, 9, 3, 64, 824, "splits=1 active=1 merge=none depth=4"),   # the default model's heads, 384 CTAs
    (264, 9, 3, 64, 824, "splits=1 active=1 merge=none depth=4"),   # 792: 6 an SM
    (265, 9, 3, 64, 824, "splits=1 active=1 merge=none depth=6"),   # 795: the long ring again
    (128, 32, 8, 64, 824, "splits=1 active=1 merge=none depth=6"),  # 1024
    (128, 32, 8, 128, 824, "splits=1 active=1 merge=none depth=3"),  # d 128 keeps its ring
]


@pytest.mark.parametrize("batch, heads, kv_heads, hd, ctx, plan", RING_CASES)
def test_decode_plan_short_ring(batch, heads, kv_heads, hd, ctx, plan):
    _cuda()
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the expected plans are worked out for 132-SM GPUs (H100 / H200)")
    got = _decode_plan(heads, kv_heads, hd, ctx, ctx + 7, batch=batch)
    assert got == plan, f"batch {batch}, {heads} / {kv_heads} heads, d {hd}: expected {plan!r}, got {got!r}"


@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("dtype", LOWP)
def test_decode_short_ring(dtype, stable_prefix):
    # 100 x 3 pairs take d 64's short ring: lengths from 1 key to past its 256 keys a CTA holds, and warps of
    # more than 8 tiles (none loaded before the wait)
    starts = [0, 1, 15, 16, 255, 256, 700, 2047] + [int(x) for x in torch.randint(0, 2048, (92,))]
    ours, ref32, lowp = _engine_case(len(starts), 1, 9, 3, 64, dtype, starts, capacity=2048,
                                     stable_prefix=stable_prefix)
    _check(ours, ref32, lowp, dtype, f"starts={starts}")


def test_decode_plan_bad_inputs():
    _cuda()
    with pytest.raises(RuntimeError, match="length must be"):
        _decode_plan(8, 2, 64, -1, 64)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256"):
        _decode_plan(8, 2, 80, 10, 64)
    q = torch.empty(1, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"q must be \[batch, 1, heads, head_dim\]"):
        torch.ops.minfer.attention_decode_plan(q, torch.empty(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16), 10)


@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("heads, kv_heads, hd, ctx", [c[:4] for c in MERGE_CASES])
def test_decode_merge_paths(heads, kv_heads, hd, ctx, stable_prefix):
    dtype = torch.bfloat16
    ours, ref32, lowp = _engine_case(1, 1, heads, kv_heads, hd, dtype, [ctx - 1], capacity=ctx + 7,
                                     stable_prefix=stable_prefix)
    _check(ours, ref32, lowp, dtype, f"ctx={ctx}")


def test_decode_merges_in_sequence():
    # Shapes with 1, 2 and 4 (batch, kv block) pairs, back to back, every merge path among them: the
    # shared split counters must be zero for each, whatever the one before used (a hang or a wrong
    # output otherwise).
    dtype = torch.bfloat16
    for rep in range(3):
        for heads, kv_heads, hd, ctx in [(32, 2, 128, 4500), (32, 4, 128, 8192), (12, 1, 64, 30000),
                                         (9, 3, 64, 2048), (32, 8, 128, 4096), (32, 4, 128, 8192)]:
            ours, ref32, lowp = _engine_case(1, 1, heads, kv_heads, hd, dtype, [ctx - 1], capacity=ctx,
                                             stable_prefix=True)
            _check(ours, ref32, lowp, dtype, f"rep {rep} {heads}/{kv_heads} ctx={ctx}")


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("layout", ["qkv view", "rows off 16 bytes"])
def test_decode_q_layouts(hd, layout):
    # Decode reads q with its own strides (as fragments up to d 128; at d 256 once a CTA in 16-byte pieces): a
    # view into the fused qkv projection (the model's q), and rows that start off a 16-byte boundary (which
    # attention() copies first where it reads 16-byte pieces).
    dtype, batch, heads, kv_heads, ctx = torch.float16, 2, 12, 3, 4097
    k, v, kp, vp = _make_cache(batch, ctx, kv_heads, hd, dtype, [ctx, ctx])
    if layout == "qkv view":
        qkv = torch.randn(batch, (heads + 2 * kv_heads) * hd, device="cuda", dtype=dtype)
        q = qkv[:, : heads * hd].view(batch, 1, heads, hd)
    else:
        q = torch.randn(batch, 1, heads, hd + 1, device="cuda", dtype=dtype)[..., 1:]  # [batch, 1, heads, hd]
    start = torch.full((batch,), ctx - 1, device="cuda", dtype=torch.int32)
    scale = 1.0 / math.sqrt(hd)
    qc = q.contiguous()  # torch's SDPA (the reference) faults on fp16 rows off 16 bytes
    ref32 = reference.attention(qc.float(), k.float(), v.float(), start, scale)
    lowp = reference.attention(qc, k, v, start, scale)
    for rep in range(3):
        ours = _cuda().attention(q, kp, vp, start, scale, stable_prefix=True)
        _check(ours, ref32, lowp, dtype, f"{layout} rep {rep}")


@pytest.mark.parametrize("hd", [64, 128])
def test_decode_mixed_lengths(hd):
    # length 1 beside long ones in one batch, in a cache much larger than any of them
    dtype = torch.bfloat16
    ours, ref32, lowp = _engine_case(4, 1, 8, 2, hd, dtype, [0, 17000, 40, 4096], capacity=32768)
    _check(ours, ref32, lowp, dtype)


@pytest.mark.parametrize("batch", [16, 70])  # 70 * 8 CTAs fill the GPU: one split, no combine kernel
def test_decode_large_batch(batch):
    dtype = torch.float16
    starts = [int(x) for x in torch.randint(0, 1000, (batch,))]
    ours, ref32, lowp = _engine_case(batch, 1, 32, 8, 128, dtype, starts, capacity=1024)
    _check(ours, ref32, lowp, dtype)


@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("hd", [64, 128])
def test_decode_long_beside_short(hd, stable_prefix):
    # 24 (batch, kv head) pairs share the splits chosen from the capacity: the 30k sequence merges all of
    # them, the 1..100-key ones use one or two and their other CTAs exit at once
    dtype = torch.bfloat16
    starts = [29999, 0, 1, 16, 32, 99, 5, 63, 64, 15, 2, 47]
    ours, ref32, lowp = _engine_case(len(starts), 1, 8, 2, hd, dtype, starts, capacity=30100,
                                     stable_prefix=stable_prefix)
    _check(ours, ref32, lowp, dtype)


@pytest.mark.parametrize("batch, kv_heads", [(15, 8), (16, 8), (17, 8), (33, 4)])
def test_decode_pairs_near_sm_count(batch, kv_heads):
    # 120-136 (batch, kv head) pairs around 132 SMs: one split each, 136 spill into a second wave; mixed lengths
    # on both sides of a long stream's 64 tiles a warp (4096 keys)
    dtype = torch.float16
    starts = [int(x) for x in torch.randint(0, 5000, (batch,))]
    ours, ref32, lowp = _engine_case(batch, 1, 4 * kv_heads, kv_heads, 128, dtype, starts, capacity=5120)
    _check(ours, ref32, lowp, dtype, f"starts={starts}")


# ---- decode at head_dim 256 and with a sliding window ----

@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("ctx", [1, 17, 4097, 16500])
def test_decode_head_dim_256(ctx, dtype, stable_prefix):
    # d 256 (Gemma's): two tiles a warp's ring, 16 q heads of one kv head a CTA (the widest partials)
    for heads, kv_heads in [(16, 4), (16, 1), (4, 1)]:
        ours, ref32, lowp = _engine_case(2, 1, heads, kv_heads, 256, dtype, [ctx - 1, ctx // 3], capacity=ctx + 300,
                                         stable_prefix=stable_prefix)
        _check(ours, ref32, lowp, dtype, f"{heads} / {kv_heads} heads, ctx={ctx}")


@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("batch, heads, kv_heads, ctx", [
    (8, 16, 1, 224),    # 7 splits of 16-row partials: merged from L2 (a spread would leave items unmerged)
    (1, 16, 1, 1000),   # 31 splits: spread
    (1, 4, 1, 1000),    # 4-row partials: in shared memory
    (1, 32, 2, 32768),  # spread, 66 splits
    (16, 8, 4, 8192),   # 64 pairs: 2 splits
])
def test_decode_head_dim_256_merges(batch, heads, kv_heads, ctx, stable_prefix):
    dtype = torch.bfloat16
    starts = [ctx - 1] + [ctx // (b + 2) for b in range(batch - 1)]
    ours, ref32, lowp = _engine_case(batch, 1, heads, kv_heads, 256, dtype, starts, capacity=ctx + 7,
                                     stable_prefix=stable_prefix)
    _check(ours, ref32, lowp, dtype, f"{batch} x {heads} / {kv_heads} heads, ctx={ctx}")


def _window_case(heads, kv_heads, hd, dtype, ctxs, window, capacity, stable_prefix):
    """Decode of sequences of ctxs[b] keys with a sliding window, over caches that are NaN but in each
    sequence's window: the keys before it must never be read (nor those past the length)."""
    batch = len(ctxs)
    starts = torch.tensor([n - 1 for n in ctxs], device="cuda", dtype=torch.int32)
    k, v, kp, vp = _make_cache(batch, capacity, kv_heads, hd, dtype, ctxs)
    for b, n in enumerate(ctxs):
        kp[b, :max(0, n - window)] = float("nan")
        vp[b, :max(0, n - window)] = float("nan")
    q = torch.randn(batch, 1, heads, hd, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(hd)
    nan_freed(q.shape, dtype)
    ours = _cuda().attention(q, kp, vp, starts, scale, stable_prefix, window=window)
    ref32 = reference.attention(q.float(), k.float(), v.float(), starts, scale, window=window)
    lowp = reference.attention(q, k, v, starts, scale, window=window)
    return ours, ref32, lowp


# Contexts below, at and past each window (a range from a tile's middle, one tile, many), and far past it.
WINDOW_CTXS = sorted({(w, c) for w in (1, 17, 512, 4096) for c in (w - 1, w, w + 1, 3 * w + 5, 20000) if c >= 1})


@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("ratio", [1, 8])
@pytest.mark.parametrize("window, ctx", WINDOW_CTXS)
def test_decode_window(window, ctx, ratio, hd, stable_prefix):
    # a sequence at ctx beside a shorter one (its window starts elsewhere in its tile), in a roomy cache
    dtype = torch.bfloat16 if (window + ctx + hd) % 2 else torch.float16
    ours, ref32, lowp = _window_case(2 * ratio, 2, hd, dtype, [ctx, max(1, ctx // 3)], window, ctx + 40,
                                     stable_prefix)
    _check(ours, ref32, lowp, dtype, f"window={window} ctx={ctx}")


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("window", [1, 17, 512, 4096])
def test_decode_plan_window(window, hd):
    # A window plans for its range, not the context: at a context past it, the keys from the 16-key tile of
    # the window's first key on (window + (ctx - window) % 16 of them), planned for a capacity of window + 15.
    _cuda()
    for heads, kv_heads in [(32, 8), (4, 1), (16, 1)]:
        for ctx in (window + 16 * 1000, window + 16 * 1000 + 9, 100000):
            q = torch.empty(1, 1, heads, hd, device="cuda", dtype=torch.bfloat16)
            k = torch.empty(1, 1, kv_heads, hd, device="cuda", dtype=torch.bfloat16).expand(1, ctx + 7, kv_heads, hd)
            got = torch.ops.minfer.attention_decode_plan(q, k, ctx, window)
            want = _decode_plan(heads, kv_heads, hd, window + (ctx - window) % 16, window + 15)
            assert got == want, f"{heads} / {kv_heads} heads, d {hd}, {ctx} keys, window {window}: {got!r} != {want!r}"
        # a window the context is within plans as no window
        assert torch.ops.minfer.attention_decode_plan(q, k[:, :window], window, window) == \
            _decode_plan(heads, kv_heads, hd, window, window)


def test_engine_fp32_falls_back():
    ours, ref32, _ = _engine_case(2, 5, 4, 2, 64, torch.float32, [0, 3], poison=False)
    torch.testing.assert_close(ours, ref32, atol=1e-5, rtol=1e-5)


def test_engine_cuda_graph():
    # no host syncs: the op can be captured and replayed with new start positions
    cuda = _cuda()
    k = torch.randn(2, 256, 2, 64, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16)
    start = torch.tensor([10, 20], device="cuda", dtype=torch.int32)
    cuda.attention(q, k, v, start, 0.125)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cuda.attention(q, k, v, start, 0.125)
    start.copy_(torch.tensor([100, 200], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    ref = reference.attention(q.float(), k.float(), v.float(), start, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


# 8 q heads: 4-row partials, merged by the last CTA; 32: 16-row partials, every split waiting for the
# pair's generation to move and merging a slice
@pytest.mark.parametrize("heads", [8, 32])
def test_decode_replays_reuse_counters(heads):
    # split counters reset themselves, generations move on: one captured graph replayed with new lengths
    # (NaN-filled output between replays), then eager calls on the same shared counters
    cuda, dtype = _cuda(), torch.bfloat16
    k = torch.randn(2, 20000, 2, 128, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(2, 1, heads, 128, device="cuda", dtype=dtype)
    start = torch.tensor([5000, 3], device="cuda", dtype=torch.int32)
    scale = 1.0 / math.sqrt(128)
    cuda.attention(q, k, v, start, scale)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cuda.attention(q, k, v, start, scale)
    for starts in ([5000, 3], [19999, 12000], [0, 700], [4096, 4095]):
        start.copy_(torch.tensor(starts, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        ref32 = reference.attention(q.float(), k.float(), v.float(), start, scale)
        _check(out, ref32, reference.attention(q, k, v, start, scale), dtype, f"replay {starts}")
    for starts in ([19999, 1], [8, 9000]):
        start.copy_(torch.tensor(starts, dtype=torch.int32))
        ours = cuda.attention(q, k, v, start, scale)
        ref32 = reference.attention(q.float(), k.float(), v.float(), start, scale)
        _check(ours, ref32, reference.attention(q, k, v, start, scale), dtype, f"eager {starts}")


def test_prefill_131k_matches_chunked_reference():
    # O(N) memory: a causal prefill of 131072 tokens (1 kv head, head_dim 128); checked on sampled
    # query blocks against fp32 attention computed block by block.
    n, hd, dtype = 131072, 128, torch.bfloat16
    q = torch.randn(1, n, 1, hd, device="cuda", dtype=dtype)
    k = torch.randn(1, n, 1, hd, device="cuda", dtype=dtype)
    v = torch.randn(1, n, 1, hd, device="cuda", dtype=dtype)
    start = torch.zeros(1, device="cuda", dtype=torch.int32)
    scale = 1.0 / math.sqrt(hd)
    out = _cuda().attention(q, k, v, start, scale)  # [1, n, 1, hd]
    rows = 1024
    for a in (0, 40000, n // 2, n - rows):
        end = a + rows
        qb = q[0, a:end, 0]  # [rows, hd]
        kb, vb = k[0, :end, 0], v[0, :end, 0]  # [end, hd]
        keep = torch.arange(end, device="cuda")[None, :] <= torch.arange(a, end, device="cuda")[:, None]
        ref32 = F.scaled_dot_product_attention(qb.float()[None], kb.float()[None], vb.float()[None],
                                               attn_mask=keep[None], scale=scale)[0]
        lowp = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], attn_mask=keep[None], scale=scale)[0]
        _check(out[0, a:end, 0], ref32, lowp, dtype, f"rows {a}..{end}")


# ---- baselines: q, k, v [batch, heads, seq, head_dim] ----

def _seed_inputs(batch, heads, kv_heads, sq, sk, hd, dtype):
    q = torch.randn(batch, heads, sq, hd, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, sk, hd, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv_heads, sk, hd, device="cuda", dtype=dtype)
    return q, k, v


def _seed_lowp(q, k, v, scale, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    mask = None
    if causal:  # bottom-right aligned (SDPA's is_causal is top-left)
        sq, sk = q.shape[-2], k.shape[-2]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


SEED_SHAPES = [(1, 4, 4, 17, 17, 64), (2, 4, 2, 113, 200, 128), (1, 6, 2, 64, 64, 80), (2, 2, 2, 1, 77, 64),
               (1, 2, 1, 300, 37, 64)]


@pytest.mark.parametrize("op", ["naive_attention", "tiled_attention", "flash_attention"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SEED_SHAPES)
def test_seed(op, dtype, causal, shape):
    batch, heads, kv_heads, sq, sk, hd = shape
    q, k, v = _seed_inputs(batch, heads, kv_heads, sq, sk, hd, dtype)
    scale = None if sq % 2 else 0.3
    ours = getattr(_baselines(), op)(q, k, v, scale=scale, is_causal=causal)
    group = heads // kv_heads
    ref32 = _baselines().attention_reference(q.float(), k.float().repeat_interleave(group, 1),
                                             v.float().repeat_interleave(group, 1), scale, causal)
    s = 1.0 / math.sqrt(hd) if scale is None else scale
    lowp = _seed_lowp(q, k, v, s, causal) if dtype != torch.float32 else ref32
    # Bottom-right causal with seq_q > seq_k: the first seq_q - seq_k rows see no key. The references
    # give NaN there; ours give zeros, and the other rows are compared as usual.
    empty = sq - sk if causal and sq > sk else 0
    assert torch.equal(ours[:, :, :empty], torch.zeros_like(ours[:, :, :empty])), f"{op}: rows with no key"
    _check(ours[:, :, empty:], ref32[:, :, empty:], lowp[:, :, empty:], dtype, op)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("sq, sk", [(1, 1), (17, 17), (113, 200), (1000, 1000), (130, 4097)])
def test_seed_flash_gqa(sq, sk, ratio, hd, causal):
    # the prefill kernel through the baselines' API: plain and bottom-right causal, GQA, ragged tiles
    dtype = torch.bfloat16 if (sq + hd) % 2 else torch.float16
    q, k, v = _seed_inputs(2, 2 * ratio, 2, sq, sk, hd, dtype)
    ours = _baselines().flash_attention(q, k, v, is_causal=causal)
    ref32 = _baselines().attention_reference(q.float(), k.float().repeat_interleave(ratio, 1),
                                             v.float().repeat_interleave(ratio, 1), None, causal)
    _check(ours, ref32, _seed_lowp(q, k, v, 1 / math.sqrt(hd), causal), dtype, f"{sq}x{sk}")


def test_seed_flash_strided_views():
    # [batch, seq, heads, head_dim] storage seen as [batch, heads, seq, head_dim] (the benchmark's layout)
    dtype = torch.bfloat16
    q = torch.randn(2, 300, 8, 128, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(2, 300, 2, 128, device="cuda", dtype=dtype).transpose(1, 2)
    v = torch.randn(2, 300, 2, 128, device="cuda", dtype=dtype).transpose(1, 2)
    for causal in (False, True):
        ours = _baselines().flash_attention(q, k, v, is_causal=causal)
        ref32 = _baselines().attention_reference(q.float(), k.float().repeat_interleave(4, 1),
                                                 v.float().repeat_interleave(4, 1), None, causal)
        _check(ours, ref32, _seed_lowp(q, k, v, 1 / math.sqrt(128), causal), dtype)


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_prefill_sm80_path_on_hopper(hd, monkeypatch):
    # the mma.sync kernel stays the sm_80 path and the fallback: keep it tested where sm90 is the default
    monkeypatch.setenv("MINFER_PREFILL_PATH", "sm80")
    dtype = torch.bfloat16
    ours, ref32, lowp = _engine_case(2, 113, 8, 2, hd, dtype, [0, 300])
    _check(ours, ref32, lowp, dtype)


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("seq", [17, 113, 1000])
def test_prefill_head_dim_256(seq, ratio, dtype, monkeypatch):
    # The default dispatch (on Hopper the sm90 kernel; test_prefill_window forces each path), cache slots past
    # each sequence poisoned.
    monkeypatch.setenv("MINFER_PREFILL_PATH", "auto")
    ours, ref32, lowp = _engine_case(2, seq, 2 * ratio, 2, 256, dtype, [0, 300])
    _check(ours, ref32, lowp, dtype, f"seq={seq}")


def _prefill_path_param(path, hd, monkeypatch):
    """sm90: the wgmma kernel, on Hopper only (the fixture's setting); sm80: the mma.sync kernel forced."""
    if path == "sm90":
        if torch.cuda.get_device_capability()[0] != 9:
            pytest.skip("no sm90 kernel here: the sm80 case runs the same inputs")
    else:
        monkeypatch.setenv("MINFER_PREFILL_PATH", "sm80")


# (window, seq): seq below, at and past the window
WINDOW_CASES = [(1, 17), (1, 130), (17, 16), (17, 17), (17, 200), (512, 300), (512, 512), (512, 1000),
                (4096, 1000), (4096, 4097), (4096, 9000)]


@pytest.mark.parametrize("path", ["sm90", "sm80"])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("window, seq", WINDOW_CASES)
def test_prefill_window(window, seq, hd, path, monkeypatch):
    # Sequence 0 from position 0; sequence 1 a chunk at 2 w + 91 over a cache of that many keys more, so
    # its first query block's window starts mid-tile, tiles past 0 (whose keys must not count).
    _prefill_path_param(path, hd, monkeypatch)
    dtype = torch.float16 if seq % 2 else torch.bfloat16
    starts = [0, 2 * window + 91]
    starts_t = torch.tensor(starts, device="cuda", dtype=torch.int32)
    k, v, kp, vp = _make_cache(2, starts[1] + seq + 5, 2, hd, dtype, [s + seq for s in starts])
    q = torch.randn(2, seq, 4, hd, device="cuda", dtype=dtype)  # [batch, seq, heads, head_dim], 2 q heads a kv head
    scale = 1.0 / math.sqrt(hd)
    nan_freed(q.shape, dtype)
    ours = _cuda().attention(q, kp, vp, starts_t, scale, window=window)
    ref32 = reference.attention(q.float(), k.float(), v.float(), starts_t, scale, window=window)
    lowp = reference.attention(q, k, v, starts_t, scale, window=window)
    _check(ours, ref32, lowp, dtype, f"window={window} seq={seq}")


def test_seed_flash_long():
    q, k, v = _seed_inputs(1, 4, 4, 1000, 4097, 128, torch.float16)
    for causal in (False, True):
        ours = _baselines().flash_attention(q, k, v, is_causal=causal)
        ref32 = _baselines().attention_reference(q.float(), k.float(), v.float(), None, causal)
        _check(ours, ref32, _seed_lowp(q, k, v, 1 / math.sqrt(128), causal), torch.float16)


# ---- opcheck and bad inputs ----

def test_opcheck():
    ops = torch.ops.minfer
    q = torch.randn(2, 3, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 16, 2, 64, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    start = torch.tensor([0, 7], device="cuda", dtype=torch.int32)
    torch.library.opcheck(ops.attention.default, (q, k, v, start, 0.125))
    torch.library.opcheck(ops.attention.default, (q[:, :1], k, v, start, 0.125))
    q, k = q.repeat(1, 1, 1, 4), k.repeat(1, 1, 1, 4)  # head_dim 256 with a window, prefill and decode
    for rows in (3, 1):
        torch.library.opcheck(ops.attention.default, (q[:, :rows], k, k.clone(), start, 0.0625, False, 5))
    qs, ks, vs = _seed_inputs(1, 4, 2, 33, 40, 64, torch.bfloat16)
    _baselines()
    for name in ("naive_attention", "tiled_attention", "flash_attention"):
        torch.library.opcheck(getattr(ops, name).default, (qs, ks, vs, None, True))
        torch.library.opcheck(getattr(ops, name).default, (qs, ks, vs, 0.2, False))


def _good():
    q = torch.randn(1, 4, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 32, 2, 64, device="cuda", dtype=torch.float16)
    return q, k, k.clone(), torch.zeros(1, device="cuda", dtype=torch.int32)


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, s: (q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), s),
     "head_dim must be 64, 128 or 256"),
    (lambda q, k, v, s: (q[:, :, :3], k, v, s), "multiple of kv_heads"),
    (lambda q, k, v, s: (q, k.bfloat16(), v, s), "same dtype"),
    (lambda q, k, v, s: (q, k, v, s.long()), "start_pos must be int32"),
    (lambda q, k, v, s: (q.cpu(), k, v, s), "must be a CUDA tensor"),
    (lambda q, k, v, s: (q, k, v, s.cpu()), "must be a CUDA tensor"),
    (lambda q, k, v, s: (q.int(), k, v, s), "float16 or bfloat16"),
    (lambda q, k, v, s: (q, k[:, :, :, :32], v, s), "same shape"),
    (lambda q, k, v, s: (q, k, v, torch.zeros(3, device="cuda", dtype=torch.int32)), r"start_pos must be"),
])
def test_engine_bad_inputs(bad, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.minfer.attention(*bad(*_good()), 0.125)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_engine_bad_scale(scale):
    # the prefill kernel takes the max of the unscaled scores, which a scale <= 0 would reorder
    with pytest.raises(RuntimeError, match="scale must be positive and finite"):
        torch.ops.minfer.attention(*_good(), scale)


def test_engine_bad_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v, s = _good()
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.minfer.attention(q, k.to("cuda:1"), v, s, 0.125)


@pytest.mark.parametrize("op", ["naive_attention", "tiled_attention", "flash_attention"])
def test_seed_bad_inputs(op):
    fn = getattr(torch.ops.minfer, op)
    q, k, v = _seed_inputs(1, 4, 2, 8, 8, 64, torch.float16)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        fn(q, k[:, :1].expand(1, 3, 8, 64), v[:, :1].expand(1, 3, 8, 64))
    with pytest.raises(RuntimeError, match="same dtype"):
        fn(q, k.float(), v)
    with pytest.raises(RuntimeError, match="must be a CUDA tensor"):
        fn(q.cpu(), k, v)
    with pytest.raises(RuntimeError, match=r"\[batch, heads, seq, head_dim\]"):
        fn(q[0], k, v)
    with pytest.raises(RuntimeError, match="head_dim"):
        fn(q, k[..., :32], v[..., :32])
