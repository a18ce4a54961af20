"""The paged ops. Reference backend: against its dense ones (the same keys scattered over shuffled pages give
the same attention, for prefill chunks at any start and decodes mixed in one call, with and without a window),
and the window against attention written out query by query. CUDA kernels (marked gpu): against the reference
in fp32 with the attention tests' error rule, on shuffled page tables over NaN-filled pools."""
import math

import pytest
import torch

from poison import nan_freed
from minfer.ops import reference

PAGE = 4


def case(q_lens, starts, heads=4, kv_heads=2, hd=16, num_pages=64, seed=0, page=PAGE):
    """Dense caches for len(q_lens) sequences, and the same keys in a paged pool through shuffled tables.
    Pool rows no sequence owns are NaN."""
    g = torch.Generator().manual_seed(seed)
    batch, lens = len(q_lens), [s + n for s, n in zip(starts, q_lens)]
    cap = max(lens)
    k_dense = torch.randn(batch, cap, kv_heads, hd, generator=g)
    v_dense = torch.randn(batch, cap, kv_heads, hd, generator=g)
    k_pool = torch.full((num_pages, page, kv_heads, hd), float("nan"))
    v_pool = k_pool.clone()
    order = torch.randperm(num_pages, generator=g).tolist()  # pages neither contiguous nor sorted
    max_pages = -(-cap // page) + 1  # a spare column: entries past a sequence's pages are never read
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(-(-n // page)):
            table[b, j] = order.pop()
    # write every position through paged_kv_cache_write (the new tokens and the earlier ones alike)
    slots = torch.cat([table[b, torch.arange(n) // page].long() * page + torch.arange(n) % page
                       for b, n in enumerate(lens)])
    reference.paged_kv_cache_write(k_pool, v_pool, torch.cat([k_dense[b, :n] for b, n in enumerate(lens)]),
                                   torch.cat([v_dense[b, :n] for b, n in enumerate(lens)]), slots)
    q = torch.randn(sum(q_lens), heads, hd, generator=g)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return q, k_dense, v_dense, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32), cu


def test_rope_paged_write_reference_equals_two_ops():
    # the reference's rope with the cache arguments is rope, then paged_kv_cache_write
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, (4 + 2 + 2) * 8, generator=g)
    q, k, v = (t.view(5, -1, 8) for t in qkv.split([32, 16, 16], dim=-1))
    positions, cos_sin = torch.tensor([0, 3, 1, 7, 2]), torch.randn(8, 8, generator=g)
    slots = torch.tensor([9, 0, 4, 15, 6])
    got_k, got_v = torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)
    q1, k1 = q.clone(), k.clone()
    reference.rope(q1, k1, positions, cos_sin, True, v=v, k_cache=got_k, v_cache=got_v, slot_mapping=slots)
    q2, k2, want_k, want_v = q.clone(), k.clone(), torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)
    reference.rope(q2, k2, positions, cos_sin, True)
    reference.paged_kv_cache_write(want_k, want_v, k2, v, slots)
    assert torch.equal(q1, q2) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    with pytest.raises(ValueError, match="come together"):
        reference.rope(q1, k1, positions, cos_sin, True, v=v)


@pytest.mark.parametrize("q_lens,starts", [([1, 1, 1], [0, 7, 12]),  # decode
                                           ([5, 9], [0, 0]),  # prefill from 0
                                           ([3, 1, 6, 1], [4, 10, 9, 0])])  # chunks at any start, mixed with decodes
@pytest.mark.parametrize("window", [None, 1, 5])
def test_paged_equals_dense(q_lens, starts, window):
    q, k_dense, v_dense, k_pool, v_pool, table, lens, cu = case(q_lens, starts)
    scale = 0.25
    out = reference.paged_attention(q, k_pool, v_pool, table, lens, cu, max(q_lens), int(lens.max()), scale,
                                    window=window)
    assert out.shape == q.shape and not out.isnan().any()
    for b, (n, s) in enumerate(zip(q_lens, starts)):
        qb = q[cu[b]:cu[b + 1]][None]  # [1, n, heads, hd]
        want = reference.attention(qb, k_dense[b:b + 1], v_dense[b:b + 1], torch.tensor([s]), scale,
                                   window=window)[0]
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], want)


def test_paged_table_entries_past_the_pages_are_ignored():
    """Block-table entries past a sequence's pages may hold anything (a graph's padding rows, stale rows): the
    same output as with zeros there."""
    q, _, _, k_pool, v_pool, table, lens, cu = case([3, 1, 6], [4, 10, 0])
    want = reference.paged_attention(q, k_pool, v_pool, table, lens, cu, 6, int(lens.max()), 0.25)
    junk = table.clone()
    for b, n in enumerate(lens.tolist()):
        junk[b, -(-n // PAGE):] = 1 << 30  # far past the pool
    assert (junk != table)[:, :-(-int(lens.max()) // PAGE)].any()  # inside the columns read
    out = reference.paged_attention(q, k_pool, v_pool, junk, lens, cu, 6, int(lens.max()), 0.25)
    assert torch.equal(out, want)


def test_paged_rows_past_the_sequences_are_zeros():
    """Query rows past cu_seqlens_q[-1] (a graph's padding, outside every sequence) come out as zeros, and the
    sequences' rows as without them."""
    q, _, _, k_pool, v_pool, table, lens, cu = case([3, 1, 6], [4, 10, 0])
    want = reference.paged_attention(q, k_pool, v_pool, table, lens, cu, 6, int(lens.max()), 0.25)
    padded = torch.cat([q, torch.randn(5, *q.shape[1:])])
    out = reference.paged_attention(padded, k_pool, v_pool, table, lens, cu, 6, int(lens.max()), 0.25)
    assert torch.equal(out[:len(q)], want) and torch.equal(out[len(q):], torch.zeros(5, *q.shape[1:]))


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_dense_window_is_the_last_keys(window):
    """Query at position p attends to keys max(0, p - window + 1) .. p, in a ragged batch (the dense op
    slices the cache from the earliest window start of the batch)."""
    g = torch.Generator().manual_seed(window)
    starts, seq, heads, kv_heads, hd = [9, 2], 4, 4, 2, 8
    k = torch.randn(2, 16, kv_heads, hd, generator=g)
    v = torch.randn(2, 16, kv_heads, hd, generator=g)
    q = torch.randn(2, seq, heads, hd, generator=g)
    out = reference.attention(q, k, v, torch.tensor(starts), 0.3, window=window)
    for b, start in enumerate(starts):
        for s in range(seq):
            p = start + s
            keys = slice(max(0, p - window + 1), p + 1)
            kk = k[b, keys].repeat_interleave(2, dim=1)  # [keys, heads, hd]
            w = torch.softmax(torch.einsum("hd,khd->hk", q[b, s], kk) * 0.3, dim=-1)
            want = torch.einsum("hk,khd->hd", w, v[b, keys].repeat_interleave(2, dim=1))
            torch.testing.assert_close(out[b, s], want, atol=1e-5, rtol=1e-5)


def test_kv_write_lands_in_its_slot():
    pool = torch.zeros(3, PAGE, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    reference.paged_kv_cache_write(pool, pool.clone(), k, k, torch.tensor([11, 0, 5]))
    assert pool[2, 3].tolist() == [[0.0, 1.0]] and pool[0, 0].tolist() == [[2.0, 3.0]]
    assert pool[1, 1].tolist() == [[4.0, 5.0]] and pool.abs().sum() == 15


# ---- CUDA kernels ----

EPS = {torch.float16: 2 ** -9, torch.bfloat16: 2 ** -7}  # times the output's largest value (test_attention.py)


def _cuda():
    from minfer.ops import cuda
    return cuda


def cuda_case(q_lens, starts, heads, kv_heads, hd, dtype, page=16, seed=0):
    """case() on the GPU in dtype, with pages enough for every sequence and a quarter more."""
    need = sum(-(-(s + n) // page) for s, n in zip(starts, q_lens))
    q, _, _, k_pool, v_pool, table, lens, cu = case(q_lens, starts, heads, kv_heads, hd, need + need // 4 + 1, seed,
                                                    page)
    dev = lambda t: t.to("cuda", dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return [dev(t) for t in (q, k_pool, v_pool, table, lens, cu)]


def assert_close(ours, ref32, lowp, q, dtype):
    """The kernel's output against the fp32 reference: q's shape and dtype, finite (its NaN-poisoned memory
    overwritten), max error <= 2x torch's own in dtype + eps."""
    assert ours.shape == q.shape and ours.dtype == dtype
    assert torch.isfinite(ours).all(), "non-finite output"
    err, base = (ours.float() - ref32).abs().max().item(), (lowp.float() - ref32).abs().max().item()
    eps = EPS[dtype] * ref32.abs().max().item()
    assert err <= 2 * base + eps, f"max err {err:.3e} vs torch {base:.3e} + {eps:.1e}"


def check_paged(q_lens, starts, heads=8, kv_heads=2, hd=128, dtype=torch.bfloat16, page=16, stable_prefix=False,
                strided=False, spare_pages=1):
    """The kernel against the fp32 reference: max error <= 2x torch's own in dtype + eps. max_seqlen_k is the
    table's width in keys (spare_pages past the longest sequence's pages)."""
    q, k, v, table, lens, cu = cuda_case(q_lens, starts, heads, kv_heads, hd, dtype, page)
    bound = int(lens.max())
    if spare_pages > 1:  # case() leaves one spare column
        table = torch.nn.functional.pad(table, (0, spare_pages - 1))
        bound = table.shape[1] * page
    if strided:  # q as the model passes it: a view into the fused qkv projection
        qkv = torch.randn(q.shape[0], (heads + 2 * kv_heads) * hd, device="cuda", dtype=dtype)
        qkv[:, :heads * hd] = q.reshape(q.shape[0], -1)
        q = qkv[:, :heads * hd].view(-1, heads, hd)
    args = (table, lens, cu, max(q_lens), bound, 1 / math.sqrt(hd))
    nan_freed(q.shape, dtype)
    ours = _cuda().paged_attention(q, k, v, *args, stable_prefix=stable_prefix)
    ref32 = reference.paged_attention(q.float(), k.float(), v.float(), *args)
    lowp = reference.paged_attention(q, k, v, *args)
    assert_close(ours, ref32, lowp, q, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("ctx", [1, 17, 48, 300, 4097, 20000])
def test_cuda_paged_decode(ctx, hd, dtype, stable_prefix):
    starts = [ctx - 1, max(0, ctx // 3 - 1), 0]  # the newest key at ctx - 1, and shorter sequences beside it
    check_paged([1, 1, 1], starts, hd=hd, dtype=dtype, stable_prefix=stable_prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("spare_pages", [1, 2, 40])
@pytest.mark.parametrize("hd", [128, 256])
def test_cuda_paged_decode_bound_past_lengths(hd, spare_pages):
    # max_seqlen_k a bound past the longest sequence (spare_pages > 1), as the engine's decode graphs pass one: the
    # plan is laid out for the bound, each sequence's split by its own length, and no key past it is read
    starts = [4095, 4000, 2047, 300, 16, 0]
    check_paged([1] * len(starts), starts, heads=8, kv_heads=2, hd=hd, stable_prefix=True, spare_pages=spare_pages)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 32, 48, 64])  # 48: not a power of two, the division's path (KvRows)
@pytest.mark.parametrize("ratio", [1, 4, 16])
def test_cuda_paged_decode_pages_and_groups(ratio, page):
    starts = [int(x) for x in torch.randint(0, 3000, (9,))]
    check_paged([1] * 9, starts, heads=2 * ratio, kv_heads=2, page=page, stable_prefix=True)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [64, 130])
def test_cuda_paged_decode_large_batch(batch):
    starts = [int(x) for x in torch.randint(0, 1500, (batch,))]
    check_paged([1] * batch, starts, heads=32, kv_heads=8, stable_prefix=True)


@pytest.mark.gpu
@pytest.mark.parametrize("stable_prefix", [False, True])
def test_cuda_paged_decode_short_ring(stable_prefix):
    # 100 sequences x 3 kv heads at d 64: more CTAs than 2 an SM, d 64's short ring, over shuffled pages
    starts = [0, 1, 15, 16, 255, 256, 700, 1999] + [int(x) for x in torch.randint(0, 2000, (92,))]
    check_paged([1] * len(starts), starts, heads=9, kv_heads=3, hd=64, stable_prefix=stable_prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("hd", [64, 128])
def test_cuda_paged_decode_long_warps(hd, stable_prefix):
    # 16 sequences x 8 kv heads fill the SMs with one split each, so a warp streams up to 313 tiles: its pages
    # come 32 at a time, a window ahead, over shuffled pages.
    starts = [19999, 12345, 4096, 2047, 511, 33] + [int(x) for x in torch.randint(0, 20000, (10,))]
    check_paged([1] * 16, starts, heads=32, kv_heads=8, hd=hd, stable_prefix=stable_prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ctx", [1, 17, 300, 4097, 20000])
def test_cuda_paged_decode_head_dim_256(ctx, dtype, stable_prefix):
    starts = [ctx - 1, max(0, ctx // 3 - 1), 0]
    check_paged([1, 1, 1], starts, hd=256, dtype=dtype, stable_prefix=stable_prefix)
    check_paged([1, 1, 1], starts, heads=16, kv_heads=1, hd=256, dtype=dtype, stable_prefix=stable_prefix)


def check_paged_decode_window(starts, window, hd, dtype, page=16, stable_prefix=False, heads=8, kv_heads=2):
    """Decode of sequences at `starts` with a sliding window against the fp32 reference. Every key before a
    sequence's window is NaN in the pool, and the block-table entries of the pages wholly before it (those the
    engine frees) point past the pool, where a read is clamped to its last page, NaN here: none may be read."""
    q, k, v, table, lens, cu = cuda_case([1] * len(starts), starts, heads, kv_heads, hd, dtype, page)
    args = (lens, cu, 1, int(lens.max()), 1 / math.sqrt(hd))
    ref32 = reference.paged_attention(q.float(), k.float(), v.float(), table, *args, window=window)
    lowp = reference.paged_attention(q, k, v, table, *args, window=window)
    k, v = (torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (k, v))  # [num_pages + 1, page, ...]
    freed_table = table.clone()
    for b, n in enumerate(lens.tolist()):
        first = max(0, n - window)  # the window's first key
        keys = torch.arange(first, device="cuda")
        pages = table[b, keys // page].long()
        k[pages, keys % page] = float("nan")
        v[pages, keys % page] = float("nan")
        freed_table[b, :first // page] = k.shape[0] + 1000
    nan_freed(q.shape, dtype)
    ours = _cuda().paged_attention(q, k, v, freed_table, *args, window=window, stable_prefix=stable_prefix)
    assert_close(ours, ref32, lowp, q, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("stable_prefix", [False, True])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("window", [1, 17, 512, 4096])
@pytest.mark.parametrize("ctx", [1, 17, 48, 300, 512, 4097, 20000])  # below, at and past the windows
def test_cuda_paged_decode_window(ctx, window, hd, stable_prefix):
    dtype = torch.bfloat16 if (ctx + window) % 2 else torch.float16
    starts = [ctx - 1, max(0, ctx // 3 - 1), window + 6, 0]  # windows from different rows of their tiles
    check_paged_decode_window(starts, window, hd, dtype, stable_prefix=stable_prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [32, 64])
@pytest.mark.parametrize("ratio", [1, 8])
@pytest.mark.parametrize("window, ctx", [(17, 300), (512, 4097), (512, 20000)])
def test_cuda_paged_decode_window_pages(ctx, window, ratio, page):
    # a window's first key inside a page that is partly before it; groups of 1 and 8 at d 256
    starts = [ctx - 1, ctx // 2 + 5, window + page // 2]
    check_paged_decode_window(starts, window, 256, torch.bfloat16, page, True, heads=2 * ratio, kv_heads=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("page", [16, 48])
@pytest.mark.parametrize("q_lens,starts", [([17], [0]),  # a prefill from 0
                                           ([113, 1000], [0, 0]),
                                           ([3, 1, 200, 1, 65], [4, 10, 37, 0, 129]),  # chunks mixed with decodes
                                           ([1, 2], [500, 4095]),
                                           ([64, 1, 1], [20000, 300, 7000])])  # a long prompt's chunk, decodes
def test_cuda_paged_prefill(q_lens, starts, page, hd, dtype):
    """Steps of few query blocks split the key tiles over CTAs where the longest sequence has 16 key tiles or
    more, 8 on d 64's narrow variant (flash_prefill.cu's prefill_kv_splits; at d 64, [1, 2] at [500, 4095] takes
    the narrow variant in 16 splits, [113, 1000] from 0 the wide one in 2); the shorter cases here run whole."""
    check_paged(q_lens, starts, hd=hd, dtype=dtype, page=page)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (9, 3), (32, 2)])
@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("q_lens,starts", [([33, 1, 7], [5000, 40, 0]),  # a chunk, a decode, a short prompt
                                           ([128, 1], [20000, 900])])  # split-KV
def test_cuda_paged_prefill_groups(q_lens, starts, heads, kv_heads, hd):
    """Ragged steps put a kv head's q heads in one CTA's rows, token-major (flash_prefill.cu, GQA packing):
    groups of 1, of 3 (a token's rows straddle two blocks) and of 16."""
    check_paged(q_lens, starts, heads=heads, kv_heads=kv_heads, hd=hd)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("window", [1, 17, 512, 4096])
@pytest.mark.parametrize("q_lens,starts", [([1000], [0]),  # a prefill from 0: later query blocks skip tiles
                                           ([300, 1, 200, 65], [4, 700, 1037, 129]),  # chunks mixed with a decode
                                           ([2, 513], [4095, 600])])
def test_cuda_paged_prefill_window(q_lens, starts, window, page, hd, dtype):
    """Ragged prefill with a sliding window. The pages wholly before the window of a sequence's first query
    (the ones the engine frees) are NaN in the pool: any row of them read would show."""
    q, k, v, table, lens, cu = cuda_case(q_lens, starts, 8, 2, hd, dtype, page)
    args = (table, lens, cu, max(q_lens), int(lens.max()), 1 / math.sqrt(hd))
    ref32 = reference.paged_attention(q.float(), k.float(), v.float(), *args, window=window)
    lowp = reference.paged_attention(q, k, v, *args, window=window)
    for b, s in enumerate(starts):
        freed = max(0, s - window + 1) // page  # pages wholly before the first query's window
        k[table[b, :freed].long()] = float("nan")
        v[table[b, :freed].long()] = float("nan")
    nan_freed(q.shape, dtype)
    ours = _cuda().paged_attention(q, k, v, *args, window=window)
    assert_close(ours, ref32, lowp, q, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 1, 70]])
def test_cuda_paged_strided_q(q_lens):
    check_paged(q_lens, [40, 0, 7], strided=True)


@pytest.mark.gpu
def test_cuda_paged_decode_in_graph():
    """No host syncs: captured once, replayed after the lengths and the tables change."""
    cuda = _cuda()
    q, k, v, table, lens, cu = cuda_case([1, 1], [100, 20], 8, 2, 64, torch.float16)
    args = lambda: (table, lens, cu, 1, 4096, 0.125)  # noqa: E731  (max_seqlen_k: a bound, as a graph needs)
    cuda.paged_attention(q, k, v, *args())
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = cuda.paged_attention(q, k, v, *args(), stable_prefix=True)
    lens.copy_(torch.tensor([7, 101], dtype=torch.int32))
    table.copy_(table.flip(0))
    g.replay()
    torch.cuda.synchronize()
    ref = reference.paged_attention(q.float(), k.float(), v.float(), *args())
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("hd, window", [(64, 0), (256, 5)])
def test_cuda_paged_opcheck(hd, window):
    q, k, v, table, lens, cu = cuda_case([1, 3], [10, 0], 8, 2, hd, torch.bfloat16)
    torch.library.opcheck(torch.ops.minfer.paged_attention, (q, k, v, table, lens, cu, 3, 11, 0.125, False, window))
    q, k, v, table, lens, cu = cuda_case([1, 1], [10, 3], 8, 2, hd, torch.bfloat16)  # decodes
    torch.library.opcheck(torch.ops.minfer.paged_attention, (q, k, v, table, lens, cu, 1, 11, 0.125, True, window))


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [64, 256])
def test_cuda_paged_into_one_tensor(hd):
    """A mixed step as the model runs it: its decodes on the decode kernel and its chunks on the prefill kernel,
    each into its rows of one NaN-filled tensor, against the fp32 reference of the whole step."""
    q_lens, starts = [1, 1, 1, 40, 7], [300, 17, 2000, 5000, 0]
    q, k, v, table, lens, cu = cuda_case(q_lens, starts, 8, 2, hd, torch.bfloat16)
    args = (table, lens, cu, max(q_lens), int(lens.max()), 1 / math.sqrt(hd))
    ref32 = reference.paged_attention(q.float(), k.float(), v.float(), *args)
    lowp = reference.paged_attention(q, k, v, *args)
    d, cuda = 3, _cuda()
    out = torch.full_like(q, float("nan"))
    assert cuda.paged_attention(q[:d], k, v, table[:d], lens[:d], cu[:d + 1], 1, int(lens[:d].max()),
                                1 / math.sqrt(hd), out=out[:d]).data_ptr() == out.data_ptr()
    cuda.paged_attention(q[d:], k, v, table[d:], lens[d:], cu[d:] - cu[d], max(q_lens[d:]), int(lens[d:].max()),
                         1 / math.sqrt(hd), out=out[d:])
    assert_close(out, ref32, lowp, q, torch.bfloat16)
    torch.library.opcheck(torch.ops.minfer.paged_attention_into,
                          (torch.empty_like(q[d:]), q[d:], k, v, table[d:], lens[d:], cu[d:] - cu[d], max(q_lens[d:]),
                           int(lens[d:].max()), 0.125, False, 0))
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        cuda.paged_attention(q, k, v, *args, out=out[:, :4])
    with pytest.raises(RuntimeError, match="out must have q's dtype"):
        cuda.paged_attention(q, k, v, *args, out=out.half())
    with pytest.raises(RuntimeError, match="out must be on q's device"):
        cuda.paged_attention(q, k, v, *args, out=out.cpu())


@pytest.mark.gpu
def test_cuda_paged_bad_inputs():
    cuda = _cuda()
    q, k, v, table, lens, cu = cuda_case([1, 1], [10, 3], 8, 2, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match="page_size must be a multiple of 16"):
        cuda.paged_attention(q, k[:, :8], v[:, :8], table, lens, cu, 1, 11, 0.1)
    with pytest.raises(RuntimeError, match="block_table must be int32"):
        cuda.paged_attention(q, k, v, table.long(), lens, cu, 1, 11, 0.1)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be"):
        cuda.paged_attention(q, k, v, table, lens, cu[:-1], 1, 11, 0.1)
    with pytest.raises(RuntimeError, match="max_seqlen_q must be"):
        cuda.paged_attention(q, k, v, table, lens, cu, 5, 11, 0.1)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256"):
        cuda.paged_attention(q[..., :32], k[..., :32], v[..., :32], table, lens, cu, 1, 11, 0.1)
    for scale in (0.0, -0.1, float("nan")):
        with pytest.raises(RuntimeError, match="scale must be positive and finite"):
            cuda.paged_attention(q, k, v, table, lens, cu, 1, 11, scale)


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [[1, 1], [1, 4]])  # decode, prefill
def test_cuda_paged_bad_page_ids_stay_in_bounds(q_lens):
    """Page ids past the pool are clamped into it: wrong rows, never an illegal access."""
    cuda = _cuda()
    q, k, v, table, lens, cu = cuda_case(q_lens, [40, 3], 8, 2, 64, torch.bfloat16)
    table.fill_(1 << 30)
    out = cuda.paged_attention(q, k.nan_to_num(0), v.nan_to_num(0), table, lens, cu, max(q_lens), 44, 0.1)
    torch.cuda.synchronize()
    assert out.shape == q.shape
