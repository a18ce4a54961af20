"""The continuous-batching engine on the default model (fp32, CPU, ref backend): every request's output in a
continuous batch equals its output alone, whatever the batch does (different lengths, arrivals mid-run,
prefill in chunks, preemption forced by a tiny page pool, prefix-cache hits); seeded sampling is
batch-invariant; after every test all pages are free (cached or not); bad input is a clear error."""
import os

import pytest
import torch

from minfer import loader
from minfer.engine.core import EngineCore
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


def test_arrivals_mid_run(engine, ids, alone):
    """Requests join while others decode, through add_request / step."""
    done = {}
    pending = list(enumerate(ids))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(p, GREEDY, request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:])] = out.token_ids
        steps += 1
    assert [done[i] for i in range(len(ids))] == alone
    assert_idle(engine)


def test_chunked_prefill(ids, alone):
    small = make(max_num_batched_tokens=8, max_num_seqs=4)  # the 20-token prompt prefills in several steps
    outs, _ = small.generate(ids, [GREEDY] * len(ids))
    assert [o.token_ids for o in outs] == alone
    assert_idle(small)


def test_preemption_never_loses_a_request(ids, alone):
    # 24 pages of 4: one sequence needs at most 10, all five together about 40
    tiny = make(num_pages=24)
    outs, stats = tiny.generate(ids, [GREEDY] * len(ids))
    assert stats.preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert_idle(tiny)


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
    chat = engine.encode("What is 2+2? Answer with one number.", chat=True)
    outs, _ = engine.generate([chat, ids[0]], [SamplingParams(temperature=0.0, max_tokens=40),
                                               SamplingParams(temperature=0.0, max_tokens=20, stop=["."], logprobs=3)])
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) < 40  # the model ends its turn
    assert outs[1].finish_reason == "stop" and outs[1].text == " Paris"
    lp = outs[1].logprobs
    assert len(lp) == len(outs[1].token_ids) and all(len(e["top"]) == 3 for e in lp)
    assert all(e["top"][0][0] == e["token_id"] and e["logprob"] == e["top"][0][1] <= 0 for e in lp)  # greedy
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


def test_bad_input(engine, ids):
    with pytest.raises(MinferError, match="no room to generate"):
        engine.add_request(list(range(CONTEXT)), GREEDY)
    with pytest.raises(MinferError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(MinferError, match="--presence-penalty"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(MinferError, match="empty prompt"):
        engine.add_request([], GREEDY)
    with pytest.raises(MinferError, match="out of range"):
        engine.add_request([engine.cfg.vocab_size], GREEDY)
    with pytest.raises(MinferError, match="pages"):
        make(num_pages=4).add_request(ids[1], GREEDY)
    with pytest.raises(MinferError, match="--max-num-batched-tokens"):
        make(max_num_batched_tokens=0)
    assert_idle(engine)


def test_llm_api():
    llm = LLM(dtype="float32", device="cpu", backend="ref", max_model_len=CONTEXT, block_size=PAGE, num_pages=64)
    outs = llm.generate(["The capital of France is", "Water boils at"], SamplingParams(temperature=0.0, max_tokens=4))
    assert outs[0].text.startswith(" Paris") and len(outs) == 2
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("The capital of France is")
    assert llm.last_stats.tokens == 8
    (one,) = llm.generate({"prompt_token_ids": outs[0].prompt_token_ids}, SamplingParams(temperature=0.0, max_tokens=4))
    assert one.token_ids == outs[0].token_ids


def test_bench_throughput_runs_on_cpu(tmp_path):
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps", "bench_throughput.py")
    spec = importlib.util.spec_from_file_location("bench_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "t.jsonl"
    assert bench.main(["--backend", "ref", "--device", "cpu", "--num-requests", "4", "--input-len", "9:12",
                       "--output-len", "3", "--shared-prefix", "8", "--block-size", "4", "--max-num-seqs", "2",
                       "--static", "--json", str(out)]) == 0
    import json
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["continuous", "static"]
    assert all(r["output_tokens"] == 12 and r["output_tok_s"] > 0 for r in rows)
    assert rows[0]["prefix_hit_rate"] > 0 and 1 <= rows[0]["mean_batch"] <= 2
