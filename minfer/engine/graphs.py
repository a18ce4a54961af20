"""Decode steps of the continuous engine replayed from CUDA graphs, one per batch bucket and context class.

A decode step (one new token per sequence) is ~10 launches a layer; at small batch the host's launch
cost is the step. Each bucket's forward is captured once over static metadata buffers. A step fills
pinned host buffers (numpy: each sequence's pages are written once, into a table row of its own, and the
step's rows gathered from there), copies them to those buffers without blocking, pads the rest of the
bucket with a scratch page that no sequence owns, replays the bucket's graph and reads the logits of its
own rows. A model with sliding-window layers has a second page table and slot mapping, of its sliding group
(kv_cache.py), with its own scratch page. Batches past the largest bucket run eagerly.

Steps of decodes and one prompt chunk of exactly --long-prefill-token-threshold tokens (a long prompt prefilling
beside running requests) replay graphs of their own (ChunkGraphs, models without sliding-window layers):
launched eagerly, such a step's ~15 launches a layer cost the host more than the GPU's work (Llama-3.2-1B
shape, H200, 16 decodes beside 32-token chunks: 3.3-5 ms a step eagerly, 2.4 ms from the graphs). Other steps
with prefill chunks run eagerly, but a lone prompt's last piece of up to 512 tokens (PromptGraphs: a request's
first token when no other runs, eagerly ~7 ms of host time on an H200 against 0.9-2.3 ms of the default model's GPU
work).
"""
from __future__ import annotations

import os
import sys

import numpy as np
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


def buckets_for(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """The bucket sizes: by default BUCKETS up to the smallest one that holds max_num_seqs (at most 256). sizes is
    vLLM's --cuda-graph-sizes: one value N gives 1, 2, 4 and the multiples of 8 up to N, several values are the
    buckets themselves; none past the smallest that holds max_num_seqs (larger batches run eagerly)."""
    if sizes and len(sizes) == 1:
        sizes = [1, 2, 4] + list(range(8, sizes[0] + 1, 8))
    out = []
    for b in sorted(set(sizes or BUCKETS)):
        out.append(b)
        if b >= max_num_seqs:
            break
    return out


def capture_graphs(graphs: dict, buckets: list[int], classes: list[int], forward, device: torch.device,
                   min_class=lambda b: 0) -> None:
    """graphs[b, c] = (graph, its output) of forward(b, c) for each bucket and each context class c >= min_class(b),
    in one memory pool: the largest first, so that the smaller graphs reuse its memory. Each is run once outside
    capture first (first-call costs: kernel attributes, workspaces)."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.current_stream(device)
    for b in reversed(buckets):
        for c in reversed([c for c in classes if c >= min_class(b)]):
            side = torch.cuda.Stream(device)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                forward(b, c)
            stream.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(b, c)
            graphs[b, c] = (graph, out)
    torch.cuda.synchronize(device)


class _PageTable:
    """One group's page table and slot mapping. Each running sequence's pages sit in a host row of its own (its
    scheduler slot), written as pages are added: a step gathers its rows from there, whatever rows its sequences
    had the step before, into a pinned buffer that travels compact (its rows, the columns in use) to the device
    table; its slots go to np_slots, a field of the pinned int64 buffer."""

    def __init__(self, rows: int, width: int, page: int, scratch_page: int, np_slots: np.ndarray, pin: bool,
                 device: torch.device):
        self.page, self.scratch, self.np_slots = page, scratch_page, np_slots
        np_slots[:] = scratch_page * page
        self.table = torch.full((rows, width), scratch_page, dtype=torch.int32, device=device)  # the graphs read it
        self.h_table = torch.empty(rows * width, dtype=torch.int32, pin_memory=pin)
        self.np_table = self.h_table.numpy()
        self.by_slot = np.full((rows, width), scratch_page, dtype=np.int32)
        self.owner: list[list | None] = [None] * rows  # the page list whose pages each slot row holds ...
        self.written = [0] * rows  # ... and how many of them

    def write(self, slots, tables: list[list[int]]) -> None:
        # A page list only grows while its sequence runs (freeing its pages gives it a new list): only the
        # pages added since the last step are written.
        owner, written = self.owner, self.written
        for r, pages in zip(slots, tables):
            if owner[r] is not pages:
                owner[r], written[r] = pages, 0
            have = written[r]
            if have < len(pages):
                self.by_slot[r, have:len(pages)] = pages[have:]
                written[r] = len(pages)

    def stage(self, slots, tables: list[list[int]], rows: np.ndarray, pos: np.ndarray, b: int,
              width: int) -> np.ndarray:
        """The step's slots and table [b, width] in the pinned buffers: its rows (sequences in slots, at
        positions pos), then padding rows on the scratch page. Returns the table."""
        self.write(slots, tables)
        n, page = len(pos), self.page
        self.np_slots[:n] = self.by_slot[rows, pos // page].astype(np.int64) * page + pos % page
        self.np_slots[n:b] = self.scratch * page
        table = self.np_table[:b * width].reshape(b, width)
        table[:n] = self.by_slot[rows, :width]
        table[n:, 0] = self.scratch
        return table

    def copy(self, b: int, width: int) -> None:
        # Rows past a sequence's pages are never read: only the columns in use travel.
        self.table[:b, :width].copy_(self.h_table[:b * width].view(b, width).to(self.table.device, non_blocking=True))


class DecodeGraphs:
    def __init__(self, model, cache: PagedKVCache, scratch_page: int, max_num_seqs: int, max_context: int,
                 device: torch.device, window: int | None = None, local_scratch_page: int = 0,
                 sizes: list[int] | None = None):
        """window: the sliding group's (None: one group), whose scratch page is local_scratch_page. sizes: the
        buckets asked for (buckets_for)."""
        self.model, self.cache, self.device = model, cache, device
        self.page, self.max_context, self.window = cache.page_size, max_context, window
        self.buckets = buckets_for(max_num_seqs, sizes)
        B, W = self.buckets[-1], -(-max_context // cache.page_size)  # rows, block-table width
        pin = device.type == "cuda"

        # Pinned host buffers (numpy views) and their device copies, a field each so that a step makes two
        # copies: int32 positions | seq_lens, int64 ids | slots (| local slots), each field 256-byte aligned.
        # Padding rows: token 0 at position 0, written to and read from the scratch pages alone.
        half = -(-B // 64) * 64
        self.h32 = torch.zeros(2 * half, dtype=torch.int32, pin_memory=pin)
        self.h64 = torch.zeros((2 if window is None else 3) * half, dtype=torch.int64, pin_memory=pin)
        self.np_pos, self.np_lens = self.h32[:B].numpy(), self.h32[half:half + B].numpy()
        self.np_ids = self.h64[:B].numpy()
        self.np_lens[:] = 1
        self.full = _PageTable(B, W, self.page, scratch_page, self.h64[half:half + B].numpy(), pin, device)
        self.local = None if window is None else \
            _PageTable(B, W, self.page, local_scratch_page, self.h64[2 * half:2 * half + B].numpy(), pin, device)
        self.d32, self.d64 = self.h32.to(device), self.h64.to(device)
        self.pos, self.lens = self.d32[:B], self.d32[half:half + B]
        self.ids, self.slots, self.local_slots = self.d64[:B], self.d64[half:half + B], self.d64[2 * half:2 * half + B]
        # The host buffers are refilled once the previous step's copies have run (the host may be a step ahead).
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self.cu = torch.arange(B + 1, dtype=torch.int32, device=device)  # one query per row
        self.classes = context_classes(max_context)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, class)
        self._capture()

    def _forward(self, b: int, max_len: int) -> torch.Tensor:
        meta = AttentionMetadata(positions=self.pos[:b], slot_mapping=self.slots[:b], block_table=self.full.table[:b],
                                 seq_lens=self.lens[:b], cu_seqlens_q=self.cu[:b + 1], max_seqlen_q=1,
                                 max_seqlen_k=max_len)  # a bound: the graph serves every length up to it
        if self.local is not None:
            meta.local_slot_mapping, meta.local_block_table = self.local_slots[:b], self.local.table[:b]
        return self.model.forward_paged(self.ids[:b], meta, self.cache, None, raw_logits=True)  # [b, vocab]

    def _capture(self) -> None:
        capture_graphs(self.graphs, self.buckets, self.classes, self._forward, self.device)

    def fits(self, n: int) -> bool:
        return n <= self.buckets[-1]

    def run(self, ids: list[int] | torch.Tensor, positions: list[int], tables: list[list[int]],
            slots: list[int] | None = None, local_tables: list[list[int]] | None = None) -> torch.Tensor:
        """One decode step: row i is one new token, ids[i], at positions[i] of a sequence with pages tables[i]
        (and local_tables[i] in the sliding group). ids: host ints, or a device tensor (the step before's sampled
        ids: async scheduling). slots[i]: the sequence's own row of the page table while it runs (default: i).
        Returns the lm_head's output [n, vocab] (raw logits: Model.final_logits; a view into the graph's output,
        valid until the next run)."""
        n = len(positions)
        b = next(x for x in self.buckets if x >= n)
        if self.copied is not None:
            self.copied.synchronize()
        slots = range(n) if slots is None else slots
        width = max(map(len, tables))
        rows = np.asarray(slots)
        pos = self.np_pos[:n]
        pos[:] = positions
        self.np_lens[:n] = pos + 1
        self.np_pos[n:b], self.np_lens[n:b], self.np_ids[n:b] = 0, 1, 0
        self.full.stage(slots, tables, rows, pos, b, width)
        self.full.copy(b, width)
        if self.local is not None:
            local = self.local.stage(slots, local_tables, rows, pos, b, width)
            # the pages wholly before each row's window are freed (block manager): on the scratch page, as eagerly
            local[:n][np.arange(width) < (pos[:, None] - self.window + 1) // self.page] = self.local.scratch
            self.local.copy(b, width)
        host_ids = not isinstance(ids, torch.Tensor)
        if host_ids:
            self.np_ids[:n] = ids
        self.d32.copy_(self.h32, non_blocking=True)
        self.d64.copy_(self.h64, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if not host_ids:
            self.ids[:n].copy_(ids)
        graph, logits = self.graphs[b, next(c for c in self.classes if c >= int(pos.max()) + 1)]
        graph.replay()
        return logits[:n]


def capture_failed(e: RuntimeError, instead: str) -> None:
    """Says, in one line, that a CUDA graph capture failed and what runs instead."""
    print(f"[minfer] CUDA graph capture failed ({str(e).splitlines()[0]}); {instead}", file=sys.stderr)


def try_decode_graphs(engine, scratch_page: int, max_num_seqs: int, sizes: list[int] | None = None):
    """DecodeGraphs for the engine when every op runs on our kernels (a ref op may sync or fall outside
    capture), else None; a capture that fails is said once and the engine decodes eagerly.
    MINFER_NO_GRAPH=1 turns graphs off."""
    ops = engine.ops
    if ops.name != "cuda" or ops.fallbacks or os.environ.get("MINFER_NO_GRAPH"):
        return None
    try:
        bm = engine.block_manager
        return DecodeGraphs(engine.model, engine.cache, scratch_page, max_num_seqs, engine.max_context, engine.device,
                            bm.window, bm.local_scratch, sizes)
    except RuntimeError as e:
        capture_failed(e, "decoding eagerly")
        return None


class ChunkGraphs:
    """Steps of n <= bucket decodes followed by one prompt chunk of exactly `chunk` tokens, replayed per (decode
    bucket, context class). Rows [0, n) decode, rows [n, b) pad on the scratch page (one token at position 0),
    rows [b, b + chunk) are the chunk; the graph computes the logits of the b decode rows only (a 17th row would
    take the Llama-3.2-1B lm_head from the GEMV to a GEMM, 136 -> 221 us), so a prompt's last chunk, whose token
    is sampled, runs eagerly. The metadata travels in three copies from pinned buffers: int32 positions |
    seq_lens, int64 ids | slots, and the columns of the page table in use."""

    def __init__(self, model, cache: PagedKVCache, scratch_page: int, buckets: list[int], chunk: int,
                 max_context: int, device: torch.device):
        self.model, self.cache, self.device, self.chunk = model, cache, device, chunk
        self.page, self.scratch, self.buckets = cache.page_size, scratch_page, buckets
        B, C, W = buckets[-1], chunk, -(-max_context // cache.page_size)
        T, half = B + C, -(-(B + C) // 64) * 64  # tokens; field size (256-byte aligned)
        pin = device.type == "cuda"
        self.h32 = torch.zeros(2 * half, dtype=torch.int32, pin_memory=pin)  # positions [T] | seq_lens [B + 1]
        self.h64 = torch.zeros(2 * half, dtype=torch.int64, pin_memory=pin)  # ids [T] | slots [T]
        self.h_table = torch.full(((B + 1) * W,), scratch_page, dtype=torch.int32, pin_memory=pin)
        self.np_pos, self.np_lens = self.h32[:T].numpy(), self.h32[half:half + B + 1].numpy()
        self.np_ids, self.np_slots = self.h64[:T].numpy(), self.h64[half:half + T].numpy()
        self.np_table = self.h_table.numpy()
        self.d32, self.d64 = self.h32.to(device), self.h64.to(device)
        self.pos, self.lens = self.d32[:T], self.d32[half:half + B + 1]
        self.ids, self.slots = self.d64[:T], self.d64[half:half + T]
        self.table = torch.full((B + 1, W), scratch_page, dtype=torch.int32, device=device)
        # The host buffers are refilled once the last step's copies have run.
        self.copied = torch.cuda.Event() if pin else None
        # Per bucket b: cu_seqlens_q [b + 2] (b decodes, the chunk) and the rows whose logits the graph computes.
        i32 = dict(dtype=torch.int32, device=device)
        self.cu = {b: torch.tensor(list(range(b + 1)) + [b + C], **i32) for b in buckets}
        self.logit_rows = {b: torch.arange(b, device=device) for b in buckets}
        self.chunk_cu = torch.tensor([0, C], **i32)
        self.classes = [c for c in context_classes(max_context) if c >= chunk]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, class)
        self._capture()

    def _forward(self, b: int, max_len: int) -> torch.Tensor:
        c = self.chunk
        meta = AttentionMetadata(positions=self.pos[:b + c], slot_mapping=self.slots[:b + c],
                                 block_table=self.table[:b + 1], seq_lens=self.lens[:b + 1], cu_seqlens_q=self.cu[b],
                                 max_seqlen_q=c, max_seqlen_k=max_len)  # bounds: the graph serves every length
        meta.num_decodes, meta.chunk_cu_seqlens_q = b, self.chunk_cu
        meta.decode_max_seqlen_k = meta.chunk_max_seqlen_k = max_len
        return self.model.forward_paged(self.ids[:b + c], meta, self.cache, self.logit_rows[b], raw_logits=True)

    def _capture(self) -> None:
        capture_graphs(self.graphs, self.buckets, self.classes, self._forward, self.device)

    def fits(self, counts: list[int], sampled: list[int]) -> bool:
        """Whether a step of these per-sequence token counts, sampling the rows `sampled`, replays a graph:
        decodes, each sampled, then one chunk that does not end its prompt."""
        n = len(counts) - 1
        return (0 < n <= self.buckets[-1] and counts[-1] == self.chunk and max(counts[:-1]) == 1
                and sampled == list(range(n)))

    def run(self, work: list[tuple[list[int], int, list[int]]], ids: torch.Tensor | None) -> torch.Tensor:
        """work as EngineCore._forward's, fitting fits(). ids: the step's tokens on the device (async
        scheduling; work's lists then give only counts), or None. Returns the n decodes' raw logits [n, vocab]
        (as DecodeGraphs.run's)."""
        n, c, page = len(work) - 1, self.chunk, self.page
        b = next(x for x in self.buckets if x >= n)
        if self.copied is not None:
            self.copied.synchronize()
        starts = np.fromiter((s for _, s, _ in work), np.int64, n + 1)
        pos, lens = self.np_pos, self.np_lens
        pos[:n], pos[n:b] = starts[:n], 0
        pos[b:b + c] = np.arange(starts[n], starts[n] + c)
        lens[:n], lens[n:b], lens[b] = starts[:n] + 1, 1, starts[n] + c
        width = max(len(pages) for _, _, pages in work)
        table = self.np_table[:(b + 1) * width].reshape(b + 1, width)
        for i, (_, _, pages) in enumerate(work[:n]):
            table[i, :len(pages)] = pages
        table[n:b, 0] = self.scratch
        table[b, :len(work[n][2])] = work[n][2]
        rows = np.concatenate([np.arange(n), np.full(c, b)])
        tok = np.concatenate([pos[:n], pos[b:b + c]]).astype(np.int64)
        slots = table[rows, tok // page].astype(np.int64) * page + tok % page
        self.np_slots[:n], self.np_slots[n:b], self.np_slots[b:b + c] = slots[:n], self.scratch * page, slots[n:]
        self.np_ids[n:b] = 0
        if ids is None:
            self.np_ids[:n] = [t[0] for t, _, _ in work[:n]]
            self.np_ids[b:b + c] = work[n][0]
        self.d32.copy_(self.h32, non_blocking=True)
        self.d64.copy_(self.h64, non_blocking=True)
        self.table[:b + 1, :width].copy_(self.h_table[:(b + 1) * width].view(b + 1, width), non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if ids is not None:
            self.ids[:n].copy_(ids[:n])
            self.ids[b:b + c].copy_(ids[n:])
        graph, logits = self.graphs[b, next(x for x in self.classes if x >= int(lens[:b + 1].max()))]
        graph.replay()
        return logits[:n]


# A lone prompt's last piece (PromptGraphs) pads to one of these token counts.
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)
# A prompt graph pays while its step's GPU work stays under the host time an eager step takes to launch it (~7 ms
# on an H200 for the default model and the Llama-3-8B shape alike, where the default model's GPU takes 0.9-2.3 ms
# at 16-512 tokens and the 8B shape's 5.4 ms at 16, 8.7 at 128). Padding may double a piece's tokens, so the
# buckets stop where the layers' work passes this many FLOPs: 64 tokens on the 8B shape, 512 below ~1.4B values.
PROMPT_GRAPH_FLOPS = 1.5e12


class PromptGraphs:
    """Steps of one prompt's last piece alone (no decodes beside it; its last token sampled), of c <= the largest
    bucket tokens, padded to the smallest bucket P >= c and replayed per (P, context class): a lone request's first
    token, which eagerly costs the host ~300 launches for a few hundred microseconds of GPU work on a small model.
    The piece is one sequence of c queries (cu_seqlens_q [0, c]); tokens [c, P) are padding at position 0 whose K
    and V go to the scratch page, outside every sequence of attention, so their rows, row-wise through the other
    layers, are never read. The logits are the piece's last token's. Metadata travels as in ChunkGraphs."""

    def __init__(self, model, cache: PagedKVCache, scratch_page: int, buckets: list[int], max_context: int,
                 device: torch.device):
        self.model, self.cache, self.device = model, cache, device
        self.page, self.scratch, self.buckets = cache.page_size, scratch_page, buckets
        P, W = buckets[-1], -(-max_context // cache.page_size)
        pin = device.type == "cuda"
        # int32: positions [P] | seq_lens [1] | cu_seqlens_q [2]; int64: ids [P] | slots [P] | the logit row [1];
        # fields 256-byte aligned. Until the first step: one query at position 0 on the scratch page.
        self.o32, self.o64 = -(-P // 64) * 64, -(-P // 32) * 32
        self.h32 = torch.zeros(self.o32 + 64 + 2, dtype=torch.int32, pin_memory=pin)
        self.h64 = torch.zeros(2 * self.o64 + 1, dtype=torch.int64, pin_memory=pin)
        self.h32[self.o32], self.h32[self.o32 + 65] = 1, 1
        self.h64[self.o64:self.o64 + P] = scratch_page * self.page
        self.h_table = torch.full((W,), scratch_page, dtype=torch.int32, pin_memory=pin)
        self.d32, self.d64 = self.h32.to(device), self.h64.to(device)
        o32, o64 = self.o32, self.o64
        self.pos, self.lens, self.cu = self.d32[:P], self.d32[o32:o32 + 1], self.d32[o32 + 64:o32 + 66]
        self.ids, self.slots, self.logit_row = self.d64[:P], self.d64[o64:o64 + P], self.d64[2 * o64:]
        self.table = torch.full((1, W), scratch_page, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if pin else None  # the host buffers are refilled once it has passed
        self.classes = context_classes(max_context)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, class)
        # a piece of P queries needs a class of at least P keys (its padding counts as queries)
        capture_graphs(self.graphs, self.buckets, self.classes, self._forward, self.device, min_class=lambda p: p)

    def _forward(self, p: int, max_len: int) -> torch.Tensor:
        meta = AttentionMetadata(positions=self.pos[:p], slot_mapping=self.slots[:p], block_table=self.table,
                                 seq_lens=self.lens, cu_seqlens_q=self.cu, max_seqlen_q=p,
                                 max_seqlen_k=max_len)  # bounds: the graph serves every piece up to them
        return self.model.forward_paged(self.ids[:p], meta, self.cache, self.logit_row, raw_logits=True)

    def fits(self, counts: list[int], sampled: list[int]) -> bool:
        """Whether a step of these per-sequence token counts, sampling the rows `sampled`, replays a graph: one
        sequence of 2 .. the largest bucket tokens that ends its prompt."""
        return len(counts) == 1 and 1 < counts[0] <= self.buckets[-1] and sampled == [0]

    def run(self, work: list[tuple[list[int], int, list[int]]], ids: torch.Tensor | None) -> torch.Tensor:
        """work as EngineCore._forward's, fitting fits(). ids: the piece's tokens on the device, or None (work's
        list holds them). Returns its last token's raw logits [1, vocab]."""
        (toks, start, pages), = work
        c, page = len(toks), self.page
        p = next(b for b in self.buckets if b >= c)
        if self.copied is not None:
            self.copied.synchronize()
        h32, h64, o32, o64 = self.h32.numpy(), self.h64.numpy(), self.o32, self.o64
        pos = np.arange(start, start + c)
        h32[:c], h32[c:p] = pos, 0
        h32[o32], h32[o32 + 64:o32 + 66] = start + c, (0, c)
        table = self.h_table.numpy()
        table[:len(pages)] = pages
        h64[o64:o64 + c] = table[pos // page].astype(np.int64) * page + pos % page
        h64[o64 + c:o64 + p] = self.scratch * page
        h64[c:p] = 0
        if ids is None:
            h64[:c] = toks
        h64[2 * o64] = c - 1
        self.d32.copy_(self.h32, non_blocking=True)
        self.d64.copy_(self.h64, non_blocking=True)
        self.table[0, :len(pages)].copy_(self.h_table[:len(pages)], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if ids is not None:
            self.ids[:c].copy_(ids)
        graph, logits = self.graphs[p, next(x for x in self.classes if x >= max(start + c, p))]
        graph.replay()
        return logits


def prompt_buckets(cfg, max_num_batched_tokens: int, max_context: int) -> list[int]:
    """PromptGraphs' token buckets: PROMPT_BUCKETS up to the step's token budget, the context and PROMPT_GRAPH_FLOPS
    of the layers' linears."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    values = cfg.num_layers * cfg.hidden_size * (2 * q + 2 * kv + 3 * cfg.intermediate_size)  # q, o, k, v, MLP
    return [p for p in PROMPT_BUCKETS if p <= min(max_num_batched_tokens, max_context)
            and 2 * values * p <= PROMPT_GRAPH_FLOPS]


def try_prompt_graphs(engine, scratch_page: int, max_num_batched_tokens: int):
    """PromptGraphs at prompt_buckets where decode graphs run and the model has no sliding-window layers; else
    None."""
    if engine.graphs is None or engine.block_manager.window is not None:
        return None
    buckets = prompt_buckets(engine.cfg, max_num_batched_tokens, engine.max_context)
    if not buckets:
        return None
    try:
        return PromptGraphs(engine.model, engine.cache, scratch_page, buckets, engine.max_context, engine.device)
    except RuntimeError as e:
        capture_failed(e, "prompts run eagerly")
        return None


def try_chunk_graphs(engine, scratch_page: int, chunk: int):
    """ChunkGraphs for the engine's chunk cap beside decodes (--long-prefill-token-threshold, shorter than the
    context), where decode graphs run and the model has no sliding-window layers, at the decode graphs' buckets up
    to 64; else None."""
    graphs = engine.graphs
    if graphs is None or not 0 < chunk < engine.max_context or engine.block_manager.window is not None:
        return None
    buckets = [b for b in graphs.buckets if b <= 64]
    try:
        return ChunkGraphs(engine.model, engine.cache, scratch_page, buckets, chunk, engine.max_context, engine.device)
    except RuntimeError as e:
        capture_failed(e, "prompt chunks run eagerly")
        return None
