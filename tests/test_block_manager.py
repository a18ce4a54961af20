"""The block manager and the scheduler on their own (no model): reference counts, the prefix cache's hash
chain and LRU eviction, chunked prefill under the token budget, preemption of the newest sequence, tokens in
flight (async scheduling)."""
import pytest

from minfer.engine.block_manager import BlockManager, page_hash
from minfer.engine.scheduler import Scheduler
from minfer.engine.sequence import Sequence, Status
from minfer.errors import MinferError
from minfer.sampling import SamplingParams

PAGE = 4


def seq(tokens, name="r", max_tokens=8):
    return Sequence(name, list(tokens), SamplingParams(temperature=0.0), max_tokens, 0)


def run_prefill(bm, s):
    """Admits s with its cached prefix and computes all its tokens (what one engine step does)."""
    cached = bm.lookup(s)
    assert bm.allocate(s, s.num_tokens - len(cached) * PAGE, cached)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_pages(s)
    return cached


def test_hash_chain_depends_on_the_whole_prefix():
    a, b = page_hash(b"", [1, 2, 3, 4]), page_hash(b"", [1, 2, 3, 5])
    assert a != b
    assert page_hash(a, [9, 9, 9, 9]) != page_hash(b, [9, 9, 9, 9])  # equal page, different prefix
    assert page_hash(a, [9, 9, 9, 9]) == page_hash(page_hash(b"", [1, 2, 3, 4]), [9, 9, 9, 9])


def test_pages_refcounts_and_free():
    bm = BlockManager(8, PAGE)
    s = seq(range(10))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_pages == 5
    assert all(bm.ref_count[p] == 1 for p in s.block_table)
    s.num_computed_tokens = 10
    assert bm.allocate(s, 1) and len(s.block_table) == 3  # token 11 fits in page 3
    s.num_computed_tokens = 12
    assert bm.allocate(s, 1) and len(s.block_table) == 4
    bm.free_pages(s)
    assert s.block_table == [] and bm.num_free_pages == 8 and not any(bm.ref_count)


def test_allocate_fails_without_changes_when_short():
    bm = BlockManager(3, PAGE)
    s = seq(range(20))
    assert not bm.allocate(s, 20)
    assert s.block_table == [] and bm.num_free_pages == 3


def test_prefix_hit_shares_pages_and_stops_before_the_last_token():
    bm = BlockManager(16, PAGE)
    a = seq(range(10), "a")
    assert run_prefill(bm, a) == []
    assert len(bm.cached) == 2  # two full pages of a registered; the third holds 2 tokens
    b = seq(list(range(8)) + [50, 51, 52], "b")  # shares a's first two pages
    cached = run_prefill(bm, b)
    assert cached == a.block_table[:2] and b.block_table[:2] == cached
    assert [bm.ref_count[p] for p in cached] == [2, 2]
    assert b.num_cached_tokens == 8 and bm.hit_tokens == 8 and bm.query_tokens == 10 + 11
    # a prompt that is exactly two cached pages: the last token is computed again, so only page 1 hits
    c = seq(range(8), "c")
    assert bm.lookup(c) == a.block_table[:1]
    for s in (a, b):
        bm.free_pages(s)
    assert bm.num_free_pages == 16 and not any(bm.ref_count)  # nothing leaked; cached pages are free


def test_freed_cached_pages_come_back_until_evicted_lru():
    bm = BlockManager(6, PAGE)
    a = seq(range(9), "a")  # pages: [0..3] [4..7] [8]
    run_prefill(bm, a)
    pages_a = list(a.block_table)
    bm.free_pages(a)
    # the un-hashed tail page is reused first; the cached ones stay
    x = seq([100], "x")
    assert bm.allocate(x, 1) and x.block_table == [pages_a[2]]
    assert len(bm.cached) == 2
    bm.free_pages(x)
    # a returns: its two full pages are found again
    a2 = seq(range(9), "a2")
    assert run_prefill(bm, a2) == pages_a[:2]
    bm.free_pages(a2)
    # a big request needs every page: cached pages are evicted, the prefix's tail (page 2 of a) first
    order = list(bm.free)
    assert order.index(pages_a[1]) < order.index(pages_a[0])
    y = seq(range(200, 220), "y")  # 5 pages
    assert bm.allocate(y, 20)
    assert pages_a[1] in y.block_table and len(bm.cached) == 1
    assert bm.lookup(seq(range(9))) == [pages_a[0]]
    bm.free_pages(y)


def test_reset_prefix_cache_keeps_pages_in_use():
    bm = BlockManager(8, PAGE)
    a, b = seq(range(9), "a"), seq(range(100, 109), "b")
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free_pages(a)
    bm.reset_prefix_cache()
    assert bm.lookup(seq(range(9))) == [] and len(bm.lookup(seq(range(100, 109)))) == 2


def test_no_prefix_caching():
    bm = BlockManager(8, PAGE, prefix_caching=False)
    a = seq(range(9))
    run_prefill(bm, a)
    assert bm.cached == {} and bm.lookup(seq(range(9))) == []


# ---- scheduler ----

def step(sched, sampled_token=7):
    """schedule() and what the engine does after the forward: tokens computed, one token for each
    sequence that has all its tokens computed."""
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_tokens):
        s.num_computed_tokens += n
        sched.bm.register_full_pages(s)
        if s.num_computed_tokens == s.num_tokens:
            s.append(sampled_token)
            if s.num_output_tokens >= s.max_tokens:
                sched.finish(s, "length")
    return {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}


def test_chunked_prefill_under_the_budget_with_decodes_first():
    sched = Scheduler(BlockManager(64, PAGE), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(seq(range(3), "short"))
    assert step(sched) == {"short": 3}
    sched.add(seq(range(100, 125), "long"))  # 25 tokens: chunks of 9, 9, 7 beside the decode of "short"
    assert step(sched) == {"short": 1, "long": 9}
    assert step(sched) == {"short": 1, "long": 9}
    assert step(sched) == {"short": 1, "long": 7}
    assert step(sched) == {"short": 1, "long": 1}


def test_long_prefill_threshold_caps_chunks_beside_decodes_only():
    sched = Scheduler(BlockManager(64, PAGE), max_num_seqs=8, max_num_batched_tokens=20,
                      long_prefill_token_threshold=6)
    sched.add(seq(range(10), "alone"))
    sched.add(seq(range(50, 57), "second"))
    assert step(sched) == {"alone": 10, "second": 7}  # no decodes yet: the whole budget, no cap
    sched.add(seq(range(100, 116), "long"))  # 16 tokens: chunks of 6, 6, 4 beside the two decodes
    assert step(sched) == {"alone": 1, "second": 1, "long": 6}
    assert step(sched) == {"alone": 1, "second": 1, "long": 6}
    assert step(sched) == {"alone": 1, "second": 1, "long": 4}
    for s in list(sched.running):
        sched.finish(s, "abort")
    sched.add(seq(range(200, 216), "lone"))
    assert step(sched) == {"lone": 16}  # a step of prompts alone takes the whole budget


def test_max_num_seqs_caps_the_running_set():
    sched = Scheduler(BlockManager(64, PAGE), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(seq(range(10 * i, 10 * i + 3), f"r{i}", max_tokens=2))
    assert step(sched) == {"r0": 3, "r1": 3}
    assert step(sched) == {"r0": 1, "r1": 1}  # both finish (2 tokens each)
    assert step(sched) == {"r2": 3}


def test_preemption_takes_the_newest_and_it_comes_back():
    bm = BlockManager(4, PAGE)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = seq(range(7), "old", max_tokens=8), seq(range(100, 107), "new", max_tokens=8)
    sched.add(old)
    sched.add(new)
    assert step(sched) == {"old": 7, "new": 7}  # 2 pages each: the pool is full
    assert step(sched) == {"old": 1, "new": 1}  # positions 7: still in page 2
    # position 8 needs a third page for each: "new" (the newest) is preempted, its pages freed
    assert step(sched) == {"old": 1}
    assert new.status == Status.WAITING and new.block_table == [] and sched.waiting[0] is new
    assert new.output_ids == [7, 7] and sched.num_preemptions == 1  # what it generated is kept
    while old.status != Status.FINISHED:
        step(sched)
    # "new" is readmitted and recomputes its prompt and output; then it goes on to its 8 tokens
    ran = step(sched)
    assert ran == {"new": 9}
    while new.status != Status.FINISHED:
        step(sched)
    assert new.num_output_tokens == 8 and bm.num_free_pages == 4


def test_request_larger_than_the_pool_is_refused():
    sched = Scheduler(BlockManager(4, PAGE), max_num_seqs=4, max_num_batched_tokens=64)
    with pytest.raises(MinferError, match="more than the 4 pages"):
        sched.add(seq(range(10), max_tokens=7))


def test_pages_filled_by_chunks_and_decodes_are_registered():
    bm = BlockManager(16, PAGE)
    s = seq(range(6), "s")
    assert bm.allocate(s, 3)  # a first chunk: page 1 part-filled
    s.num_computed_tokens = 3
    bm.register_full_pages(s)
    assert bm.allocate(s, 3)  # the rest of the prompt fills page 1
    s.num_computed_tokens = 6
    bm.register_full_pages(s)
    assert len(bm.cached) == 1
    for t in (6, 7):  # two decodes fill page 2
        s.append(100 + t)
        assert bm.allocate(s, 1)
        s.num_computed_tokens += 1
        bm.register_full_pages(s)
    assert len(bm.cached) == 2
    assert bm.lookup(seq(s.token_ids + [5])) == s.block_table[:2]


def test_slots_and_tokens_in_flight():
    """Async scheduling's view: a token sampled but not read yet (in flight) counts as a token; a sequence whose
    in-flight token is its last is not scheduled; a page filled by a token computed from an in-flight id is
    registered once the id is known; each running sequence has a slot of its own until it finishes."""
    bm = BlockManager(16, PAGE)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=64)
    a, b = seq(range(3), "a", max_tokens=2), seq(range(10, 13), "b", max_tokens=8)
    sched.add(a)
    sched.add(b)

    def launch():  # the step's tokens computed, one id sampled for each (not read yet)
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_computed_tokens += n
            s.in_flight += 1
        return {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}

    def read(s, token):
        s.in_flight -= 1
        s.append(token)
        bm.register_full_pages(s)

    assert launch() == {"a": 3, "b": 3} and sorted([a.slot, b.slot]) == [0, 1]
    assert launch() == {"a": 1, "b": 1}  # decodes of the in-flight ids
    assert b.num_computed_tokens == 4 and b.in_flight == 2
    bm.register_full_pages(b)
    assert bm.cached == {}  # b's first page holds the KV of an id not read yet
    read(a, 7)
    read(b, 7)
    assert len(bm.cached) == 2 and a.num_tokens == 5  # a's first page and b's
    assert launch() == {"b": 1}  # a's in-flight id is its second and last
    read(a, 8)
    slot = a.slot
    sched.finish(a, "length")
    assert a.slot == -1 and sched.free_slots[-1] == slot
    c = seq(range(20, 23), "c")
    sched.add(c)
    assert launch() == {"b": 1, "c": 3} and c.slot not in (-1, b.slot)
