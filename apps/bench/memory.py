"""Memory-bound kernels: embed, rmsnorm, fused_add_rmsnorm, rope, rope_qk_norm, silu_mul, gelu_mul, argmax.

Every shape is (tokens, hidden). What the other dims are, per kernel:
- embed: table [32000, hidden], int64 ids [tokens] (one table per (hidden, dtype), shared by the input sets).
- rmsnorm, fused_add_rmsnorm: x (and residual) [tokens, hidden].
- silu_mul, gelu_mul (gelu_tanh_and_mul): x [tokens, 2 * hidden] -> [tokens, hidden] (hidden plays the
  intermediate size).
- rope: head_dim 128, heads = hidden / 128, kv_heads = heads / 4 (hidden 576: head_dim 64, 9 / 3 heads),
  full rotary, NeoX pairs; q and k are views into a fused qkv [tokens, (heads + 2 kv_heads) * head_dim];
  int64 positions (decode: random in [0, 32768); prefill: 0 .. tokens-1); cos_sin [32768, head_dim] fp32.
- rope_qk_norm (tokens, heads, kv_heads, head_dim): the engine's call for Qwen3 and Gemma 3: each q and k head
  RMSNorm'd, rotated as rope's, and k and v written to a paged cache of 65536 rows at distinct random slots.
- argmax (rows, vocab): greedy sampling over the lm_head's output [rows, vocab] in its dtype; ref = what the
  engine ran before it, the fp32 copy and torch.argmax over it.
The ref side is torch eager (minfer.ops.reference), with the host-synced range check of embedding replaced by
the plain torch expression so that it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from minfer.ops import reference as ref

from .common import Case

SHAPES = [(t, h) for h in (576, 2048, 4096) for t in (1, 8, 2048, 16384)]
VOCAB = 32000
MAX_POS = 32768
EPS = 1e-6


def _cuda():
    from minfer.ops import cuda
    return cuda


def _size(dtype):
    return torch.empty((), dtype=dtype).element_size()


def _randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


def _heads(hidden):  # (heads, kv_heads, head_dim)
    return (9, 3, 64) if hidden == 576 else (hidden // 128, hidden // 512, 128)


def _positions(tokens, high):
    if tokens == 1:
        return torch.randint(0, high, (1,), device="cuda")
    return torch.arange(tokens, device="cuda")


_shared = {}  # tensors reused across input sets: embedding tables, KV caches, cos_sin


def _once(key, make):
    if key not in _shared:
        _shared[key] = make()
    return _shared[key]


# ---- embed ----

def _embed_inputs(shape, dtype):
    tokens, hidden = shape
    weight = _once(("embed", hidden, dtype), lambda: _randn(VOCAB, hidden, dtype=dtype))
    return dict(ids=torch.randint(0, VOCAB, (tokens,), device="cuda"), weight=weight)


def _embed_ref(ids, weight):
    return weight[ids]


def _embed_bytes(shape, dtype):
    tokens, hidden = shape
    return 2 * tokens * hidden * _size(dtype) + tokens * 8  # rows read + written, ids


# ---- rmsnorm / fused_add_rmsnorm ----

def _norm_inputs(shape, dtype):
    tokens, hidden = shape
    return dict(x=_randn(tokens, hidden, dtype=dtype), weight=1 + 0.1 * _randn(hidden, dtype=dtype), eps=EPS)


def _fused_inputs(shape, dtype):
    d = _norm_inputs(shape, dtype)
    d["residual"] = _randn(*shape, dtype=dtype)
    return d


def _norm_bytes(shape, dtype):
    tokens, hidden = shape
    return (2 * tokens + 1) * hidden * _size(dtype)  # x read, out written, weight


def _fused_bytes(shape, dtype):
    tokens, hidden = shape
    return (4 * tokens + 1) * hidden * _size(dtype)  # x, residual read; x, residual written; weight


# ---- silu_mul, gelu_mul ----

def _act_mul_inputs(shape, dtype):
    tokens, inter = shape
    return dict(x=_randn(tokens, 2 * inter, dtype=dtype))


def _act_mul_bytes(shape, dtype):
    tokens, inter = shape
    return 3 * tokens * inter * _size(dtype)  # gate, up read; out written


# ---- rope ----

def _cos_sin(head_dim):
    def make():
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float32) / head_dim))
        angles = torch.arange(MAX_POS, device="cuda", dtype=torch.float32)[:, None] * inv_freq
        return torch.cat([angles.cos(), angles.sin()], dim=-1)  # [MAX_POS, head_dim]
    return _once(("cos_sin", head_dim), make)


def _rope_inputs(shape, dtype):
    tokens, hidden = shape
    heads, kv_heads, hd = _heads(hidden)
    qkv = _randn(tokens, (heads + 2 * kv_heads) * hd, dtype=dtype)
    q = qkv[:, :heads * hd].view(tokens, heads, hd)
    k = qkv[:, heads * hd:(heads + kv_heads) * hd].view(tokens, kv_heads, hd)
    return dict(q=q, k=k, positions=_positions(tokens, MAX_POS), cos_sin=_cos_sin(hd), is_neox=True)


def _rope_bytes(shape, dtype):
    tokens, hidden = shape
    heads, kv_heads, hd = _heads(hidden)
    # q, k read + written; one cos|sin row (fp32) and one position per token
    return 2 * tokens * (heads + kv_heads) * hd * _size(dtype) + tokens * (hd * 4 + 8)


# The heads of Gemma-3-4B (8 / 4, d 256), gemma-3-270m (4 / 1, d 256) and Qwen3-8B (32 / 8, d 128): decode
# rows and a prefill chunk.
QK_NORM_SHAPES = [(t, h, kvh, d) for h, kvh, d in ((8, 4, 256), (4, 1, 256), (32, 8, 128)) for t in (1, 16, 2048)]
CACHE_ROWS = 65536


def _rope_qk_norm_inputs(shape, dtype):
    tokens, heads, kv_heads, hd = shape
    qkv = _randn(tokens, (heads + 2 * kv_heads) * hd, dtype=dtype)  # [tokens, (heads + 2 kv_heads) hd]
    q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)

    def cache():  # pages of 16 rows, shared by the input sets
        return torch.zeros(CACHE_ROWS // 16, 16, kv_heads, hd, device="cuda", dtype=dtype)

    return dict(q=q.view(tokens, heads, hd), k=k.view(tokens, kv_heads, hd), positions=_positions(tokens, MAX_POS),
                cos_sin=_cos_sin(hd), is_neox=True, q_weight=1 + 0.1 * _randn(hd, dtype=dtype),
                k_weight=1 + 0.1 * _randn(hd, dtype=dtype), eps=EPS, v=v.view(tokens, kv_heads, hd),
                k_cache=_once(("k_cache", kv_heads, hd, dtype), cache),
                v_cache=_once(("v_cache", kv_heads, hd, dtype), cache),
                slot_mapping=torch.randperm(CACHE_ROWS, device="cuda")[:tokens])


def _rope_qk_norm_bytes(shape, dtype):
    tokens, heads, kv_heads, hd = shape
    # q, k read + written, v read, k and v written to the cache; a cos|sin row (fp32), a position and a slot per
    # token; the two norm weights
    return ((2 * (heads + kv_heads) + 3 * kv_heads) * tokens * hd * _size(dtype) + tokens * (hd * 4 + 16)
            + 2 * hd * _size(dtype))


# ---- argmax (greedy sampling) ----

# Decode rows over Llama-3's 128256 and Gemma 3's 262144 vocabularies.
ARGMAX_SHAPES = [(r, v) for v in (128256, 262144) for r in (1, 16, 64, 256)]


def _argmax_inputs(shape, dtype):
    return dict(logits=_randn(*shape, dtype=dtype))


def _argmax_bytes(shape, dtype):
    rows, vocab = shape
    return rows * vocab * _size(dtype) + rows * 8


DRAW_SHAPES = [(r, v) for v in (49152, 128256) for r in (1, 16, 64, 256)]


def _draw_inputs(shape, dtype):
    rows, vocab = shape
    return dict(logits=_randn(rows, vocab, dtype=dtype), seeds=torch.randint(0, 2**62, (rows,), device="cuda"),
                positions=torch.randint(0, 1 << 20, (rows,), device="cuda"),
                temperature=torch.rand(rows, device="cuda") + 0.5)


def _draw_bytes(shape, dtype):
    rows, vocab = shape
    return rows * vocab * _size(dtype) + rows * 28  # logits; seeds, positions, temperature read, ids written


def _filtered_inputs(shape, dtype):
    rows = shape[0]
    d = _draw_inputs(shape, dtype)
    d.update(top_k=torch.randint(20, 200, (rows,), device="cuda"), top_p=torch.rand(rows, device="cuda") * 0.5 + 0.45,
             min_p=torch.rand(rows, device="cuda") * 0.05)
    return d


def _bitmask_inputs(shape, dtype):
    rows, vocab = shape
    words = torch.randint(-2**31, 2**31, (rows, -(-vocab // 32)), device="cuda", dtype=torch.int64)
    return dict(logits=_randn(rows, vocab, dtype=torch.float32), bitmask=words.to(torch.int32))


def _bitmask_bytes(shape, dtype):
    rows, vocab = shape
    return rows * vocab * 4 * 2 + rows * -(-vocab // 32) * 4  # fp32 logits read and written (its floor), the mask


CASES = {
    "embed": Case(SHAPES, _embed_inputs, _embed_ref, lambda **kw: _cuda().embedding(**kw), _embed_bytes,
                  shape_names="tokens x hidden"),
    "rmsnorm": Case(SHAPES, _norm_inputs, ref.rms_norm, lambda **kw: _cuda().rms_norm(**kw), _norm_bytes,
                    shape_names="tokens x hidden"),
    "fused_add_rmsnorm": Case(SHAPES, _fused_inputs, ref.fused_add_rms_norm,
                              lambda **kw: _cuda().fused_add_rms_norm(**kw), _fused_bytes,
                              shape_names="tokens x hidden"),
    "rope": Case(SHAPES, _rope_inputs, ref.rope, lambda **kw: _cuda().rope(**kw), _rope_bytes,
                 shape_names="tokens x hidden (heads = hidden/128, kv = heads/4, hd 128; 576: 9/3 x 64)"),
    "rope_qk_norm": Case(QK_NORM_SHAPES, _rope_qk_norm_inputs, ref.rope, lambda **kw: _cuda().rope(**kw),
                         _rope_qk_norm_bytes, shape_names="tokens x heads x kv_heads x head_dim"),
    "silu_mul": Case(SHAPES, _act_mul_inputs, ref.silu_and_mul, lambda **kw: _cuda().silu_and_mul(**kw),
                     _act_mul_bytes, shape_names="tokens x inter (x = [tokens, 2 inter])"),
    "gelu_mul": Case(SHAPES, _act_mul_inputs, ref.gelu_tanh_and_mul, lambda **kw: _cuda().gelu_tanh_and_mul(**kw),
                     _act_mul_bytes, shape_names="tokens x inter (x = [tokens, 2 inter])"),
    "argmax": Case(ARGMAX_SHAPES, _argmax_inputs, lambda logits: logits.float().argmax(-1),
                   lambda **kw: _cuda().argmax(**kw), _argmax_bytes, shape_names="rows x vocab"),
    # the random draw (logits / temperature + Gumbel noise, argmax) against the reference's torch ops
    "gumbel_argmax": Case(DRAW_SHAPES, _draw_inputs, ref.gumbel_argmax, lambda **kw: _cuda().gumbel_argmax(**kw),
                          _draw_bytes, shape_names="rows x vocab"),
    # the draw after each row's top-k, min-p and top-p (all three on) against the reference's sort-based filters
    "draw_filtered": Case(DRAW_SHAPES, _filtered_inputs, ref.draw_filtered, lambda **kw: _cuda().draw_filtered(**kw),
                          _draw_bytes, shape_names="rows x vocab"),
    # structured outputs' packed masks, in place on fp32 logits, against the reference's unpack and masked_fill
    "token_bitmask": Case(DRAW_SHAPES, _bitmask_inputs, ref.apply_token_bitmask,
                          lambda **kw: _cuda().apply_token_bitmask(**kw), _bitmask_bytes, shape_names="rows x vocab",
                          dtypes=(torch.float32,)),
}
