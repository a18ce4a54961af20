"""The reference backend's paged ops against its dense ones: the same keys scattered over shuffled pages
give the same attention, for prefill chunks at any start and decodes mixed in one call, with and without
a window; the window itself against attention written out query by query."""
import pytest
import torch

from minfer.ops import reference

PAGE = 4


def case(q_lens, starts, heads=4, kv_heads=2, hd=16, num_pages=64, seed=0):
    """Dense caches for len(q_lens) sequences, and the same keys in a paged pool through shuffled tables."""
    g = torch.Generator().manual_seed(seed)
    batch, lens = len(q_lens), [s + n for s, n in zip(starts, q_lens)]
    cap = max(lens)
    k_dense = torch.randn(batch, cap, kv_heads, hd, generator=g)
    v_dense = torch.randn(batch, cap, kv_heads, hd, generator=g)
    k_pool = torch.full((num_pages, PAGE, kv_heads, hd), float("nan"))
    v_pool = k_pool.clone()
    order = torch.randperm(num_pages, generator=g).tolist()  # pages neither contiguous nor sorted
    max_pages = -(-cap // PAGE)
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(-(-n // PAGE)):
            table[b, j] = order.pop()
    # write every position through paged_kv_cache_write (the new tokens and the earlier ones alike)
    slots = torch.cat([table[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
                       for b, n in enumerate(lens)])
    reference.paged_kv_cache_write(k_pool, v_pool, torch.cat([k_dense[b, :n] for b, n in enumerate(lens)]),
                                   torch.cat([v_dense[b, :n] for b, n in enumerate(lens)]), slots)
    q = torch.randn(sum(q_lens), heads, hd, generator=g)
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return q, k_dense, v_dense, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32), cu


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
