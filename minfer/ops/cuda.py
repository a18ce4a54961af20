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
