"""Sliding-window layers in the continuous engine keep only their window in the paged KV cache (fp32, CPU, ref
backend, random tiny models): greedy outputs equal transformers' for prompts longer than the window and than a
step's chunk, also under preemption and through the decode graphs' metadata (graphs emulated on the CPU); the
local pages a sequence holds stay within the window's bound; both pools are whole again after every run; a
pool too small is a clear error."""
import pytest
import torch

from minfer.engine.block_manager import BlockManager
from minfer.engine.core import EngineCore
from minfer.engine.scheduler import Scheduler
from minfer.engine.sequence import Sequence
from minfer.errors import MinferError
from minfer.sampling import SamplingParams

from test_continuous import with_emulated_graphs
from test_gemma3 import CONFIG as GEMMA3, VOCAB
from test_models import build_hf, write_tokenizer

transformers = pytest.importorskip("transformers")

CONTEXT, PAGE, CHUNK, NEW = 64, 4, 8, 14
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (folder, HF model, window): Gemma 3 (windowed and full layers, window 8), Mistral (every layer
    windowed, window 6), Qwen2 (a full layer and a windowed one, window 5)."""
    out = {}
    folder = tmp_path_factory.mktemp("gemma3")
    torch.manual_seed(0)
    gemma = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**GEMMA3)).float().eval()
    with torch.no_grad():
        for name, p in gemma.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p))
    gemma.save_pretrained(folder)
    write_tokenizer(folder)
    out["gemma3"] = (folder, gemma, GEMMA3["sliding_window"])
    for case, window in (("mistral_window", 6), ("qwen2_window", 5)):
        folder = tmp_path_factory.mktemp(case)
        out[case] = (folder, build_hf(case, folder), window)
    return out


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (19, 4, 27, 11)]


@pytest.fixture(scope="module")
def hf_outputs(models, prompts):
    out = {}
    for name, (_, hf, _) in models.items():
        with torch.no_grad():
            out[name] = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
                         for p in prompts]
    return out


def make(folder, **kw):
    kw = {"num_pages": 64, "max_num_batched_tokens": CHUNK, "max_num_seqs": 3, **kw}
    return EngineCore(str(folder), dtype=torch.float32, device="cpu", backend="ref", max_context=CONTEXT,
                      page_size=PAGE, **kw)


def assert_idle(engine):
    """Nothing running, every page of both pools free."""
    bm = engine.block_manager
    assert not engine.has_unfinished() and not engine.seqs
    assert bm.num_free_pages == bm.num_pages and not any(bm.ref_count)
    assert sorted(bm.local_free) == list(range(bm.num_local_pages))


@pytest.mark.parametrize("name", ["gemma3", "mistral_window", "qwen2_window"])
@pytest.mark.parametrize("kw", [{}, {"num_pages": 14}], ids=["plain", "preempting"])
def test_greedy_matches_hf(models, prompts, hf_outputs, name, kw, capsys):
    """Prompts past the window and past a step's chunk, decoded past the window, three at a time; 14 pages
    of 4 hold about one sequence and a half: the others are preempted and computed again."""
    folder, _, window = models[name]
    engine = make(folder, **kw)
    assert capsys.readouterr().err == ""  # prefix caching is off for such a model, by default without a notice
    bm = engine.block_manager
    assert bm.window == window and not bm.prefix_caching
    outs, stats = engine.generate(prompts, [GREEDY] * len(prompts))
    assert [o.token_ids for o in outs] == hf_outputs[name]
    assert stats.preemptions > 0 or not kw
    assert_idle(engine)


@pytest.mark.parametrize("asked", [None, True, False])
def test_prefix_caching_is_off_with_windows(models, asked, capsys):
    """By default without a word; asked for (--enable-prefix-caching), with a notice."""
    folder, _, _ = models["gemma3"]
    assert not make(folder, prefix_caching=asked).block_manager.prefix_caching
    assert ("prefix caching is off" in capsys.readouterr().err) == (asked is True)


def test_local_pages_stay_within_the_window(models, prompts, hf_outputs):
    """While a sequence prefills in chunks and decodes, it holds the local pages of its window and its new
    tokens alone (a page more where they straddle pages); the ones before point at the scratch page."""
    folder, _, window = models["gemma3"]
    engine = make(folder, async_scheduling=True)
    bm = engine.block_manager
    engine.add_request(prompts[2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), "long")
    seq, held, full, tokens = engine.seqs["long"], [], [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens = o.token_ids
        if seq.block_table:
            live = seq.local_block_table[seq.num_local_freed:]
            assert seq.local_block_table[:seq.num_local_freed] == [bm.local_scratch] * seq.num_local_freed
            assert len(seq.local_block_table) == len(seq.block_table)
            assert sorted(live + bm.local_free) == list(range(bm.num_local_pages))  # the others are free
            # none freed that the next query (at num_computed_tokens) may still see
            assert seq.num_local_freed * PAGE <= max(0, seq.num_computed_tokens - window + 1)
            held.append(len(live))
            full.append(len(seq.block_table))
    assert tokens[:NEW] == hf_outputs["gemma3"][2]
    assert max(held) <= bm.local_pages_for(CONTEXT, CHUNK) == -(-(window - 1 + CHUNK) // PAGE) + 1
    assert held[-1] <= -(-window // PAGE) + 1  # decoding: a window
    assert max(full) == -(-(27 + 30 - 1) // PAGE)  # the full layers keep every computed position
    assert_idle(engine)


def test_graph_metadata_equals_eager(models, prompts, hf_outputs, monkeypatch):
    """Decode steps through DecodeGraphs.run (a page table per group, the local entries before each window on
    the scratch page) give the eager steps' tokens, with preemption and ids chained on the device."""
    folder, _, _ = models["gemma3"]
    engine = with_emulated_graphs(make(folder, num_pages=14, async_scheduling=True), monkeypatch)
    runs, graphed = [], engine.graphs.run

    def spy(*args):
        runs.append(args)
        return graphed(*args)

    monkeypatch.setattr(engine.graphs, "run", spy)
    outs, stats = engine.generate(prompts, [GREEDY] * len(prompts))
    assert [o.token_ids for o in outs] == hf_outputs["gemma3"]
    assert len(runs) > 10 and stats.preemptions > 0
    assert any(isinstance(args[0], torch.Tensor) for args in runs)  # chained: ids on the device
    assert all(args[4] is not None for args in runs)  # the sliding group's tables
    assert_idle(engine)


@pytest.mark.parametrize("name", ["gemma3", "mistral_window"])
def test_piece_graph_metadata_equals_eager(models, prompts, hf_outputs, name, monkeypatch):
    """Steps of decodes beside one prompt piece through PieceGraphs.run (both groups' page tables and slots, the
    sliding group's freed entries on its scratch page): prompts' ends padded to a token bucket and chunks of 3
    beside decodes give transformers' tokens, prompts arriving while others decode, past the window."""
    from test_continuous import run_arriving
    folder, _, _ = models[name]
    engine = with_emulated_graphs(make(folder, max_num_batched_tokens=32, long_prefill_token_threshold=3,
                                       async_scheduling=True), monkeypatch, chunk=3, prompts=True)
    runs, graphed = [], engine.piece_graphs.run

    def spy(key, work, ids, local_tables):
        runs.append((key, local_tables))
        return graphed(key, work, ids, local_tables)

    monkeypatch.setattr(engine.piece_graphs, "run", spy)
    assert run_arriving(engine, prompts, every=2, params=GREEDY) == hf_outputs[name]
    assert any(not ends for (_, _, ends), _ in runs)  # chunks
    assert any(ends and d for (d, _, ends), _ in runs) and any(ends and not d for (d, _, ends), _ in runs)  # ends
    assert all(local is not None for _, local in runs)
    assert_idle(engine)


def test_memory_split(models):
    """Without --num-pages (CPU): the sliding pool holds a window and a page per running sequence and a step's
    chunk; the full group gets max_num_seqs contexts. Mistral has no full layers: its full pages take nothing."""
    for name in ("gemma3", "mistral_window"):
        folder, _, window = models[name]
        engine = make(folder, num_pages=None)
        cache, bm = engine.cache, engine.block_manager
        assert bm.num_local_pages == 3 * (-(-window // PAGE) + 1) + CHUNK // PAGE == cache.num_local_pages - 1
        assert bm.num_pages == 3 * CONTEXT // PAGE == cache.num_pages - 1
        full_layers = [k for k, w in zip(cache.k, engine.model.windows) if w is None]
        assert all(k.shape[0] == bm.num_pages + 1 for k in full_layers)
        assert all(k.shape[0] == bm.num_local_pages + 1 for k, w in zip(cache.k, engine.model.windows) if w)
        assert (cache.pools[0].numel() == 0) == (name == "mistral_window")


def test_pool_too_small_is_a_clear_error(models, prompts):
    folder, _, _ = models["gemma3"]
    with pytest.raises(MinferError, match="pages of 4 tokens in the KV cache"):
        make(folder, num_pages=4).add_request(prompts[2], GREEDY)
    sched = Scheduler(BlockManager(64, PAGE, prefix_caching=False, window=8, num_local_pages=4), 3, CHUNK)
    with pytest.raises(MinferError, match="sliding-window layers"):
        sched.add(Sequence("0", prompts[2], GREEDY, NEW, 0))
