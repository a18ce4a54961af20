"""The baseline kernels' API, kept apart from the engine's ops (ops/__init__.py's MODEL_OPS): naive, tiled
and flash attention on [batch, heads, seq, head_dim], gemm, tensor_core_gemm and gemm_int8. The model
never calls them; they stay exposed, tested and benchmarked as baselines (kernels in csrc/baselines/).

Each op has a CUDA wrapper over torch.ops.minfer.<op>, its fake (meta) implementation for torch.compile
and opcheck, registered when the extension is built, and a plain-torch reference (`*_reference`, fp32
math, any device) with the same semantics.
"""
from __future__ import annotations

import math

import torch

try:
    import minfer._C  # noqa: F401  registers torch.ops.minfer
except ImportError:  # the extension is not built: the references still work
    _BUILT = False
else:
    _BUILT = True


# ---- fake implementations: shapes and dtypes only ----

if _BUILT:
    @torch.library.register_fake("minfer::gemm")
    def _gemm_fake(a, b, alpha=1.0, beta=0.0, c=None, trans_a=False, trans_b=False, path="auto"):
        m = a.shape[1] if trans_a else a.shape[0]
        n = b.shape[0] if trans_b else b.shape[1]
        return a.new_empty((m, n))

    @torch.library.register_fake("minfer::tensor_core_gemm")
    def _tensor_core_gemm_fake(a, b):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)

    @torch.library.register_fake("minfer::gemm_int8")
    def _gemm_int8_fake(a, b):
        return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.int32)

    def _attention_fake(q, k, v, scale=None, is_causal=False):
        return q.new_empty(q.shape)  # [batch, heads, seq_q, head_dim], contiguous

    for _name in ("naive_attention", "tiled_attention", "flash_attention"):
        torch.library.register_fake(f"minfer::{_name}")(_attention_fake)


# ---- CUDA wrappers ----
# gemm's op takes one more trailing argument, path = auto | wmma | sm80 | sm90 | gemv | simt.

def gemm(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, c: torch.Tensor | None = None,
         trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    # alpha * op(A) @ op(B) + beta * C; A [M, K] (or [K, M] if trans_a), B [K, N] (or [N, K] if trans_b);
    # C broadcastable to [M, N]
    return torch.ops.minfer.gemm(a, b, alpha, beta, c, trans_a, trans_b)


def tensor_core_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # fp16 A [M, K] @ B [K, N] -> fp32 [M, N] (WMMA)
    return torch.ops.minfer.tensor_core_gemm(a, b)


def gemm_int8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # int8 A [M, K] @ int8 B [K, N] -> int32 [M, N], exact
    return torch.ops.minfer.gemm_int8(a, b)


def naive_attention(q, k, v, scale=None, is_causal=False):
    # q [batch, heads, seq_q, head_dim], k, v [batch, kv_heads, seq_k, head_dim]; causal is bottom-right
    return torch.ops.minfer.naive_attention(q, k, v, scale, is_causal)


def tiled_attention(q, k, v, scale=None, is_causal=False):
    return torch.ops.minfer.tiled_attention(q, k, v, scale, is_causal)


def flash_attention(q, k, v, scale=None, is_causal=False):
    # fp16/bf16 with head_dim 64/128/256 run on tensor cores; fp32 and other head dims on the tiled kernel.
    return torch.ops.minfer.flash_attention(q, k, v, scale, is_causal)


# ---- torch references ----

def gemm_reference(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 0.0,
                   c: torch.Tensor | None = None, trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    a32 = a.float().t() if trans_a else a.float()
    b32 = b.float().t() if trans_b else b.float()
    y = alpha * (a32 @ b32)
    if c is not None and beta != 0.0:
        y = y + beta * c.float()
    return y.to(a.dtype)


def tensor_core_gemm_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.float() @ b.float()


def gemm_int8_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # exact: int64 on the CPU, fp64 (exact for these sums) elsewhere
    return (a.long() @ b.long()).to(torch.int32) if a.device.type == "cpu" else \
        (a.double() @ b.double()).round().to(torch.int32)


def attention_reference(q, k, v, scale=None, is_causal=False):
    # naive/tiled/flash_attention's semantics with k, v already at q's head count:
    # q [batch, heads, seq_q, head_dim], k, v [batch, heads, seq_k, head_dim]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if is_causal:  # bottom-right aligned, as for queries that are the last seq_q of seq_k
        sq, sk = q.shape[-2], k.shape[-2]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    return (s.softmax(-1) @ v.float()).to(q.dtype)
