"""Structured outputs (minfer.structured): every sampled token keeps the output inside the constraint, alone and in
a batch, with and without async scheduling and the decode graphs; the masks' bits are llguidance's; bad
constraints are errors naming the field."""
import json
import re

import pytest
import torch

pytest.importorskip("llguidance")

from minfer import LLM  # noqa: E402
from minfer.errors import MinferError  # noqa: E402
from minfer.ops.reference import unpack_bitmask  # noqa: E402
from minfer.sampling import SamplingParams  # noqa: E402
from minfer.structured import StructuredOutputs  # noqa: E402
from test_continuous import MODEL_PATH, assert_idle, make, with_emulated_graphs  # noqa: E402

pytestmark = pytest.mark.skipif(not __import__("os").path.exists(MODEL_PATH), reason="default model not installed")

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "population": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["big", "old", "capital"]},
                                                    "maxItems": 2}},
          "required": ["city", "population", "tags"], "additionalProperties": False}
GBNF = 'root ::= answer " because " [a-z ]{1,20} "."\nanswer ::= "yes" | "no"'
CONSTRAINTS = {
    "json": (dict(json=SCHEMA), lambda t: _follows_schema(json.loads(t))),
    "json_object": (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    "regex": (dict(regex=r"[0-9]{3}-[A-Z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
    "choice": (dict(choice=["Paris", "Lyon", "Marseille"]), lambda t: t in ("Paris", "Lyon", "Marseille")),
    "gbnf": (dict(grammar=GBNF), lambda t: re.fullmatch(r"(yes|no) because [a-z ]{1,20}\.", t)),
    "lark": (dict(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
             lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", t)),
}
PROMPT = "Tell me about the capital of France."


def _follows_schema(x) -> bool:
    return (set(x) == {"city", "population", "tags"} and isinstance(x["city"], str) and len(x["city"]) <= 12
            and isinstance(x["population"], int) and len(x["tags"]) <= 2
            and all(t in ("big", "old", "capital") for t in x["tags"]))


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", device="cpu", backend="ref", max_model_len=256, block_size=16, num_pages=256)


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_output_follows_its_constraint(llm, kind):
    """Greedy and seeded draws at temperature 1: an output that ends ("stop") is checked by an independent
    validator (json, re); one cut at max_tokens (an unbounded object at temperature 1 may go on) has every token
    accepted by a fresh matcher."""
    spec, holds = CONSTRAINTS[kind]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=spec)] + \
        [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=spec) for s in range(3)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out in outs:
        if out.finish_reason == "stop":
            assert holds(out.text), (kind, out.text)
        else:
            m = llm.engine.matchers.matcher(StructuredOutputs(**spec))
            assert out.finish_reason == "length" and m.validate_tokens(out.token_ids) == len(out.token_ids)
    assert outs[0].finish_reason == "stop"  # greedy ends every one of them
    assert_idle(llm.engine)


def allowed(matchers, rows) -> torch.Tensor:
    """[rows, vocab] bool: the sampler's view of the rows' masks."""
    return unpack_bitmask(torch.from_numpy(matchers.bitmask(rows)), matchers.vocab_size)


def test_masks_are_llguidances_bits(llm):
    """The first token a choice allows: exactly the ids whose text starts one of the choices, and the mask's bit
    order is llguidance's own (its numpy helper, applied to each matcher's own bitmask), rows computed together
    (in parallel) as one at a time."""
    import llguidance.numpy as lln
    import numpy as np
    matchers, vocab = llm.engine.matchers, llm.engine.cfg.vocab_size
    specs = [StructuredOutputs(choice=["Paris", "Lyon"]), None, StructuredOutputs(regex="[0-9]+ [a-z]"),
             StructuredOutputs(json=SCHEMA)]
    ms = [None if s is None else matchers.matcher(s) for s in specs]
    ours = allowed(matchers, ms).numpy()
    assert ours.shape == (len(ms), vocab) and ours[1].all()
    for row, m in enumerate(ms):
        if m is not None:
            logits = np.zeros((1, vocab), np.float32)
            lln.apply_token_bitmask_inplace(logits, np.frombuffer(m.compute_bitmask(), np.int32)[None])
            assert (ours[row] == np.isfinite(logits[0])).all(), row
            assert 0 < ours[row].sum() < vocab
    tok = llm.get_tokenizer()
    texts = [tok.decode([i]) for i in np.flatnonzero(ours[0])]
    assert texts and all("Paris".startswith(t) or "Lyon".startswith(t) for t in texts)
    assert {"P", "Paris", "L"} <= set(texts)


def test_a_cheap_constraint_is_built_apart_for_parallel_masks(llm, monkeypatch):
    """Copies of one matcher compute their masks one at a time (they share its caches behind a lock), so a constraint
    that builds fast is built up to PARALLEL_MASKS times and its requests' copies dealt over them; one that builds
    slowly is built once. Rows of the same text have the same mask, whichever matcher they copy."""
    import numpy as np
    from minfer import structured
    matchers, tok = llm.engine.matchers, llm.get_tokenizer()
    monkeypatch.setattr(structured, "PARALLEL_MASKS", 4)
    monkeypatch.setattr(structured, "CHEAP_BUILD_S", 60.0)  # every constraint fast to build (a loaded host is slow)
    monkeypatch.setattr(matchers, "_built", {})
    spec = StructuredOutputs(regex="[a-z ,.]{8,40}")
    ms = [matchers.matcher(spec) for _ in range(6)]
    (built, _), = matchers._built.values()
    assert len(built) == 4 and len({id(m) for m in built}) == 4
    for m in ms:
        for t in tok.encode("the quick"):
            assert m.consume_token(t)
    masks = matchers.bitmask(ms)
    assert (masks == masks[0]).all() and 0 < np.unpackbits(masks[0].view(np.uint8)).sum() < llm.engine.cfg.vocab_size
    monkeypatch.setattr(structured, "CHEAP_BUILD_S", 0.0)  # every constraint slow to build
    spec = StructuredOutputs(regex="[a-z]{2,9}")
    for _ in range(3):
        matchers.matcher(spec)
    assert len(matchers._built[next(k for k in matchers._built if "[a-z]{2,9}" in k)][0]) == 1


@pytest.mark.parametrize("kind", ["structured", "penalty"])
def test_host_id_rows_chain_their_forward(monkeypatch, kind):
    """Under async scheduling a row that samples from its ids on the host (a structured output's mask, a penalty)
    still queues each step's forward before the step before's ids are read: they are read while it runs, before the
    sampling. Its tokens are those of a synchronous engine."""
    extra = dict(structured_outputs=CONSTRAINTS["json"][0]) if kind == "structured" else \
        dict(repetition_penalty=1.3, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=12, **extra)
    engine = make(async_scheduling=True, num_pages=64, page_size=16)
    ids = engine.tokenizer.encode(PROMPT)
    engine.warmup()  # its own steps, before the counts
    forwards, seen = [0], []
    forward, apply = engine._forward, engine._apply
    monkeypatch.setattr(engine, "_forward", lambda *a, **k: (forwards.__setitem__(0, forwards[0] + 1), forward(*a, **k))[1])
    monkeypatch.setattr(engine, "_apply", lambda step: (seen.append(forwards[0]), apply(step))[1])
    (out,), _ = engine.generate([ids], [params])
    # the i-th step's ids (1-based) read after the (i + 1)-th forward: all but the last, which no forward follows
    assert len(seen) == len(out.token_ids) + (out.finish_reason == "stop")
    assert sum(f == i + 2 for i, f in enumerate(seen)) == len(seen) - 1, seen
    solo = make(async_scheduling=False, num_pages=64, page_size=16)
    assert solo.generate([ids], [params])[0][0].token_ids == out.token_ids
    assert_idle(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_constraint_holds_after_the_reasoning(async_scheduling):
    """With reasoning tags (here "<|im_start|>" and ".", one token each in this vocabulary) a constrained request
    samples freely up to the end tag and follows its constraint after it, unless its prompt ended the reasoning (an
    end tag after the last start tag). Tags of several tokens are refused: the constraint holds from the first token."""
    engine = make(async_scheduling=async_scheduling, num_pages=64, page_size=16)
    ids = engine.tokenizer.encode("The capital of France is")
    free = engine.generate([ids], [SamplingParams(temperature=0.0, max_tokens=12)])[0][0].text
    reasoning = free[:free.index(".") + 1]  # " Paris."
    assert not engine.set_reasoning_tags("<think>", "</think>") and engine.reasoning_tags is None
    bos, engine.tokenizer.add_bos = engine.tokenizer.add_bos, True  # a tokenizer that adds a BOS (Llama's) alike
    assert engine.set_reasoning_tags("<|im_start|>", ".") and engine.reasoning_tags == (1, 30)
    engine.tokenizer.add_bos = bos
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=dict(regex="[0-9]{3}"))
    (thought, ended, opened), _ = engine.generate(
        [ids, engine.tokenizer.encode("Hi. The capital of France is"),
         engine.tokenizer.encode("Hi. <|im_start|> The capital of France is")], [params] * 3)
    assert thought.text.startswith(reasoning) and re.fullmatch("[0-9]{3}", thought.text[len(reasoning):]), thought.text
    assert re.fullmatch("[0-9]{3}", ended.text), ended.text
    assert opened.text.count(".") == 1 and re.fullmatch("[0-9]{3}", opened.text.split(".")[1]), opened.text
    assert_idle(engine)


def test_llm_reasoning_parser_needs_one_token_tags():
    """LLM(reasoning_parser=...): a name it does not know, and a vocabulary without <think> and </think> as single
    tokens (this model's), are errors that say so."""
    with pytest.raises(MinferError, match="reasoning_parser must be one of deepseek_r1, qwen3, not 'r1'"):
        LLM(device="cpu", backend="ref", reasoning_parser="r1")
    with pytest.raises(MinferError, match="reasoning_parser qwen3: <think> and </think> are not each one token"):
        LLM(device="cpu", backend="ref", reasoning_parser="qwen3", num_pages=8)


@pytest.mark.parametrize("graphs", [False, True])
def test_constrained_rows_in_a_batch_equal_alone(monkeypatch, graphs):
    """Constrained and free requests in one batch, async scheduling on (the constrained rows' steps wait for the ids
    before them) and the decode graphs emulated: each request's tokens are those it samples alone."""
    engine = make(async_scheduling=True, num_pages=256, page_size=16)
    if graphs:
        engine = with_emulated_graphs(engine, monkeypatch)
    ids = engine.tokenizer.encode(PROMPT)
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=CONSTRAINTS["json"][0]),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_outputs=CONSTRAINTS["gbnf"][0]),
              SamplingParams(temperature=0.8, seed=9, max_tokens=12, ignore_eos=True)]
    outs, _ = engine.generate([ids] * len(params), params)
    solo = make(async_scheduling=False, prefix_caching=False, num_pages=256, page_size=16)
    for out, p in zip(outs, params):
        assert out.token_ids == solo.generate([ids], [p])[0][0].token_ids
    assert CONSTRAINTS["json"][1](outs[0].text) and CONSTRAINTS["gbnf"][1](outs[2].text)
    assert_idle(engine)


def test_logprobs_are_the_models(llm):
    """A constrained request's logprobs are of the model's raw distribution, as an unconstrained one's: the same
    first-token logprob as the free request's for the token both chose."""
    free = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
    (f,) = llm.generate("The capital of France is", free, use_tqdm=False)
    first = llm.get_tokenizer().decode(f.token_ids)
    assert first == " Paris"
    (c,) = llm.generate("The capital of France is", SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=2, structured_outputs=dict(choice=[" Lyon", first + "!"])),
        use_tqdm=False)
    assert c.token_ids == f.token_ids and c.logprobs[0]["logprob"] == pytest.approx(f.logprobs[0]["logprob"], abs=1e-5)
    (ci, cl), (fi, fl) = zip(*c.logprobs[0]["top"]), zip(*f.logprobs[0]["top"])
    assert ci == fi and cl == pytest.approx(fl, abs=1e-5)  # the top ids of the raw logits, " Lyon" not among them


@pytest.mark.parametrize("spec,needle", [
    (dict(), "exactly one of"), (dict(regex="a", choice=["a"]), "exactly one of"),
    (dict(choice=[]), "structured_outputs.choice"), (dict(json="{bad"), "structured_outputs.json"),
    (dict(json={"type": "strong"}), "structured_outputs.json"), (dict(regex="[a"), "structured_outputs.regex"),
    (dict(regex="a(b"), "structured_outputs.regex: .*regex parse error: unclosed group$"),
    (dict(grammar="root ::= undefined"), "structured_outputs.grammar"), (dict(jsn={}), "structured_outputs takes"),
])
def test_bad_constraints_are_errors(llm, spec, needle):
    with pytest.raises(MinferError, match=needle):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert_idle(llm.engine)


def test_a_bad_constraint_in_a_batch_queues_nothing(llm):
    """A constraint that fails to build (here: no text satisfies it) is a MinferError before any request of the
    call is queued: the good one beside it is not left behind, and the LLM runs on."""
    ok = SamplingParams(temperature=0.0, max_tokens=3)
    want = llm.generate("Hi", ok, use_tqdm=False)[0].token_ids
    for spec in (dict(regex=r"[^\s\S]"), dict(json={"$ref": "#"}), dict(json=False)):
        with pytest.raises(MinferError, match="no text satisfies it|matches nothing"):
            llm.generate(["A", "B"], [ok, SamplingParams(max_tokens=3, structured_outputs=spec)], use_tqdm=False)
        assert_idle(llm.engine)
    with pytest.raises(MinferError, match="nested too deeply"):
        llm.generate("A", SamplingParams(structured_outputs=dict(json="[" * 50000 + "]" * 50000)), use_tqdm=False)
    assert llm.generate("Hi", ok, use_tqdm=False)[0].token_ids == want


def test_the_end_of_sequence_ends_a_constrained_request(llm):
    """The grammar offers the model's end-of-sequence id only where its text is complete: drawn, it ends the request
    and is no output token, ignore_eos or not (the constraint holds the length)."""
    eos = sorted(llm.engine.stop_ids)
    for ignore in (False, True):
        (o,) = llm.generate("Year:", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=ignore,
                                                    logit_bias={i: 100 for i in eos[:1]} | {2: 100},
                                                    structured_outputs=dict(regex=" [0-9]{1,8}")), use_tqdm=False)
        assert o.finish_reason == "stop" and not set(o.token_ids) & set(eos) and re.fullmatch(" [0-9]{1,8}", o.text)


def test_schema_true_is_any_json_and_the_class_is_exported(llm):
    """The schema true allows any JSON value and nothing else: its first mask takes a value's first token (an
    object, a number, a string, true) and no word; a greedy output that ends parses."""
    from minfer import StructuredOutputs as Exported
    assert Exported is StructuredOutputs
    tok, matchers = llm.get_tokenizer(), llm.engine.matchers
    (mask,) = allowed(matchers, [matchers.matcher(StructuredOutputs(json=True))])
    first = {t: bool(mask[tok.encode(t)[0]]) for t in ("{", "[", "1", '"', "true", "Paris", " Paris", "The")}
    assert first == {"{": True, "[": True, "1": True, '"': True, "true": True,
                     "Paris": False, " Paris": False, "The": False}, first
    (o,) = llm.generate("Any:", SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=dict(json=True)),
                        use_tqdm=False)
    assert o.token_ids and (o.finish_reason == "length" or json.loads(o.text) is not None)


def test_random_weights_without_a_tokenizer():
    from minfer import shapes
    from minfer.engine.core import EngineCore
    core = EngineCore(random_weights=shapes.config("smollm2-135m"), dtype=torch.float32, device="cpu",
                      max_context=32, num_pages=8)
    with pytest.raises(MinferError, match="need the model's tokenizer"):
        core.add_request([1, 2], SamplingParams(structured_outputs=dict(regex="a")))
