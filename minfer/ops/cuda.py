"""The cuda backend: thin Python wrappers over torch.ops.minfer.*, plus their fake (meta)
implementations so that the ops work under torch.compile, opcheck and CUDA graph capture.

An op appears here only when its kernel exists; ops/__init__.py falls back to ref for the rest.
"""
from __future__ import annotations

import torch

import minfer._C  # noqa: F401  registers torch.ops.minfer

from . import reference

_ops = torch.ops.minfer


# ---- fake implementations: shapes and dtypes only ----

@torch.library.register_fake("minfer::embedding")
def _embedding_fake(ids, weight):
    return weight.new_empty((*ids.shape, weight.shape[1]))


# ---- the ops the model calls ----

def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Rows of out-of-range ids come back as NaN (the kernel never reads outside the table).
    return _ops.embedding(ids.contiguous(), weight)


# ---- attention family (csrc/attention/) ----

@torch.library.register_fake("minfer::attention")
def _attention_fake(q, k_cache, v_cache, start_pos, scale):
    return q.new_empty(q.shape)  # [batch, seq, heads, head_dim], contiguous


def _seed_attention_fake(q, k, v, scale=None, is_causal=False):
    return q.new_empty(q.shape)  # [batch, heads, seq_q, head_dim], contiguous


for _name in ("naive_attention", "tiled_attention", "flash_attention"):
    torch.library.register_fake(f"minfer::{_name}")(_seed_attention_fake)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start_pos: torch.Tensor,
              scale: float) -> torch.Tensor:
    # q [batch, seq, heads, head_dim] (a strided view into the fused qkv is fine); caches
    # [batch, capacity, kv_heads, head_dim]; start_pos [batch] int32 on the device.
    # seq > 1: flash prefill; seq == 1: split-KV decode. fp32 has no kernel (the engine runs fp16/bf16
    # on GPU) and runs on the reference instead.
    if q.dtype == torch.float32:
        return reference.attention(q, k_cache, v_cache, start_pos, scale)
    return _ops.attention(q, k_cache, v_cache, start_pos, float(scale))


def naive_attention(q, k, v, scale=None, is_causal=False):
    return _ops.naive_attention(q, k, v, scale, is_causal)


def tiled_attention(q, k, v, scale=None, is_causal=False):
    return _ops.tiled_attention(q, k, v, scale, is_causal)


def flash_attention(q, k, v, scale=None, is_causal=False):
    # fp16/bf16 with head_dim 64/128 run on tensor cores; fp32 and other head dims on the tiled kernel.
    return _ops.flash_attention(q, k, v, scale, is_causal)
