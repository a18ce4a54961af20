"""Attention benchmarks: the engine op (flash prefill, split-KV decode) and the seed kernels.

attention_prefill (batch, seq, heads, kv_heads, head_dim, causal): causal rows time the engine op
    (queries at positions 0..seq-1 over a cache of exactly seq slots); the engine op is always causal,
    so non-causal rows time the same tensor-core kernel through the seed flash_attention (strided views,
    no copies). ref: SDPA on contiguous [batch, heads, seq, head_dim] with K/V expanded to all heads
    beforehand (untimed), is_causal as the row says.
attention_decode (batch, context, heads, kv_heads, head_dim): one query per sequence at position
    context-1; bytes = K + V read. ref: SDPA (enable_gqa) over the cache slice [:, :context].
attention_decode_paged (batch, context, heads, kv_heads, head_dim): the same decode through a block table
    over shuffled 16-key pages (the continuous engine's cache); ref: our dense-cache decode on the same keys,
    so the ratio is paged / dense.
naive/tiled/flash_attention (batch, heads, seq, head_dim, causal): the seed API (minfer/ops/baselines.py);
    ref: SDPA.
"""
from __future__ import annotations

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

def _prefill_inputs(shape, dtype):
    b, s, h, kvh, d, causal = shape
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)        # [batch, seq, heads, head_dim]
    k = torch.randn(b, s, kvh, d, device="cuda", dtype=dtype)      # [batch, capacity = seq, kv_heads, head_dim]
    v = torch.randn(b, s, kvh, d, device="cuda", dtype=dtype)
    g = h // kvh
    return dict(q=q, k=k, v=v, start=torch.zeros(b, device="cuda", dtype=torch.int32), causal=bool(causal),
                q_ref=q.transpose(1, 2).contiguous(),                           # [batch, heads, seq, head_dim]
                k_ref=k.transpose(1, 2).repeat_interleave(g, 1).contiguous(),
                v_ref=v.transpose(1, 2).repeat_interleave(g, 1).contiguous())


def _prefill_ref(q, k, v, start, causal, q_ref, k_ref, v_ref):
    return F.scaled_dot_product_attention(q_ref, k_ref, v_ref, is_causal=causal)


def _prefill_minfer(q, k, v, start, causal, q_ref, k_ref, v_ref):
    if causal:
        return _ops().attention(q, k, v, start, 1.0 / math.sqrt(q.shape[-1]))
    return _baselines().flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def _prefill_bytes(shape, dtype):
    b, s, h, kvh, d, _ = shape
    return (2 * b * s * h * d + 2 * b * s * kvh * d) * dtype.itemsize  # q + out + k + v


def _prefill_flops(shape):
    b, s, h, _, d, causal = shape
    return _attn_flops(b, h, s, s, d, causal)


# ---- decode ----

def _decode_inputs(shape, dtype):
    b, ctx, h, kvh, d = shape
    return dict(q=torch.randn(b, 1, h, d, device="cuda", dtype=dtype),
                k=torch.randn(b, ctx, kvh, d, device="cuda", dtype=dtype),  # cache with capacity = context
                v=torch.randn(b, ctx, kvh, d, device="cuda", dtype=dtype),
                start=torch.full((b,), ctx - 1, device="cuda", dtype=torch.int32))


def _decode_ref(q, k, v, start):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)


def _decode_minfer(q, k, v, start):
    # As the engine calls it: nothing here writes start or the caches, so the promise holds.
    return _ops().attention(q, k, v, start, 1.0 / math.sqrt(q.shape[-1]), stable_prefix=True)


def _decode_bytes(shape, dtype):
    b, ctx, _, kvh, d = shape
    return 2 * b * ctx * kvh * d * dtype.itemsize


PAGE = 16


def _to_pages(c, table):
    """c [batch, ctx, kv_heads, d] -> a pool [batch * pages, PAGE, kv_heads, d] where page table[i, j] holds
    keys j * PAGE .. of sequence i."""
    b, ctx, kvh, d = c.shape
    padded = F.pad(c, (0, 0, 0, 0, 0, table.shape[1] * PAGE - ctx)).view(-1, PAGE, kvh, d)
    pool = torch.empty_like(padded)
    pool[table.flatten().long()] = padded
    return pool


def _paged_inputs(shape, dtype):
    b, ctx, h, kvh, d = shape
    dense = _decode_inputs(shape, dtype)
    per_seq = -(-ctx // PAGE)
    table = torch.randperm(b * per_seq, device="cuda").to(torch.int32).view(b, per_seq)  # shuffled pages
    return dict(dense, k_pages=_to_pages(dense["k"], table), v_pages=_to_pages(dense["v"], table), table=table,
                lens=torch.full((b,), ctx, device="cuda", dtype=torch.int32),
                cu=torch.arange(b + 1, device="cuda", dtype=torch.int32))


def _paged_dense(q, k, v, start, k_pages, v_pages, table, lens, cu):
    return _decode_minfer(q, k, v, start)


def _paged_minfer(q, k, v, start, k_pages, v_pages, table, lens, cu):
    # As the engine's decode step calls it (stable_prefix); max_seqlen_k the longest sequence.
    return _ops().paged_attention(q[:, 0], k_pages, v_pages, table, lens, cu, 1, k.shape[1],
                                  1.0 / math.sqrt(q.shape[-1]), stable_prefix=True)


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
                (1, 16384, 32, 8, 64, 1), (4, 4096, 32, 8, 128, 0), (4, 4096, 32, 8, 64, 0)],
        make_inputs=_prefill_inputs, ref=_prefill_ref, minfer=_prefill_minfer, bytes=_prefill_bytes,
        flops=_prefill_flops, shape_names="batch x seq x heads x kv_heads x head_dim x causal"),
    "attention_decode": Case(
        shapes=[(1, 1024, 32, 8, 128), (1, 4096, 32, 8, 128), (1, 16384, 32, 8, 128), (1, 32768, 32, 8, 128),
                (2, 4096, 32, 8, 128), (4, 4096, 32, 8, 128),  # a few sequences: 8 / 4 splits each
                (16, 1024, 32, 8, 128), (16, 4096, 32, 8, 128), (16, 16384, 32, 8, 128), (16, 32768, 32, 8, 128),
                (64, 1024, 32, 8, 128), (64, 4096, 32, 8, 128), (64, 16384, 32, 8, 128), (64, 32768, 32, 8, 128),
                (1, 4096, 32, 8, 64), (16, 4096, 32, 8, 64),
                # the default model's heads (SmolLM2-135M: 9 q / 3 kv, d 64) at chat-sized contexts
                (1, 256, 9, 3, 64), (1, 2048, 9, 3, 64),
                # 16 q heads per kv head: big partials, the spread merge
                (1, 4096, 32, 2, 128), (1, 32768, 32, 2, 128)],
        make_inputs=_decode_inputs, ref=_decode_ref, minfer=_decode_minfer, bytes=_decode_bytes,
        shape_names="batch x context x heads x kv_heads x head_dim"),
    "attention_decode_paged": Case(
        shapes=[(b, ctx, 32, 8, 128) for b in (1, 16, 64) for ctx in (1024, 4096, 16384)] +
               [(1, 2048, 9, 3, 64), (64, 1024, 9, 3, 64)],
        make_inputs=_paged_inputs, ref=_paged_dense, minfer=_paged_minfer, bytes=_decode_bytes,
        shape_names="batch x context x heads x kv_heads x head_dim"),
    "naive_attention": _seed_case([(1, 8, 1024, 64, 0), (1, 8, 2048, 64, 0), (1, 8, 2048, 64, 1)], "naive_attention"),
    "tiled_attention": _seed_case([(1, 8, 1024, 64, 0), (1, 8, 2048, 64, 0), (1, 8, 2048, 64, 1)], "tiled_attention"),
    "flash_attention": _seed_case([(4, 32, 4096, 128, 0), (4, 32, 4096, 128, 1), (4, 32, 4096, 64, 0),
                                   (4, 32, 4096, 64, 1)], "flash_attention"),
}
