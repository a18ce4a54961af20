"""The reference backend's paged ops against its dense ones: the same keys scattered over shuffled pages
give the same attention, for prefill chunks at any start and decodes mixed in one call."""
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
def test_paged_equals_dense(q_lens, starts):
    q, k_dense, v_dense, k_pool, v_pool, table, lens, cu = case(q_lens, starts)
    scale = 0.25
    out = reference.paged_attention(q, k_pool, v_pool, table, lens, cu, max(q_lens), int(lens.max()), scale)
    assert out.shape == q.shape and not out.isnan().any()
    for b, (n, s) in enumerate(zip(q_lens, starts)):
        qb = q[cu[b]:cu[b + 1]][None]  # [1, n, heads, hd]
        want = reference.attention(qb, k_dense[b:b + 1], v_dense[b:b + 1], torch.tensor([s]), scale)[0]
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], want)


def test_kv_write_lands_in_its_slot():
    pool = torch.zeros(3, PAGE, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    reference.paged_kv_cache_write(pool, pool.clone(), k, k, torch.tensor([11, 0, 5]))
    assert pool[2, 3].tolist() == [[0.0, 1.0]] and pool[0, 0].tolist() == [[2.0, 3.0]]
    assert pool[1, 1].tolist() == [[4.0, 5.0]] and pool.abs().sum() == 15
