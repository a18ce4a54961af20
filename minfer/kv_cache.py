"""Preallocated KV caches: plain storage, written by rope (its cache write) and read by attention.

KVCache (the static engine's dense cache, one layout for prefill and decode attention):
    k[layer], v[layer]: [batch, capacity, kv_heads, head_dim], contiguous.
Token s of sequence b at absolute position p lives at [b, p]. Each sequence's valid length is
tracked by the engine (start positions), not here.

PagedKVCache (the continuous engine's): a pool of fixed-size pages per layer,
    k[layer], v[layer]: [num_pages, page_size, kv_heads, head_dim], contiguous;
position p of a sequence lives in page block_table[p // page_size], row p % page_size. The block manager
decides which pages a sequence owns; AttentionMetadata carries that to the ops for one step.
A model with sliding-window layers has two groups of layers: the full ones, as above, and the sliding ones,
whose pools have num_local_pages pages and whose positions go through the sequence's local block table
(local_block_table, local_slot_mapping): it holds only the pages of keys some query can still see.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .errors import MinferError


class KVCache:
    def __init__(self, num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.batch, self.capacity = batch, capacity
        shape = (num_layers, batch, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, batch, capacity, kv_heads, head_dim]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # sequence b's first row in a layer's cache seen as [batch x capacity] rows (rope's cache write)
        self.row_base = torch.arange(batch, dtype=torch.int64, device=device)[:, None] * capacity  # [batch, 1]

    def check_fits(self, end_position: int) -> None:
        """Raise a clear error if positions up to end_position (exclusive) do not fit."""
        if end_position > self.capacity:
            raise MinferError(f"KV cache is full: {end_position} positions needed, capacity is {self.capacity} "
                              f"(raise --max-context)")

    def rows(self, batch: int) -> "KVCache":
        """The first `batch` sequences, sharing this cache's storage (each layer's rows stay contiguous)."""
        view = copy.copy(self)
        view.batch, view.k, view.v, view.row_base = batch, self.k[:, :batch], self.v[:, :batch], self.row_base[:batch]
        return view

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class PagedKVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, sliding: list[bool] | None = None, num_local_pages: int = 0):
        """sliding[layer]: the layer is in the sliding group, whose pools have num_local_pages pages."""
        self.num_pages, self.num_local_pages, self.page_size = num_pages, num_local_pages, page_size
        sliding = sliding or [False] * num_layers
        # per layer: its group's pool [pages, page_size, kv_heads, head_dim], a view into that group's k or v
        self.k: list[torch.Tensor] = [None] * num_layers
        self.v: list[torch.Tensor] = [None] * num_layers
        self.pools = []  # full k, v, sliding k, v: [group's layers, pages, page_size, kv_heads, head_dim]
        for group, pages in ((False, num_pages), (True, num_local_pages)):
            layers = [i for i in range(num_layers) if sliding[i] == group]
            k, v = (torch.zeros((len(layers), pages, page_size, kv_heads, head_dim), dtype=dtype, device=device)
                    for _ in range(2))
            self.pools += [k, v]
            for j, i in enumerate(layers):
                self.k[i], self.v[i] = k[j], v[j]

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V bytes of one page over all layers."""
        return 2 * num_layers * page_size * kv_heads * head_dim * dtype.itemsize

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.pools)


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the paged cache: what rope (its paged cache write) and paged_attention read.
    The step's tokens are the sequences' new tokens back to back, sequence by sequence."""
    positions: torch.Tensor  # [tokens] int32: position of each token in its sequence
    slot_mapping: torch.Tensor  # [tokens] int64: page * page_size + row where each token's K and V go
    block_table: torch.Tensor  # [batch, max_pages] int32: each sequence's pages in order, padded with 0
    seq_lens: torch.Tensor  # [batch] int32: keys of each sequence once this step's are written
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32: sequence b's tokens are [cu_seqlens_q[b], cu_seqlens_q[b + 1])
    max_seqlen_q: int  # host copies of the largest query count and seq_len: sizes without a device sync
    max_seqlen_k: int
    # The sliding group's own slot_mapping and block_table (None: one group). Entries before a sequence's window
    # point at a scratch page (their pages are freed).
    local_slot_mapping: torch.Tensor | None = None  # [tokens] int64
    local_block_table: torch.Tensor | None = None  # [batch, max_pages] int32
    # A step of decodes and prompt chunks: its first num_decodes sequences have one query each (the scheduler
    # puts decodes first), and attention runs them on the decode kernel, apart from the chunks after them, whose
    # cu_seqlens_q from their own first token is chunk_cu_seqlens_q. 0: one call for the whole step.
    num_decodes: int = 0
    decode_max_seqlen_k: int = 0
    chunk_cu_seqlens_q: torch.Tensor | None = None  # [batch - num_decodes + 1] int32
    chunk_max_seqlen_k: int = 0
