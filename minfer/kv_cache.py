"""Preallocated KV cache, owned by the engine and written by the kv_cache_write op.

Layout (one layout for prefill and decode attention):
    k[layer], v[layer]: [batch, capacity, kv_heads, head_dim], contiguous.
Token s of sequence b at absolute position p lives at [b, p]. Each sequence's valid length is
tracked by the engine (start positions), not here: the cache is plain storage.
"""
from __future__ import annotations

import copy

import torch

from .errors import MinferError


class KVCache:
    def __init__(self, num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.batch, self.capacity = batch, capacity
        shape = (num_layers, batch, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, batch, capacity, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def check_fits(self, end_position: int) -> None:
        """Raise a clear error if positions up to end_position (exclusive) do not fit."""
        if end_position > self.capacity:
            raise MinferError(f"KV cache is full: {end_position} positions needed, capacity is {self.capacity} "
                              f"(raise --max-context)")

    def rows(self, batch: int) -> "KVCache":
        """The first `batch` sequences, sharing this cache's storage (each layer's rows stay contiguous)."""
        view = copy.copy(self)
        view.batch, view.k, view.v = batch, self.k[:, :batch], self.v[:, :batch]
        return view

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
