"""Attention benchmarks: the engine op (flash prefill, split-KV decode) and the seed kernels.

attention_prefill (batch, seq, heads, kv_heads, head_dim, causal[, window]): causal rows time the engine op
    (queries at positions 0..seq-1 over a cache of exactly seq slots); the engine op is always causal,
    so non-causal rows time the same tensor-core kernel through the seed flash_attention (strided views,
    no copies). ref: SDPA on contiguous [batch, heads, seq, head_dim] with K/V expanded to all heads
    beforehand (untimed), is_causal as the row says. window w > 0 (causal rows only): a query at p sees keys
    p - w < key <= p; ours gets window=w, SDPA a boolean mask of that band (it takes no is_causal with a
    mask), and FLOPs count only the keys each query sees.
attention_decode (batch, context, heads, kv_heads, head_dim[, window]): one query per sequence at position
    context-1, with a sliding window of `window` keys (0 or absent: none); bytes = K + V read (the window's
    keys only). ref: SDPA (enable_gqa) over the cache slice [:, :context], or with a window over the slice
    of the window's keys [:, context - window:context] (no mask: the same keys read as ours).
attention_decode_paged (batch, context, heads, kv_heads, head_dim[, window]): the same decode through a block
    table over shuffled pages of PAGE keys (the continuous engine's cache; benchmark.py --block-size); ref: our
    dense-cache decode on the same keys, so the ratio is paged / dense.
attention_chunk_paged (chunk, context, heads, kv_heads, head_dim): one prompt's chunk of `chunk` queries at
    positions context - chunk .. context - 1 over shuffled pages of PAGE keys, as the continuous engine prefills a
    long prompt beside decodes; ref: SDPA on the same keys (dense, expanded to all heads beforehand, untimed)
    with the chunk's causal band as a boolean mask. FLOPs count the keys each query sees.
naive/tiled/flash_attention (batch, heads, seq, head_dim, causal): the baselines (minfer/ops/baselines.py);
    ref: SDPA.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .common import Case


def _ops():
    from minfer.ops import cuda
    return cuda


def _baselines():
    from minfer.ops import baselines
    return baselines


def _attn_flops(b, h, sq, sk, d, causal):
    f = 4 * b * h * sq * sk * d
    return f // 2 if causal else f


# ---- prefill ----

def _prefill_window(shape):
    return shape[6] if len(shape) > 6 else 0  # 0: no window


@functools.lru_cache(maxsize=2)  # one mask for all of a shape's input sets (32k x 32k is 1 GiB)
def _window_mask(s, w):
    q_pos = torch.arange(s, device="cuda")[:, None]
    key = torch.arange(s, device="cuda")[None, :]
    return (key <= q_pos) & (key > q_pos - w)  # [seq, seq] bool: the causal band of width w


def _prefill_inputs(shape, dtype):
    b, s, h, kvh, d, causal = shape[:6]
    w = _prefill_window(shape)
    assert causal or not w, "attention_prefill: a window needs a causal row"
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)        # [batch, seq, heads, head_dim]
    k = torch.randn(b, s, kvh, d, device="cuda", dtype=dtype)      # [batch, capacity = seq, kv_heads, head_dim]
    v = torch.randn(b, s, kvh, d, device="cuda", dtype=dtype)
    g = h // kvh
    return dict(q=q, k=k, v=v, start=torch.zeros(b, device="cuda", dtype=torch.int32), causal=bool(causal),
                window=w, mask=_window_mask(s, w) if w else None,
                q_ref=q.transpose(1, 2).contiguous(),                           # [batch, heads, seq, head_dim]
                k_ref=k.transpose(1, 2).repeat_interleave(g, 1).contiguous(),
                v_ref=v.transpose(1, 2).repeat_interleave(g, 1).contiguous())


def _prefill_ref(q, k, v, start, causal, window, mask, q_ref, k_ref, v_ref):
    if window:
        return F.scaled_dot_product_attention(q_ref, k_ref, v_ref, attn_mask=mask)
    return F.scaled_dot_product_attention(q_ref, k_ref, v_ref, is_causal=causal)


def _prefill_minfer(q, k, v, start, causal, window, mask, q_ref, k_ref, v_ref):
    if causal:
        return _ops().attention(q, k, v, start, 1.0 / math.sqrt(q.shape[-1]), window=window or None)
    return _baselines().flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def _prefill_bytes(shape, dtype):
    b, s, h, kvh, d, _ = shape[:6]
    return (2 * b * s * h * d + 2 * b * s * kvh * d) * dtype.itemsize  # q + out + k + v


def _prefill_flops(shape):
    b, s, h, _, d, causal = shape[:6]
    w = _prefill_window(shape)
    if not w:
        return _attn_flops(b, h, s, s, d, causal)
    n = min(s, w)
    seen = n * (n + 1) // 2 + (s - n) * w  # query p sees min(p + 1, w) keys
    return 4 * b * h * seen * d


# ---- decode ----

def _window(shape):
    return shape[5] if len(shape) > 5 else 0  # 0: no window


def _decode_inputs(shape, dtype):
    b, ctx, h, kvh, d = shape[:5]
    return dict(q=torch.randn(b, 1, h, d, device="cuda", dtype=dtype),
                k=torch.randn(b, ctx, kvh, d, device="cuda", dtype=dtype),  # cache with capacity = context
                v=torch.randn(b, ctx, kvh, d, device="cuda", dtype=dtype),
                start=torch.full((b,), ctx - 1, device="cuda", dtype=torch.int32), window=_window(shape))


def _decode_ref(q, k, v, start, window):
    first = max(0, k.shape[1] - window) if window else 0  # every sequence is at the cache's last slot
    k, v = k[:, first:], v[:, first:]  # [batch, keys, kv_heads, head_dim] views: the keys the query sees
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)


def _decode_minfer(q, k, v, start, window):
    # As the engine calls it: nothing here writes start or the caches, so the promise holds.
    return _ops().attention(q, k, v, start, 1.0 / math.sqrt(q.shape[-1]), stable_prefix=True, window=window or None)


def _decode_bytes(shape, dtype):
    b, ctx, _, kvh, d = shape[:5]
    keys = min(ctx, _window(shape) or ctx)
    return 2 * b * keys * kvh * d * dtype.itemsize


PAGE = 16  # keys a page (benchmark.py --block-size; the engine's default)


def _to_pages(c, table):
    """c [batch, ctx, kv_heads, d] -> a pool [batch * pages, PAGE, kv_heads, d] where page table[i, j] holds
    keys j * PAGE .. of sequence i."""
    b, ctx, kvh, d = c.shape
    padded = F.pad(c, (0, 0, 0, 0, 0, table.shape[1] * PAGE - ctx)).view(-1, PAGE, kvh, d)
    pool = torch.empty_like(padded)
    pool[table.flatten().long()] = padded
    return pool


def _paged_inputs(shape, dtype):
    b, ctx, h, kvh, d = shape[:5]
    dense = _decode_inputs(shape, dtype)
    per_seq = -(-ctx // PAGE)
    table = torch.randperm(b * per_seq, device="cuda").to(torch.int32).view(b, per_seq)  # shuffled pages
    return dict(dense, k_pages=_to_pages(dense["k"], table), v_pages=_to_pages(dense["v"], table), table=table,
                lens=torch.full((b,), ctx, device="cuda", dtype=torch.int32),
                cu=torch.arange(b + 1, device="cuda", dtype=torch.int32))


def _paged_dense(q, k, v, start, window, k_pages, v_pages, table, lens, cu):
    return _decode_minfer(q, k, v, start, window)


def _paged_minfer(q, k, v, start, window, k_pages, v_pages, table, lens, cu):
    # As the engine's decode step calls it (stable_prefix); max_seqlen_k the longest sequence.
    return _ops().paged_attention(q[:, 0], k_pages, v_pages, table, lens, cu, 1, k.shape[1],
                                  1.0 / math.sqrt(q.shape[-1]), window=window or None, stable_prefix=True)


# ---- a prompt chunk over a long paged context ----

def _chunk_inputs(shape, dtype):
    c, ctx, h, kvh, d = shape
    q = torch.randn(c, h, d, device="cuda", dtype=dtype)        # [chunk, heads, head_dim]
    k = torch.randn(1, ctx, kvh, d, device="cuda", dtype=dtype)  # [1, context, kv_heads, head_dim]
    v = torch.randn(1, ctx, kvh, d, device="cuda", dtype=dtype)
    table = torch.randperm(-(-ctx // PAGE), device="cuda").to(torch.int32)[None]  # [1, pages], shuffled
    pos = torch.arange(ctx - c, ctx, device="cuda")[:, None]
    g = h // kvh
    return dict(q=q, k_pages=_to_pages(k, table), v_pages=_to_pages(v, table), table=table,
                lens=torch.full((1,), ctx, device="cuda", dtype=torch.int32),
                cu=torch.tensor([0, c], device="cuda", dtype=torch.int32),
                mask=torch.arange(ctx, device="cuda")[None] <= pos,               # [chunk, context] bool
                k_ref=k.transpose(1, 2).repeat_interleave(g, 1).contiguous(),     # [1, heads, context, head_dim]
                v_ref=v.transpose(1, 2).repeat_interleave(g, 1).contiguous())


def _chunk_ref(q, k_pages, v_pages, table, lens, cu, mask, k_ref, v_ref):
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_ref, v_ref, attn_mask=mask)


def _chunk_minfer(q, k_pages, v_pages, table, lens, cu, mask, k_ref, v_ref):
    return _ops().paged_attention(q, k_pages, v_pages, table, lens, cu, q.shape[0], k_ref.shape[2],
                                  1.0 / math.sqrt(q.shape[-1]))


def _chunk_bytes(shape, dtype):
    c, ctx, h, kvh, d = shape
    return (2 * c * h * d + 2 * ctx * kvh * d) * dtype.itemsize  # q + out + k + v


def _chunk_flops(shape):
    c, ctx, h, _, d = shape
    return 4 * h * d * (c * (ctx - c) + c * (c + 1) // 2)  # query i of the chunk sees ctx - c + i + 1 keys


# ---- seed kernels ----

def _seed_inputs(shape, dtype):
    b, h, s, d, causal = shape
    mk = lambda: torch.randn(b, h, s, d, device="cuda", dtype=dtype)  # noqa: E731  [batch, heads, seq, head_dim]
    return dict(q=mk(), k=mk(), v=mk(), causal=bool(causal))


def _seed_ref(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _seed(name):
    return lambda q, k, v, causal: getattr(_baselines(), name)(q, k, v, is_causal=causal)


def _seed_bytes(shape, dtype):
    b, h, s, d, _ = shape
    return 4 * b * h * s * d * dtype.itemsize


def _seed_flops(shape):
    b, h, s, d, causal = shape
    return _attn_flops(b, h, s, s, d, causal)


def _seed_case(shapes, name):
    return Case(shapes=shapes, make_inputs=_seed_inputs, ref=_seed_ref, minfer=_seed(name), bytes=_seed_bytes,
                flops=_seed_flops, shape_names="batch x heads x seq x head_dim x causal")


CASES = {
    "attention_prefill": Case(
        shapes=[(4, 4096, 32, 8, 128, 1), (1, 16384, 32, 8, 128, 1), (4, 4096, 32, 8, 64, 1),
                (1, 16384, 32, 8, 64, 1), (4, 4096, 32, 8, 128, 0), (4, 4096, 32, 8, 64, 0),
                # head_dim 256 (Gemma-like heads), full causal, and one non-causal row
                (1, 4096, 4, 1, 256, 1), (1, 16384, 4, 1, 256, 1), (1, 4096, 8, 4, 256, 1), (1, 16384, 8, 4, 256, 1),
                (1, 4096, 8, 4, 256, 0),
                (1, 32768, 8, 4, 256, 1), (1, 32768, 32, 8, 128, 1),  # the 32k windows' unwindowed twins
                # sliding windows: against SDPA with the band as a mask, and against the rows above
                *[(1, s, h, kvh, d, 1, w) for h, kvh, d in ((8, 4, 256), (32, 8, 128))
                  for w in (512, 1024) for s in (8192, 32768)]],
        make_inputs=_prefill_inputs, ref=_prefill_ref, minfer=_prefill_minfer, bytes=_prefill_bytes,
        flops=_prefill_flops, shape_names="batch x seq x heads x kv_heads x head_dim x causal [x window]"),
    "attention_decode": Case(
        shapes=[(1, 1024, 32, 8, 128), (1, 4096, 32, 8, 128), (1, 16384, 32, 8, 128), (1, 32768, 32, 8, 128),
                (2, 4096, 32, 8, 128), (4, 4096, 32, 8, 128),  # a few sequences: 8 / 4 splits each
                (16, 1024, 32, 8, 128), (16, 4096, 32, 8, 128), (16, 16384, 32, 8, 128), (16, 32768, 32, 8, 128),
                (64, 1024, 32, 8, 128), (64, 4096, 32, 8, 128), (64, 16384, 32, 8, 128), (64, 32768, 32, 8, 128),
                (1, 4096, 32, 8, 64), (16, 4096, 32, 8, 64),
                # the default model's heads (SmolLM2-135M: 9 q / 3 kv, d 64) at chat-sized contexts
                (1, 256, 9, 3, 64), (1, 2048, 9, 3, 64),
                # 16 q heads per kv head: big partials, the spread merge
                (1, 4096, 32, 2, 128), (1, 32768, 32, 2, 128),
                # head_dim 256 (Gemma 3: 4 q / 1 kv heads in the 270m, 8 q / 4 kv in the 4b), without and with a
                # sliding window (512 keys: the 270m's; 4096: Gemma 2's, Mistral's), at chat and long contexts
                (1, 4096, 4, 1, 256), (16, 4096, 8, 4, 256), (1, 32768, 8, 4, 256)] +
               [(b, ctx, h, kvh, 256, w) for h, kvh in ((4, 1), (8, 4)) for w in (512, 4096) for ctx in (8192, 32768)
                for b in (1, 16)] +
               [(1, 32768, 32, 8, 128, 4096), (16, 32768, 32, 8, 128, 4096)],
        make_inputs=_decode_inputs, ref=_decode_ref, minfer=_decode_minfer, bytes=_decode_bytes,
        shape_names="batch x context x heads x kv_heads x head_dim [x window]"),
    "attention_decode_paged": Case(
        shapes=[(b, ctx, 32, 8, 128) for b in (1, 16, 64) for ctx in (1024, 4096, 16384)] +
               [(1, 2048, 9, 3, 64), (64, 1024, 9, 3, 64)] +
               [(16, 4096, 8, 4, 256), (1, 32768, 8, 4, 256, 4096), (16, 8192, 8, 4, 256, 512),
                (16, 32768, 4, 1, 256, 512)],
        make_inputs=_paged_inputs, ref=_paged_dense, minfer=_paged_minfer, bytes=_decode_bytes,
        shape_names="batch x context x heads x kv_heads x head_dim [x window]"),
    "attention_chunk_paged": Case(
        # Llama-3.2-1B heads (32 q / 8 kv, d 64) and Llama-3-8B's (d 128): the engine's chunks beside decodes
        shapes=[(c, ctx, 32, 8, d) for d in (64, 128) for c in (32, 64, 128) for ctx in (4096, 16384, 32768)],
        make_inputs=_chunk_inputs, ref=_chunk_ref, minfer=_chunk_minfer, bytes=_chunk_bytes, flops=_chunk_flops,
        shape_names="chunk x context x heads x kv_heads x head_dim"),
    "naive_attention": _seed_case([(1, 8, 1024, 64, 0), (1, 8, 2048, 64, 0), (1, 8, 2048, 64, 1)], "naive_attention"),
    "tiled_attention": _seed_case([(1, 8, 1024, 64, 0), (1, 8, 2048, 64, 0), (1, 8, 2048, 64, 1)], "tiled_attention"),
    "flash_attention": _seed_case([(4, 32, 4096, 128, 0), (4, 32, 4096, 128, 1), (4, 32, 4096, 64, 0),
                                   (4, 32, 4096, 64, 1)], "flash_attention"),
}
