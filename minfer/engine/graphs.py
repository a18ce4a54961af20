"""Decode steps of the continuous engine replayed from CUDA graphs, one per batch bucket and context class.

A decode step (one new token per sequence) is ~10 launches a layer; at small batch the host's launch
cost is the step. Each bucket's forward is captured once over static metadata buffers. A step fills
pinned host buffers (numpy: each sequence's pages are written once, into a table row of its own, and the
step's rows gathered from there), copies them to those buffers without blocking, pads the rest of the
bucket with a scratch page that no sequence owns, replays the bucket's graph and reads the logits of its
own rows. A model with sliding-window layers has a second page table and slot mapping, of its sliding group
(kv_cache.py), with its own scratch page. Batches past the largest bucket run eagerly.

Steps of decodes and one prompt piece replay graphs of their own (PieceGraphs, with both groups' tables where there
are two), the piece padded to a token bucket: a long prompt's chunks of --long-prefill-token-threshold tokens beside
running requests, whose ~15 launches a layer cost the host more than the GPU's work eagerly (Llama-3.2-1B shape, H200,
16 decodes beside 32-token chunks: 3.3-5 ms a step eagerly, 2.4 ms from the graphs); and, where the engine asks for
them (the server), a prompt's last piece of up to 512 tokens beside up to 16 decodes (a request's first token, alone
or joining running ones; eagerly ~7 ms of host time on an H200 against 0.9-2.3 ms of the default model's GPU work).
Other steps with prefill chunks run eagerly.
"""
from __future__ import annotations

import gc
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
    in one memory pool: the largest first, so that the smaller graphs reuse its memory. Each bucket's forward runs
    once outside capture first, at its largest class (first-call costs: kernel attributes, workspaces). One
    collection and sync for the whole set, where torch.cuda.graph takes them per graph, and a bucket's other classes
    not run eagerly first: the default model's 174 server graphs 2.6-2.9 -> 2.0-2.1 s (H200), ~8.5 ms a capture."""
    pool = torch.cuda.graph_pool_handle()
    stream, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    gc.collect()  # garbage from before is freed now, not by a collection in the middle of a capture
    side.wait_stream(stream)
    with torch.cuda.stream(side):  # capture needs a stream other than the default one
        for b in reversed(buckets):
            for i, c in enumerate(reversed([c for c in classes if c >= min_class(b)])):
                if i == 0:
                    forward(b, c)
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=pool)
                try:
                    out = forward(b, c)
                finally:
                    graph.capture_end()
                graphs[b, c] = (graph, out)
    stream.wait_stream(side)
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
        self.h_table = torch.full((rows * width,), scratch_page, dtype=torch.int32, pin_memory=pin)
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


def fill_piece_step(work: list[tuple[list[int], int, list[int]]], d: int, p: int, page: int, scratch: int,
                    pos: np.ndarray, lens: np.ndarray, slots: np.ndarray, ids: np.ndarray,
                    table_flat: np.ndarray, with_ids: bool) -> int:
    """The host metadata of a step of n = len(work) - 1 decodes and one prompt piece of c <= p tokens (work as
    EngineCore._forward's) in the rows of decode bucket d and token bucket p: rows [0, n) decode, [n, d) pad on the
    scratch page (one token at position 0), [d, d + c) are the piece and [d + c, d + p) pad at position 0, their K
    and V to the scratch page. pos, slots, ids: views of [d + p]; lens: of [d + 1]; table_flat: the pinned page
    table, filled as [d + 1, width]. The real ids are filled with_ids only (else they come from the device).
    Returns the table's width."""
    n = len(work) - 1
    toks, start, _ = work[n]
    c = len(toks)
    starts = np.fromiter((s for _, s, _ in work[:n]), np.int64, n)
    pos[:n], pos[n:d] = starts, 0
    pos[d:d + c], pos[d + c:d + p] = np.arange(start, start + c), 0
    lens[:n], lens[n:d], lens[d] = starts + 1, 1, start + c
    ids[n:d], ids[d + c:d + p] = 0, 0
    if with_ids:
        ids[:n] = [t[0] for t, _, _ in work[:n]]
        ids[d:d + c] = toks
    return fill_piece_pages([pg for _, _, pg in work], d, p, c, page, scratch, pos, slots, table_flat)


def fill_piece_pages(tables: list[list[int]], d: int, p: int, c: int, page: int, scratch: int, pos: np.ndarray,
                     slots: np.ndarray, table_flat: np.ndarray) -> int:
    """One group's page table and slots of a step that fill_piece_step laid out (pos as it filled them): tables,
    the pages of its n decodes and of its piece of c tokens. A model with sliding-window layers calls it again for
    the sliding group. Returns the table's width."""
    n = len(tables) - 1
    width = max(map(len, tables))
    table = table_flat[:(d + 1) * width].reshape(d + 1, width)
    for i, pg in enumerate(tables[:n]):
        table[i, :len(pg)] = pg
    table[n:d, 0] = scratch
    table[d, :len(tables[n])] = tables[n]
    rows = np.concatenate([np.arange(n), np.full(c, d)])
    tok = np.concatenate([pos[:n], pos[d:d + c]]).astype(np.int64)
    found = table[rows, tok // page].astype(np.int64) * page + tok % page
    slots[:n], slots[d:d + c] = found[:n], found[n:]
    slots[n:d], slots[d + c:d + p] = scratch * page, scratch * page
    return width


# A prompt's last piece pads to one of these token counts ...
PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)
# ... beside up to this many decodes (their bucket: one of the decode graphs', or none).
PROMPT_MAX_DECODES = 16
# A prompt graph pays while its step's GPU work stays under the host time an eager step takes to launch it (~7 ms on
# an H200, where the default model's GPU takes 0.9-2.3 ms at 16-512 tokens), and its padded rows cost the GPU little:
# on the Llama-3-8B shape lone pieces of 16-64 tokens took 5.56 ms from graphs padded to 16-64 against 6.06 eagerly,
# but beside 8 decodes 11.30 against 9.99 (72 rows where eagerly 24-72 ran). So a (decodes, tokens) bucket is taken
# while its linears' work is at most this many FLOPs: on the 8B shape pieces of up to 32 tokens beside up to 2
# decodes and 16 beside up to 16; the default model's every bucket.
PROMPT_GRAPH_FLOPS = 5e11
# A chunk that does not end its prompt (--long-prefill-token-threshold) replays beside up to this many decodes.
CHUNK_MAX_DECODES = 64


class PieceGraphs:
    """Steps of n decodes (each sampled) and one prompt piece of 1 < c tokens, replayed per key (d, p, ends) and
    context class: d a decode bucket (n <= d), p a token bucket (c <= p), ends whether the piece ends its prompt (its
    last token sampled). Two kinds of key:
    - a prompt's last piece (ends) of up to 512 tokens beside up to 16 decodes (prompt_buckets): a request's first
      token, alone or joining running ones, where the engine asks for them (the server). Eagerly such a step costs
      the host ~300 launches, ~7 ms on an H200 against 0.9-2.3 ms of the default model's GPU work.
    - a chunk that does not end its prompt, of the engine's cap (--long-prefill-token-threshold) beside 1-64 decodes:
      a long prompt prefilling beside running requests (Llama-3.2-1B shape, H200, 16 decodes beside 32-token chunks:
      3.3-5 ms a step eagerly, 2.4 ms from the graphs).
    Rows [0, n) decode, [n, d) pad on the scratch page (one token at position 0), [d, d + c) are the piece, one
    sequence of c queries, and [d + c, d + p) pad at position 0, their K and V written to the scratch page, outside
    every sequence of attention: row-wise through the other layers, they are never read. The graph computes the
    logits of the d decode rows, and of the piece's last token where it ends its prompt (not otherwise: a 17th row
    would take the Llama-3.2-1B lm_head from the GEMV to a GEMM, 136 -> 221 us). The metadata travels in three
    copies from pinned buffers: int32 positions | seq_lens | cu_seqlens_q | the piece's own, int64 ids | slots |
    logit rows (| the sliding group's slots), and the columns of the page table(s) in use."""

    def __init__(self, model, cache: PagedKVCache, scratch_page: int, keys: list[tuple[int, int, bool]],
                 max_context: int, device: torch.device, window: int | None = None, local_scratch_page: int = 0):
        """keys: the (decode bucket, token bucket, ends) to capture (piece_keys). window: the sliding group's (None:
        one group), whose scratch page is local_scratch_page."""
        self.model, self.cache, self.device, self.window = model, cache, device, window
        self.page, self.scratch, self.local_scratch = cache.page_size, scratch_page, local_scratch_page
        # per kind (ends): each decode bucket's token buckets, both ascending (a step takes its smallest decode
        # bucket, then that bucket's smallest token bucket that holds its piece)
        self.buckets: dict[bool, dict[int, list[int]]] = {False: {}, True: {}}
        for d, p, ends in sorted(keys):
            self.buckets[ends].setdefault(d, []).append(p)
        D, P, W = max(k[0] for k in keys), max(k[1] for k in keys), -(-max_context // cache.page_size)
        pin = device.type == "cuda"
        f = -(-(D + P) // 64) * 64  # a field's room (256-byte aligned at int32)
        # int32: positions [D + P] | seq_lens [D + 1] | cu_seqlens_q [D + 2] | the piece's own [2];
        # int64: ids [D + P] | slots [D + P] | logit rows [D + 1] (| local slots [D + P]). Until the first step every
        # row is one query at position 0 on the scratch page(s).
        self.h32 = torch.zeros(4 * f, dtype=torch.int32, pin_memory=pin)
        self.h64 = torch.zeros((3 if window is None else 4) * f, dtype=torch.int64, pin_memory=pin)
        self.h32[f:f + D + 1] = 1
        self.h32[2 * f:2 * f + D + 2] = torch.arange(D + 2, dtype=torch.int32)
        self.h32[3 * f:3 * f + 2] = torch.tensor([0, 1], dtype=torch.int32)
        self.h64[f:2 * f] = scratch_page * self.page
        self.h64[3 * f:] = local_scratch_page * self.page
        self.h_table = torch.full(((D + 1) * W,), scratch_page, dtype=torch.int32, pin_memory=pin)
        self.d32, self.d64 = self.h32.to(device), self.h64.to(device)
        self.f = f
        self.pos, self.lens, self.cu = self.d32[:D + P], self.d32[f:f + D + 1], self.d32[2 * f:2 * f + D + 2]
        self.piece_cu = self.d32[3 * f:3 * f + 2]
        self.ids, self.slots, self.logit_rows = self.d64[:D + P], self.d64[f:f + D + P], self.d64[2 * f:2 * f + D + 1]
        self.table = torch.full((D + 1, W), scratch_page, dtype=torch.int32, device=device)
        if window is not None:  # the sliding group's page table and slots, filled as the full group's
            self.h_local_table = torch.full(((D + 1) * W,), local_scratch_page, dtype=torch.int32, pin_memory=pin)
            self.local_table = torch.full((D + 1, W), local_scratch_page, dtype=torch.int32, device=device)
            self.local_slots = self.d64[3 * f:3 * f + D + P]
        self.copied = torch.cuda.Event() if pin else None  # the host buffers are refilled once it has passed
        self.classes = context_classes(max_context)
        self.graphs: dict[tuple[tuple[int, int, bool], int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture(sorted(keys, key=lambda k: (k[0] + k[1], k)))  # capture_graphs takes the most rows first

    def _capture(self, keys: list[tuple[int, int, bool]]) -> None:
        # a piece of P queries needs a class of at least P keys (its padding counts as queries)
        capture_graphs(self.graphs, keys, self.classes, self._forward, self.device, min_class=lambda k: k[1])

    def _forward(self, key: tuple[int, int, bool], max_len: int) -> torch.Tensor:
        d, p, ends = key
        meta = AttentionMetadata(positions=self.pos[:d + p], slot_mapping=self.slots[:d + p],
                                 block_table=self.table[:d + 1], seq_lens=self.lens[:d + 1],
                                 cu_seqlens_q=self.cu[:d + 2], max_seqlen_q=p,
                                 max_seqlen_k=max_len)  # bounds: the graph serves every step up to them
        if d:  # the decodes on the decode kernel, the piece apart (AttentionMetadata)
            meta.num_decodes, meta.chunk_cu_seqlens_q = d, self.piece_cu
            meta.decode_max_seqlen_k = meta.chunk_max_seqlen_k = max_len
        if self.window is not None:
            meta.local_slot_mapping, meta.local_block_table = self.local_slots[:d + p], self.local_table[:d + 1]
        return self.model.forward_paged(self.ids[:d + p], meta, self.cache, self.logit_rows[:d + ends],
                                        raw_logits=True)

    def key(self, counts: list[int], sampled: list[int]) -> tuple[int, int, bool] | None:
        """The key of the graph that replays a step of these per-sequence token counts, sampling the rows `sampled`,
        or None: decodes, each sampled, then one piece of more than one token, sampled where it ends its prompt."""
        n, c = len(counts) - 1, counts[-1]
        if c < 2 or any(x != 1 for x in counts[:-1]):
            return None
        ends = sampled == list(range(n + 1))
        if not ends and sampled != list(range(n)):
            return None
        d = next((x for x in self.buckets[ends] if x >= n), None)
        p = None if d is None else next((x for x in self.buckets[ends][d] if x >= c), None)
        return None if p is None else (d, p, ends)

    def run(self, key: tuple[int, int, bool], work: list[tuple[list[int], int, list[int]]],
            ids: torch.Tensor | None, local_tables: list[list[int]] | None = None) -> torch.Tensor:
        """work as EngineCore._forward's, with key(its counts, its sampled rows). ids: the step's tokens on the device
        (async scheduling; work's lists then give only counts), or None. local_tables: each sequence's pages in the
        sliding group (its freed entries on its scratch page), where there is one. Returns the raw logits
        [n + ends, vocab] of the n decodes and, where it ends its prompt, the piece's last token."""
        d, p, ends = key
        n, f, c = len(work) - 1, self.f, len(work[-1][0])
        if self.copied is not None:
            self.copied.synchronize()
        h32, h64 = self.h32.numpy(), self.h64.numpy()
        lens, cu = h32[f:f + d + 1], h32[2 * f:2 * f + d + 2]
        width = fill_piece_step(work, d, p, self.page, self.scratch, h32[:d + p], lens, h64[f:f + d + p], h64[:d + p],
                                self.h_table.numpy(), ids is None)
        if self.window is not None:
            local_width = fill_piece_pages(local_tables, d, p, c, self.page, self.local_scratch, h32[:d + p],
                                           h64[3 * f:3 * f + d + p], self.h_local_table.numpy())
        cu[:d + 1], cu[d + 1] = np.arange(d + 1), d + c  # an earlier step's d + c may sit in [0, d]
        h32[3 * f + 1] = c
        logit_rows = h64[2 * f:2 * f + d + 1]
        logit_rows[:n], logit_rows[n:] = np.arange(n), 0
        if ends:
            logit_rows[n] = d + c - 1
        self.d32.copy_(self.h32, non_blocking=True)
        self.d64.copy_(self.h64, non_blocking=True)
        self.table[:d + 1, :width].copy_(self.h_table[:(d + 1) * width].view(d + 1, width), non_blocking=True)
        if self.window is not None:
            self.local_table[:d + 1, :local_width].copy_(
                self.h_local_table[:(d + 1) * local_width].view(d + 1, local_width), non_blocking=True)
        if self.copied is not None:  # the host buffers are refilled once it has passed
            self.copied.record()
        if ids is not None:
            self.ids[:n].copy_(ids[:n])
            self.ids[d:d + c].copy_(ids[n:])
        longest = max(int(lens.max()), p)
        graph, logits = self.graphs[key, next(x for x in self.classes if x >= longest)]
        graph.replay()
        return logits[:n + ends]


def prompt_buckets(cfg, decode_buckets: list[int], max_num_batched_tokens: int,
                   max_context: int) -> list[tuple[int, int]]:
    """A prompt's last piece's (decode bucket, token bucket) pairs (PieceGraphs): 0 and the decode graphs' buckets up
    to PROMPT_MAX_DECODES, beside PROMPT_BUCKETS up to the context, within the step's token budget and
    PROMPT_GRAPH_FLOPS of the layers' linears."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    values = cfg.num_layers * cfg.hidden_size * (2 * q + 2 * kv + 3 * cfg.intermediate_size)  # q, o, k, v, MLP
    decodes = [0] + [d for d in decode_buckets if d <= PROMPT_MAX_DECODES]
    return [(d, p) for d in decodes for p in PROMPT_BUCKETS
            if p <= max_context and d + p <= max_num_batched_tokens and 2 * values * (d + p) <= PROMPT_GRAPH_FLOPS]


def piece_keys(cfg, decode_buckets: list[int], max_num_batched_tokens: int, max_context: int, prompts: bool,
               chunk: int) -> list[tuple[int, int, bool]]:
    """PieceGraphs' keys: with prompts, a prompt's last piece at prompt_buckets; with a chunk cap shorter than the
    context, chunks of that many tokens beside each decode bucket up to CHUNK_MAX_DECODES."""
    keys = [(d, p, True) for d, p in prompt_buckets(cfg, decode_buckets, max_num_batched_tokens, max_context)] \
        if prompts else []
    if 1 < chunk < max_context:
        keys += [(d, chunk, False) for d in decode_buckets if d <= CHUNK_MAX_DECODES]
    return keys


def try_piece_graphs(engine, scratch_page: int, max_num_batched_tokens: int, chunk: int, prompts: bool):
    """PieceGraphs at piece_keys where decode graphs run; else None."""
    if engine.graphs is None:
        return None
    keys = piece_keys(engine.cfg, engine.graphs.buckets, max_num_batched_tokens, engine.max_context, prompts, chunk)
    if not keys:
        return None
    bm = engine.block_manager
    try:
        return PieceGraphs(engine.model, engine.cache, scratch_page, keys, engine.max_context, engine.device, bm.window,
                           bm.local_scratch)
    except RuntimeError as e:
        capture_failed(e, "prompt pieces run eagerly")
        return None
