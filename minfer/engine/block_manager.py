"""The page pool of the paged KV cache: which pages each sequence holds, and prefix caching.

Pages are reference-counted: a page of a cached prefix may sit in several block tables at once. A full
page (page_size tokens whose K and V are written) is registered under a hash of its tokens chained to the
previous page's hash, so that equal hashes mean equal prefixes (vLLM's automatic prefix caching). A page
whose count falls to 0 goes to the free queue but keeps its contents and hash: a later request with the
same prefix takes it back, until allocation evicts it, least recently freed first.

A model with sliding-window layers (window) has a second pool for them, of plain pages: a sequence gets a
local page with each full page, and gives it back once every key in it is older than the window of its next
query. Prefix caching is off then: a prefix hit would skip tokens whose local keys are gone.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .sequence import Sequence


def page_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a full page: its tokens and the hash of the page before it (b"" for the first page)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True, window: int | None = None,
                 num_local_pages: int = 0):
        assert window is None or not prefix_caching, "prefix caching keeps no local pages"
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.ref_count = [0] * num_pages
        self.hash_of: list[bytes | None] = [None] * num_pages  # the page's prefix-cache key, if registered
        self.cached: dict[bytes, int] = {}  # hash -> page
        # Pages with count 0, oldest first: allocation takes from the front. Pages without a hash go to the
        # front (nothing to keep), cached ones to the back (kept longest).
        self.free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages))
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache ...
        self.hit_tokens = 0  # ... and found there
        self.window, self.num_local_pages = window, num_local_pages
        self.local_scratch = num_local_pages  # the cache's extra local page: freed entries point at it
        self.local_free = list(range(num_local_pages))  # the sliding group's free pages (nothing kept in them)

    @property
    def num_free_pages(self) -> int:
        """Pages that allocation can hand out (free ones, cached or not)."""
        return len(self.free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def local_pages_for(self, num_tokens: int, chunk: int) -> int:
        """The most local pages a sequence of num_tokens tokens holds at once, computing at most chunk tokens a
        step: the window - 1 keys before its first new token and the new ones, a page more where they straddle."""
        return min(self.pages_for(num_tokens), self.pages_for(self.window - 1 + chunk) + 1)

    def _hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """Hashes of the sequence's first num_pages full pages (kept on the sequence: tokens never change)."""
        hashes = seq.page_hashes
        while len(hashes) < num_pages:
            i = len(hashes)
            hashes.append(page_hash(hashes[-1] if hashes else b"", seq.token_ids[i * self.page_size:(i + 1) * self.page_size]))
        return hashes[:num_pages]

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached pages of the sequence's longest cached prefix. They stop before its last token: that
        token is computed again, for its logits."""
        if not self.prefix_caching:
            return []
        pages = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.page_size):
            page = self.cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_pages: list[int] = ()) -> bool:
        """Gives the sequence pages for num_new_tokens more tokens after its computed ones; on admission,
        cached_pages (from lookup) become its first pages and their tokens count as computed. Returns False,
        changing nothing (but the release of local pages out of its window), when a pool is short."""
        if self.window is not None:
            self._release_window(seq)
        if not cached_pages and seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.page_size:
            return True  # a running sequence within its last page: the common decode step
        taken_free = sum(1 for p in cached_pages if self.ref_count[p] == 0)  # they leave the free queue
        have = len(seq.block_table) + len(cached_pages)
        computed = seq.num_computed_tokens + len(cached_pages) * self.page_size
        need = self.pages_for(computed + num_new_tokens) - have
        if need > self.num_free_pages - taken_free or (self.window is not None and need > len(self.local_free)):
            return False
        if not seq.block_table:  # admission: count the lookup; the cached pages are registered already
            self.query_tokens += seq.num_tokens
            self.hit_tokens += len(cached_pages) * self.page_size
            seq.num_cached_tokens = len(cached_pages) * self.page_size
            seq.num_registered_pages = len(cached_pages)
        for p in cached_pages:
            if self.ref_count[p] == 0:
                del self.free[p]
            self.ref_count[p] += 1
        seq.block_table.extend(cached_pages)
        seq.num_computed_tokens = computed
        for _ in range(need):
            page, _ = self.free.popitem(last=False)
            if self.hash_of[page] is not None:  # evict: its contents are about to be overwritten
                del self.cached[self.hash_of[page]]
                self.hash_of[page] = None
            self.ref_count[page] = 1
            seq.block_table.append(page)
        if self.window is not None:  # a local page with each full one (no cached pages: prefix caching is off)
            seq.local_block_table += [self.local_free.pop() for _ in range(need)]
        return True

    def _release_window(self, seq: Sequence) -> None:
        """Frees the local pages whose keys are all older than the window of the sequence's next query (at
        num_computed_tokens): keys < num_computed_tokens - window + 1 are never read again. Their entries
        point at the scratch page, so that a stray read stays in the pool."""
        dead = (seq.num_computed_tokens - self.window + 1) // self.page_size  # pages wholly before the window
        for i in range(seq.num_local_freed, dead):
            self.local_free.append(seq.local_block_table[i])
            seq.local_block_table[i] = self.local_scratch
        seq.num_local_freed = max(seq.num_local_freed, dead)

    def register_full_pages(self, seq: Sequence) -> None:
        """Offers the sequence's pages that became full (all their tokens computed) to the prefix cache.
        A page whose hash is already cached (another sequence computed the same prefix) stays private. A
        token computed from an id still in flight (async scheduling) waits: its page's hash needs the id."""
        full = min(seq.num_computed_tokens, len(seq.token_ids)) // self.page_size
        if not self.prefix_caching or full <= seq.num_registered_pages:
            return
        for i, h in enumerate(self._hashes(seq, full)[seq.num_registered_pages:], seq.num_registered_pages):
            page = seq.block_table[i]
            if h not in self.cached and self.hash_of[page] is None:
                self.cached[h], self.hash_of[page] = page, h
        seq.num_registered_pages = max(seq.num_registered_pages, full)

    def free_pages(self, seq: Sequence) -> None:
        """Releases the sequence's pages, last page first: a prefix's tail is evicted before its head,
        which more requests share."""
        for page in reversed(seq.block_table):
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                self.free[page] = None
                if self.hash_of[page] is None:
                    self.free.move_to_end(page, last=False)
        self.local_free += seq.local_block_table[seq.num_local_freed:]
        # new lists, not cleared ones: the decode graphs know a running sequence's tables by identity
        seq.block_table, seq.num_computed_tokens, seq.num_registered_pages = [], 0, 0
        seq.local_block_table, seq.num_local_freed = [], 0

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page that no sequence holds."""
        for page in self.free:
            if self.hash_of[page] is not None:
                del self.cached[self.hash_of[page]]
                self.hash_of[page] = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
