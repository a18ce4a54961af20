"""The engine on the default model (fp32, CPU, ref backend): a prompt's output does not depend on its batch,
the timing is honest (warm-up apart, no decode speed without decode steps), and the KV cache and decode
steps are made once and reused."""
import os

import pytest
import torch

from minfer.engine import static as engine_mod
from minfer import loader
from minfer.engine import Engine, format_stats
from minfer.errors import MinferError
from minfer.sampling import SamplingParams

MODEL_PATH = os.path.join(loader.cache_dir(), loader.DEFAULT_MODEL_FILE)
pytestmark = pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason=f"default model not at {MODEL_PATH}")

CONTEXT = 80
GREEDY_PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.3)
SHORT = "The capital of France is"
LONG = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
        "who repaired every clock in the valley. Each morning he opened his shop before sunrise, lit a candle, "
        "and listened to the ticking of a hundred clocks")


@pytest.fixture(scope="module")
def engine():
    return Engine(None, dtype=torch.float32, device="cpu", backend="ref", max_context=CONTEXT)


def test_output_alone_equals_output_in_a_batch(engine):
    short, long = engine.encode(SHORT, chat=False), engine.encode(LONG, chat=False)
    assert len(short) + 40 < CONTEXT < len(long) + 40  # the long prompt's cap is below the short one's
    alone = [engine.generate([p], GREEDY_PENALIZED, 40, ignore_eos=True)[0][0] for p in (short, long)]
    batch, _ = engine.generate([short, long], GREEDY_PENALIZED, 40, ignore_eos=True)
    # each sequence has its own cap: what fits after its own prompt
    assert len(alone[0].token_ids) == 40
    assert len(alone[1].token_ids) == CONTEXT - len(long)
    for a, b in zip(alone, batch):
        assert b.token_ids == a.token_ids
        assert b.text == a.text
        assert b.finish_reason == a.finish_reason == "length"


def test_parameters_the_static_engine_does_not_apply_are_refused(engine):
    """The static engine samples one SamplingParams' temperature, filters, repetition penalty and seed: the rest
    is an error naming them, not ignored."""
    ids = engine.encode(SHORT, chat=False)
    for params, needle in [(SamplingParams(temperature=0.0, presence_penalty=0.5), "presence_penalty"),
                           (SamplingParams(temperature=0.0, logprobs=1), "logprobs"),
                           (SamplingParams(temperature=0.0, logit_bias={1: 2.0}), "logit_bias"),
                           (SamplingParams(temperature=0.0, prompt_logprobs=1), "prompt_logprobs"),
                           (SamplingParams(temperature=0.0, n=2), "n"),
                           (SamplingParams(temperature=0.0, structured_outputs={"regex": "a"}), "structured_outputs")]:
        with pytest.raises(MinferError, match=needle):
            engine.generate([ids], params, 2)


def test_sampled_generation_follows_temperature_filters_and_seed(engine):
    """At temperature 1 the tokens are drawn: a seed gives the same tokens again, other seeds other tokens, not all
    the greedy ones; top_k 1 leaves only the greedy token to draw."""
    ids = engine.encode(SHORT, chat=False)
    run = lambda **kw: engine.generate([ids], SamplingParams(**kw), 8, ignore_eos=True)[0][0].token_ids  # noqa: E731
    greedy = run(temperature=0.0)
    drawn = [run(temperature=1.0, seed=s) for s in range(4)]
    assert run(temperature=1.0, seed=0) == drawn[0]
    assert len({tuple(d) for d in drawn}) > 1 and greedy not in drawn
    assert run(temperature=1.0, top_k=1, seed=0) == greedy


def test_repetition_penalty_sees_only_prompt_ids(engine, monkeypatch):
    """The prefill's seen-set holds each prompt's ids and nothing else (not the padding of a shorter one)."""
    real_sample, seen_at_prefill = engine_mod.sample, []

    def spy(logits, params, generator=None, seen=None):
        if not seen_at_prefill:  # the first call samples from the prefill's logits
            seen_at_prefill.append(seen.clone())
        return real_sample(logits, params, generator, seen)

    monkeypatch.setattr(engine_mod, "sample", spy)
    prompts = [engine.encode(SHORT, chat=False), engine.encode(LONG, chat=False)]
    engine.generate(prompts, GREEDY_PENALIZED, 2)
    (seen,) = seen_at_prefill
    for b, p in enumerate(prompts):
        assert set(seen[b].nonzero().flatten().tolist()) == set(p)


def test_stats_count_steps_and_tokens(engine):
    ids = engine.encode(SHORT, chat=False)
    _, stats = engine.generate([ids, ids], SamplingParams(temperature=0.0), 6, ignore_eos=True)
    assert (stats.tokens, stats.steps, stats.decode_tokens) == (12, 5, 10)
    assert stats.decode_tok_s == pytest.approx(10 / stats.decode_s)
    assert stats.ttft_s == stats.prefill_s > 0
    assert "decode " in format_stats(engine, stats) and format_stats(engine, stats).count("tok/s") == 2


@pytest.mark.parametrize("how", ["one token", "stop string"])
def test_no_decode_speed_without_decode_steps(engine, how):
    ids = engine.encode(SHORT, chat=False)
    if how == "one token":
        outs, stats = engine.generate([ids], SamplingParams(temperature=0.0), 1)
    else:  # any first token's text holds a letter or a space; a stop string of each matches at once
        stops = [chr(c) for c in range(32, 127)]
        outs, stats = engine.generate([ids], SamplingParams(temperature=0.0), 16, stop=stops)
        assert outs[0].finish_reason == "stop"
    assert stats.steps == 0 and stats.decode_tok_s is None
    line = format_stats(engine, stats)
    assert "decode –" in line and line.count("tok/s") == 1


def test_ignore_eos_generates_exactly_n(engine):
    ids = engine.encode("What is 2+2? Answer with one number.", chat=True)
    assert len(ids) + 20 <= CONTEXT
    outs, _ = engine.generate([ids], SamplingParams(temperature=0.0), 20)
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) < 19  # the model ends its turn
    outs, _ = engine.generate([ids], SamplingParams(temperature=0.0), 20, ignore_eos=True)
    assert len(outs[0].token_ids) == 20 and outs[0].finish_reason == "length"


def test_text_ends_with_what_the_decoder_held_back(engine, monkeypatch):
    """A sequence that ends inside a character has the tokenizer's whole decode as its text (U+FFFD for the
    unfinished bytes), streamed too, with stop strings or without."""
    lead = engine.tokenizer.tok.token_to_id("\u00e2")  # byte-level BPE's token for the byte 0xE2 alone
    monkeypatch.setattr(engine, "_next_ids", lambda raw, *_: torch.full(raw.shape[:1], lead, device=raw.device))
    for stop in (None, ["zzz"]):
        seen = []
        outs, _ = engine.generate([engine.encode(SHORT, chat=False)], SamplingParams(temperature=0.0), 3, stop=stop,
                                  on_text=lambda b, t: seen.append(t), ignore_eos=True)
        assert outs[0].token_ids == [lead] * 3
        assert outs[0].text == "".join(seen) == engine.tokenizer.decode(outs[0].token_ids) == "\ufffd" * 3


def test_stats_leave_out_the_step_after_the_end(engine):
    """The static engine launches each step before it reads the one before: the step launched after the model ends
    its turn is wasted, and the stats count only the steps whose tokens were read."""
    ids = engine.encode("What is 2+2? Answer with one number.", chat=True)
    outs, stats = engine.generate([ids], SamplingParams(temperature=0.0), 20)
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) < 19
    assert stats.tokens == len(outs[0].token_ids) + 1  # and the stop id
    assert stats.steps == stats.tokens - 1 == stats.decode_tokens


def test_warm_engine_reuses_cache_and_steps(engine):
    ids = engine.encode(SHORT, chat=False)
    greedy = SamplingParams(temperature=0.0)
    first, _ = engine.generate([ids] * 3, greedy, 8)
    cache, step = engine.cache.k.data_ptr(), engine.steps[3]
    again, stats = engine.generate([ids] * 3, greedy, 8)
    assert stats.warmup_s == 0.0  # nothing left to warm: the timing is the steady state's
    assert engine.cache.k.data_ptr() == cache and engine.steps[3] is step
    assert [o.token_ids for o in again] == [o.token_ids for o in first]


def test_cache_grows_and_results_match_a_fresh_engine(engine):
    """A longer request after a short one grows the cache (and remakes the decode steps over it); the
    results equal those of an engine that never saw the short request."""
    fresh = Engine(None, dtype=torch.float32, device="cpu", backend="ref", max_context=CONTEXT)
    short, long = engine.encode(SHORT, chat=False), engine.encode(LONG, chat=False)
    greedy = SamplingParams(temperature=0.0)
    engine.generate([short], greedy, 2)
    grown, stats = engine.generate([long, short, short, long, short], greedy, 12)
    assert stats.warmup_s > 0 and engine.cache.batch >= 5
    ref, _ = fresh.generate([long, short, short, long, short], greedy, 12)
    assert [o.token_ids for o in grown] == [o.token_ids for o in ref]


def test_prompt_filling_the_context_says_no_room(engine):
    ids = engine.encode(LONG, chat=False)
    small = Engine(None, dtype=torch.float32, device="cpu", backend="ref", max_context=len(ids))
    with pytest.raises(MinferError, match=f"prompt is {len(ids)} tokens.*no room to generate"):
        small.generate([ids], SamplingParams(temperature=0.0), 4)


def test_empty_stop_string_is_rejected(engine):
    with pytest.raises(MinferError, match="empty stop string"):
        engine.generate([engine.encode(SHORT, chat=False)], SamplingParams(temperature=0.0), 4, stop=[""])
