"""Decode steps of the continuous engine replayed from CUDA graphs, one per batch bucket and context class.

A decode step (one new token per sequence) is ~10 launches a layer; at small batch the host's launch
cost is the step. Each bucket's forward is captured once over static metadata buffers. A step copies its
metadata into the first rows of those buffers (one pinned host buffer per field, non-blocking copies),
pads the rest of the bucket with a scratch page that no sequence owns, replays the bucket's graph and
reads the logits of its own rows. Steps with prefill chunks, and batches past the largest bucket, run
eagerly.
"""
from __future__ import annotations

import os
import sys

import torch

from ..kv_cache import AttentionMetadata, PagedKVCache

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Context classes: each bucket has a graph per class, replayed for steps whose longest sequence fits it. The
# decode kernel lays its splits out for the longest sequence a call may have: planned for the whole context,
# a short sequence's call launches splits that find no keys (default model, 1 x 130 keys: 44 splits against
# 8 planned for 256; a decode step 0.99 ms against ~0.8).
SHORTEST_CLASS = 256


def context_classes(max_context: int) -> list[int]:
    """256, 1024, 4096, ... (x4) below max_context, then max_context."""
    out, c = [], SHORTEST_CLASS
    while c < max_context:
        out.append(c)
        c *= 4
    return out + [max_context]


def buckets_for(max_num_seqs: int) -> list[int]:
    """The bucket sizes up to the smallest one that holds max_num_seqs (at most 256)."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_num_seqs:
            break
    return out


class DecodeGraphs:
    def __init__(self, model, cache: PagedKVCache, scratch_page: int, max_num_seqs: int, max_context: int,
                 device: torch.device):
        self.model, self.cache, self.device = model, cache, device
        self.page, self.max_context = cache.page_size, max_context
        self.buckets = buckets_for(max_num_seqs)
        B, W = self.buckets[-1], -(-max_context // cache.page_size)  # rows, block-table width
        self.scratch_slot = scratch_page * self.page
        pin = device.type == "cuda"

        def pair(shape, dtype, fill):
            host = torch.full(shape, fill, dtype=dtype, pin_memory=pin)
            return host, host.to(device)

        # host (pinned) and device copies; padding rows: token 0 at position 0, written to and read from the
        # scratch page alone
        self.h_ids, self.ids = pair((B,), torch.int64, 0)
        self.h_pos, self.pos = pair((B,), torch.int32, 0)
        self.h_slots, self.slots = pair((B,), torch.int64, self.scratch_slot)
        self.h_lens, self.lens = pair((B,), torch.int32, 1)
        self.h_table, self.table = pair((B, W), torch.int32, scratch_page)
        self.row_pages: list[tuple[list | None, int]] = [(None, 0)] * B  # per host table row: (page list, pages written)
        self.cu = torch.arange(B + 1, dtype=torch.int32, device=device)  # one query per row
        self.rows = torch.arange(B, dtype=torch.int64, device=device)  # every row's logits
        self.classes = context_classes(max_context)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, class)
        self._capture()

    def _forward(self, b: int, max_len: int) -> torch.Tensor:
        meta = AttentionMetadata(positions=self.pos[:b], slot_mapping=self.slots[:b], block_table=self.table[:b],
                                 seq_lens=self.lens[:b], cu_seqlens_q=self.cu[:b + 1], max_seqlen_q=1,
                                 max_seqlen_k=max_len)  # a bound: the graph serves every length up to it
        return self.model.forward_paged(self.ids[:b], meta, self.cache, self.rows[:b])  # [b, vocab] fp32

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.current_stream(self.device)
        for b in reversed(self.buckets):  # the largest first: the smaller graphs reuse its memory
            for max_len in reversed(self.classes):
                side = torch.cuda.Stream(self.device)
                side.wait_stream(stream)
                with torch.cuda.stream(side):  # first-call costs outside capture: kernel attributes, workspaces
                    self._forward(b, max_len)
                stream.wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(b, max_len)
                self.graphs[b, max_len] = (graph, logits)
        torch.cuda.synchronize(self.device)

    def fits(self, n: int) -> bool:
        return n <= self.buckets[-1]

    def run(self, work: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """work: per sequence ([its one new token], its position, its pages). Returns the logits [n, vocab] (a
        view into the graph's output, valid until the next run)."""
        n = len(work)
        b = next(x for x in self.buckets if x >= n)
        ids, pos, slots, lens, table = (t.numpy() for t in (self.h_ids, self.h_pos, self.h_slots, self.h_lens,
                                                            self.h_table))
        page = self.page
        starts = [start for _, start, _ in work]
        ids[:n] = [toks[0] for toks, _, _ in work]
        pos[:n] = starts
        lens[:n] = [start + 1 for start in starts]
        slots[:n] = [pages[start // page] * page + start % page for _, start, pages in work]
        width = 1
        for i, (_, _, pages) in enumerate(work):
            # A row whose sequence is the same as last step (the same page list: a sequence gets a new list when
            # its pages are freed) has its old pages there already; a page list only ever grows.
            owner, have = self.row_pages[i]
            have = have if owner is pages else 0
            if have < len(pages):
                table[i, have:len(pages)] = pages[have:]
            self.row_pages[i] = (pages, len(pages))
            width = max(width, len(pages))
        for i in range(n, b):
            self.row_pages[i] = (None, 0)
        ids[n:b], pos[n:b], slots[n:b], lens[n:b] = 0, 0, self.scratch_slot, 1
        table[n:b, 0] = self.scratch_slot // self.page
        # Rows past a sequence's pages are never read: only the columns in use travel.
        for host, dev in ((self.h_ids, self.ids), (self.h_pos, self.pos), (self.h_slots, self.slots),
                          (self.h_lens, self.lens)):
            dev[:b].copy_(host[:b], non_blocking=True)
        self.table[:b, :width].copy_(self.h_table[:b, :width], non_blocking=True)
        longest = max(starts) + 1
        graph, logits = self.graphs[b, next(c for c in self.classes if c >= longest)]
        graph.replay()
        return logits[:n]


def try_decode_graphs(engine, scratch_page: int, max_num_seqs: int):
    """DecodeGraphs for the engine when every op runs on our kernels (a ref op may sync or fall outside
    capture), else None; a capture that fails is said once and the engine decodes eagerly.
    MINFER_NO_GRAPH=1 turns graphs off."""
    ops = engine.ops
    if ops.name != "cuda" or ops.fallbacks or os.environ.get("MINFER_NO_GRAPH"):
        return None
    try:
        return DecodeGraphs(engine.model, engine.cache, scratch_page, max_num_seqs, engine.max_context, engine.device)
    except RuntimeError as e:
        print(f"[minfer] CUDA graph capture failed ({str(e).splitlines()[0]}); decoding eagerly", file=sys.stderr)
        return None
