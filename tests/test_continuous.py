"""The continuous-batching engine on the default model (fp32, CPU, ref backend): every request's output in a
continuous batch equals its output alone, whatever the batch does (different lengths, arrivals mid-run,
prefill in chunks, preemption forced by a tiny page pool, prefix-cache hits); seeded sampling is
batch-invariant; async scheduling gives the synchronous engine's tokens and text; decode steps through
the graph path's metadata (graphs emulated on the CPU) give the eager ones; after every test all pages are
free (cached or not); bad input is a clear error."""
import dataclasses
import itertools
import os

import numpy as np
import pytest
import torch

from minfer import loader, shapes
from minfer.engine.core import EngineCore, step_metadata
from minfer.engine.graphs import DecodeGraphs, PieceGraphs, piece_keys
from minfer.errors import MinferError
from minfer.llm import LLM
from minfer.sampling import SamplingParams

MODEL_PATH = os.path.join(loader.cache_dir(), loader.DEFAULT_MODEL_FILE)
pytestmark = pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason=f"default model not at {MODEL_PATH}")

CONTEXT, PAGE = 96, 4
PROMPTS = ["The capital of France is",
           "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker",
           "def fibonacci(n):",
           "Water boils at",
           "List of prime numbers: 2, 3, 5, 7,"]
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=16, ignore_eos=True)


def make(**kw):
    kw = {"max_num_batched_tokens": 64, "num_pages": 256, "page_size": PAGE, **kw}
    return EngineCore(None, dtype=torch.float32, device="cpu", backend="ref", max_context=CONTEXT, **kw)


@pytest.fixture(scope="module")
def engine():
    return make()


@pytest.fixture(scope="module")
def ids(engine):
    return [engine.encode(p, chat=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(ids):
    """Each prompt alone on an engine without prefix caching: the oracle."""
    solo = make(prefix_caching=False)
    return [solo.generate([p], [GREEDY])[0][0].token_ids for p in ids]


def assert_idle(engine):
    """Nothing running or waiting, and every page free (cached pages count as free)."""
    bm = engine.block_manager
    assert not engine.has_unfinished() and not engine.seqs
    assert bm.num_free_pages == bm.num_pages and not any(bm.ref_count)


def test_batch_equals_alone(engine, ids, alone):
    outs, stats = engine.generate(ids, [GREEDY] * len(ids))
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and len(o.token_ids) == 16 for o in outs)
    assert stats.tokens == 16 * len(ids) and stats.prompt_tokens == sum(map(len, ids))
    assert_idle(engine)


def test_alone_equals_the_static_engine(ids, alone):
    from minfer.engine import Engine
    static = Engine(None, dtype=torch.float32, device="cpu", backend="ref", max_context=CONTEXT)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert static.generate([ids[0]], params, 16, ignore_eos=True)[0][0].token_ids == alone[0]


def run_arriving(engine, ids, every: int, params: SamplingParams = GREEDY) -> list[list[int]]:
    """Each prompt added `every` steps after the one before, through add_request / step; the output ids."""
    done, pending, steps = {}, list(enumerate(ids)), 0
    while pending or engine.has_unfinished():
        if pending and steps % every == 0:
            i, p = pending.pop(0)
            engine.add_request(p, params, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:])] = out.token_ids
        steps += 1
    return [done[i] for i in range(len(ids))]


def test_arrivals_mid_run(engine, ids, alone):
    """Requests join while others decode."""
    assert run_arriving(engine, ids, every=3) == alone
    assert_idle(engine)


@pytest.mark.parametrize("kw", [{"max_num_batched_tokens": 8, "max_num_seqs": 4},
                                {"long_prefill_token_threshold": 3}], ids=["budget", "threshold"])
def test_chunked_prefill(ids, alone, kw):
    """The 20-token prompt prefills in several steps: under a small budget, or in chunks of 3 beside decodes
    (arriving while the others decode)."""
    small = make(**kw)
    assert run_arriving(small, ids, every=2) == alone
    assert_idle(small)


def test_priority_scheduling(ids, alone, monkeypatch):
    """--scheduling-policy priority: one sequence at a time, they start in (priority, arrival) order, where fcfs
    starts them as they came; with a tiny pool the victims are the last in that order (here never the first
    request); every output is its output alone. A priority on an fcfs engine, or one per prompt missing, is an
    error that queues nothing."""
    priorities = [5, 0, 1, 0, 9]
    for policy, want in [("fcfs", [0, 1, 2, 3, 4]), ("priority", [1, 3, 2, 0, 4])]:
        one = make(max_num_seqs=1, scheduling_policy=policy)
        started = []
        outs, _ = one.generate(ids, [GREEDY] * len(ids), lambda i, out: started.count(i) or started.append(i),
                               priorities if policy == "priority" else None)
        assert started == want and [o.token_ids for o in outs] == alone
        assert_idle(one)
    # the urgent request comes last, into a full pool: fcfs would preempt it, the newest, first (async scheduling:
    # a victim may have a token in flight)
    tiny = make(num_pages=24, scheduling_policy="priority", async_scheduling=True)
    victims, preempt = [], tiny.scheduler._preempt
    monkeypatch.setattr(tiny.scheduler, "_preempt", lambda seq: victims.append(seq.request_id) or preempt(seq))
    done, steps = {}, 0
    for i in (1, 2, 3, 4):
        tiny.add_request(ids[i], GREEDY, request_id=f"r{i}", priority=1)
    while tiny.has_unfinished() or not done:
        if steps == 6:
            tiny.add_request(ids[0], GREEDY, request_id="r0", priority=0)
        done.update((out.request_id, out.token_ids) for out in tiny.step() if out.finished)
        steps += 1
    assert victims and "r0" not in victims and [done[f"r{i}"] for i in range(len(ids))] == alone
    assert_idle(tiny)
    llm = LLM(dtype="float32", device="cpu", backend="ref", max_model_len=CONTEXT, max_num_seqs=1,
              scheduling_policy="priority")
    started = []
    outs = llm.generate([ids[0], ids[1]], dataclasses.replace(GREEDY, n=2), use_tqdm=False, priority=[1, 0],
                        on_output=lambda i, out: started.count(i) or started.append(i))
    assert started == [1, 0] and [o.token_ids for o in outs] == alone[:2]
    fcfs = make()
    for bad, message in [([0, 1, 0, 0, 0], "need --scheduling-policy priority"), ([0], "5 requests and 1 priorities")]:
        with pytest.raises(MinferError, match=message):
            fcfs.generate(ids, [GREEDY] * len(ids), priorities=bad)
    with pytest.raises(MinferError, match="priority must be an integer, not True"):
        tiny.add_request(ids[0], GREEDY, priority=True)
    with pytest.raises(MinferError, match="--scheduling-policy must be one of fcfs, priority"):
        make(scheduling_policy="lifo")
    assert_idle(fcfs)
    assert_idle(tiny)


def test_preemption_never_loses_a_request(ids, alone):
    # 24 pages of 4: one sequence needs at most 10, all five together about 40
    tiny = make(num_pages=24)
    outs, stats = tiny.generate(ids, [GREEDY] * len(ids))
    assert stats.preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert_idle(tiny)


@pytest.mark.parametrize("kw", [{}, {"num_pages": 24}, {"max_num_batched_tokens": 8, "async_scheduling": True}],
                         ids=["plain", "preempting", "chunked-async"])
def test_prompt_logprobs_are_the_prompts_own_in_any_batch(ids, alone, kw):
    """prompt_logprobs (checked against transformers in test_gguf.py) are a prompt's own whatever the batch does:
    with the prefix cache holding the prompt (not taken: a cached token has no logits), under preemption, in chunks
    over several steps beside decodes, with async scheduling; the tokens are as without them, the others' too."""
    long = max(ids, key=len)
    asked = SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    (want,), _ = make(prefix_caching=False).generate([long], [asked])
    eng = make(**kw)
    eng.generate(ids, [GREEDY] * len(ids))  # the prefix cache holds every prompt
    outs, stats = eng.generate(ids + [long], [GREEDY] * len(ids) + [asked])
    got = outs[-1]
    assert got.token_ids == want.token_ids == alone[ids.index(long)]
    assert [o.token_ids for o in outs[:-1]] == alone and (stats.preemptions > 0) == ("num_pages" in kw)
    assert got.num_cached_tokens == 0 or stats.preemptions  # readmitted with its prompt logprobs done: it may hit
    assert len(got.prompt_logprobs) == len(long) and got.prompt_logprobs[0] is None
    for e, w, token in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], long[1:]):
        assert e["token_id"] == w["token_id"] == token and [i for i, _ in e["top"]] == [i for i, _ in w["top"]]
        assert e["logprob"] == pytest.approx(w["logprob"], abs=1e-4)  # chunks change fp32's summation order
    assert outs[0].prompt_logprobs is None
    assert_idle(eng)


def test_prompt_logprobs_keep_few_logits_a_step(ids, monkeypatch):
    """The prompts whose logprobs are asked for keep at most PROMPT_LOGPROBS_CHUNK tokens' logits a step, all of
    them together (each row is [vocab] fp32); they take more steps for it and give the same logprobs."""
    from minfer.engine import scheduler
    asked = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    params = [asked, GREEDY, asked, asked]
    want, _ = make().generate(ids[:4], params)
    monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_CHUNK", 5)
    eng, kept = make(), []
    real = eng._prompt_rows

    def spy(seqs, counts):
        kept.append(real(seqs, counts)[0])
        return real(seqs, counts)

    monkeypatch.setattr(eng, "_prompt_rows", spy)
    got, _ = eng.generate(ids[:4], params)
    assert max(map(len, kept)) <= 5 < sum(map(len, kept)) and [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert (g.prompt_logprobs is None) == (w.prompt_logprobs is None)
        assert len(g.prompt_logprobs or []) == len(w.prompt_logprobs or [])
        for e, f in zip((g.prompt_logprobs or [None])[1:], (w.prompt_logprobs or [None])[1:]):
            assert e["token_id"] == f["token_id"] and e["logprob"] == pytest.approx(f["logprob"], abs=1e-4)
    assert_idle(eng)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_scored_alone(ids, alone, async_scheduling):
    """max_tokens 0 with prompt_logprobs scores the prompt alone: it is prefilled and finishes ("length") with no
    token sampled, so a prompt of the whole context fits; the requests beside it get their own tokens. Without
    prompt_logprobs max_tokens 0 is still an error, and a prompt past the context still has no room."""
    full = (ids[1] * CONTEXT)[:CONTEXT]
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    (want,), _ = make().generate([full[:-1]], [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)])
    eng = make(async_scheduling=async_scheduling)
    outs, _ = eng.generate([full, ids[0], ids[2][:1]], [scored, GREEDY, scored])
    assert [(o.token_ids, o.finish_reason) for o in (outs[0], outs[2])] == [([], "length")] * 2
    assert outs[1].token_ids == alone[0] and outs[2].prompt_logprobs == [None]
    assert len(outs[0].prompt_logprobs) == CONTEXT
    for e, w in zip(outs[0].prompt_logprobs[1:-1], want.prompt_logprobs[1:]):
        assert e["token_id"] == w["token_id"] and e["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
    with pytest.raises(MinferError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for prompt, params in [(full + full[:1], scored), (full, GREEDY)]:
        with pytest.raises(MinferError, match="no room"):
            eng.add_request(prompt, params)
    assert_idle(eng)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("budget, chunk", [(8, 256), (64, 8)], ids=["budget", "logprobs-chunk"])
def test_prompt_scored_alone_ends_in_a_chunk_of_one(ids, async_scheduling, budget, chunk, monkeypatch):
    """A prompt scored alone whose chunks leave its last token to a step of its own (17 tokens in chunks of 8: under
    the step's budget, or PROMPT_LOGPROBS_CHUNK, as a 257-token prompt at the default) runs that token too, though
    no token is sampled after it: it finishes with the prompt logprobs of one whole chunk."""
    from minfer.engine import scheduler
    prompt = (ids[1] * 2)[:17]
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    (want,), _ = make().generate([prompt], [scored])
    monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_CHUNK", chunk)
    eng = make(async_scheduling=async_scheduling, max_num_batched_tokens=budget)
    (got,), _ = eng.generate([prompt], [scored])
    assert (got.token_ids, got.finish_reason, len(got.prompt_logprobs)) == ([], "length", 17)
    for e, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert e["token_id"] == w["token_id"] and e["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
    assert_idle(eng)


def test_prefix_cache_hits_and_same_outputs(engine, ids, alone):
    engine.generate(ids, [GREEDY] * len(ids))  # fills the cache
    outs, stats = engine.generate(ids, [GREEDY] * len(ids))
    # every prompt's full pages (but never its last token) come from the cache
    assert stats.cached_tokens == sum((len(p) - 1) // PAGE * PAGE for p in ids)
    assert all(o.num_cached_tokens == (len(p) - 1) // PAGE * PAGE for o, p in zip(outs, ids))
    assert [o.token_ids for o in outs] == alone
    # a prompt whose every page is cached still computes its last token's logits
    whole = ids[1][:len(ids[1]) // PAGE * PAGE]
    out, _ = engine.generate([whole], [GREEDY])
    assert len(out[0].token_ids) == 16
    assert_idle(engine)


def test_shared_prefix_in_one_batch(engine, ids):
    prefix = ids[1]
    prompts = [prefix + p for p in ids[:3]]
    first, _ = engine.generate(prompts[:1], [GREEDY])
    outs, stats = engine.generate(prompts, [GREEDY] * 3)
    assert stats.cached_tokens >= 2 * (len(prefix) // PAGE * PAGE)
    assert outs[0].token_ids == first[0].token_ids
    assert_idle(engine)


def test_seeded_sampling_is_batch_invariant(engine, ids):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=12, ignore_eos=True) for s in range(3)]
    alone = [engine.generate([p], [sp])[0][0].token_ids for p, sp in zip(ids[:3], params)]
    batched, _ = engine.generate(ids[:3], params)
    assert [o.token_ids for o in batched] == alone
    other, _ = engine.generate(ids[:1], [SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=12,
                                                        ignore_eos=True)])
    assert other[0].token_ids != alone[0]
    assert_idle(engine)


def test_stops_and_logprobs(engine, ids):
    """Stop strings cut the greedy text where they first match (the expected texts come from the same run without
    them: " Paris. ..." on this prompt)."""
    full = engine.generate([ids[0]], [SamplingParams(temperature=0.0, max_tokens=20)])[0][0].text
    par, dot, ari = full.index(" Par"), full.index("."), full.index("ari")
    assert full.startswith(" Paris", par) and par < ari < dot  # the cases below need such a text
    chat = engine.encode("What is 2+2? Answer with one number.", chat=True)
    outs, _ = engine.generate([chat, ids[0]], [SamplingParams(temperature=0.0, max_tokens=40),
                                               SamplingParams(temperature=0.0, max_tokens=20, stop=["."], logprobs=3)])
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) < 40  # the model ends its turn
    assert outs[1].finish_reason == "stop" and outs[1].text == full[:dot]
    # the stop string kept (vLLM's include_stop_str_in_output); of two matches at one place, the longer
    (kept,), _ = engine.generate([ids[0]], [SamplingParams(temperature=0.0, max_tokens=20, stop=[" Par", " Paris"],
                                                           include_stop_str_in_output=True)])
    assert kept.finish_reason == "stop" and kept.text == full[:par + len(" Paris")]
    (cut,), _ = engine.generate([ids[0]], [SamplingParams(temperature=0.0, max_tokens=20, stop=["ari", "."],
                                                          include_stop_str_in_output=True)])
    assert cut.text == full[:ari + len("ari")]
    lp = outs[1].logprobs
    assert len(lp) == len(outs[1].token_ids) and all(len(e["top"]) == 3 for e in lp)
    assert all(e["top"][0][0] == e["token_id"] and e["logprob"] == e["top"][0][1] <= 0 for e in lp)  # greedy
    assert_idle(engine)


def test_logit_bias(engine, ids):
    """A banned token (-100) gives way to the runner-up that the unbiased logprobs name, at every step; +100 forces
    a token; a row without a bias in the same steps is as alone. Bad biases are errors, nothing queued."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (plain, other), _ = engine.generate(ids[:2], [SamplingParams(temperature=0.0, max_tokens=1, logprobs=2), greedy])
    (first, _), (runner_up, _) = plain.logprobs[0]["top"]
    outs, _ = engine.generate([ids[0], ids[0], ids[1]], [
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={first: -100}),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={42: 100}), greedy])
    assert outs[0].token_ids[0] == runner_up and first not in outs[0].token_ids
    assert outs[1].token_ids == [42] * 4 and outs[2].token_ids == other.token_ids
    for bad, needle in [({engine.cfg.vocab_size: 1.0}, "out of range"), ({1: 101}, r"\[-100, 100\]"),
                        ({1: float("nan")}, "--logit-bias"), ({"1": 1.0}, "--logit-bias"), ([1], "dict")]:
        with pytest.raises(ValueError, match=needle):
            engine.add_request(ids[0], dataclasses.replace(greedy, logit_bias=bad))
    assert_idle(engine)


def test_allowed_token_ids(engine, ids):
    """vLLM's allowed_token_ids: every token drawn is one of them, greedy the one of the highest raw logit; a row
    without them in the same steps is as alone; beside a constraint, the ids both allow. Bad ids are errors."""
    (plain,), _ = engine.generate([ids[0]], [SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)])
    (first, _), (second, _), (third, _) = plain.logprobs[0]["top"]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs, _ = engine.generate([ids[0], ids[0], ids[1]], [
        dataclasses.replace(greedy, allowed_token_ids=[third, second]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, allowed_token_ids=[7, 9, 11]),
        greedy])
    assert outs[0].token_ids[0] == second and set(outs[0].token_ids) <= {second, third}
    assert set(outs[1].token_ids) <= {7, 9, 11} and len(outs[1].token_ids) == 6
    assert outs[2].token_ids == engine.generate([ids[1]], [greedy])[0][0].token_ids
    for bad, needle in [([], "non-empty list"), (["1"], "token ids"), ([engine.cfg.vocab_size], "out of range")]:
        with pytest.raises(MinferError, match=needle):
            engine.add_request(ids[0], dataclasses.replace(greedy, allowed_token_ids=bad))
    assert_idle(engine)
    # beside a structured output's mask (ids 1-3 here), the ids both allow
    from minfer.ops.reference import unpack_bitmask
    from minfer.sampling import SamplingTensors
    words = np.zeros((2, 2), np.int32)
    words[:, 0] = 0b1110
    t = SamplingTensors.build([dataclasses.replace(greedy, allowed_token_ids=[2, 3, 4]), greedy], [0, 0], [0, 0],
                              [[1], [1]], [[], []], 40, "cpu", allowed=words)
    allowed = unpack_bitmask(t.allowed, 40)
    assert [torch.nonzero(r).flatten().tolist() for r in allowed] == [[2, 3], [1, 2, 3]]


def test_min_tokens(engine):
    """min_tokens: the stop ids and stop strings wait for it. Where the model would end its turn, the runner-up that
    the plain run's logprobs name comes instead; the output is at least min_tokens long."""
    chat = engine.encode("What is 2+2? Answer with one number.", chat=True)
    (plain,), _ = engine.generate([chat], [SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)])
    n = len(plain.token_ids)
    assert plain.finish_reason == "stop" and n < 30
    (longer, cut), _ = engine.generate([chat, chat], [
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=n + 5),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=n + 5, stop=[plain.text[:2]])])
    assert longer.token_ids[:n] == plain.token_ids and len(longer.token_ids) >= n + 5
    eos_step = engine.generate([chat + plain.token_ids], [SamplingParams(temperature=0.0, max_tokens=1, logprobs=2,
                                                                          ignore_eos=True)])[0][0].logprobs[0]
    assert eos_step["top"][0][0] in engine.stop_ids and longer.token_ids[n] == eos_step["top"][1][0]
    assert cut.token_ids[:n + 5] == longer.token_ids[:n + 5]  # its stop string came in the first tokens: no cut
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert_idle(engine)


def test_abort(engine, ids):
    a = engine.add_request(ids[0], GREEDY)
    b = engine.add_request(ids[1], GREEDY)
    engine.step()
    engine.abort_request(a)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert {o.request_id for o in outs} == {b}
    assert_idle(engine)


def test_mixed_step_decodes_apart_equal_one_call():
    """A step of decodes then a prompt chunk runs its decodes' attention apart (AttentionMetadata.num_decodes);
    the logits equal one attention call over the whole step."""
    core = make()  # its own pages: this test writes K and V where no sequence owns them
    pages = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16, 17]]
    work = [([11], 4, pages[0]), ([12], 16, pages[1]), ([13], 4 * PAGE + 1, pages[2]),
            (list(range(20, 29)), 3, pages[3])]  # (new ids, start position, pages)
    meta, ids, rows = step_metadata(work, PAGE, None, True, None, core.device)
    assert (meta.num_decodes, meta.decode_max_seqlen_k, meta.chunk_max_seqlen_k) == (3, 4 * PAGE + 2, 12)
    apart = core.model.forward_paged(ids, meta, core.cache, rows)
    meta.num_decodes = 0
    whole = core.model.forward_paged(ids, meta, core.cache, rows)
    # fp32: the reference attention pads each call to its own longest sequence and rounds differently
    # (~1e-5 of the logits' scale of 20); a row attended wrongly would be off by whole units.
    torch.testing.assert_close(apart, whole, rtol=0, atol=1e-3)


def test_prefix_caching_is_on_by_default(engine):
    assert engine.block_manager.prefix_caching and not make(prefix_caching=False).block_manager.prefix_caching


def test_bad_input(engine, ids):
    with pytest.raises(MinferError, match="no room to generate"):
        engine.add_request(list(range(CONTEXT)), GREEDY)
    with pytest.raises(MinferError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(MinferError, match="--presence-penalty"):
        SamplingParams(presence_penalty=3)
    for bad, name in [({"top_p": 1.5}, "--top-p"), ({"min_p": 1.0}, "--min-p"), ({"logprobs": -1}, "logprobs"),
                      ({"frequency_penalty": 2.5}, "--frequency-penalty"),
                      ({"frequency_penalty": -2.5}, "--frequency-penalty")]:
        with pytest.raises(MinferError, match=name):
            SamplingParams(**bad)
    # the edges of those ranges are good
    SamplingParams(top_p=1.0, min_p=0.999, logprobs=0, frequency_penalty=2.0)
    SamplingParams(frequency_penalty=-2.0)
    with pytest.raises(MinferError, match="empty prompt"):
        engine.add_request([], GREEDY)
    with pytest.raises(MinferError, match="out of range"):
        engine.add_request([engine.cfg.vocab_size], GREEDY)
    with pytest.raises(MinferError, match="pages"):
        make(num_pages=4).add_request(ids[1], GREEDY)
    with pytest.raises(MinferError, match="--max-num-batched-tokens"):
        make(max_num_batched_tokens=0)
    with pytest.raises(MinferError, match="--long-prefill-token-threshold"):
        make(long_prefill_token_threshold=-1)
    for bad, flag in [({"gpu_memory_utilization": 0}, "--gpu-memory-utilization"),
                      ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization"),
                      ({"gpu_memory_utilization": float("nan")}, "--gpu-memory-utilization"),
                      ({"num_pages": 0}, "--num-pages"), ({"page_size": 0}, "--block-size"),
                      ({"max_num_seqs": 2**17}, "--max-num-seqs"), ({"max_num_batched_tokens": 2**21},
                                                                   "--max-num-batched-tokens"),
                      ({"page_size": 2**17}, "--block-size"), ({"num_pages": 2**40}, "--num-pages")]:
        with pytest.raises(MinferError, match=flag):
            make(**bad)
    with pytest.raises(MinferError, match="--cuda-graph-sizes"):
        make(cuda_graph_sizes=[0, 8])
    with pytest.raises(MinferError, match="out of range"):  # all or none: the good first one is not queued either
        engine.add_requests([(ids[0], GREEDY, None), ([engine.cfg.vocab_size], GREEDY, None)])
    with pytest.raises(MinferError, match="given twice"):
        engine.add_requests([(ids[0], GREEDY, "a"), (ids[1], GREEDY, "a")])
    assert_idle(engine)


def test_llm_api():
    llm = LLM(dtype="float32", device="cpu", backend="ref", max_model_len=CONTEXT, block_size=PAGE, num_pages=64)
    outs = llm.generate(["The capital of France is", "Water boils at"], SamplingParams(temperature=0.0, max_tokens=4))
    assert outs[0].text.startswith(" Paris") and len(outs) == 2
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("The capital of France is")
    assert llm.last_stats.tokens == 8
    (one,) = llm.generate({"prompt_token_ids": outs[0].prompt_token_ids}, SamplingParams(temperature=0.0, max_tokens=4))
    assert one.token_ids == outs[0].token_ids
    assert_idle(llm.engine)


def test_llm_n_completions_in_vllms_view():
    """SamplingParams.n: a prompt's n completions, seeded seed, seed + 1, ... (each equal to its run alone);
    .outputs lists them as vLLM's RequestOutput does, .prompt is the text given; on_output and the progress bar
    count prompts."""
    import dataclasses
    llm = LLM(dtype="float32", device="cpu", backend="ref", max_model_len=CONTEXT, block_size=PAGE, num_pages=64)
    ids = llm.get_tokenizer().encode(PROMPTS[2])
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=3, logprobs=0)
    seen = []
    outs = llm.generate([PROMPTS[0], {"prompt": PROMPTS[1]}, ids], sp, on_output=lambda i, o: seen.append(i))
    assert sorted(set(seen)) == [0, 1, 2]
    for out, prompt, text in zip(outs, [PROMPTS[0], PROMPTS[1], ids], [PROMPTS[0], PROMPTS[1], None]):
        assert out.prompt == text and [c.index for c in out.outputs] == [0, 1, 2]
        assert all(s.prompt == text for s in out.siblings)
        for c, comp in enumerate(out.outputs):
            (alone,) = llm.generate(prompt, dataclasses.replace(sp, n=1, seed=7 + c))
            assert (comp.token_ids, comp.text, comp.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
            assert comp.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in alone.logprobs), abs=1e-3)
        assert out.text == out.outputs[0].text and len({tuple(c.token_ids) for c in out.outputs}) > 1
    (one,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3))
    assert [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason) for c in one.outputs] == \
        [(0, one.text, one.token_ids, None, None, "length")]
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="LLM.generate makes n of them"):
        llm.engine.add_requests([(ids, SamplingParams(n=2), None)])
    assert_idle(llm.engine)


def test_llm_chat():
    """chat() renders each conversation with the model's template (generation prompt added) and generates from
    those ids; content parts read as their text joined by newlines (vLLM's LLM.chat); a bad conversation is a
    ValueError naming it, nothing queued."""
    llm = LLM(dtype="float32", device="cpu", backend="ref", max_model_len=CONTEXT, block_size=PAGE, num_pages=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    talk = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    ids = llm.get_tokenizer().encode_chat(talk)
    assert llm.get_tokenizer().decode(ids).endswith("assistant\n")  # SmolLM2's template opens the reply
    (out,) = llm.chat(talk, greedy)
    assert out.prompt_token_ids == ids and out.prompt == llm.get_tokenizer().apply_chat_template(talk)
    (plain,) = llm.generate({"prompt_token_ids": ids}, greedy)
    assert out.token_ids == plain.token_ids
    parts = [talk[0], {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                                   {"type": "input_text", "text": "of France?"}]}]
    joined = [talk[0], {"role": "user", "content": "What is the capital\nof France?"}]
    two = llm.chat([parts, [{"role": "user", "content": "Hi"}]], greedy)
    assert [o.prompt_token_ids for o in two] == [llm.get_tokenizer().encode_chat(joined),
                                                 llm.get_tokenizer().encode_chat([{"role": "user", "content": "Hi"}])]
    assert two[0].token_ids == llm.chat(joined, greedy)[0].token_ids
    # vLLM's render options: the reply's start given, continued; a template variable
    start = talk + [{"role": "assistant", "content": "The capital"}]
    (cont,) = llm.chat(start, greedy, add_generation_prompt=False, continue_final_message=True)
    assert llm.get_tokenizer().decode(cont.prompt_token_ids).endswith("assistant\nThe capital")  # its turn left open
    template = "{{ messages[-1].content }}{{ ' is' if verb else '' }}"
    outs = [llm.chat(talk, greedy, chat_template=template, chat_template_kwargs={"verb": v})[0] for v in (True, False)]
    assert [llm.get_tokenizer().decode(o.prompt_token_ids) for o in outs] == [talk[-1]["content"] + " is",
                                                                             talk[-1]["content"]]
    for bad, needle in [([], "list of"), ([[]], r"messages\[0\]"), ([talk, [{"content": "x"}]], r"messages\[1\]\[0\]"),
                        ([{"role": "user", "content": 5}], "content must be text"),
                        ([talk[0], {"role": "user", "content": 5}], r"^messages\[1\]: content must be text"),
                        ([{"role": "user", "content": [{"type": "image_url"}]}], "content parts")]:
        with pytest.raises(ValueError, match=needle):
            llm.chat(bad, greedy)
        assert_idle(llm.engine)


def test_llm_bad_input_is_a_value_error_and_leaves_it_usable():
    """A bad prompt or parameter is a MinferError (a ValueError) naming it, before any step; a call that fails
    midway through its prompts leaves nothing queued, so the next call runs as on a fresh LLM."""
    llm = LLM(dtype="float32", device="cpu", backend="ref", max_model_len=CONTEXT, block_size=PAGE, num_pages=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    want = llm.generate(PROMPTS[0], greedy)[0].token_ids
    bad_calls = [
        (lambda: llm.generate([PROMPTS[0], PROMPTS[3], [-1]], greedy), "out of range"),
        (lambda: llm.generate([PROMPTS[0], {"ids": [1]}], greedy), "prompt_token_ids"),
        (lambda: llm.generate([PROMPTS[0], None], greedy), "a prompt is text"),
        (lambda: llm.generate([[1.5, 2.7]], greedy), "integers"),
        (lambda: llm.generate(PROMPTS[0], {"temperature": 0}), "sampling_params"),
        (lambda: llm.generate(PROMPTS[:2], [greedy]), "2 prompts and 1 sampling params"),
    ]
    for call, needle in bad_calls:
        with pytest.raises(ValueError, match=needle):
            call()
        assert_idle(llm.engine)
    for bad, needle in [({"seed": float("nan")}, "--seed"), ({"seed": "x"}, "--seed"), ({"logprobs": True}, "logprobs"),
                        ({"stop": [5]}, "stop"), ({"repetition_penalty": 1e-46}, "--repetition-penalty"),
                        ({"temperature": 1e39}, "--temperature"), ({"top_k": 1.5}, "--top-k")]:
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="more than the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=10**6))
    changed = SamplingParams(temperature=0.0)
    changed.top_p = 0.0  # after construction: the engine checks it again
    with pytest.raises(ValueError, match="--top-p"):
        llm.generate(PROMPTS[0], changed)
    assert SamplingParams(stop=".").stop == ["."]  # one string, as vLLM takes it
    (again,) = llm.generate(PROMPTS[0], (greedy,))  # a tuple of params is a list
    assert again.token_ids == want
    for bad, needle in [({"dtype": "foo"}, "dtype"), ({"max_model_len": 0}, "max_model_len")]:
        with pytest.raises(ValueError, match=needle):
            LLM(**{"device": "cpu", "backend": "ref", **bad})


@pytest.mark.parametrize("kw", [{"max_model_len": 2}, {"max_model_len": 4}, {"num_pages": 1}])
def test_tiny_contexts_and_page_pools_run(kw):
    """The warm-up request fits whatever context or page pool the engine has."""
    llm = LLM(**{"dtype": "float32", "device": "cpu", "backend": "ref", "block_size": PAGE, **kw})
    (out,) = llm.generate([1], SamplingParams(temperature=0.0, max_tokens=1))
    assert len(out.token_ids) == 1


def test_llm_progress_bar(monkeypatch):
    """generate() shows a bar of the finished prompts and the output tok/s where a terminal would show it, and
    none with use_tqdm=False; the caller's on_output still sees every output."""
    import io

    import minfer.llm as llm_module
    bar_text, real = io.StringIO(), llm_module.tqdm
    monkeypatch.setattr(llm_module, "tqdm", lambda **kw: real(**{**kw, "file": bar_text, "disable": kw["disable"] or False}))
    llm = LLM(dtype="float32", device="cpu", backend="ref", max_model_len=CONTEXT, block_size=PAGE, num_pages=64)
    seen = []
    llm.generate(["Hi", "Water boils at"], SamplingParams(temperature=0.0, max_tokens=3, n=2),
                 on_output=lambda i, o: seen.append(i))
    assert "Processed prompts" in bar_text.getvalue() and "2/2" in bar_text.getvalue()  # prompts, not completions
    assert "3/2" not in bar_text.getvalue() and "4/2" not in bar_text.getvalue()
    assert "tok/s" in bar_text.getvalue() and sorted(set(seen)) == [0, 1] and len(seen) == 12
    bar_text.truncate(0)
    bar_text.seek(0)
    llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert bar_text.getvalue() == ""
    assert_idle(llm.engine)


def test_graph_buckets():
    from minfer.engine.graphs import buckets_for
    assert buckets_for(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert buckets_for(20) == [1, 2, 4, 8, 16, 32]  # up to the first that holds max_num_seqs
    assert buckets_for(256, [40]) == [1, 2, 4, 8, 16, 24, 32, 40]  # vLLM's one-value form
    assert buckets_for(100, [192, 1, 96, 8, 96]) == [1, 8, 96, 192]  # a list, sorted, up to 100's bucket
    assert buckets_for(300, [4, 16]) == [4, 16]  # batches past 16 decode eagerly


def test_prompt_graph_buckets():
    """Prompt graphs pad a prompt's last piece to 16 .. 512 tokens beside 0 or a decode bucket up to 16, as far as
    the context, the step's budget and the layers' work allow: the Llama-3-8B shape's 7.0 G linear values take up to
    32 tokens beside up to 2 decodes."""
    from minfer.engine.graphs import prompt_buckets
    decodes = [1, 2, 4, 8, 16, 32, 64]
    small = prompt_buckets(shapes.config("smollm2-135m"), decodes, 8192, 8192)
    assert small == [(d, p) for d in (0, 1, 2, 4, 8, 16) for p in (16, 32, 64, 128, 256, 512)]
    assert prompt_buckets(shapes.config("llama-3-8b"), decodes, 8192, 8192) == [
        (0, 16), (0, 32), (1, 16), (1, 32), (2, 16), (2, 32), (4, 16), (8, 16), (16, 16)]
    one_b = prompt_buckets(shapes.config("llama-3.2-1b"), decodes, 8192, 8192)
    assert (0, 256) in one_b and (1, 256) not in one_b and (16, 128) in one_b and (16, 256) not in one_b
    assert prompt_buckets(shapes.config("smollm2-135m"), [1, 2], 70, 8192) == [  # the step's token budget
        (0, 16), (0, 32), (0, 64), (1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (2, 64)]
    assert max(p for _, p in prompt_buckets(shapes.config("smollm2-135m"), decodes, 8192, 200)) == 128  # the context


@pytest.mark.parametrize("n, d, c, p", [(0, 0, 5, 16), (2, 4, 16, 16), (3, 4, 40, 64), (1, 1, 32, 32)])
def test_piece_step_metadata_matches_eager(n, d, c, p):
    """The graphs' host metadata of n decodes and one prompt piece padded to p >= c tokens (PieceGraphs) holds what the eager step's has for every real token (positions, K/V slots, ids, seq_lens, pages), and
    puts the padding rows at position 0 on the scratch page."""
    from minfer.engine.graphs import fill_piece_step
    page, scratch = 16, 99
    work = [([7 + i], 20 + 9 * i, [3 * i, 3 * i + 1, 3 * i + 2]) for i in range(n)]  # decodes at 20, 29, 38
    work.append((list(range(100, 100 + c)), 17, [50, 51, 52, 53]))  # the piece after 17 cached tokens
    meta, ids, _ = step_metadata(work, page, None, True, None, torch.device("cpu"))
    pos, slots, tok = (np.full(d + p, -1, np.int64) for _ in range(3))
    lens, table = np.full(d + 1, -1, np.int64), np.full(4 * (d + 1), -1, np.int32)
    width = fill_piece_step(work, d, p, page, scratch, pos, lens, slots, tok, table, True)
    real = list(range(n)) + list(range(d, d + c))  # the graph's rows of the eager step's tokens, in order
    assert width == 4 and pos[real].tolist() == meta.positions.tolist()
    assert slots[real].tolist() == meta.slot_mapping.tolist() and tok[real].tolist() == ids.tolist()
    assert lens[list(range(n)) + [d]].tolist() == meta.seq_lens.tolist()
    pad = list(range(n, d)) + list(range(d + c, d + p))
    assert (pos[pad] == 0).all() and (slots[pad] == scratch * page).all() and (tok[pad] == 0).all()
    assert (lens[n:d] == 1).all() and (table.reshape(d + 1, width)[n:d, 0] == scratch).all()
    assert table.reshape(d + 1, width)[d].tolist() == [50, 51, 52, 53]


def load_bench_throughput():
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps", "bench_throughput.py")
    spec = importlib.util.spec_from_file_location("bench_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_throughput_runs_on_cpu(tmp_path):
    bench = load_bench_throughput()
    out = tmp_path / "t.jsonl"
    assert bench.main(["--backend", "ref", "--device", "cpu", "--num-requests", "4", "--input-len", "9:12",
                       "--output-len", "3", "--shared-prefix", "8", "--block-size", "4", "--max-num-seqs", "2",
                       "--static", "--json", str(out)]) == 0
    import json
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["continuous", "static"]
    assert all(r["output_tokens"] == 12 and r["output_tok_s"] > 0 for r in rows)
    assert rows[0]["prefix_hit_rate"] > 0 and 1 <= rows[0]["mean_batch"] <= 2


def test_bench_throughput_under_a_regex(tmp_path):
    """--regex: every request's output follows it (the engine's outputs are counted: a request may end early)."""
    pytest.importorskip("llguidance")
    out = tmp_path / "t.jsonl"
    assert load_bench_throughput().main(["--backend", "ref", "--device", "cpu", "--num-requests", "3", "--input-len",
                                         "9", "--output-len", "6", "--regex", "[a-z]{2}", "--json", str(out)]) == 0
    import json
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["regex"] == "[a-z]{2}" and 3 <= row["output_tokens"] <= 6  # one or two tokens a request


def test_bench_throughput_under_a_json_schema(tmp_path):
    """--json-schema: as --regex; a choice of two quoted strings is 3-6 tokens a request with the default model."""
    pytest.importorskip("llguidance")
    out, schema = tmp_path / "t.jsonl", '{"enum": ["ab", "cd"]}'
    assert load_bench_throughput().main(["--backend", "ref", "--device", "cpu", "--num-requests", "2", "--input-len",
                                         "9", "--output-len", "8", "--json-schema", schema, "--json", str(out)]) == 0
    import json
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["json_schema"] == schema and row["regex"] is None and 2 * 3 <= row["output_tokens"] <= 2 * 6


def test_bench_throughput_random_shape_on_cpu(tmp_path):
    """--shape: random weights of a named model shape, no checkpoint; the rates are the counts over the time."""
    out = tmp_path / "t.jsonl"
    assert load_bench_throughput().main(["--shape", "smollm2-135m", "--backend", "ref", "--device", "cpu",
                                         "--num-requests", "3", "--input-len", "9:12", "--output-len", "3",
                                         "--block-size", "4", "--max-num-seqs", "2", "--json", str(out)]) == 0
    import json
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["engine"], row["model"], row["output_tokens"]) == ("continuous", "smollm2-135m", 9)
    assert row["output_tok_s"] == pytest.approx(9 / row["elapsed_s"])
    prompt_tokens = row["total_tok_s"] * row["elapsed_s"] - 9
    assert 3 * 9 - 1e-6 <= prompt_tokens <= 3 * 12 + 1e-6
    assert row["peak_gb"] is None and row["host_idle"] is None  # measured on a GPU only


def test_bench_throughput_decode_step_on_cpu(tmp_path, capsys):
    """The decode step at two batch sizes, timed and profiled (on the CPU: no roofline, torch ops for kernels)."""
    out = tmp_path / "t.jsonl"
    assert load_bench_throughput().main(
        ["--backend", "ref", "--device", "cpu", "--input-len", "6", "--block-size", "4", "--decode-batch", "1,3",
         "--decode-steps", "3", "--profile", "--num-pages", "64", "--json", str(out)]) == 0
    import json
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["engine"], r["batch"]) for r in rows] == [("decode step", 1), ("decode step", 3)]
    assert all(r["ms_per_step"] > 0 and r["pct_roofline"] is None and r["kernels"] for r in rows)
    assert any(k["name"] == "mm" for k in rows[1]["kernels"])  # the linears
    assert "decode step: batch 3" in capsys.readouterr().out
    from bench.step_profile import short_name  # apps/ is on the path once the app is loaded
    assert short_name("void minfer::attn::flash_decode_kernel<__nv_bfloat16, 64, (bool)0>(minfer::P)") == \
        "flash_decode_kernel"
    assert short_name("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_nn") == "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_nn"
    from bench.step_profile import tails
    # norm starts early beside the gemv (a programmatic dependent) and waits: only its 2 µs past the gemv count;
    # the small op inside the gemv's span counts nothing; a gap counts nothing; the tails add to the busy time
    spans = [("norm", 8.0, 12.0), ("gemv", 0.0, 10.0), ("tiny", 3.0, 4.0), ("gemv", 20.0, 25.0)]
    assert tails(spans) == {"gemv": 15.0, "tiny": 0.0, "norm": 2.0}


def test_bench_throughput_long_prompt_on_cpu(tmp_path):
    """The ITL of 3 decoding requests before and while a 40-token prompt prefills in chunks of 8 beside them."""
    out = tmp_path / "t.jsonl"
    assert load_bench_throughput().main(
        ["--backend", "ref", "--device", "cpu", "--num-requests", "3", "--input-len", "5", "--block-size", "4",
         "--long-prompt-len", "40", "--long-prefill-token-threshold", "8", "--itl-steps", "3",
         "--num-pages", "64", "--json", str(out)]) == 0
    import json
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["engine"] == "long prompt" and row["running"] == 3
    assert row["steps_during"] >= 5  # 40 tokens, 8 a step
    assert row["itl_before_p50_ms"] > 0 and row["itl_during_p50_ms"] > 0 and row["long_ttft_ms"] > 0
    assert row["itl_ratio_p50_rounds"] == [row["itl_ratio_p50"]]


def test_bench_throughput_long_prompt_rounds_on_cpu(tmp_path, capsys):
    """--rounds 3: three measured rounds after the first; the row is the one with the median p50 ratio."""
    out = tmp_path / "t.jsonl"
    assert load_bench_throughput().main(
        ["--backend", "ref", "--device", "cpu", "--num-requests", "2", "--input-len", "5", "--block-size", "4",
         "--long-prompt-len", "24", "--long-prefill-token-threshold", "8", "--itl-steps", "3",
         "--num-pages", "64", "--rounds", "3", "--json", str(out)]) == 0
    import json
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    ratios = row["itl_ratio_p50_rounds"]
    assert len(ratios) == 3 and row["itl_ratio_p50"] == sorted(ratios)[1]
    assert "the median of 3 rounds" in capsys.readouterr().out


def test_bench_throughput_profiles_a_later_chunk_on_cpu(tmp_path, capsys):
    """--profile-from K profiles the long prompt's steps from chunk K on (their torch ops on the CPU); a K the
    prompt does not reach is a one-line error."""
    out = tmp_path / "t.jsonl"
    common = ["--backend", "ref", "--device", "cpu", "--num-requests", "2", "--input-len", "5", "--block-size", "4",
              "--long-prompt-len", "64", "--long-prefill-token-threshold", "8", "--itl-steps", "3",
              "--num-pages", "64", "--profile"]
    assert load_bench_throughput().main(common + ["--profile-from", "3", "--json", str(out)]) == 0
    import json
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["profiled_from"] == 3 and row["profiled_steps"] == 2  # (8 chunks - 3) // 2
    assert row["kernels"] and "kernels of 2 steps of its prefill from chunk 3" in capsys.readouterr().out
    assert load_bench_throughput().main(common + ["--profile-from", "7"]) == 1
    assert ("minfer: error: --profile-from 7: the prompt takes 8 chunks of 8 tokens; give at most 6"
            in capsys.readouterr().err)


# ---- async scheduling ----

MIXED = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
         SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=12, ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=20, stop=[" return", "\n\n"], logprobs=2),
         SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=10),  # its steps wait for the ids
         SamplingParams(temperature=0.8, seed=7, max_tokens=25, stop=["."], logprobs=0, min_tokens=6,
                        logit_bias={13: -2.0})]


def run_streaming(engine, ids, params):
    """Every output of every step, its text read as it comes (a server's view)."""
    for i, (p, sp) in enumerate(zip(ids, params)):
        engine.add_request(p, sp, request_id=f"s{i}")
    seen = {}
    while engine.has_unfinished():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append((list(o.token_ids), o.new_text, o.text, o.finished,
                                                      o.finish_reason, o.logprobs and list(o.logprobs)))
    return seen


def final(outs):
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs]


def assert_same(got, want):
    """Equal, but logprobs within float rounding: a sequence preempted at another step recomputes its KV in
    other shapes (its tokens stay the same)."""
    def split(x, floats):
        if isinstance(x, float):
            floats.append(x)
            return None
        if isinstance(x, dict):
            return {k: split(v, floats) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [split(v, floats) for v in x]
        return x

    got_floats, want_floats = [], []
    assert split(got, got_floats) == split(want, want_floats)
    assert got_floats == pytest.approx(want_floats, rel=1e-4, abs=1e-5)


def chained_steps(engine, monkeypatch):
    """Counts the steps launched before the ids of the step before were read."""
    count, launch = [0], engine._launch

    def spy(batch, prev):
        count[0] += prev is not None
        return launch(batch, prev)

    monkeypatch.setattr(engine, "_launch", spy)
    return count


@pytest.mark.parametrize("kw", [{}, {"num_pages": 24}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}],
                         ids=["plain", "preempting", "chunked"])
def test_async_equals_sync(ids, kw, monkeypatch):
    """Greedy, seeded, stop strings and ids, penalties and logprobs in one batch: the same tokens, text,
    logprobs and per-step outputs with and without async scheduling, also under preemption and chunking."""
    prompts = ids + ids[:1]
    params = MIXED + [SamplingParams(temperature=0.7, seed=5, max_tokens=30, stop_token_ids=[33])]
    sync, fast = make(async_scheduling=False, **kw), make(async_scheduling=True, **kw)
    chained = chained_steps(fast, monkeypatch)
    want, stats = sync.generate(prompts, params)
    got, fast_stats = fast.generate(prompts, params)
    assert_same(final(got), final(want))
    assert fast_stats.preemptions == stats.preemptions and chained[0] > 0
    assert_same(run_streaming(fast, prompts, params), run_streaming(sync, prompts, params))
    assert_idle(fast)
    assert_idle(sync)


PLAIN = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # no penalty: its steps are chained


@pytest.fixture(scope="module")
def plain_alone(ids):
    solo = make(prefix_caching=False, async_scheduling=False)
    return [solo.generate([p], [PLAIN])[0][0].token_ids for p in ids[:2]]


def test_async_stop_id_drops_the_launched_token(ids, alone, plain_alone):
    """A request stopped by an id read while its next step runs: that step's token for it is discarded (no
    output after the finished one); a request that reaches max_tokens is not scheduled past it."""
    plain = PLAIN
    first, second = plain_alone
    k = next(i for i in range(3, 16) if first[i] not in first[:i])
    engine = make(async_scheduling=True)
    engine.add_request(ids[0], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[first[k]]), "stops")
    engine.add_request(ids[1], plain, "long")
    outs, launched = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            assert not outs.get(o.request_id) or not outs[o.request_id][-1].finished
            outs.setdefault(o.request_id, []).append(o)
        launched += engine.last_step[0] > 0
    stops = outs["stops"]
    assert stops[-1].finished and stops[-1].finish_reason == "stop"
    assert len(stops) == k + 1 and stops[-1].token_ids == first[:k] and stops[-1].new_text == ""
    assert outs["long"][-1].token_ids == second and len(outs["long"]) == 16
    assert launched == 16  # "long" ran 16 steps (its prompt, 15 decodes), not a 17th for its in-flight token
    assert_idle(engine)
    # a penalized request's steps wait for the ids: it stops the same way
    k = next(i for i in range(3, 16) if alone[0][i] not in alone[0][:i])
    stop = SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=16, stop_token_ids=[alone[0][k]])
    assert engine.generate([ids[0]], [stop])[0][0].token_ids == alone[0][:k]
    assert_idle(engine)


def test_async_prompt_chunks_beside_decodes_chain(ids, plain_alone, monkeypatch):
    """A prompt arriving while another request decodes: its chunks run in steps launched before the decode's
    ids are read (that row's input id gathered on the device, the chunk's from the host), and both requests
    get the tokens they get alone."""
    engine = make(async_scheduling=True, max_num_batched_tokens=6)
    mixed, launch = [0], engine._launch

    def spy(batch, prev):
        mixed[0] += prev is not None and max(batch.num_tokens) > 1 and min(batch.num_tokens) == 1
        return launch(batch, prev)

    monkeypatch.setattr(engine, "_launch", spy)
    engine.add_request(ids[0], PLAIN, "first")
    got = {}
    for step in itertools.count():
        if step == 4:
            engine.add_request(ids[1], PLAIN, "second")  # prefills in chunks of 5 beside "first"'s decodes
        for o in engine.step():
            got[o.request_id] = o.token_ids
        if not engine.has_unfinished():
            break
    assert mixed[0] >= 2 and [got["first"], got["second"]] == plain_alone
    assert_idle(engine)


def test_async_abort_in_flight(ids, plain_alone, monkeypatch):
    """A request aborted while a step with its row runs: no output of it after the abort, its pages free, and
    the others' tokens unchanged."""
    engine = make(async_scheduling=True)
    chained = chained_steps(engine, monkeypatch)
    a, b = engine.add_request(ids[0], PLAIN), engine.add_request(ids[1], PLAIN)
    got = {a: [], b: []}
    for _ in range(4):
        for o in engine.step():
            got[o.request_id].append(o)
    assert chained[0] > 0 and a in [s.request_id for s in engine.in_flight.seqs]
    engine.abort_request(a)  # its row of the step in flight is discarded, its pages freed now
    engine.add_request(ids[2], PLAIN, "late")
    engine.abort_request("late")  # still waiting
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == b
            got[b].append(o)
    assert got[b][-1].token_ids == plain_alone[1] and got[b][-1].finished
    assert len(got[a]) < 16 and not any(o.finished for o in got[a])
    assert_idle(engine)


def test_text_is_the_same_read_late_or_never(engine, ids):
    """Text without stop strings is decoded when read: outputs read after the run, last first, hold what
    outputs read at once hold."""
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * 3
    now, late = [], []
    engine.generate(ids[:3], params, lambda i, o: now.append((i, o.new_text, o.text)))
    engine.generate(ids[:3], params, lambda i, o: late.append((i, o)))
    assert [(i, o.new_text, o.text) for i, o in reversed(late)][::-1] == now
    for i in range(3):
        assert "".join(t for j, t, _ in now if j == i) == [t for j, _, t in now if j == i][-1]
    assert_idle(engine)


def test_text_with_stop_strings_is_never_taken_back(engine, ids):
    """With stop strings too, an output's text is the text released so far (its new_texts joined): the tail held
    back as a stop string's possible start is not in it, since the stop string may yet cut it off."""
    full = engine.generate([ids[0]], [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)])[0][0].text
    stop = full[1:full.index(".") + 1]  # " Paris." -> "Paris.": " Paris" is out before "." cuts it
    seen = []
    outs, _ = engine.generate([ids[0]], [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[stop])],
                              lambda i, o: seen.append((o.new_text, o.text)))
    assert outs[0].finish_reason == "stop" and outs[0].text == full[:1]
    released = ""
    for new, text in seen:
        released += new
        assert text == released
    assert_idle(engine)


def test_text_ends_with_what_the_decoder_held_back(engine, ids):
    """A request that ends inside a character has the tokenizer's whole decode as its text (U+FFFD for the
    unfinished bytes), in its last new_text too, with stop strings or without."""
    lead = engine.tokenizer.tok.token_to_id("\u00e2")  # byte-level BPE's token for the byte 0xE2 alone
    for stop in ([], ["zzz"]):
        seen = []
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={lead: 100}, stop=stop)
        outs, _ = engine.generate([ids[0]], [params], lambda i, o: seen.append(o.new_text))
        assert outs[0].token_ids == [lead] * 3
        assert outs[0].text == "".join(seen) == engine.tokenizer.decode(outs[0].token_ids) == "\ufffd" * 3
    assert_idle(engine)


class _Replay:
    """A captured decode graph, emulated: its replay runs the bucket's forward eagerly over the static
    metadata buffers, which is what the real graph reads."""

    def __init__(self, graphs, b, max_len, out):
        self.graphs, self.b, self.max_len, self.out = graphs, b, max_len, out

    def replay(self):
        self.out.copy_(self.graphs._forward(self.b, self.max_len))


def with_emulated_graphs(engine, monkeypatch, chunk: int = 0, prompts: bool = False):
    """The engine with its decode graphs emulated on the CPU, and with chunk > 0 or prompts, its graphs of decodes
    beside a prompt piece (a chunk of that many tokens, a prompt's last piece) too."""
    def capture(self):
        for b in self.buckets:
            for c in self.classes:
                out = torch.empty(b, self.model.cfg.vocab_size)
                self.graphs[b, c] = (_Replay(self, b, c, out), out)

    def capture_pieces(self, keys):
        for key in keys:
            for c in (c for c in self.classes if c >= key[1]):
                out = torch.empty(key[0] + key[2], self.model.cfg.vocab_size)
                self.graphs[key, c] = (_Replay(self, key, c, out), out)

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    monkeypatch.setattr(PieceGraphs, "_capture", capture_pieces)
    bm = engine.block_manager
    engine.graphs = DecodeGraphs(engine.model, engine.cache, bm.num_pages, engine.scheduler.max_num_seqs,
                                 engine.max_context, engine.device, bm.window, bm.local_scratch)
    keys = piece_keys(engine.cfg, engine.graphs.buckets, engine.scheduler.max_num_batched_tokens, engine.max_context,
                      prompts, chunk)
    if keys:
        engine.piece_graphs = PieceGraphs(engine.model, engine.cache, bm.num_pages, keys, engine.max_context,
                                          engine.device, bm.window, bm.local_scratch)
    return engine


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_metadata_equals_eager(ids, async_scheduling, monkeypatch):
    """Decode steps through DecodeGraphs.run (its page table rows per scheduler slot, written as pages come;
    padding rows on the scratch page; ids from the device when chained) give the tokens of eager steps,
    while requests of different lengths finish, arrive, and are preempted (a tiny pool)."""
    kw = dict(num_pages=14, max_num_seqs=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (16, 5, 16, 9, 16)]
    want, want_stats = make(async_scheduling=False, **kw).generate(ids, params)
    engine = with_emulated_graphs(make(async_scheduling=async_scheduling, **kw), monkeypatch)
    runs, graphed = [], engine.graphs.run

    def spy(tokens, *args):
        runs.append(isinstance(tokens, torch.Tensor))
        return graphed(tokens, *args)

    monkeypatch.setattr(engine.graphs, "run", spy)
    outs, stats = engine.generate(ids, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert len(runs) > 10 and stats.preemptions > 0 and want_stats.preemptions > 0
    assert any(runs) == async_scheduling  # chained steps read their ids from the device
    assert_idle(engine)


@pytest.mark.parametrize("kw", [{"long_prefill_token_threshold": 1}, {"max_num_batched_tokens": 3}],
                         ids=["threshold", "budget"])
def test_one_token_chunks_run_eagerly(ids, alone, kw, monkeypatch):
    """A step whose rows are one token each, one of them a prompt's chunk short of its end (beside decodes under a
    threshold of 1, or the last token of a budget of 3), is no decode step: the decode graphs would feed that row
    its sequence's last token and sample it. It runs eagerly, and each prompt gets its tokens alone."""
    engine = with_emulated_graphs(make(async_scheduling=True, **kw), monkeypatch)
    runs, graphed = [], engine.graphs.run

    def spy(tokens, positions, *args):
        runs.append(positions)
        return graphed(tokens, positions, *args)

    monkeypatch.setattr(engine.graphs, "run", spy)
    assert run_arriving(engine, ids, every=2) == alone
    assert len(runs) > 10  # the decode steps still replay the graphs
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunk_graph_metadata_equals_eager(ids, async_scheduling, monkeypatch):
    """Steps of decodes beside a prompt chunk of --long-prefill-token-threshold tokens through PieceGraphs.run (the
    decodes, padding rows on the scratch page up to the bucket, then the chunk; the decodes' logits) give the tokens
    of each prompt alone, with prompts arriving while others decode and, chained, ids from the device. A prompt's
    last chunk runs eagerly (its token is sampled, and no prompt graphs were asked for)."""
    sampled = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # no penalty: steps chain
    want = [make(prefix_caching=False).generate([p], [sampled])[0][0].token_ids for p in ids]
    engine = with_emulated_graphs(make(long_prefill_token_threshold=3, async_scheduling=async_scheduling,
                                       max_num_seqs=4), monkeypatch, chunk=3)
    runs, graphed = [], engine.piece_graphs.run

    def spy(key, work, ids_on_device, local_tables):
        runs.append((key, ids_on_device is not None))
        return graphed(key, work, ids_on_device, local_tables)

    monkeypatch.setattr(engine.piece_graphs, "run", spy)
    assert run_arriving(engine, ids, every=2, params=sampled) == want
    assert len(runs) > 3 and len({d for (d, _, _), _ in runs}) > 1  # several decode buckets
    assert all(p == 3 and not ends for (_, p, ends), _ in runs)
    assert any(chained for _, chained in runs) == async_scheduling
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_graph_metadata_equals_eager(ids, async_scheduling, monkeypatch):
    """Steps that end a prompt beside 0-4 decodes through PieceGraphs.run (the piece padded to a token bucket, its
    padding outside every sequence of attention; the decodes' logits and the piece's last token's), and the chunks
    of 3 before, give the tokens of each prompt alone, prompts arriving while others decode."""
    sampled = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [make(prefix_caching=False).generate([p], [sampled])[0][0].token_ids for p in ids]
    engine = with_emulated_graphs(make(long_prefill_token_threshold=3, async_scheduling=async_scheduling,
                                       max_num_seqs=4), monkeypatch, chunk=3, prompts=True)
    runs, graphed = [], engine.piece_graphs.run

    def spy(key, work, ids_on_device, local_tables):
        runs.append((key, len(work[-1][0])))
        return graphed(key, work, ids_on_device, local_tables)

    monkeypatch.setattr(engine.piece_graphs, "run", spy)
    assert run_arriving(engine, ids, every=2, params=sampled) == want
    ends = [(key, c) for key, c in runs if key[2]]  # the others: a last piece of one token, or two prompts a step
    assert len(ends) >= 3 and all(c < p for (_, p, _), c in ends)  # padded: pieces of 2-5 tokens, 16 a graph
    assert any(d > 0 for (d, _, _), _ in ends) and any(not e for (_, _, e), _ in runs)  # beside decodes; chunks
    assert_idle(engine)
