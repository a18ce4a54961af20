"""The newest key's rope folded into the decode call (attention / paged_attention with k_new, v_new, cos_sin).
Reference backend: the fold equals rope, the cache write and the plain call, bit for bit, and leaves its inputs
as they were; the engines' greedy tokens are the same with their decode steps folded and not. CUDA (marked gpu): the caches hold the rope kernel's bits, the output is the unfolded kernels' and is
within the attention tests' error rule of the fp32 reference, on NaN-poisoned caches, for dense and paged layouts,
windows, groups that take several kv blocks, and rows that must not be written (past the dense capacity, a page
outside the pool)."""
import math
import os

import pytest
import torch
from test_paged_attention import case, cuda_case
from poison import nan_freed

from minfer import loader
from minfer.ops import reference

MODEL_PATH = os.path.join(loader.cache_dir(), loader.DEFAULT_MODEL_FILE)

EPS = {torch.float16: 2 ** -9, torch.bfloat16: 2 ** -7}  # times the output's largest value (test_attention.py)


def cos_sin_table(max_pos, hd, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(max_pos, hd // 2, generator=g) * 6.3
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)  # [max_pos, hd]: cos | sin


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


# ---- reference backend ----

def test_reference_dense_fold_is_rope_write_attend():
    g = torch.Generator().manual_seed(0)
    batch, cap, heads, kvh, hd = 3, 20, 4, 2, 16
    k_cache, v_cache = torch.randn(batch, cap, kvh, hd, generator=g), torch.randn(batch, cap, kvh, hd, generator=g)
    q = torch.randn(batch, 1, heads, hd, generator=g)
    k_new, v_new = torch.randn(batch, kvh, hd, generator=g), torch.randn(batch, kvh, hd, generator=g)
    start = torch.tensor([0, 7, cap - 1], dtype=torch.int32)
    cs = cos_sin_table(32, hd)
    inputs = [t.clone() for t in (q, k_new, v_new)]
    kc, vc = k_cache.clone(), v_cache.clone()
    got = reference.attention(q, kc, vc, start, 0.25, window=5, k_new=k_new, v_new=v_new, cos_sin=cs)
    q2, k2 = q[:, 0].clone(), k_new.clone()
    reference.rope(q2, k2, start, cs, True)
    kw, vw = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        kw[b, start[b]], vw[b, start[b]] = k2[b], v_new[b]
    want = reference.attention(q2[:, None], kw, vw, start, 0.25, window=5)
    assert torch.equal(got, want) and torch.equal(kc, kw) and torch.equal(vc, vw)
    assert all(torch.equal(a, b) for a, b in zip((q, k_new, v_new), inputs))


def test_reference_paged_fold_is_rope_write_attend():
    starts = [0, 5, 30]
    q, _, _, k_pool, v_pool, table, lens, cu = case([1, 1, 1], starts, heads=4, kv_heads=2, hd=16, seed=1)
    g = torch.Generator().manual_seed(2)
    k_new, v_new = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    table[2, 30 // 4] = 1000  # the newest key's page outside the pool: nothing written for it
    cs = cos_sin_table(40, 16)
    args = (table, lens, cu, 1, int(lens.max()), 0.25)
    kc, vc = k_pool.clone(), v_pool.clone()
    got = reference.paged_attention(q, kc, vc, *args, k_new=k_new, v_new=v_new, cos_sin=cs)
    q2, k2 = q.clone(), k_new.clone()
    pos = lens.long() - 1
    reference.rope(q2, k2, pos, cs, True)
    kw, vw = k_pool.clone(), v_pool.clone()
    slots = table[torch.arange(2), pos[:2] // 4].long() * 4 + pos[:2] % 4
    reference.paged_kv_cache_write(kw, vw, k2[:2], v_new[:2], slots)
    want = reference.paged_attention(q2, kw, vw, *args)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert torch.equal(kc.nan_to_num(7.0), kw.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vw.nan_to_num(7.0))


def test_reference_fold_bad_calls():
    q, _, _, k_pool, v_pool, table, lens, cu = case([1, 1], [3, 4])
    k_new = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="come together"):
        reference.paged_attention(q, k_pool, v_pool, table, lens, cu, 1, 8, 0.25, k_new=k_new)
    q, _, _, k_pool, v_pool, table, lens, cu = case([2, 1], [3, 4])
    with pytest.raises(ValueError, match="for decode calls"):
        reference.paged_attention(q, k_pool, v_pool, table, lens, cu, 2, 8, 0.25, k_new=k_new, v_new=k_new,
                                  cos_sin=cos_sin_table(8, 16))
    with pytest.raises(ValueError, match="whole head"):
        q, _, _, k_pool, v_pool, table, lens, cu = case([1, 1], [3, 4])
        reference.paged_attention(q, k_pool, v_pool, table, lens, cu, 1, 8, 0.25, k_new=k_new, v_new=k_new,
                                  cos_sin=cos_sin_table(8, 8))


def _engines_agree(make_engine, generate):
    """The default model's greedy tokens with every decode step folded (rows >= 1) and with none folded."""
    outs = []
    for fold in (True, False):
        engine = make_engine()
        engine.model.rope_in_decode_rows = 1
        engine.model.rope_in_decode = fold
        outs.append(generate(engine))
    assert outs[0] == outs[1]


@pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason=f"default model not at {MODEL_PATH}")
def test_reference_engines_fold_their_decode_steps():
    from minfer.engine import Engine
    from minfer.engine.core import EngineCore
    from minfer.sampling import SamplingParams
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 1812, 253, 29], [1, 6, 7]]
    kw = {"dtype": torch.float32, "device": "cpu", "backend": "ref", "max_context": 64}
    _engines_agree(lambda: EngineCore(None, num_pages=64, page_size=4, **kw),
                   lambda e: [o.token_ids for o in e.generate(prompts, [greedy] * 3)[0]])
    _engines_agree(lambda: Engine(None, **kw),
                   lambda e: [o.token_ids for o in e.generate(prompts, SamplingParams(temperature=0.0), 12,
                                                              ignore_eos=True)[0]])


# ---- CUDA ----

def _cuda():
    from minfer.ops import cuda
    return cuda


def check_close(ours, ref32, lowp, dtype, what=""):
    assert ours.dtype == dtype and ours.shape == ref32.shape, what
    assert torch.isfinite(ours).all(), f"{what}: non-finite output"
    err, base = (ours.float() - ref32).abs().max().item(), (lowp.float() - ref32).abs().max().item()
    eps = EPS[dtype] * ref32.abs().max().item()
    assert err <= 2 * base + eps, f"{what}: max err {err:.3e} vs torch {base:.3e} + {eps:.1e}"


def qkv_rows(batch, heads, kvh, hd, dtype, seed):
    """q [batch, heads, hd], k_new, v_new [batch, kvh, hd] as the model passes them: views into one qkv row."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(batch, (heads + 2 * kvh) * hd, device="cuda", dtype=dtype, generator=g)
    q, k, v = qkv.split([heads * hd, kvh * hd, kvh * hd], dim=-1)
    return q.view(batch, heads, hd), k.view(batch, kvh, hd), v.view(batch, kvh, hd)


def check_dense(starts, hd, dtype, heads=8, kvh=2, window=None, stable_prefix=True, capacity=None, seed=0):
    cuda = _cuda()
    batch = len(starts)
    capacity = capacity or max(starts) + 9
    g = torch.Generator(device="cuda").manual_seed(seed + 100)
    k_clean = torch.randn(batch, capacity, kvh, hd, device="cuda", dtype=dtype, generator=g)  # the reference's
    v_clean = torch.randn(batch, capacity, kvh, hd, device="cuda", dtype=dtype, generator=g)
    k_cache, v_cache = k_clean.clone(), v_clean.clone()
    for b, s in enumerate(starts):  # the kernels': the newest row and everything after it NaN until written
        k_cache[b, s:], v_cache[b, s:] = float("nan"), float("nan")
    q, k_new, v_new = qkv_rows(batch, heads, kvh, hd, dtype, seed)
    start = torch.tensor(starts, device="cuda", dtype=torch.int32)
    cs = cos_sin_table(capacity + 16, hd, "cuda", seed)
    scale = 1 / math.sqrt(hd)
    inputs = [t.clone() for t in (q, k_new, v_new)]
    # unfolded, as the engine ran before: the rope kernel writes the cache rows, then the plain call
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    q2, k2 = q.clone(), k_new.clone()
    slots = (torch.arange(batch, device="cuda") * capacity + start.long()).masked_fill(start >= capacity, -1)
    cuda.rope(q2, k2, start, cs, True, v=v_new, k_cache=kc2, v_cache=vc2, slot_mapping=slots)
    want = cuda.attention(q2[:, None], kc2, vc2, start, scale, stable_prefix, window)
    kc, vc = k_cache.clone(), v_cache.clone()
    nan_freed((batch, 1, heads, hd), dtype)
    got = cuda.attention(q[:, None], kc, vc, start, scale, stable_prefix, window, k_new=k_new, v_new=v_new,
                         cos_sin=cs)
    what = f"starts={starts[:4]} hd={hd} {dtype} window={window}"
    assert torch.equal(bits(kc), bits(kc2)) and torch.equal(bits(vc), bits(vc2)), f"{what}: cache bits"
    assert torch.equal(bits(got), bits(want)), f"{what}: not the unfolded kernels' output"
    assert all(torch.equal(a, b) for a, b in zip((q, k_new, v_new), inputs)), f"{what}: inputs written"
    if max(starts) >= capacity:
        return got
    ref_args = (start, scale, False, window)
    ref32 = reference.attention(q[:, None].float(), k_clean.float(), v_clean.float(), *ref_args,
                                k_new=k_new.float(), v_new=v_new.float(), cos_sin=cs)
    lowp = reference.attention(q[:, None], k_clean, v_clean, *ref_args, k_new=k_new, v_new=v_new, cos_sin=cs)
    check_close(got, ref32, lowp, dtype, what)
    return got


def check_paged(starts, hd, dtype, heads=8, kvh=2, page=16, window=None, stable_prefix=True, spare_pages=1,
                seed=0, outside=()):
    """outside: sequences whose newest key's page entry lies outside the pool (nothing may be written for them)."""
    cuda = _cuda()
    batch = len(starts)
    q0, k_pool, v_pool, table, lens, cu = cuda_case([1] * batch, starts, heads, kvh, hd, dtype, page, seed)
    if spare_pages > 1:
        table = torch.nn.functional.pad(table, (0, spare_pages - 1))
    bound = table.shape[1] * page if spare_pages > 1 else int(lens.max())
    pos = lens.long() - 1
    rows = table[torch.arange(batch, device="cuda"), pos // page].long() * page + pos % page  # newest keys' rows
    k_pool.view(-1, kvh, hd)[rows] = float("nan")  # unwritten until the call writes them
    v_pool.view(-1, kvh, hd)[rows] = float("nan")
    for b in outside:
        table[b, pos[b] // page] = k_pool.shape[0] + 7
    q, k_new, v_new = qkv_rows(batch, heads, kvh, hd, dtype, seed)
    cs = cos_sin_table(int(lens.max()) + 16, hd, "cuda", seed)
    scale = 1 / math.sqrt(hd)
    args = (table, lens, cu, 1, bound, scale)
    keep = torch.ones(batch, dtype=torch.bool, device="cuda")
    keep[list(outside)] = False
    kc2, vc2 = k_pool.clone(), v_pool.clone()
    q2, k2 = q.clone(), k_new.clone()
    cuda.rope(q2, k2, pos, cs, True, v=v_new, k_cache=kc2, v_cache=vc2, slot_mapping=rows.masked_fill(~keep, -1))
    want = cuda.paged_attention(q2, kc2, vc2, *args, window=window, stable_prefix=stable_prefix)
    kc, vc = k_pool.clone(), v_pool.clone()
    nan_freed(q.shape, dtype)
    got = cuda.paged_attention(q, kc, vc, *args, window=window, stable_prefix=stable_prefix, k_new=k_new, v_new=v_new,
                               cos_sin=cs)
    what = f"starts={starts[:4]} hd={hd} {dtype} page={page} window={window}"
    assert torch.equal(bits(kc), bits(kc2)) and torch.equal(bits(vc), bits(vc2)), f"{what}: cache bits"
    assert torch.equal(bits(got[keep]), bits(want[keep])), f"{what}: not the unfolded kernels' output"
    if outside:
        return
    ref32 = reference.paged_attention(q.float(), k_pool.float(), v_pool.float(), *args, window=window,
                                      k_new=k_new.float(), v_new=v_new.float(), cos_sin=cs)
    lowp = reference.paged_attention(q, k_pool.clone(), v_pool.clone(), *args, window=window, k_new=k_new,
                                     v_new=v_new, cos_sin=cs)
    check_close(got, ref32, lowp, dtype, what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_rope_kernel_is_the_reference_bit_for_bit(dtype):
    # the fold's cache bits are the rope kernel's, and both are torch's: each product and sum rounded on its own
    cuda = _cuda()
    q, k, _ = qkv_rows(37, 8, 2, 128, dtype, 3)
    pos = torch.randint(0, 500, (37,), device="cuda")
    cs = cos_sin_table(500, 128, "cuda")
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    cuda.rope(q1, k1, pos, cs, True)
    reference.rope(q2, k2, pos, cs, True)
    assert torch.equal(bits(q1), bits(q2)) and torch.equal(bits(k1), bits(k2))


@pytest.mark.gpu
@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("ctx", [1, 16, 17, 48, 300, 4097])
def test_cuda_fold_dense(ctx, hd, dtype, stable_prefix):
    check_dense([ctx - 1, max(0, ctx // 3 - 1), 0], hd, dtype, stable_prefix=stable_prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("ctx", [1, 17, 300, 4097])
def test_cuda_fold_paged(ctx, hd, dtype, stable_prefix):
    check_paged([ctx - 1, max(0, ctx // 3 - 1), 0], hd, dtype, stable_prefix=stable_prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kvh", [(1, 1), (4, 1), (32, 8), (32, 1), (128, 2)])  # 128 / 2: 4 kv blocks a head
@pytest.mark.parametrize("hd", [64, 128])
def test_cuda_fold_groups(heads, kvh, hd):
    starts = [2500, 700, 31, 0]
    check_dense(starts, hd, torch.bfloat16, heads=heads, kvh=kvh)
    check_paged(starts, hd, torch.bfloat16, heads=heads, kvh=kvh, page=48)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [64, 130])
def test_cuda_fold_large_batch(batch):
    starts = [int(x) for x in torch.randint(0, 1500, (batch,))]
    check_dense(starts, 128, torch.bfloat16, heads=32, kvh=8)
    check_paged(starts, 128, torch.bfloat16, heads=32, kvh=8)
    check_paged(starts, 64, torch.float16, heads=9, kvh=3)  # d 64's short ring at 100+ sequences


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 17, 512])
@pytest.mark.parametrize("hd", [64, 128])
def test_cuda_fold_window(window, hd):
    starts = [4000, 600, 511, 16, 0]
    check_dense(starts, hd, torch.float16, window=window)
    check_paged(starts, hd, torch.float16, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("spare_pages", [2, 40])
def test_cuda_fold_bound_past_lengths(spare_pages):
    # the decode graphs' call: max_seqlen_k a bound past every length
    check_paged([4095, 2047, 300, 16, 0], 128, torch.bfloat16, spare_pages=spare_pages)


@pytest.mark.gpu
def test_cuda_fold_writes_nothing_outside():
    # a page entry outside the pool, and a dense sequence at its capacity: no row written (bits compared whole)
    check_paged([700, 300, 16], 128, torch.bfloat16, outside=(1,))
    check_dense([40, 12], 64, torch.bfloat16, capacity=40)


@pytest.mark.gpu
def test_cuda_fold_opcheck():
    q, k_new, v_new = qkv_rows(2, 8, 2, 64, torch.bfloat16, 0)
    k_cache = torch.randn(2, 20, 2, 64, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    start = torch.tensor([3, 11], device="cuda", dtype=torch.int32)
    cs = cos_sin_table(32, 64, "cuda")
    torch.library.opcheck(torch.ops.minfer.attention,
                          (q[:, None].contiguous(), k_cache, v_cache, start, 0.125, True, 0, k_new.contiguous(),
                           v_new.contiguous(), cs))


@pytest.mark.gpu
def test_cuda_fold_bad_args():
    cuda = _cuda()
    q, k_new, v_new = qkv_rows(2, 8, 2, 64, torch.bfloat16, 0)
    k_cache = torch.zeros(2, 20, 2, 64, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    start = torch.tensor([3, 11], device="cuda", dtype=torch.int32)
    cs = cos_sin_table(32, 64, "cuda")
    call = lambda **kw: cuda.attention(q[:, None], k_cache, v_cache, start, 0.125, True, **kw)  # noqa: E731
    with pytest.raises(RuntimeError, match="come together"):
        call(k_new=k_new, cos_sin=cs)
    with pytest.raises(RuntimeError, match="k_new must be"):
        call(k_new=k_new[:, :1], v_new=v_new, cos_sin=cs)
    with pytest.raises(RuntimeError, match="v_new must have q's device and dtype"):
        call(k_new=k_new, v_new=v_new.half(), cos_sin=cs)
    with pytest.raises(RuntimeError, match="cos_sin must be float32"):
        call(k_new=k_new, v_new=v_new, cos_sin=cs.double())
    with pytest.raises(RuntimeError, match="cos_sin must be a contiguous"):
        call(k_new=k_new, v_new=v_new, cos_sin=cs[:, :32])
    with pytest.raises(RuntimeError, match="for decode calls"):
        cuda.attention(q[:, None].expand(2, 3, 8, 64), k_cache, v_cache, start, 0.125, k_new=k_new, v_new=v_new,
                       cos_sin=cs)
    q256, k256, v256 = qkv_rows(2, 8, 2, 256, torch.bfloat16, 0)
    c256 = torch.zeros(2, 20, 2, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        cuda.attention(q256[:, None], c256, c256.clone(), start, 0.125, k_new=k256, v_new=v256,
                       cos_sin=cos_sin_table(32, 256, "cuda"))
