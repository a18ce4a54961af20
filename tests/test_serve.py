"""The OpenAI-compatible server (python -m minfer.serve's app) over real HTTP, on the default model (the ref
backend in fp32 on the CPU; the cuda backend in bf16, marked gpu), driven by the official openai client where it can be: chat and completions, streamed and
not, n > 1, seeds, stop strings, logprobs; greedy outputs equal LLM.generate's, alone or concurrent; every
error case has its status and OpenAI's error body; the API key; a client that hangs up mid-stream frees its
pages; the loop survives a failing step; /metrics has its series."""
import concurrent.futures
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from minfer import loader

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from minfer.engine.core import EngineCore  # noqa: E402
from minfer.llm import LLM  # noqa: E402
from minfer.sampling import SamplingParams  # noqa: E402
from minfer.serve.api import build_app  # noqa: E402
from minfer.serve.async_engine import AsyncEngine  # noqa: E402

MODEL_PATH = os.path.join(loader.cache_dir(), loader.DEFAULT_MODEL_FILE)
pytestmark = pytest.mark.skipif(not os.path.exists(MODEL_PATH), reason=f"default model not at {MODEL_PATH}")

CONTEXT, KEY, NAME = 96, "sk-test", "minfer-test"
ENGINE = dict(max_num_batched_tokens=64, num_pages=256)
# The suite runs on each backend: ref in fp32 on the CPU (CI), cuda in bf16 (its pages hold 16 tokens).
BACKENDS = {"ref": dict(dtype="float32", device="cpu", page=4), "cuda": dict(dtype="bfloat16", device="cuda", page=16)}
PROMPTS = ["The capital of France is", "Water boils at", "def fibonacci(n):", "List of prime numbers: 2, 3, 5, 7,"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(app):
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    return srv, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module", params=["ref", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def server(backend):
    b = BACKENDS[backend]
    core = EngineCore(None, dtype=getattr(torch, b["dtype"]), device=b["device"], backend=backend,
                      max_context=CONTEXT, page_size=b["page"], prompt_graphs=True, **ENGINE)  # as minfer.serve
    engine = AsyncEngine(core)
    srv, thread, url = start(build_app(engine, NAME, api_key=KEY))
    yield SimpleNamespace(url=url, engine=engine, core=core,
                          http=httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60))
    srv.should_exit = True
    thread.join()
    engine.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def oracle(backend):
    """The offline engine on the server's model and backend: what each request should give."""
    b = BACKENDS[backend]
    return LLM(None, dtype=b["dtype"], device=b["device"], backend=backend, max_model_len=CONTEXT,
               block_size=b["page"], enable_prefix_caching=False, **ENGINE)


@pytest.fixture(scope="module")
def solo(oracle):
    """Each prompt alone through LLM.generate (greedy, 8 tokens)."""
    return [oracle.generate(p, SamplingParams(temperature=0.0, max_tokens=8))[0].text for p in PROMPTS]


def assert_idle(core, timeout=10.0):
    """Soon nothing runs and every page is free (cached pages count as free)."""
    bm = core.block_manager
    deadline = time.time() + timeout
    while (core.seqs or bm.num_free_pages != bm.num_pages) and time.time() < deadline:
        time.sleep(0.02)
    assert not core.seqs and bm.num_free_pages == bm.num_pages and not any(bm.ref_count)


def test_health_models(server, client):
    assert server.http.get("/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [NAME]
    assert server.http.get("/version").json() == {"version": __import__("minfer").__version__}


def test_priority(server, monkeypatch):
    """vLLM's priority field reaches the engine with each of the request's sequences; on an engine that schedules
    first come, first served, a priority other than 0 is a 400 naming it."""
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "n": 2}
    r = server.http.post("/v1/completions", json={**body, "priority": 3})
    assert_error(r, 400, "priority")
    assert "need --scheduling-policy priority" in r.json()["error"]["message"]
    seen, add = [], server.core.add_requests
    monkeypatch.setattr(server.core.scheduler, "policy", "priority")
    monkeypatch.setattr(server.core, "add_requests", lambda requests, priorities: seen.append(priorities) or add(
        requests, priorities))
    assert server.http.post("/v1/completions", json={**body, "priority": -4}).status_code == 200
    messages = [{"role": "user", "content": "Hi"}]
    assert server.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "priority": 7}
                            ).status_code == 200
    assert seen == [[-4, -4], [7]]
    assert_idle(server.core)


def test_vllm_sampling_fields(server, oracle, backend):
    """vLLM's include_stop_str_in_output (the text ends after the stop string) and allowed_token_ids (only those
    drawn), as LLM.generate gives them."""
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stop": ["."]}
    plain = server.http.post("/v1/completions", json=body).json()["choices"][0]
    kept = server.http.post("/v1/completions", json={**body, "include_stop_str_in_output": True}).json()["choices"][0]
    (want,) = oracle.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=["."],
                                                         include_stop_str_in_output=True), use_tqdm=False)
    assert (kept["text"], kept["finish_reason"]) == (want.text, "stop") == (plain["text"] + ".", plain["finish_reason"])
    assert_error(server.http.post("/v1/completions", json={**body, "include_stop_str_in_output": 1}), 400,
                 "include_stop_str_in_output")
    only = server.core.tokenizer.encode(" Lyon is big")
    r = server.http.post("/v1/completions", json={**body, "allowed_token_ids": only, "stop": []}).json()["choices"][0]
    (want,) = oracle.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=only),
                              use_tqdm=False)
    exact_or_follows(backend, r["text"], want.text, lambda t: set(server.core.tokenizer.encode(t)) <= set(only))
    assert set(server.core.tokenizer.encode(r["text"])) <= set(only)
    assert_error(server.http.post("/v1/completions", json={**body, "allowed_token_ids": []}), 400)
    assert_idle(server.core)


def test_cors(server):
    """A browser page may call the server (vLLM's default: any origin, no credentials): the preflight is answered
    before the API key is asked for, and responses carry the origin header; --allowed-origins narrows it."""
    asked = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=asked)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = server.http.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    srv, thread, url = start(build_app(server.engine, NAME, cors=dict(allow_origins=["http://ok.example"])))
    try:
        assert httpx.options(url + "/v1/models", headers={**asked, "Origin": "http://ok.example"}).status_code == 200
        r = httpx.options(url + "/v1/models", headers={**asked, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    finally:
        srv.should_exit = True
        thread.join()


def test_completion_greedy_equals_llm(server, client, solo):
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert out.choices[0].text == solo[0] and out.choices[0].finish_reason == "length"
    n_prompt = len(server.core.tokenizer.encode(PROMPTS[0]))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)
    # a list of prompts, and the same prompt as token ids
    out = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in out.choices] == solo
    ids = [server.core.tokenizer.encode(p) for p in PROMPTS[:2]]
    assert client.completions.create(model=NAME, prompt=ids[0], max_tokens=8, temperature=0).choices[0].text == solo[0]
    assert [c.text for c in client.completions.create(model=NAME, prompt=ids, max_tokens=8,
                                                       temperature=0).choices] == solo[:2]
    assert_idle(server.core)


def test_concurrent_streams_equal_solo(server, client, solo):
    def stream(p):
        chunks = client.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        assert list(pool.map(stream, PROMPTS * 2)) == solo * 2
    assert_idle(server.core)


def test_chat_streamed_equals_not_streamed(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    n_prompt = len(server.core.tokenizer.encode_chat(messages))
    assert full.usage.prompt_tokens == n_prompt and full.usage.total_tokens == n_prompt + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump() | {
        "completion_tokens_details": None, "prompt_tokens_details": None}


def test_raw_sse_ends_with_done(server):
    with server.http.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert all("choices" in json.loads(line[6:]) for line in lines[:-1])


def test_n_and_seed(server, client):
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1  # the choices of one seed differ
    assert a.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          n=2, seed=1, temperature=1.0, extra_body={"top_k": 50, "min_p": 0.01,
                                                                                    "repetition_penalty": 1.1})
    assert len(chat.choices) == 2
    assert_idle(server.core)


def test_stop_strings(server, client, solo):
    cut = solo[0].index(".")
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=["."])
    assert out.choices[0].text == solo[0][:cut] and out.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=".",
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == solo[0][:cut]


def test_logprobs(server, client):
    out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)  # greedy: the chosen is the top
    assert "".join(e.token for e in content) == out.choices[0].message.content
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) == 3 for t in lp.top_logprobs) and "".join(lp.tokens) == out.choices[0].text
    # sampled: a completion's top_logprobs hold the chosen token beside the top n (OpenAI's n + 1 at most)
    out = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=1.5, seed=3, logprobs=1)
    lp = out.choices[0].logprobs
    for t, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[t] == pytest.approx(chosen, abs=1e-4) and len(top) <= 2, (t, chosen, top)
    assert any(len(top) == 2 for top in lp.top_logprobs), "no token sampled below the top 1: the check saw nothing"


def test_logprobs_of_byte_tokens(server, backend):
    """Tokens that are pieces of a multi-byte character (emoji) show as "bytes:\\xNN" with their real bytes, which
    rebuild the text; distinct ones stay distinct in a completion's top_logprobs; text_offset indexes the text.
    Host-side formatting: the ref backend's fp32 greedy text, which is emoji here, covers it."""
    if backend != "ref":
        pytest.skip("the logprobs' formatting is the host's; the ref backend's run covers it")
    body = {"prompt": "Emoji list: \U0001F600 \U0001F603 \U0001F604 \U0001F601 \U0001F606", "max_tokens": 6,
            "temperature": 0}
    out = server.http.post("/v1/completions", json=body | {"logprobs": 5}).json()["choices"][0]
    lp, text = out["logprobs"], out["text"]
    assert any(t.startswith("bytes:") for t in lp["tokens"]), lp["tokens"]  # the model answers in emoji
    assert all(len(top) == 5 for top in lp["top_logprobs"]), lp["top_logprobs"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(text)
    for t, start in zip(lp["tokens"], lp["text_offset"]):
        assert t.startswith("bytes:") or text[start:].startswith(t), (t, start, text)
    chat = {"messages": [{"role": "user", "content": body["prompt"]}], "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    out = server.http.post("/v1/chat/completions", json=chat).json()["choices"][0]
    content = out["logprobs"]["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode(errors="replace").startswith(out["message"]["content"])


def test_streamed_text_offsets_equal_not_streamed(server, backend):
    """A streamed completion's text_offset are the non-streamed one's: a delta's text lags its tokens where a tail
    that may begin a stop string or a character split across tokens is held back, so the offsets count the tokens'
    characters, carried from delta to delta."""
    if backend != "ref":
        pytest.skip("the logprobs' formatting is the host's; the ref backend's run covers it")
    emoji = "Emoji list: \U0001F600 \U0001F603 \U0001F604 \U0001F601 \U0001F606"
    for prompt, stop in [(PROMPTS[3], ["zzzz"]), (emoji, ["zzzz"]), (emoji, [])]:  # the last: split characters alone
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2, "stop": stop, "ignore_eos": True}
        full = server.http.post("/v1/completions", json=body).json()["choices"][0]
        with server.http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        assert "".join(c["text"] for c in choices) == full["text"]
        lp = {k: [x for c in choices for x in c["logprobs"][k]] for k in full["logprobs"]}
        assert lp["tokens"] == full["logprobs"]["tokens"] and len(lp["tokens"]) == 10
        assert lp["text_offset"] == full["logprobs"]["text_offset"], (lp["text_offset"], full["logprobs"])
        for t, start in zip(lp["tokens"], lp["text_offset"]):
            assert t.startswith("bytes:") or full["text"][start:].startswith(t), (t, start, full["text"])
    assert_idle(server.core)


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == status
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("body,param", [
    ('{"prompt": "x", ', None),  # invalid JSON
    ('[1, 2]', None),  # not an object
    ('{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
    ('{"prompt": "x", "temperature": NaN}', "temperature"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature"),
    ('{"prompt": "x", "top_p": 0}', "top_p"),
    ('{"prompt": "x", "top_p": 1.5}', "top_p"),
    ('{"prompt": "x", "min_p": 1}', "min_p"),
    ('{"prompt": "x", "frequency_penalty": 2.5}', "frequency_penalty"),
    ('{"prompt": "x", "logprobs": -1}', "logprobs"),
    ('{"prompt": "x", "n": 0}', "n"),
    ('{"prompt": "x", "bogus": 1}', "bogus"),
    ('{"prompt": "x", "stop": [""]}', None),
    ('{"max_tokens": 3}', "prompt"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": [1, 99999999]}', "prompt"),  # outside the vocabulary
    ('{"prompt": [-1]}', "prompt"),
    ('{"prompt": "' + "word " * 200 + '"}', "prompt"),  # over the context
    ('{"prompt": "' + "word " * 200_000 + '"}', "prompt"),  # over any tokenization of it: refused untokenized
    ('{"prompt": "x", "foo": ' + "[" * 2000 + "]" * 2000 + "}", None),  # nested past json's recursion limit
    ('{"prompt": 5}', "prompt"),  # a union's member is not the param, and the message lists what it takes
    ('{"prompt": [true, false]}', "prompt"),  # strict types: no bools as ids, numbers, counts
    ('{"prompt": [1.0]}', "prompt"),
    ('{"prompt": "x", "temperature": true}', "temperature"),
    ('{"prompt": "x", "n": 2.0}', "n"),
    ('{"prompt": "x", "max_tokens": "1"}', "max_tokens"),
    ('{"prompt": "x", "stop": 5}', "stop"),
    ('{"prompt": "x", "stop": ' + json.dumps([str(i) for i in range(65)]) + "}", "stop"),
    ('{"prompt": "x", "temperature": 1e-6}', "temperature"),  # the core's check, named as the field
    ('{"prompt": "x", "stop": ["a", ""]}', "stop"),
    ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),  # without echo
    ('{"prompt": "x", "suffix": "y"}', "suffix"),  # OpenAI's fields that minfer lacks: only their no-op values
    ('{"prompt": "x", "best_of": 2}', None),
    ('{"prompt": "x", "logit_bias": {"a": 5}}', "logit_bias"),
    ('{"prompt": "x", "logit_bias": {"1": 101}}', "logit_bias"),
    ('{"prompt": "x", "logit_bias": {"1": 1, "01": 2}}', "logit_bias"),  # one token twice
    ('{"prompt": "x", "logit_bias": {"1": "5"}}', "logit_bias"),
    ('{"prompt": "x", "logit_bias": {"99999999": 5}}', "logit_bias"),  # past the vocabulary: the core's check
    ('{"prompt": "x", "logit_bias": ' + json.dumps({str(i): 1 for i in range(301)}) + "}", "logit_bias"),
    ('{"prompt": "x", "stream_options": {"include_usage": true}}', None),  # without stream
    ('{"prompt": ' + json.dumps([[1]] * 33) + ', "n": 128, "max_tokens": 1}', "n"),  # 4224 sequences: over 4096
])
def test_bad_completion_requests(server, body, param):
    assert_error(server.http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
                 400, param)


def test_bad_chat_requests(server):
    user = [{"role": "user", "content": "x"}]
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, None),
                        ({"messages": user, "top_logprobs": 99}, "top_logprobs"),
                        ({"messages": user, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
                        ({"messages": user, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                         "messages.0.content.0.type"),  # a text model says so, rather than drop the image
                        ({"messages": user, "tools": [{"type": "function"}]}, "tools.0.function"),
                        ({"messages": [{"role": "user", "content": "word " * 200_000}]}, "messages"),
                        ({"messages": user, "response_format": {"type": "xml"}}, "response_format.type")]:
        assert_error(server.http.post("/v1/chat/completions", json=body), 400, param)


def test_null_is_default_and_no_op_fields_pass(server, solo):
    """OpenAI's nullable fields take null as their default; its fields minfer lacks pass at their no-op values."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream", "stop",
                           "seed", "logit_bias", "suffix", "best_of"])
    body = {"prompt": PROMPTS[0], "max_tokens": 8, **nulls, "echo": False, "logit_bias": {}, "store": False,
            "service_tier": "auto"}
    r = server.http.post("/v1/completions", json=body | {"temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == solo[0]
    assert server.http.post("/v1/completions", json=body).status_code == 200  # temperature null: 1.0, sampled
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 2,
            "logprobs": None, "temperature": None, "response_format": {"type": "text"}, "tool_choice": "none",
            "parallel_tool_calls": False}
    assert server.http.post("/v1/chat/completions", json=chat).status_code == 200
    assert server.http.get("/v1/models/" + NAME).json()["id"] == NAME
    assert_error(server.http.get("/v1/models/gpt-4"), 404, "model")
    assert_idle(server.core)


def test_logit_bias(server, solo):
    """OpenAI's logit_bias: -100 on each greedy token in turn steers the text off it, +100 forces a token, on both
    endpoints."""
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    plain = server.http.post("/v1/completions", json=body).json()["choices"][0]
    first = server.core.tokenizer.encode(plain["logprobs"]["tokens"][0])
    assert len(first) == 1
    banned = server.http.post("/v1/completions", json=body | {"logit_bias": {str(first[0]): -100}}).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != plain["logprobs"]["tokens"][0]
    forced = server.http.post("/v1/completions", json=body | {"logit_bias": {"42": 100}}).json()["choices"][0]
    assert forced["text"] == server.core.tokenizer.decode([42] * 4)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}}
    assert server.http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"] == \
        server.core.tokenizer.decode([42] * 3)
    assert_idle(server.core)


def test_echo(server, solo, oracle):
    """echo: the prompt before the completion, and with logprobs its tokens' logprobs before the new ones' (the first
    token's null), as the engine's prompt_logprobs give them; max_tokens 0 with echo scores the prompt alone
    (lm-evaluation-harness's loglikelihood request)."""
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 2}
    out = server.http.post("/v1/completions", json=body).json()
    (c,), lp = out["choices"], out["choices"][0]["logprobs"]
    ids = server.core.tokenizer.encode(PROMPTS[0])
    assert c["text"] == PROMPTS[0] + solo[0] and out["usage"]["completion_tokens"] == 8
    assert len(lp["tokens"]) == len(ids) + 8 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == c["text"] and lp["text_offset"][len(ids)] == len(PROMPTS[0])
    want = oracle.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx([e["logprob"] for e in want[1:]], abs=1e-4)
    alone = server.http.post("/v1/completions", json=body | {"max_tokens": 0}).json()
    assert alone["choices"][0]["text"] == PROMPTS[0] and alone["usage"]["completion_tokens"] == 0
    scored = alone["choices"][0]["logprobs"]["token_logprobs"]  # no row sampled beside them: fp32's rounding differs
    assert scored[0] is None and scored[1:] == pytest.approx(lp["token_logprobs"][1:len(ids)], abs=1e-4)
    assert alone["choices"][0]["finish_reason"] == "length"
    for whole in (out, alone):  # streamed: the same text, logprobs and usage, the prompt's in the first chunk
        stream = body | {"max_tokens": whole["usage"]["completion_tokens"], "stream": True,
                         "stream_options": {"include_usage": True}}
        with server.http.stream("POST", "/v1/completions", json=stream) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        parts = [c["choices"][0] for c in chunks if c["choices"]]
        assert parts[0]["text"].startswith(PROMPTS[0]) and "".join(c["text"] for c in parts) == whole["choices"][0]["text"]
        got = {k: [x for c in parts for x in c["logprobs"][k]] for k in lp}
        assert got == whole["choices"][0]["logprobs"] and chunks[-1]["usage"] == whole["usage"]
    special = server.core.tokenizer.special_ids  # a special token shows as its name (vLLM's), adding no text
    chat_ids = server.core.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    echoed = server.http.post("/v1/completions", json={"prompt": chat_ids, "max_tokens": 0, "echo": True,
                                                       "logprobs": 1}).json()["choices"][0]
    names = [t for t, i in zip(echoed["logprobs"]["tokens"], chat_ids) if i in special]
    assert names and all(n.startswith("<|") for n in names), echoed["logprobs"]["tokens"]
    assert echoed["text"] == server.core.tokenizer.decode(chat_ids)
    two = server.http.post("/v1/completions", json={"prompt": [ids, ids[:3]], "max_tokens": 2, "temperature": 0,
                                                    "echo": True}).json()["choices"]
    assert [c["text"][:len(t)] for c, t in zip(two, [PROMPTS[0], server.core.tokenizer.decode(ids[:3])])] == \
        [PROMPTS[0], server.core.tokenizer.decode(ids[:3])]
    assert_idle(server.core)


def stream_choices(server, body) -> tuple[list[dict], list[dict]]:
    """A streamed completion's chunks and their choices."""
    with server.http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return chunks, [c["choices"][0] for c in chunks if c["choices"]]


def test_echo_scores_a_prompt_that_fills_the_context(server):
    """max_tokens 0 with echo scores the prompt alone: no new token needs room, so a prompt of the whole context is
    prefilled (its logprobs are the shorter prompt's where they overlap), finishing on "length" with no completion
    token, streamed too; one token more is still refused."""
    tok = server.core.tokenizer
    ids = (tok.encode(" ".join(PROMPTS)) * CONTEXT)[:CONTEXT]
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = server.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    (c,), lp = out["choices"], out["choices"][0]["logprobs"]
    assert c["text"] == tok.decode(ids) and c["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": CONTEXT, "completion_tokens": 0, "total_tokens": CONTEXT}
    assert len(lp["tokens"]) == CONTEXT and lp["token_logprobs"][0] is None
    shorter = server.http.post("/v1/completions", json=body | {"prompt": ids[:-1]}).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][1:-1] == pytest.approx(shorter["token_logprobs"][1:], abs=1e-4)
    chunks, parts = stream_choices(server, body | {"stream_options": {"include_usage": True}})
    assert "".join(p["text"] for p in parts) == c["text"] and parts[-1]["finish_reason"] == "length"
    assert {k: [x for p in parts for x in p["logprobs"][k]] for k in lp} == lp and chunks[-1]["usage"] == out["usage"]
    plain = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True}).json()
    assert plain["choices"][0]["text"] == c["text"] and plain["choices"][0].get("logprobs") is None
    assert_error(server.http.post("/v1/completions", json=body | {"prompt": ids + ids[:1]}), 400, "prompt")
    assert_error(server.http.post("/v1/completions", json=body | {"max_tokens": 1}), 400, "prompt")
    assert_idle(server.core)


def test_echoed_special_tokens_count_in_text_offset(server, backend):
    """A text prompt that writes special tokens' names (a chat transcript) is echoed as written: each such token moves
    text_offset on by its name, so that every prompt token's offset is where it starts in the text. Given as ids,
    the echoed text is their decoding, which skips special tokens: they move nothing, nor do generated ones."""
    if backend != "ref":
        pytest.skip("the logprobs' formatting is the host's; the ref backend's run covers it")
    tok = server.core.tokenizer
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    end = tok.tok.token_to_id("<|im_end|>")
    assert end in ids and end in tok.special_ids
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0, "ignore_eos": True,
            "logit_bias": {str(end): 100}}  # three generated special tokens: no text
    full = server.http.post("/v1/completions", json=body).json()["choices"][0]
    lp, text = full["logprobs"], full["text"]
    assert text == prompt and lp["tokens"][len(ids):] == ["<|im_end|>"] * 3
    assert lp["text_offset"] == list(itertools.accumulate(map(len, lp["tokens"][:len(ids)]), initial=0)) + \
        [len(prompt)] * 2
    for t, start in zip(lp["tokens"][:len(ids)], lp["text_offset"]):
        assert text[start:].startswith(t), (t, start, text)
    _, parts = stream_choices(server, body)
    assert {k: [x for p in parts for x in p["logprobs"][k]] for k in lp} == lp
    as_ids = server.http.post("/v1/completions", json=body | {"prompt": ids}).json()["choices"][0]
    lp, text = as_ids["logprobs"], as_ids["text"]
    assert text == tok.decode(ids) and lp["text_offset"][len(ids):] == [len(text)] * 3
    for i, t, start in zip(ids, lp["tokens"], lp["text_offset"]):
        assert i in tok.special_ids or text[start:].startswith(t), (t, start, text)
    assert_idle(server.core)


def test_min_tokens(server):
    """vLLM's min_tokens: the end of turn waits for it; over max_tokens it is a 400 naming it."""
    body = {"messages": [{"role": "user", "content": "What is 2+2? Answer with one number."}], "max_tokens": 40,
            "temperature": 0}
    plain = server.http.post("/v1/chat/completions", json=body).json()
    n = plain["usage"]["completion_tokens"]
    assert plain["choices"][0]["finish_reason"] == "stop" and n < 30
    longer = server.http.post("/v1/chat/completions", json=body | {"min_tokens": n + 5}).json()
    assert longer["usage"]["completion_tokens"] >= n + 5
    assert_error(server.http.post("/v1/chat/completions", json=body | {"min_tokens": 41}), 400, "min_tokens")
    assert_idle(server.core)


def test_tokenize_add_special_tokens(server, monkeypatch):
    """vLLM's add_special_tokens on a model that adds BOS: a prompt gets it unless false; messages get only the
    template's tokens, unless true asks for BOS before them too."""
    http, tok = server.http, server.core.tokenizer
    monkeypatch.setattr(tok, "add_bos", True)
    text, bos = tok.tok.encode(PROMPTS[0], add_special_tokens=False).ids, tok.bos_token_id
    ask = lambda **body: http.post("/tokenize", json=body).json()["tokens"]  # noqa: E731
    assert ask(prompt=PROMPTS[0]) == ask(prompt=PROMPTS[0], add_special_tokens=True) == [bos] + text
    assert ask(prompt=PROMPTS[0], add_special_tokens=False) == text
    messages = [{"role": "user", "content": "Hi"}]
    template = tok.tok.encode(tok.apply_chat_template(messages), add_special_tokens=False).ids
    assert ask(messages=messages) == ask(messages=messages, add_special_tokens=False) == template
    assert ask(messages=messages, add_special_tokens=True) == [bos] + template


def test_chat_render_options(server, oracle):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs reach the template on /tokenize
    and on /v1/chat/completions (whose text is LLM.chat's with the same options); a bad combination is a 400 naming
    the field."""
    http, tok = server.http, server.core.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital"}]
    for options in [dict(add_generation_prompt=False), dict(add_generation_prompt=False, continue_final_message=True),
                    dict(chat_template_kwargs={"unused": 1})]:
        render = dict(add_generation_prompt=options.get("add_generation_prompt", True),
                      continue_final_message=options.get("continue_final_message", False),
                      template_kwargs=options.get("chat_template_kwargs"))
        ids = tok.encode_chat(messages, **render)
        assert http.post("/tokenize", json={"messages": messages, **options}).json()["tokens"] == ids
        r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "temperature": 0, **options})
        (want,) = oracle.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                              **{k: v for k, v in options.items()})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert tok.decode(tok.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)).endswith(
        "assistant\nThe capital")
    for body, param in [({"continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": []}, "chat_template_kwargs")]:
        for path in ("/tokenize", "/v1/chat/completions"):
            assert_error(http.post(path, json={"messages": messages, **body}), 400, param)
    assert_idle(server.core)


def exact_or_follows(backend: str, got, want, follows) -> None:
    """Greedy under a constraint: on the ref backend (fp32) the oracle's text exactly; on the GPU (bf16) a text the
    constraint allows. The server's prefix cache holds the chat's system prompt from earlier requests, computed in
    another batch than the oracle's, and over tens of tokens of JSON a near tie between two allowed ids can flip."""
    if backend == "ref":
        assert got == want
    else:
        assert follows(got), got


def test_structured_outputs(server, oracle, backend):
    """OpenAI's response_format (json_object, json_schema) and vLLM's structured_outputs constrain the output: the
    greedy text is LLM.chat's / LLM.generate's under the same constraint (exact_or_follows); a bad one is a 400
    naming its field."""
    pytest.importorskip("llguidance")
    http = server.http
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "big": {"type": "boolean"}},
              "required": ["name", "big"], "additionalProperties": False}
    greedy = dict(temperature=0, max_tokens=48)
    for fmt, spec in [({"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
                       {"json": schema}), ({"type": "json_object"}, {"json_object": True})]:
        r = http.post("/v1/chat/completions", json={"messages": messages, "response_format": fmt, **greedy})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        (want,) = oracle.chat(messages, SamplingParams(structured_outputs=spec, **greedy), use_tqdm=False)
        exact_or_follows(backend, text, want.text, lambda t: isinstance(json.loads(t), dict) and (
            "json_object" in spec or (set(json.loads(t)) == {"name", "big"} and len(json.loads(t)["name"]) <= 10)))
        assert isinstance(json.loads(text), dict)
    choices = ["Paris", "London"]
    r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "structured_outputs": {"choice": choices}, **greedy})
    (want,) = oracle.generate(PROMPTS[0], SamplingParams(structured_outputs={"choice": choices}, **greedy))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text and want.text in choices
    for body, param in [({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strong"}}}},
                         "response_format"),
                        ({"structured_outputs": {"regex": "[a"}}, "structured_outputs"),
                        ({"structured_outputs": {}}, "structured_outputs"),
                        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
                         "structured_outputs")]:
        assert_error(http.post("/v1/chat/completions", json={"messages": messages, **body}), 400, param)
    assert_idle(server.core)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_forced_tool_calls(server, client, oracle, backend):
    """tool_choice naming a function, or 'required': the output is constrained to the tools' schemas and comes back
    as tool_calls (streamed too: a named call's arguments as they come, 'required''s calls at the end), the text the
    engine gives under the same constraint (exact_or_follows); the tools reach the chat template."""
    pytest.importorskip("llguidance")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools, greedy = [WEATHER, TIME], dict(temperature=0, max_tokens=60)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=NAME, messages=messages, tools=tools, tool_choice=named, **greedy)
    m = r.choices[0].message
    (want,) = oracle.chat(messages, SamplingParams(structured_outputs={"json": WEATHER["function"]["parameters"]},
                                                   **greedy), use_tqdm=False, tools=tools)
    assert m.content is None and [c.function.name for c in m.tool_calls] == ["get_weather"]
    assert m.tool_calls[0].function.arguments == want.text and set(json.loads(want.text)) == {"city", "unit"}
    assert m.tool_calls[0].id.startswith("call_") and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, tools=tools, tool_choice=named,
                                                 stream=True, **greedy))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert "".join(c.function.arguments for c in calls) == want.text and len(calls) > 1

    r = client.chat.completions.create(model=NAME, messages=messages, tools=tools, tool_choice="required", **greedy)
    one = lambda t: {"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},  # noqa: E731
                                                      "parameters": t["function"]["parameters"]},
                     "required": ["name", "parameters"], "additionalProperties": False}
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [one(t) for t in tools]}}
    (want,) = oracle.chat(messages, SamplingParams(structured_outputs={"json": schema}, **greedy), use_tqdm=False,
                          tools=tools)
    expected = [(c["name"], c["parameters"]) for c in json.loads(want.text)]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    keys = {"get_weather": {"city", "unit"}, "get_time": {"zone"}}
    exact_or_follows(backend, got, expected, lambda calls: calls and all(set(a) == keys[n] for n, a in calls))
    expected = got  # the stream: the same request to the same server
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, tools=tools, tool_choice="required",
                                                 stream=True, **greedy))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls for c in ch.choices[0].delta.tool_calls]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == expected
    assert [c.index for c in streamed] == list(range(len(expected)))
    assert_idle(server.core)


def test_tools_reach_the_chat_template(server, monkeypatch):
    """A template that lists the tools (as Qwen's and Llama 3.1's do) sees the request's tools, as OpenAI gives them."""
    pytest.importorskip("llguidance")
    tok = server.core.tokenizer
    monkeypatch.setattr(tok, "chat_template", "{% for t in tools or [] %}{{ t.function.name }}: {{ t.function.parameters."
                        "required | tojson }}\n{% endfor %}{% for m in messages %}{{ m.content }}\n{% endfor %}")
    messages = [{"role": "user", "content": "Hi"}]
    body = {"messages": messages, "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 1}
    r = server.http.post("/v1/chat/completions", json=body)
    text = tok.apply_chat_template(messages, tools=[WEATHER, TIME])
    assert text == 'get_weather: ["city", "unit"]\nget_time: ["zone"]\nHi\n'
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.tok.encode(text).ids)
    tokens = server.http.post("/tokenize", json={"messages": messages, "tools": [WEATHER, TIME]}).json()["tokens"]
    assert tokens == tok.tok.encode(text).ids  # /tokenize takes the tools too, as vLLM's does
    assert_idle(server.core)


def test_hermes_parser():
    from minfer.serve.tool_parser import Hermes
    h = Hermes()
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Zürich"}}\n</tool_call>'
    assert h.parse("Checking.\n" + call + call) == ("Checking.\n", [("get_time", '{"zone": "Zürich"}')] * 2)
    assert h.parse(call[:-len("</tool_call>")]) == (None, [("get_time", '{"zone": "Zürich"}')])  # cut before its end
    assert h.parse('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>') == (None, [("f", "{}")])
    for text in ("no call", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": 5}</tool_call>', "<tool_call>"):
        assert h.parse(text) is None
    assert [h.held(t) for t in ("a <tool", "a <", "a <x", "<tool_call", "")] == [5, 1, 0, 10, 0]
    assert h.content_end("ab <tool_call>{") == (3, True) and h.content_end("ab <to") == (3, False)


def test_auto_tool_choice_with_the_hermes_parser(server):
    """--tool-call-parser hermes: the calls the model writes (forced here through a choice constraint, as the small
    model writes none of its own) come back as tool_calls, the text before them as content, finish_reason
    tool_calls, the same streamed; a reply with no call is content as before."""
    pytest.importorskip("llguidance")
    srv, thread, url = start(build_app(server.engine, NAME, tool_parser="hermes"))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    written = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    body = dict(model=NAME, messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, TIME], max_tokens=60,
                temperature=0)
    try:
        r = client.chat.completions.create(**body, extra_body={"structured_outputs": {"choice": [written]}})
        m = r.choices[0].message
        assert (m.content, r.choices[0].finish_reason) == ("Let me look.\n", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("get_time", {"zone": "UTC"})]
        chunks = list(client.chat.completions.create(**body, stream=True,
                                                     extra_body={"structured_outputs": {"choice": [written]}}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "Let me look.\n"
        (calls,) = [d.tool_calls for d in deltas if d.tool_calls]
        assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "get_time", '{"zone": "UTC"}')]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        plain = client.chat.completions.create(**body, extra_body={"structured_outputs": {"choice": ["It is noon <"]}})
        assert plain.choices[0].message.content == "It is noon <" and not plain.choices[0].message.tool_calls
        streamed = list(client.chat.completions.create(**body, stream=True,
                                                       extra_body={"structured_outputs": {"choice": ["It is noon <"]}}))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "It is noon <"
    finally:
        srv.should_exit = True
        thread.join()
    assert_idle(server.core)


def test_reasoning_parsers():
    """<think>reasoning</think>answer: the start tag optional (where the output does not open it, the parser's rule
    says what its text is); the first </think> ends the reasoning; streamed in any pieces, the same parts."""
    from minfer.serve.reasoning import parser
    cases = [("qwen3", "", "<think>\nwhy</think>\n\nSo 4.", ("\nwhy", "\n\nSo 4.")),
             ("qwen3", "", "Just 4.", (None, "Just 4.")),  # enable_thinking=False: no tags
             ("qwen3", "<|im_start|>assistant\n<think>\n", "why</think>4", ("why", "4")),  # the prompt opened it
             ("qwen3", "", "<think>cut off", ("cut off", None)),
             ("qwen3", "", "<thin", (None, "<thin")),
             ("deepseek_r1", "", "why</think>4 <think>x</think>", ("why", "4 <think>x</think>")),
             ("deepseek_r1", "", "<think>why</think>4", ("why", "4")),  # R1-0528 writes the start tag
             ("deepseek_r1", "", "still thinking </thi", ("still thinking </thi", None)),
             ("deepseek_r1", "", "</think>", (None, None))]
    rng = __import__("random").Random(0)
    for name, prompt, text, want in cases:
        assert parser(name, prompt).split(text) == want, (name, text)
        for _ in range(20):  # streamed in random pieces
            cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1)))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            p, got = parser(name, prompt), [[], []]
            for k, piece in enumerate(pieces):
                for part, out in zip(p.feed(piece, k == len(pieces) - 1), got):
                    out.append(part)
            assert tuple("".join(g) or None for g in got) == want, (name, pieces)


def test_reasoning_comes_apart_from_the_answer(server):
    """--reasoning-parser qwen3 on a template whose prompt opens <think> (a few shots the model copies): the reply's
    reasoning_content and content are the split of the text the same request gives without the parser, streamed
    the same; include_reasoning false drops the reasoning; a constrained reply is all answer."""
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<think>\n{% endif %}")
    shots = "Q: 2+2?\n<think>\nadd them</think>\nA: 4\n\nQ: 3+3?\n<think>\nadd them</think>\nA: 6\n\nQ: 5+5?\n"
    tok = server.core.tokenizer
    own, tok.chat_template = tok.chat_template, template
    srv, thread, url = start(build_app(server.engine, NAME, reasoning_parser="qwen3"))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    body = dict(model=NAME, messages=[{"role": "user", "content": shots}], max_tokens=12, temperature=0)
    try:
        free = server.http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert free["reasoning_content"] is None and "</think>" in free["content"]
        thought, answer = free["content"].split("</think>", 1)
        r = client.chat.completions.create(**body).choices[0].message
        assert (r.reasoning_content, r.content) == (thought, answer)
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**body, stream=True) if c.choices]
        assert "".join(d.reasoning_content or "" for d in deltas if hasattr(d, "reasoning_content")) == thought
        assert "".join(d.content or "" for d in deltas) == answer
        hidden = client.chat.completions.create(**body, extra_body={"include_reasoning": False}).choices[0].message
        assert (getattr(hidden, "reasoning_content", None), hidden.content) == (None, answer)
        pytest.importorskip("llguidance")
        fixed = client.chat.completions.create(**body, extra_body={"structured_outputs": {"choice": ["a</think>b"]}})
        assert (fixed.choices[0].message.reasoning_content, fixed.choices[0].message.content) == (None, "a</think>b")
    finally:
        tok.chat_template = own
        srv.should_exit = True
        thread.join()
    assert_idle(server.core)


def test_a_constrained_reply_reasons_first(server, monkeypatch):
    """With reasoning tags the engine knows (one token each: here "<|im_start|>" and ",", standing in for <think> and
    </think>), a constrained chat reply reasons freely up to the end tag, comes back apart as reasoning_content, and
    its content follows the constraint; streamed the same."""
    pytest.importorskip("llguidance")
    from minfer.serve import reasoning
    monkeypatch.setattr(reasoning, "START", "<|im_start|>")
    monkeypatch.setattr(reasoning, "END", ",")
    core = server.core
    assert core.set_reasoning_tags(reasoning.START, reasoning.END)
    srv, thread, url = start(build_app(server.engine, NAME, reasoning_parser="deepseek_r1"))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    body = dict(model=NAME, messages=[{"role": "user", "content": "The capital of France is"}], max_tokens=24,
                temperature=0, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    try:
        m = client.chat.completions.create(**body).choices[0].message
        assert m.reasoning_content and "," not in m.reasoning_content and re.fullmatch("[0-9]{3}", m.content), m
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**body, stream=True) if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == m.reasoning_content
        assert "".join(d.content or "" for d in deltas) == m.content
    finally:
        core.reasoning_tags = None
        srv.should_exit = True
        thread.join()
    assert_idle(server.core)


def test_tool_requests_that_cannot_run(server):
    """'auto' (OpenAI's default with tools) needs a parser of the model's own call format (--tool-call-parser): without
    one, a 400 that says what works; so are a named function that is not among the tools, 'required' without tools, a
    forced call beside another constraint, and a tool name outside OpenAI's pattern."""
    messages = [{"role": "user", "content": "Hi"}]
    for body, param in [({"tools": [WEATHER]}, "tool_choice"), ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # no parser
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
                         "tools.0.function.name")]:
        assert_error(server.http.post("/v1/chat/completions", json={"messages": messages, **body}), 400, param)
    r = server.http.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "tool_choice": "none",
                                                       "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []
    assert_idle(server.core)


def test_tokenize_and_detokenize(server):
    """vLLM's /tokenize gives the ids the completion and chat routes run (their usage counts them), /detokenize
    the text of ids; bad input is a 400 naming the field."""
    http, tok = server.http, server.core.tokenizer
    r = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert r["tokens"] == tok.encode(PROMPTS[0]) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.core.max_context
    used = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1}).json()["usage"]
    assert used["prompt_tokens"] == r["count"]
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tok.encode_chat(messages)
    # text parts join with newlines, as vLLM joins them for a template that reads a string
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "input_text", "text": "there"}]}]
    assert http.post("/tokenize", json={"messages": parts}).json()["tokens"] == \
        tok.encode_chat([{"role": "user", "content": "Hi\nthere"}])
    used = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert used["prompt_tokens"] == chat["count"]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPTS[0]}
    assert_error(http.post("/tokenize", json={"prompt": "x", "add_special_tokens": 1}), 400, "add_special_tokens")
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                              ("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": [server.core.cfg.vocab_size]}, "tokens"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens.0")]:
        assert_error(http.post(path, json=body), 400, param)
    assert_idle(server.core)


def test_tiny_top_p_keeps_the_top_token(server, solo):
    """A top_p that is 0 in fp32 still keeps the most likely token: the greedy text, not an empty one."""
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "top_p": 1e-300, "seed": 1}
    assert server.http.post("/v1/completions", json=body).json()["choices"][0]["text"] == solo[0]


def test_sampling_fields_reach_the_engine(server, solo, oracle):
    """top_k, min_p and the three penalties act as SamplingParams' do: at temperature 1, top_k 1 or a min_p near 1
    leaves only the greedy token to draw (the greedy text, where the plain draws leave it); each penalty gives
    LLM.generate's greedy text under that penalty, which is not the plain greedy text."""
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 1, "n": 4}
    texts = lambda reply: [c["text"] for c in reply.json()["choices"]]  # noqa: E731
    assert texts(server.http.post("/v1/completions", json=body)) != [solo[0]] * 4  # the check below can fail
    for cut in ({"top_k": 1}, {"min_p": 0.999}):
        assert texts(server.http.post("/v1/completions", json=body | cut)) == [solo[0]] * 4, cut
    for penalty in ({"repetition_penalty": 1.3}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.5}):
        want = oracle.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, **penalty))[0].text
        assert want != solo[0], penalty  # the penalty changes this prompt's text: the check below can fail
        reply = server.http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                                          **penalty})
        assert texts(reply) == [want], penalty
    assert_idle(server.core)


def test_not_found_and_too_large(server):
    assert_error(server.http.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404, "model")
    assert_error(server.http.get("/v1/nothing"), 404)
    assert_error(server.http.post("/v1/completions", content=b"x" * (5 << 20)), 413)
    assert server.http.get("/health").status_code == 200


def test_api_key(server):
    assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}), 401)
    assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": KEY}), 401)
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics need no key


def test_full_queue_is_429(server):
    srv, thread, url = start(build_app(server.engine, NAME, max_waiting=0))
    try:
        assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x"}), 429)
    finally:
        srv.should_exit = True
        thread.join()


def test_an_add_in_flight_counts_as_waiting(server, monkeypatch):
    """While the engine thread moves a request into the scheduler it still counts as waiting (never in neither
    place), so a concurrent admission check cannot let one more past --max-waiting."""
    add, step, moving = server.core.add_requests, server.core.step, threading.Event()

    def slow_add(*args):
        moving.set()
        time.sleep(0.3)
        return add(*args)

    monkeypatch.setattr(server.core, "add_requests", slow_add)
    # the step after the add starts late, so that the request is still queued when the count, which waits for the
    # add, is read (the step would otherwise move it to running first)
    monkeypatch.setattr(server.core, "step", lambda: (time.sleep(0.3), step())[1])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert moving.wait(10)
        time.sleep(0.1)  # inside the add
        assert server.engine.num_waiting == 1
        assert reply.result().status_code == 200
    assert_idle(server.core)


def test_max_waiting_holds_under_a_burst(server, monkeypatch):
    """Concurrent requests see each other's admissions: at most --max-waiting wait, the rest get 429; a request
    that alone needs more than the limit is a 400 naming n, not a 429 to retry forever."""
    step = server.core.step
    monkeypatch.setattr(server.core, "step", lambda: (time.sleep(0.2), step())[1])
    srv, thread, url = start(build_app(server.engine, NAME, max_waiting=2))
    try:
        assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 1}), 400, "n")
        body = {"prompt": "x", "max_tokens": 1}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(16)))
        assert {r.status_code for r in replies} == {200, 429}
        waiting = [int(re.search(r"\((\d+) requests waiting\)", r.json()["error"]["message"])[1])
                   for r in replies if r.status_code == 429]
        assert max(waiting) <= 2, waiting  # what each refused request saw: never more than the limit
    finally:
        srv.should_exit = True
        thread.join()
    assert_idle(server.core)


def test_disconnect_mid_stream_frees_pages(server, caplog):
    caplog.set_level(logging.INFO, logger="minfer.serve")
    body = {"prompt": PROMPTS[1], "max_tokens": 80, "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert server.core.block_manager.num_free_pages < server.core.block_manager.num_pages
    assert_idle(server.core)
    assert any("finish abort" in m for m in caplog.messages)
    assert 'minfer_requests_finished_total{finish_reason="abort"}' in httpx.get(server.url + "/metrics").text


def test_disconnect_before_the_response_aborts(server, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="minfer.serve")
    step = server.core.step
    monkeypatch.setattr(server.core, "step", lambda: (time.sleep(0.02), step())[1])  # > 0.5 s on any device
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 200, "ignore_eos": True},
                         timeout=0.5)
    assert_idle(server.core)
    assert any("finish abort" in m for m in caplog.messages)


def test_disconnect_during_admission_drops_the_request(server, monkeypatch):
    """A client that leaves while its request waits for the engine thread (busy in a step) is never added:
    no prefill for nobody."""
    added, add, step = [], server.core._add, server.core.step
    monkeypatch.setattr(server.core, "_add", lambda ids, params, rid, *m: (added.append(rid), add(ids, params, rid, *m))[1])
    monkeypatch.setattr(server.core, "step", lambda: (time.sleep(1.0), step())[1])
    busy = threading.Thread(target=lambda: server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}))
    busy.start()
    time.sleep(0.2)  # the engine thread is in the first request's slow step
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 2}, timeout=0.2)
    busy.join()
    assert_idle(server.core)
    assert len(added) == 1, added


def test_a_bad_prompt_rejects_its_request_whole(server, monkeypatch):
    """A request with one prompt past the context is a 400 before any of its prompts is added: nothing
    prefilled, nothing counted in the metrics."""
    added, add = [], server.core._add  # every request the core queues passes here
    monkeypatch.setattr(server.core, "_add", lambda ids, params, rid, *m: (added.append(rid), add(ids, params, rid, *m))[1])

    def metric(name):
        text = httpx.get(server.url + "/metrics").text
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    before = metric("minfer_prompt_tokens_total"), metric("minfer_requests_finished_total")
    body = {"prompt": [PROMPTS[0], "one two " * CONTEXT], "n": 2, "max_tokens": 2}
    assert_error(server.http.post("/v1/completions", json=body), 400, "prompt")
    assert_idle(server.core)
    assert added == [] and (metric("minfer_prompt_tokens_total"), metric("minfer_requests_finished_total")) == before


def test_failing_step_fails_its_requests_only(server, client, solo, monkeypatch):
    def boom():
        monkeypatch.undo()  # fail once
        raise RuntimeError("boom")
    monkeypatch.setattr(server.core, "step", boom)
    # on one raw connection: the 500, then a second request on the same socket (the connection stays open)
    host, port = server.url.removeprefix("http://").split(":")
    body = b'{"prompt": "x", "max_tokens": 2}'
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 500") and b'"code":500' in reply, reply
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200"), "the 500 closed the connection"
    assert_idle(server.core)
    assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0).choices[0].text == solo[0]


def test_metrics(server, client):
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    for name in ["minfer_num_requests_running", "minfer_num_requests_waiting", "minfer_kv_pages_used",
                 "minfer_kv_pages_free", "minfer_prefix_cache_hit_rate", "minfer_prompt_tokens_total",
                 "minfer_generation_tokens_total", "minfer_time_to_first_token_seconds_bucket",
                 "minfer_inter_token_latency_seconds_bucket", "minfer_e2e_request_latency_seconds_bucket"]:
        assert f"\n{name}" in text, name
    assert "minfer_kv_pages_used 0.0" in text


def test_piled_up_deltas_go_out_as_one_chunk(server):
    """Tokens that came while the event loop was busy leave as one chunk, with the text and logprobs (offsets
    included) that the chunks one a token would have had."""
    body = {"prompt": PROMPTS[3], "max_tokens": 32, "temperature": 0, "logprobs": 2, "ignore_eos": True}
    for _ in range(2):  # the second finds the prompt in the prefix cache, as the streamed one will
        full = server.http.post("/v1/completions", json=body).json()["choices"][0]
    app = build_app(server.engine, NAME)

    @app.get("/stall")
    async def stall():  # blocks the loop while the engine makes 4 tokens
        seq = next(iter(server.core.seqs.values()))
        end, deadline = len(seq.output_token_ids) + 4, time.time() + 30
        while len(seq.output_token_ids) < end and seq.finish_reason is None and time.time() < deadline:
            time.sleep(0.01)
        return {}

    srv, thread, url = start(app)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                lines = r.iter_lines()
                chunks = [json.loads(next(line for line in lines if line.startswith("data: {"))[6:])]
                http.get("/stall")
                chunks += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    finally:
        srv.should_exit = True
        thread.join()
    choices = [c["choices"][0] for c in chunks]
    assert max(len(c["logprobs"]["tokens"]) for c in choices) > 1 and choices[-1]["finish_reason"] == "length"
    assert "".join(c["text"] for c in choices) == full["text"]
    lp = {k: [x for c in choices for x in c["logprobs"][k]] for k in full["logprobs"]}
    assert lp["tokens"] == full["logprobs"]["tokens"] and lp["text_offset"] == full["logprobs"]["text_offset"]
    assert lp["token_logprobs"] == pytest.approx(full["logprobs"]["token_logprobs"], abs=1e-4)
    assert [list(t) for t in lp["top_logprobs"]] == [list(t) for t in full["logprobs"]["top_logprobs"]]
    assert_idle(server.core)


def test_bulk_histogram_matches_prometheus_client():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from minfer.serve.metrics import LATENCY_BUCKETS
    from minfer.serve.metrics import Histogram as BulkHistogram
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    a = Histogram("minfer_x_seconds", "X", registry=theirs, buckets=LATENCY_BUCKETS)
    b = BulkHistogram("minfer_x_seconds", "X", ours)
    for value, count in [(0.0005, 1), (0.001, 3), (0.0011, 2), (0.3, 1), (100.0, 2)]:
        for _ in range(count):
            a.observe(value)
        b.observe(value, count)
    def lines(registry):  # the _created series hold their own creation times
        return [line for line in generate_latest(registry).decode().splitlines() if "_created " not in line]
    assert lines(theirs) == lines(ours)


def test_bench_serve(server, tmp_path, capsys):
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps", "bench_serve.py")
    spec = importlib.util.spec_from_file_location("bench_serve", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "serve.jsonl"
    assert bench.main(["--base-url", server.url, "--api-key", KEY, "--num-requests", "4", "--input-len", "8:16",
                       "--output-len", "4", "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["completed"] == 4 and row["failed"] == 0 and row["output_tok_s"] > 0
    assert all(row[f"{m}_p{q}_ms"] is not None for m in ("ttft", "tpot", "itl") for q in (50, 90, 99))
    assert "4/4 requests (0 failed)" in capsys.readouterr().out
    assert_idle(server.core)


def test_stress_serve(server, backend, tmp_path, capsys):
    """apps/stress_serve.py, small: disconnects and malformed bodies among valid requests leave no 5xx, right
    usage, the probe's solo text in the storm, no page held, /health OK."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "apps", "stress_serve.py")
    spec = importlib.util.spec_from_file_location("stress_serve", path)
    stress = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stress)
    out = tmp_path / "stress.jsonl"
    rc = stress.main(["--base-url", server.url, "--api-key", KEY, "--num-requests", "40", "--max-concurrency", "8",
                      "--max-tokens", "2:6", "--probe-copies", "4", "--json", str(out)]
                     + (["--probe-may-differ"] if backend == "cuda" else []))
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    row = json.loads(out.read_text())
    assert row["passed"] and row["tokenizer"] and row["context"] == CONTEXT
    assert (row["valid"], row["disconnect"], row["malformed"], row["probe"]) == (32, 4, 4, 4)
    assert row["server_errors"] == 0 and row["pages_held"] == 0
    assert row["probe_mismatches"] == 0 or backend == "cuda"
    assert captured.out.startswith("PASS: 40 requests")
    assert_idle(server.core)


def serve_process(*args: str):
    """python -m minfer.serve ARGS in a process of its own, on a free port, once /health answers."""
    import subprocess
    import sys
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minfer.serve", "--port", str(port), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the server did not start: {proc.communicate()[0][-2000:]}")


def stop(proc) -> str:
    import signal
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    return out


def test_server_process(solo, backend):
    """The CLI itself: flags, the API key, the greedy text of the in-process server, one log line a request."""
    if backend != "ref":
        pytest.skip("the in-process suite covers the cuda backend")
    proc, url = serve_process("--backend", "ref", "--device", "cpu", "--dtype", "float32", "--max-context",
                              str(CONTEXT), "--block-size", "4", "--api-key", KEY, "--served-model-name", NAME)
    try:
        assert httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0]}).status_code == 401
        r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == solo[0]
    finally:
        out = stop(proc)
    assert re.search(r"request cmpl-\S+: prompt \d+ tokens, completion 8 tokens, ttft [\d.]+ ms, total [\d.]+ ms, "
                     r"finish length", out), out


def test_server_process_random_weights(backend):
    """--shape: random weights and the placeholder byte-level tokenizer: text and token-id prompts both work."""
    if backend != "ref":
        pytest.skip("CPU only")
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    proc, url = serve_process("--shape", "smollm2-135m", "--device", "cpu", "--dtype", "float32",
                              "--max-context", "64", "--chat-template", template)
    try:
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "smollm2-135m"
        for prompt in ("hello world", [1, 2, 3]):
            r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True},
                           timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["text"]
        # --chat-template: the placeholder vocabulary has none of its own
        messages = [{"role": "user", "content": "hi"}]
        r = httpx.post(url + "/tokenize", json={"messages": messages})
        assert r.status_code == 200
        from minfer.quantize import placeholder_vocab
        from minfer.tokenizer import from_gguf_fields
        tok = from_gguf_fields(placeholder_vocab(49152).fields().get)
        assert r.json()["tokens"] == tok.tok.encode("<user>hi<assistant>", add_special_tokens=False).ids
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.tok.encode("<user>hi<assistant>").ids)
    finally:
        stop(proc)


def test_server_process_bad_flags(tmp_path):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "minfer.serve", str(tmp_path / "x.gguf"), "--shape", "llama-3-8b"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "give a CHECKPOINT or --shape, not both" in r.stderr
    assert len(r.stderr.splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "minfer.serve", "--tool-call-parser", "hermes"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "--enable-auto-tool-choice and --tool-call-parser come together" in r.stderr
    r = subprocess.run([sys.executable, "-m", "minfer.serve", "--allowed-origins", "http://a.example"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "--allowed-origins: 'http://a.example' is not a JSON list" in r.stderr
    r = subprocess.run([sys.executable, "-m", "minfer.serve", str(tmp_path / "x.gguf"), "--chat-template", "{{ x"],
                       capture_output=True, text=True, timeout=60)  # before the (missing) model loads
    assert r.returncode == 1 and r.stderr.startswith("minfer: error: --chat-template: not valid Jinja (line 1: ")
    assert len(r.stderr.splitlines()) == 1
