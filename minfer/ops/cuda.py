"""The cuda backend: thin Python wrappers over torch.ops.minfer.*, plus their fake (meta)
implementations so that the ops work under torch.compile, opcheck and CUDA graph capture.

An op appears here only when its kernel exists; ops/__init__.py falls back to ref for the rest.
"""
from __future__ import annotations

import torch

import minfer._C  # noqa: F401  registers torch.ops.minfer

_ops = torch.ops.minfer


# ---- fake implementations: shapes and dtypes only ----

@torch.library.register_fake("minfer::embedding")
def _embedding_fake(ids, weight):
    return weight.new_empty((*ids.shape, weight.shape[1]))


# ---- the ops the model calls ----

def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Rows of out-of-range ids come back as NaN (the kernel never reads outside the table).
    return _ops.embedding(ids.contiguous(), weight)


# ---- gemm family (csrc/gemm/) ----
# Extra trailing argument on the ops (not on the wrappers): path = auto | wmma | sm80 | sm90 | gemv | simt.

@torch.library.register_fake("minfer::linear")
def _linear_fake(x, w, bias=None, path="auto"):
    return x.new_empty((x.shape[0], w.shape[0]))


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x [tokens, in] (last dim contiguous), weight [out, in], bias [out] -> [tokens, out]
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _ops.linear(x, weight, bias)


def gemm(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, c: torch.Tensor | None = None,
         trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    return _ops.gemm(a, b, alpha, beta, c, trans_a, trans_b)


def tensor_core_gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _ops.tensor_core_gemm(a, b)


def gemm_int8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _ops.gemm_int8(a, b)
