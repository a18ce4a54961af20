"""The whole engine on the cuda backend, static and continuous: every layer on our kernels, and the same
greedy text as the fp32 reference backend on the default model."""
import os

import pytest
import torch

from minfer import loader, shapes
from minfer.engine import Engine
from minfer.engine.core import EngineCore, step_metadata
from minfer.ops import DENSE_OPS, PAGED_OPS
from minfer.sampling import SamplingParams

pytestmark = pytest.mark.gpu
MODEL_PATH = os.path.join(loader.cache_dir(), loader.DEFAULT_MODEL_FILE)
needs_model = pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason=f"default model not at {MODEL_PATH}")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def reference_tokens():
    ref = Engine(dtype=torch.float32, device="cuda", backend="ref")
    out, _ = ref.generate([ref.encode(PROMPT, chat=False)], SamplingParams(temperature=0), 8)
    return out[0].token_ids


@needs_model
def test_every_op_runs_on_our_kernels():
    eng = Engine(dtype=torch.float16, device="cuda", backend="cuda")
    assert eng.ops.fallbacks == [], f"ops still on ref: {eng.ops.fallbacks}"
    from minfer.ops import cuda
    assert all(getattr(eng.ops, op) is getattr(cuda, op) for op in DENSE_OPS + PAGED_OPS)


@needs_model
def test_continuous_greedy_matches_reference(reference_tokens):
    core = EngineCore(dtype=torch.float16, device="cuda", backend="cuda", max_context=512, num_pages=64)
    outs, _ = core.generate([core.encode(PROMPT, chat=False)], [SamplingParams(temperature=0, max_tokens=8)])
    assert outs[0].token_ids == reference_tokens


@needs_model
def test_continuous_batch_with_prefix_hits_and_chunks():
    """Chunked prefill (a 40-token budget), prefix-cache hits and decodes mixed in steps: each request's
    first tokens equal its own run alone, without the cache."""
    def make(**kw):
        return EngineCore(dtype=torch.float16, device="cuda", backend="cuda", max_context=512, num_pages=128, **kw)
    solo, core = make(prefix_caching=False), make(max_num_batched_tokens=40)
    stem = "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who"
    prompts = [solo.encode(p, chat=False) for p in (stem + " built", PROMPT, stem + " sold", "def fibonacci(n):")]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [solo.generate([p], [greedy])[0][0].token_ids for p in prompts]
    core.generate(prompts[:1], [greedy])  # the stem's pages into the prefix cache
    outs, stats = core.generate(prompts, [greedy] * len(prompts))
    assert stats.cached_tokens > 0
    for a, o in zip(alone, outs):
        assert o.token_ids[:4] == a[:4]


@needs_model
def test_mixed_step_decodes_apart_against_fp32():
    """A step of decodes, then prompt chunks: the decodes attend on the split-KV decode kernel and the chunks
    on the prefill kernel (AttentionMetadata.num_decodes). Against the fp32 reference on the same cache (random
    K and V, pages out of order): the rows' mean error (each row's largest) within 2x that of one prefill call
    for the whole step. One row's error is noisy (30 fp16 layers amplify rounding), a mean over 14 is not;
    a decode attending the wrong keys is off by whole units."""
    starts = [3, 17, 40, 90, 160, 255, 300, 511, 700, 901, 1200, 1500]  # the decodes' positions
    spans = [([11 + i], p) for i, p in enumerate(starts)] + [(list(range(20, 60)), 100), (list(range(60, 69)), 0)]

    def make(dtype, backend):
        return EngineCore(dtype=dtype, device="cuda", backend=backend, max_context=2048, num_pages=400)
    core, ref = make(torch.float16, "cuda"), make(torch.float32, "ref")
    page = core.block_manager.page_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i in range(len(core.cache.k)):
        for ours, theirs in ((core.cache.k[i], ref.cache.k[i]), (core.cache.v[i], ref.cache.v[i])):
            ours.copy_(torch.randn(ours.shape, generator=gen, device="cuda"))
            theirs.copy_(ours.float())
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(1)).tolist()
    work = []
    for new_ids, start in spans:  # (new ids, start position, pages)
        n = -(-(start + len(new_ids)) // page)
        work.append((new_ids, start, perm[:n]))
        perm = perm[n:]

    def logits(engine, apart):
        meta, ids, rows = step_metadata(work, page, None, True, None, engine.device)
        assert meta.num_decodes == len(starts)
        if not apart:
            meta.num_decodes = 0
        return engine.model.forward_paged(ids, meta, engine.cache, rows)  # [rows, vocab]

    want = logits(ref, False)
    whole_err = (logits(core, False) - want).abs().amax(1).mean().item()
    apart_err = (logits(core, True) - want).abs().amax(1).mean().item()
    assert 0 < apart_err <= 2 * whole_err, (apart_err, whole_err)


@needs_model
def test_async_scheduling_equals_sync():
    """Decode steps from graphs, launched before the ids of the step before are read (their ids gathered on
    the device): the synchronous engine's tokens, greedy and seeded, with requests ending at other lengths."""
    def make(async_scheduling):
        return EngineCore(dtype=torch.float16, device="cuda", backend="cuda", max_context=256, num_pages=64,
                          async_scheduling=async_scheduling)
    sync, fast = make(False), make(True)
    assert fast.graphs is not None
    prompts = [sync.encode(p, chat=False) for p in (PROMPT, "def fibonacci(n):", "Water boils at")]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=2, max_tokens=17, ignore_eos=True)]
    want = [o.token_ids for o in sync.generate(prompts, params)[0]]
    assert [o.token_ids for o in fast.generate(prompts, params)[0]] == want


@needs_model
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_greedy_matches_reference(dtype, reference_tokens):
    eng = Engine(dtype=dtype, device="cuda", backend="cuda")
    out, stats = eng.generate([eng.encode(PROMPT, chat=False)], SamplingParams(temperature=0), 8)
    assert len(reference_tokens) == 8
    if dtype == torch.float16:  # the acceptance check: fp16 kernels reproduce fp32 greedy decoding
        assert out[0].token_ids == reference_tokens
    else:  # bf16 has 3 fewer mantissa bits; require the answer itself (" Paris.")
        assert out[0].token_ids[:2] == reference_tokens[:2]
    assert stats.decode_tok_s > 0


@needs_model
def test_batched_generation_matches_single():
    eng = Engine(dtype=torch.float16, device="cuda", backend="cuda")
    prompts = [eng.encode(p, chat=False) for p in (PROMPT, "Water boils at a temperature of", "Hi")]
    batch, _ = eng.generate(prompts, SamplingParams(temperature=0), 12)
    for p, out in zip(prompts, batch):
        single, _ = eng.generate([p], SamplingParams(temperature=0), 12)
        # Different batch shapes take different GEMM paths; the first tokens must agree.
        assert single[0].token_ids[:4] == out.token_ids[:4]


@pytest.fixture(scope="module")
def graph_core():
    return EngineCore(dtype=torch.float16, device="cuda", backend="cuda", max_context=256, num_pages=1024,
                      max_num_seqs=256)  # every bucket; 4 pages a sequence


@pytest.fixture(scope="module")
def fp32_core():
    return EngineCore(dtype=torch.float32, device="cuda", backend="ref", max_context=256, num_pages=1024,
                      max_num_seqs=256)


@needs_model
def test_decode_graph_context_classes():
    """Each bucket has a graph per context class; a step replays the smallest class that holds its longest
    sequence, with the same logits as the step run eagerly."""
    core = EngineCore(dtype=torch.float16, device="cuda", backend="cuda", max_context=2000, num_pages=300,
                      max_num_seqs=4)
    assert core.graphs.classes == [256, 1024, 2000] and len(core.graphs.graphs) == 3 * 3
    gen = torch.Generator().manual_seed(0)
    for length in (100, 700, 1500):  # one sequence in each class
        toks = torch.randint(0, 1000, (length + 1,), generator=gen).tolist()
        pages = list(range(-(-(length + 1) // 16)))
        core._forward([(toks[:-1], 0, pages)], core.cache)
        eager = core._forward([([toks[-1]], length, pages)], core.cache).clone()
        graphed = core.graphs.run([toks[-1]], [length], [pages]).clone()
        torch.testing.assert_close(graphed, eager, atol=5e-2, rtol=1e-2)


@needs_model
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 128, 200, 256])
def test_decode_graph_every_bucket(graph_core, fp32_core, n):
    """A decode step replayed from its bucket's graph (padding rows on the scratch page) against the fp32
    reference on the same pages: the rows' mean error (each row's largest) within 2x that of the same step
    run eagerly. The bucket's linears run at its padded row count, which may take another GEMM than the
    eager step's (200 rows replay at 256), so the two differ by fp16 rounding, not bit for bit."""
    core = graph_core
    assert core.graphs is not None and core.graphs.buckets == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert core.graphs.classes == [256]  # max_context 256: one class
    gen = torch.Generator().manual_seed(n)
    lens = [5 + (7 * i) % 50 for i in range(n)]  # at most 4 pages of 16
    seqs = [(torch.randint(0, 1000, (m + 1,), generator=gen).tolist(), list(range(4 * i, 4 * i + 4)))
            for i, m in enumerate(lens)]
    prompts = [(toks[:-1], 0, pages) for toks, pages in seqs]  # the prompts' KV
    step = [([toks[-1]], len(toks) - 1, pages) for toks, pages in seqs]
    fp32_core._forward(prompts, fp32_core.cache)
    want = fp32_core._forward(step, fp32_core.cache)  # [n, vocab]
    core._forward(prompts, core.cache)
    eager = core._forward(step, core.cache).clone()  # rewrites the same newest rows
    graphed = core.graphs.run([toks[-1] for toks, _ in seqs], [len(toks) - 1 for toks, _ in seqs],
                              [pages for _, pages in seqs]).clone()
    eager_err = (eager.float() - want).abs().amax(1).mean().item()
    graphed_err = (graphed.float() - want).abs().amax(1).mean().item()
    assert 0 < graphed_err <= 2 * eager_err, (graphed_err, eager_err)
    assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean() > 0.95


@needs_model
@pytest.mark.parametrize("n", [1, 5, 8])
def test_norms_in_the_linears(fp32_core, n):
    """The default model (Q4_1 linears on regs_kernel) takes its norms and residual adds in the linears' launches up
    to 8 rows, not past them; at its hidden of 576 a step's logits so equal, bit for bit, the same step with the norms
    and adds in launches of their own (each rounded, and each norm summed, in the same order), and are close to the
    fp32 reference."""
    core = EngineCore(dtype=torch.float16, device="cuda", backend="cuda", max_context=256, num_pages=256,
                      max_num_seqs=64, cuda_graph_sizes=[1])
    model = core.model
    assert all(model._norms_in_linears(torch.empty(rows, 1, device="cuda", dtype=torch.float16)) == (rows <= 8)
               for rows in (1, 8, 9))
    gen = torch.Generator().manual_seed(n)
    seqs = [(torch.randint(0, 1000, (20 + 3 * i,), generator=gen).tolist(), list(range(4 * i, 4 * i + 4)))
            for i in range(n)]  # at most 41 tokens: 3 pages of 16
    prompts = [(toks[:-1], 0, pages) for toks, pages in seqs]
    step = [([toks[-1]], len(toks) - 1, pages) for toks, pages in seqs]
    fp32_core._forward(prompts, fp32_core.cache)
    want = fp32_core._forward(step, fp32_core.cache)  # [n, vocab]
    core._forward(prompts, core.cache)
    fused = core._forward(step, core.cache).clone()
    model._fused_norms[n] = False
    apart = core._forward(step, core.cache).clone()
    assert torch.equal(fused, apart)
    assert (fused.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def piece_step(gen, lens: list[int], start: int, c: int):
    """Work for a step of decodes beside one prompt piece, on consecutive pages of 16 tokens: sequences of `lens`
    tokens before the step, each decoding one more, and a prompt whose tokens [start, start + c) are the piece, with
    one token more, decoded after it. Returns the work before the step (the decodes' tokens before it, the prompt's
    first `start`), the step's, the one after and the sequences' pages."""
    toks = [torch.randint(0, 1000, (m + 1,), generator=gen).tolist() for m in lens]
    prompt = torch.randint(0, 1000, (start + c + 1,), generator=gen).tolist()
    pages, first = [], 0
    for m in lens + [start + c + 1]:
        pages.append(list(range(first, first + -(-(m + 1) // 16))))
        first = pages[-1][-1] + 1
    before = [(t[:-1], 0, pg) for t, pg in zip(toks, pages)] + ([(prompt[:start], 0, pages[-1])] if start else [])
    step = [([t[-1]], len(t) - 1, pg) for t, pg in zip(toks, pages)] + [(prompt[start:-1], start, pages[-1])]
    return before, step, [([prompt[-1]], start + c, pages[-1])], pages


def test_chunk_graphs_match_eager():
    """A step of n decodes beside a prompt chunk of up to 32 tokens that does not end its prompt, replayed from its
    (decode bucket, 32 tokens, context class) graph (padding rows up to both), gives the decodes' logits of the same
    step run eagerly."""
    core = EngineCore(dtype=torch.float16, device="cuda", backend="cuda", max_context=2000, num_pages=400,
                      max_num_seqs=8, long_prefill_token_threshold=32, random_weights=shapes.config("smollm2-135m"))
    graphs = core.piece_graphs
    assert graphs is not None and graphs.buckets == {False: {1: [32], 2: [32], 4: [32], 8: [32]}, True: {}}
    assert graphs.classes == [256, 1024, 2000] and len(graphs.graphs) == 4 * 3
    gen = torch.Generator().manual_seed(0)
    for n, start, c in ((1, 100, 32), (3, 700, 20), (8, 1500, 32)):  # the chunk's context in each class
        before, step, _, _ = piece_step(gen, [40 + 9 * i for i in range(n)], start, c)
        core._forward(before, core.cache)
        eager = core._forward(step, core.cache, list(range(n))).clone()  # [n, vocab]; rewrites the same rows
        key = graphs.key([1] * n + [c], list(range(n)))
        assert key == ({1: 1, 3: 4, 8: 8}[n], 32, False)
        graphed = graphs.run(key, step, None).clone()
        torch.testing.assert_close(graphed, eager, atol=5e-2, rtol=1e-2)
        assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean() > 0.8


def test_prompt_graphs_match_eager():
    """A prompt's last piece of 2-512 tokens, after 0 or more cached tokens, alone or beside decodes, replayed from
    its (decode bucket, token bucket, context class) graph (padding rows up to both buckets) gives the logits of the
    decodes and of its last token that the same step gives eagerly, and writes the same K and V: the piece's next
    token decodes (eagerly) to the same logits after either. The engine takes the graphs for such steps."""
    core = EngineCore(dtype=torch.float16, device="cuda", backend="cuda", max_context=2000, num_pages=400,
                      max_num_seqs=4, random_weights=shapes.config("smollm2-135m"), prompt_graphs=True)
    graphs = core.piece_graphs
    assert graphs is not None and graphs.buckets == {False: {}, True: {d: [16, 32, 64, 128, 256, 512] for d in
                                                                       (0, 1, 2, 4)}}
    assert graphs.classes == [256, 1024, 2000]
    assert len(graphs.graphs) == 4 * (5 * 3 + 2)  # each pair in the classes of at least P keys
    assert graphs.key([17], [0]) == (0, 32, True) and graphs.key([1, 1, 1, 512], [0, 1, 2, 3]) == (4, 512, True)
    assert graphs.key([1], [0]) is graphs.key([513], [0]) is graphs.key([1] * 5 + [17], list(range(6))) is None
    assert graphs.key([17], []) is graphs.key([1, 17], [1]) is graphs.key([2, 17], [0, 1]) is None
    gen = torch.Generator().manual_seed(0)
    agree = []
    # (decodes, the piece's tokens, its cached tokens): each token bucket, the three classes, 0-4 decodes
    for n, c, start in ((0, 2, 0), (0, 16, 0), (1, 17, 0), (3, 100, 40), (2, 300, 700), (4, 512, 0), (0, 33, 1500)):
        before, step, after, _ = piece_step(gen, [30 + 41 * i for i in range(n)], start, c)
        if before:
            core._forward(before, core.cache)
        eager = core._forward(step, core.cache).clone()  # [n + 1, vocab]
        eager_next = core._forward(after, core.cache).clone()
        graphed = graphs.run(graphs.key([1] * n + [c], list(range(n + 1))), step, None).clone()  # the same rows
        graphed_next = core._forward(after, core.cache).clone()
        torch.testing.assert_close(graphed, eager, atol=5e-2, rtol=1e-2)
        torch.testing.assert_close(graphed_next, eager_next, atol=5e-2, rtol=1e-2)
        agree += (graphed.argmax(-1) == eager.argmax(-1)).tolist()
    assert sum(agree) >= 0.8 * len(agree)  # random weights: near ties may flip by the padded rows' other GEMMs

    core.warmup()  # its request's prompt would take a graph too
    used = []
    run = graphs.run
    graphs.run = lambda key, work, *rest: used.append([len(t) for t, _, _ in work]) or run(key, work, *rest)
    prompts = [torch.randint(0, 1000, (m,), generator=gen).tolist() for m in (77, 20)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 4)]
    core.generate(prompts[:1], params[:1])  # alone: the piece's graph, then decode graphs
    assert used == [[77]]
    core.add_request(prompts[0], params[0])  # a prefix hit (4 pages): a piece of 13, then decodes ...
    for _ in range(4):
        core.step()
    core.add_request(prompts[1], params[1])  # ... that another request joins
    lengths = {}
    while core.has_unfinished():
        for o in core.step():
            lengths[o.request_id] = (len(o.token_ids), o.finish_reason)
    graphs.run = run
    assert used[1:] == [[13], [1, 20]] and sorted(lengths.values()) == [(4, "length"), (12, "length")]


def test_windowed_piece_graphs_match_eager():
    """A sliding-window model (the gemma-3-270m shape: window 512, bf16): steps of 0-4 decodes beside a prompt's
    last piece or a 32-token chunk, before and past the window, replayed from PieceGraphs with both groups' page
    tables give the logits of the same steps run eagerly, and write the same K and V (the next token's logits)."""
    core = EngineCore(dtype=torch.bfloat16, device="cuda", backend="cuda", max_context=2000, num_pages=400,
                      max_num_seqs=4, long_prefill_token_threshold=32, random_weights=shapes.config("gemma-3-270m"),
                      prompt_graphs=True)
    graphs = core.piece_graphs
    assert graphs is not None and graphs.window == 512 and graphs.buckets[False] == {1: [32], 2: [32], 4: [32]}
    gen = torch.Generator().manual_seed(0)
    agree = []
    # (decodes, the piece's tokens, its context before, ends its prompt): inside the window and past it
    for n, c, start, ends in ((0, 300, 0, True), (1, 100, 600, True), (3, 32, 900, False), (4, 17, 1500, True)):
        before, step, after, pages = piece_step(gen, [30 + 41 * i for i in range(n)], start, c)
        # the sliding group's pages: other ids in its own pool, none freed (the window masks the keys before it)
        local = [[x + 200 for x in pg] for pg in pages]
        if before:
            core._forward(before, core.cache, local_tables=local[:n] + (local[-1:] if start else []))
        rows = list(range(n + ends))
        key = graphs.key([1] * n + [c], rows)
        assert key is not None and key[2] == ends
        eager = core._forward(step, core.cache, rows, local_tables=local).float().clone()  # [n + ends, vocab]
        eager_next = core._forward(after, core.cache, local_tables=local[-1:]).float().clone()
        graphed = graphs.run(key, step, None, local).float().clone()  # rewrites the same rows
        graphed_next = core._forward(after, core.cache, local_tables=local[-1:]).float().clone()
        assert (graphed - eager).abs().amax() <= 0.05 * eager.abs().amax()
        assert (graphed_next - eager_next).abs().amax() <= 0.05 * eager_next.abs().amax()
        agree += (graphed.argmax(-1) == eager.argmax(-1)).tolist()
    assert sum(agree) >= 0.8 * len(agree)  # random weights: near ties may flip by the padded rows' other GEMMs
