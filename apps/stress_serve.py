"""Reliability run against a running server (python -m minfer.serve): a storm of requests where some clients
hang up mid-stream and some bodies are malformed, then checks that the server answered each as it should and
is left clean.

    python -m minfer.serve --backend ref --device cpu --dtype float32 --max-context 256 --port 8123 &
    python apps/stress_serve.py --base-url http://127.0.0.1:8123 --num-requests 200 --max-tokens 4:16
    python apps/stress_serve.py --num-requests 1000 --max-concurrency 32 --json stress.jsonl

--num-requests requests go out, --max-concurrency at a time, in a seeded random order:
  valid       a seeded mix of /v1/completions (token-id or text prompts) and /v1/chat/completions, streamed
              (with stream_options.include_usage) or not, greedy or seeded sampling, n 1 or 2, some with
              logprobs; ignore_eos, so that each choice makes exactly max_tokens (--max-tokens, N or LO:HI).
              Chat and text prompts only when the server has a tokenizer (a first request finds out; a
              token-id-only server answers text with a 400), and prompt + max_tokens stays within the
              server's context (max_model_len of /v1/models).
  disconnect  --disconnect-fraction of them: streamed, asking for 4x the largest --max-tokens (at most half
              the context), and the client closes the connection after a random number of chunks (>= 1,
              up to half the largest --max-tokens).
  malformed   --malformed-fraction of them, in turn: bad JSON, bytes that are not UTF-8, a body that is not an
              object, wrong types, negative max_tokens, an unknown field, an id outside the vocabulary, a
              prompt over the context, a 1 MB prompt string, an unknown model, a lone surrogate ("\\ud800")
              in a prompt and in a message, a content part whose text is not a string.
  probe       one fixed greedy request (--probe-copies of the valid ones): sent alone before the storm, then
              inside it at random positions, streamed and not.

The checks, each a failure (exit code 1) when it does not hold:
  - no response is a 5xx, and no stream carries an error event;
  - every valid request is a 200 whose usage is right: completion_tokens == n * max_tokens, prompt_tokens ==
    the prompt's ids (token-id prompts; text ones: > 0), total_tokens their sum; n choices, each finishing
    with "length"; with logprobs, max_tokens entries a choice; a stream has at most max_tokens text chunks a
    choice (deltas that piled up go out merged), its usage chunk last and then [DONE];
  - every malformed request is the expected 4xx with OpenAI's error body {"error": {"message", "type",
    "param", "code"}};
  - a disconnect gets a 200 stream (before it is cut);
  - every storm copy of the probe returns the text it returned alone (with --probe-may-differ: reported only);
  - after the storm (waiting up to --settle-timeout s for nothing to run or wait), /metrics shows no KV page
    held by a request (minfer_kv_pages_used, which counts pages with a reference: prefix-cached pages that no
    request holds are free), and /health is 200.
One summary line is printed, the first failures go to stderr, and --json appends the run as one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter

import httpx

from minfer.errors import ArgumentParser, MinferError

# appended, not first: apps/profile.py would shadow the standard library's profile module for whoever imports this
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from bench.cli import check_json, int_range, length_spec, run_status, seconds  # noqa: E402
from bench.server import add_server_args, client as server_client, first_model  # noqa: E402
from bench.workload import MAX_REQUESTS, append_json, length_range, lengths  # noqa: E402

DEFAULT_CONTEXT = 256  # when /v1/models does not say max_model_len
WORDS = ("the of and to in is was for on that with as by at from his her time year people way day man thing "
         "water house light river city music paper story garden window morning").split()
MALFORMED = ["bad_json", "not_utf8", "not_object", "max_tokens_type", "temperature_type", "messages_type",
             "negative_max_tokens", "unknown_field", "id_out_of_vocab", "prompt_over_context", "prompt_1mb",
             "unknown_model", "prompt_surrogate", "message_surrogate", "content_part_type"]


# ---- the plan: every request is drawn up front from --seed ----

def make_plan(args, rng: random.Random, server: dict) -> tuple[list[dict], dict]:
    """The storm's requests in order, and the probe request."""
    ctx, vocab = server["context"], server["vocab"]
    n_req = args.num_requests
    n_disc = round(n_req * args.disconnect_fraction)
    n_bad = round(n_req * args.malformed_fraction)
    n_valid = n_req - n_disc - n_bad
    n_probe = min(args.probe_copies, n_valid)
    kinds = ["probe"] * n_probe + ["valid"] * (n_valid - n_probe) + ["disconnect"] * n_disc + ["malformed"] * n_bad
    rng.shuffle(kinds)
    outs = lengths(args.max_tokens, n_req, rng, "--max-tokens")
    probe_ids = [rng.randrange(vocab) for _ in range(min(32, ctx // 2))]
    probe = {"kind": "probe", "path": "/v1/completions", "stream": False, "n": 1, "ids": probe_ids, "logprobs": False,
             "max_tokens": min(32, ctx - len(probe_ids)),
             "body": {"prompt": probe_ids, "max_tokens": min(32, ctx - len(probe_ids)), "temperature": 0,
                      "ignore_eos": True}}
    hi = max(outs)
    plan, probes, bad = [], 0, rng.randrange(len(MALFORMED))
    for kind, max_tokens in zip(kinds, outs):
        # a disconnect asks for more than it reads, so that its cut comes mid-stream even where chunks merge
        max_tokens = min(4 * hi, ctx // 2) if kind == "disconnect" else max_tokens
        if kind == "probe":  # alternately not streamed and streamed
            item = dict(probe, body=dict(probe["body"]), stream=bool(probes % 2))
            if item["stream"]:
                item["body"] |= {"stream": True, "stream_options": {"include_usage": True}}
            probes += 1
        elif kind == "malformed":
            item = malformed(MALFORMED[bad % len(MALFORMED)], server)
            bad += 1
        else:
            item = valid(rng, max_tokens, server, disconnect=kind == "disconnect")
            if kind == "disconnect":  # data chunks read before hanging up
                item["cut_after"] = rng.randint(1, max(1, hi // 2))
        item["kind"] = kind
        plan.append(item)
    return plan, probe


def valid(rng: random.Random, max_tokens: int, server: dict, disconnect: bool) -> dict:
    ctx, vocab = server["context"], server["vocab"]
    chat = server["tokenizer"] and rng.random() < 0.4 and ctx - max_tokens - server["chat_overhead"] >= 2
    stream = disconnect or rng.random() < 0.5
    n = 1 if disconnect or rng.random() < 0.85 else 2
    logprobs = rng.random() < 0.25
    body = {"max_tokens": max_tokens, "ignore_eos": True}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body |= {"temperature": round(rng.uniform(0.5, 1.2), 2), "seed": rng.randrange(2**31)}
    if n > 1:
        body["n"] = n
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    item = {"path": "/v1/chat/completions" if chat else "/v1/completions", "stream": stream, "n": n,
            "max_tokens": max_tokens, "ids": None, "logprobs": logprobs, "body": body}
    # text: at most 2 tokens a word is generous for these words; the server's template and BOS come on top
    overhead = server["chat_overhead"] if chat else server["text_overhead"]
    words = (ctx - max_tokens - overhead) // 2
    if chat or (server["tokenizer"] and rng.random() < 0.4 and words >= 1):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max(1, min(words, 24)))))
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            if logprobs:
                body["logprobs"] = True
        else:
            body["prompt"] = text
    else:
        item["ids"] = ids = [rng.randrange(vocab) for _ in range(rng.randint(1, min(64, ctx - max_tokens)))]
        body["prompt"] = ids
    if logprobs and not chat:
        body["logprobs"] = 1
    return item


def malformed(name: str, server: dict) -> dict:
    """A bad request: its body (bytes) and the statuses it may get."""
    ctx, vocab = server["context"], server["vocab"]
    path, expect = "/v1/completions", {400}
    obj = {"prompt": [1, 2, 3], "max_tokens": 4}
    if name == "bad_json":
        raw = b'{"prompt": [1, 2, 3], "max_tokens": '
    elif name == "not_utf8":
        raw = b'{"prompt": "\xff\xfe"}'
    elif name == "not_object":
        raw = b"[1, 2, 3]"
    elif name == "max_tokens_type":
        obj["max_tokens"] = "ten"
    elif name == "temperature_type":
        obj["temperature"] = "hot"
    elif name == "messages_type":
        path, obj = "/v1/chat/completions", {"messages": 5, "max_tokens": 4}
    elif name == "negative_max_tokens":
        obj["max_tokens"] = -5
    elif name == "unknown_field":
        obj["frobnicate"] = True
    elif name == "id_out_of_vocab":
        obj["prompt"] = [1, vocab + 7]
    elif name == "prompt_over_context":
        obj["prompt"] = [1] * ctx
    elif name == "prompt_1mb":  # over the context, or over the body limit (413), or no tokenizer for text
        obj["prompt"], expect = "hello " * ((1 << 20) // 6), {400, 413}
    elif name == "prompt_surrogate":  # valid JSON, but no text: a lone surrogate
        raw = b'{"prompt": "a \\ud800 b", "max_tokens": 4}'
    elif name == "message_surrogate":
        path, raw = "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}'
    elif name == "content_part_type":
        path, obj = "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                                             "max_tokens": 4}
    elif name == "unknown_model":
        obj["model"], expect = "no-such-model", {404}
    if name not in ("bad_json", "not_utf8", "not_object", "prompt_surrogate", "message_surrogate"):
        raw = json.dumps(obj).encode()
    return {"path": path, "raw": raw, "expect": expect, "name": name, "stream": False}


# ---- sending ----

async def send(client: httpx.AsyncClient, item: dict, model: str | None, timeout: float) -> dict:
    """Sends one request and checks it; returns {"status", "problems": [...], "text": [...], ...}."""
    res = {"status": None, "problems": [], "stream_error": False}
    if "raw" in item:  # malformed
        try:
            r = await client.post(item["path"], content=item["raw"], timeout=timeout,
                                  headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            res["problems"].append(f"{item['name']}: {type(e).__name__}: {e}")
            return res
        res["status"] = r.status_code
        if r.status_code not in item["expect"]:
            res["problems"].append(f"{item['name']}: status {r.status_code}, expected {sorted(item['expect'])}: "
                                   f"{r.text[:200]}")
        else:
            res["problems"] += [f"{item['name']}: {p}" for p in error_shape(r)]
        return res
    body = item["body"] | ({"model": model} if model else {})
    try:
        if item["stream"]:
            await send_stream(client, item, body, res, timeout)
        else:
            r = await client.post(item["path"], json=body, timeout=timeout)
            res["status"] = r.status_code
            if r.status_code != 200:
                res["problems"].append(f"status {r.status_code}: {r.text[:200]}")
            else:
                check_full(item, r.json(), res)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        res["problems"].append(f"{type(e).__name__}: {e}")
    return res


async def send_stream(client, item, body, res, timeout) -> None:
    chat = item["path"].endswith("chat/completions")
    per_choice = {}  # index -> {"text": [...], "chunks", "finish": [...], "logprobs"}
    usage, after_usage, done, seen = None, 0, False, 0
    async with client.stream("POST", item["path"], json=body, timeout=timeout) as r:
        res["status"] = r.status_code
        if r.status_code != 200:
            res["problems"].append(f"status {r.status_code}: {(await r.aread()).decode()[:200]}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            if done:
                res["problems"].append("data after [DONE]")
            msg = json.loads(line[6:])
            seen += 1
            if "error" in msg:
                res["stream_error"] = True
                res["problems"].append(f"error in the stream: {msg['error'].get('message')}")
                continue
            if usage is not None:
                after_usage += 1
            if msg.get("usage"):
                usage = msg["usage"]
            for c in msg.get("choices") or []:
                st = per_choice.setdefault(c["index"], {"text": [], "chunks": 0, "finish": [], "logprobs": 0})
                text = c["delta"].get("content") if chat else c.get("text")
                if text:
                    st["text"].append(text)
                    st["chunks"] += 1
                if c.get("finish_reason"):
                    st["finish"].append(c["finish_reason"])
                if c.get("logprobs"):
                    st["logprobs"] += len(c["logprobs"]["content"] if chat else c["logprobs"]["tokens"])
            if "cut_after" in item and seen >= item["cut_after"]:
                res["cut"] = True
                return  # leaving the block closes the connection mid-stream
    if "cut_after" in item:
        res["cut"] = False  # it finished before its cut
    if not done:
        res["problems"].append("the stream ended without [DONE]")
    if after_usage:
        res["problems"].append("chunks after the usage chunk")
    for i, st in per_choice.items():
        if st["chunks"] > item["max_tokens"]:
            res["problems"].append(f"choice {i}: {st['chunks']} text chunks for {item['max_tokens']} tokens")
        if st["finish"] != ["length"]:
            res["problems"].append(f"choice {i}: finish reasons {st['finish']}, expected ['length']")
    res["text"] = ["".join(per_choice[i]["text"]) if i in per_choice else None for i in range(item["n"])]
    check_usage(item, usage, sorted(per_choice), {i: st["logprobs"] for i, st in per_choice.items()}, res)


def check_full(item: dict, data: dict, res: dict) -> None:
    chat = item["path"].endswith("chat/completions")
    choices = data["choices"]
    for c in choices:
        if c.get("finish_reason") != "length":
            res["problems"].append(f"choice {c['index']}: finish reason {c.get('finish_reason')!r}, expected 'length'")
    lps = {c["index"]: len((c.get("logprobs") or {}).get("content" if chat else "tokens") or []) for c in choices}
    res["text"] = [c["message"]["content"] if chat else c["text"] for c in sorted(choices, key=lambda c: c["index"])]
    check_usage(item, data.get("usage"), [c["index"] for c in choices], lps, res)


def check_usage(item: dict, usage: dict | None, indexes: list[int], logprobs: dict[int, int], res: dict) -> None:
    p = res["problems"]
    n, m = item["n"], item["max_tokens"]
    if sorted(indexes) != list(range(n)):
        p.append(f"choices {sorted(indexes)}, expected 0..{n - 1}")
    if item["logprobs"]:
        for i in indexes:
            if logprobs.get(i, 0) != m:
                p.append(f"choice {i}: {logprobs.get(i, 0)} logprobs entries for {m} tokens")
    if usage is None:
        return p.append("no usage")
    if usage.get("completion_tokens") != n * m:
        p.append(f"usage.completion_tokens {usage.get('completion_tokens')}, expected {n} x {m}")
    got = usage.get("prompt_tokens")
    if item["ids"] is not None and got != len(item["ids"]):
        p.append(f"usage.prompt_tokens {got}, expected {len(item['ids'])} (the prompt's ids)")
    if item["ids"] is None and not (isinstance(got, int) and got > 0):
        p.append(f"usage.prompt_tokens {got}, expected > 0")
    if usage.get("total_tokens") != (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0):
        p.append(f"usage.total_tokens {usage.get('total_tokens')} is not prompt + completion")


def error_shape(r: httpx.Response) -> list[str]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return [f"status {r.status_code}: not an OpenAI error body: {r.text[:200]}"]
    if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return [f"status {r.status_code}: error fields {sorted(err) if isinstance(err, dict) else err!r}"]
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)):
        return [f"status {r.status_code}: error message/type {err['message']!r}/{err['type']!r}"]
    return []


# ---- the server ----

def gauges(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("minfer_") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


async def discover(client: httpx.AsyncClient, args) -> tuple[str | None, dict]:
    """The model, context, vocabulary and whether text prompts work (and the tokens the chat template and
    BOS add to a prompt)."""
    info = await first_model(client, args)
    model = args.model or info["id"]
    server = {"context": info.get("max_model_len") or DEFAULT_CONTEXT, "vocab": info.get("vocab_size") or 256,
              "tokenizer": False, "chat_overhead": 0, "text_overhead": 0}
    # a valid request holds a prompt token and max_tokens new ones: more than that would have to be cut silently
    most = length_range(args.max_tokens)[1]
    if most > server["context"] - 1:
        raise MinferError(f"--max-tokens {args.max_tokens}: the server's context holds {server['context']} tokens "
                          f"(max_model_len), so a request makes at most {server['context'] - 1}")
    r = await client.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
    if r.status_code == 200:
        c = await client.post("/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                            "messages": [{"role": "user", "content": "Hi"}]})
        if c.status_code == 200:  # "Hi" is a token or two: count both as overhead
            server |= {"tokenizer": True, "text_overhead": r.json()["usage"]["prompt_tokens"],
                       "chat_overhead": c.json()["usage"]["prompt_tokens"]}
    elif "tokenizer" not in r.text:
        raise MinferError(f"POST /v1/completions with a text prompt: {r.status_code}: "
                          f"{' '.join(r.text[:200].split())}")
    return model, server


async def settle(client: httpx.AsyncClient, timeout: float) -> dict[str, float]:
    """/metrics once nothing runs, waits or holds a page (or at the timeout)."""
    deadline = time.perf_counter() + timeout
    while True:
        g = gauges((await client.get("/metrics")).raise_for_status().text)
        idle = not g.get("minfer_num_requests_running") and not g.get("minfer_num_requests_waiting")
        if (idle and not g.get("minfer_kv_pages_used")) or time.perf_counter() > deadline:
            return g
        await asyncio.sleep(0.1)


def concurrency(args, plan: list[dict]) -> int:
    """Requests in flight at most: --max-concurrency, whose 0 means all of them."""
    return args.max_concurrency or len(plan)


async def run(args) -> dict:
    failures: list[str] = []
    notes: list[str] = []  # probe mismatches under --probe-may-differ
    async with server_client(args, args.timeout) as client:
        model, server = await discover(client, args)
        rng = random.Random(args.seed)
        plan, probe = make_plan(args, rng, server)
        solo = await send(client, probe, model, args.timeout)
        if solo["problems"]:
            failures += [f"probe alone: {p}" for p in solo["problems"]]
        gate = asyncio.Semaphore(concurrency(args, plan))

        async def limited(item):
            async with gate:
                return await send(client, item, model, args.timeout)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(item) for item in plan))
        duration = time.perf_counter() - t0
        g = await settle(client, args.settle_timeout)
        try:
            health = (await client.get("/health")).status_code
        except httpx.HTTPError:
            health = None

    statuses = Counter(r["status"] for r in results)
    kinds = Counter(item["kind"] for item in plan)
    server_errors = sum(1 for r in results if r["status"] is not None and r["status"] >= 500)
    stream_errors = sum(r["stream_error"] for r in results)
    failed = Counter()
    for i, (item, res) in enumerate(zip(plan, results)):
        if res["problems"]:
            failed[item["kind"]] += 1
            failures += [f"request {i} ({item['kind']} {item['path']}{' stream' if item['stream'] else ''}): {p}"
                         for p in res["problems"]]
    mismatches = 0
    for i, (item, res) in enumerate(zip(plan, results)):
        if item["kind"] == "probe" and not res["problems"] and res.get("text") != solo.get("text"):
            mismatches += 1
            (notes if args.probe_may_differ else failures).append(f"request {i} (probe{' stream' if item['stream'] else ''}): text {res.get('text')!r} "
                            f"!= alone {solo.get('text')!r}")
    pages_held = g.get("minfer_kv_pages_used")
    if pages_held is None:
        failures.append("/metrics has no minfer_kv_pages_used")
    elif pages_held:
        failures.append(f"{pages_held:g} KV pages still held after the storm (running "
                        f"{g.get('minfer_num_requests_running', 0):g}, "
                        f"waiting {g.get('minfer_num_requests_waiting', 0):g})")
    if health != 200:
        failures.append(f"/health: {health}")
    row = {"model": model, "num_requests": len(plan), "max_concurrency": concurrency(args, plan),
           "max_tokens": args.max_tokens, "seed": args.seed, "context": server["context"],
           "tokenizer": server["tokenizer"], "valid": kinds["valid"] + kinds["probe"], "probe": kinds["probe"],
           "disconnect": kinds["disconnect"], "malformed": kinds["malformed"],
           "cut_mid_stream": sum(1 for r in results if r.get("cut")),
           "statuses": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
           "server_errors": server_errors, "stream_errors": stream_errors,
           "valid_failed": failed["valid"] + failed["probe"], "disconnect_failed": failed["disconnect"],
           "malformed_failed": failed["malformed"], "probe_mismatches": mismatches,
           "pages_held": pages_held, "pages_total": g.get("minfer_kv_pages_total"), "health": health,
           "duration_s": round(duration, 3)}
    row["passed"] = not failures and not server_errors and not stream_errors
    row["failures"], row["notes"] = failures, notes
    return row


def report(args) -> int:
    check_json(args.json)
    row = asyncio.run(run(args))
    st = " ".join(f"{k}x{v}" for k, v in row["statuses"].items())
    print(f"{'PASS' if row['passed'] else 'FAIL'}: {row['num_requests']} requests ({row['valid']} valid incl. "
          f"{row['probe']} probes, {row['disconnect']} disconnect ({row['cut_mid_stream']} cut mid-stream), "
          f"{row['malformed']} malformed) in {row['duration_s']:.2f} s | statuses {st} | 5xx {row['server_errors']}"
          f" + {row['stream_errors']} in streams | failed: valid {row['valid_failed']}, disconnect "
          f"{row['disconnect_failed']}, malformed {row['malformed_failed']} | probe mismatches "
          f"{row['probe_mismatches']}/{row['probe']} | pages held after {row['pages_held']} | health {row['health']}")
    for f in row["notes"][:3]:
        print(f"  note: {f}", file=sys.stderr)
    for f in row["failures"][:5]:
        print(f"  {f}", file=sys.stderr)
    if len(row["failures"]) > 5:
        print(f"  ... {len(row['failures']) - 5} more", file=sys.stderr)
    append_json(args.json, row)
    return 0 if row["passed"] else 1


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.add_argument("--num-requests", type=int_range(1, MAX_REQUESTS), default=1000)
    p.add_argument("--max-concurrency", type=int_range(0), default=32,
                   help="requests in flight, at most; 0: no limit (default: %(default)s)")
    p.add_argument("--disconnect-fraction", type=float, default=0.1, help="default: %(default)s")
    p.add_argument("--malformed-fraction", type=float, default=0.1, help="default: %(default)s")
    p.add_argument("--max-tokens", type=length_spec, default="8:64",
                   help="tokens a valid request makes: N or LO:HI (default: %(default)s)")
    p.add_argument("--probe-copies", type=int_range(0), default=8,
                   help="the probe's copies in the storm (default: %(default)s)")
    p.add_argument("--probe-may-differ", action="store_true",
                   help="report the probe's storm texts that differ from its solo text, without failing: the cuda "
                        "backend's numerics depend on the batch (M <= 32 quantized weights run on the fused GEMV, "
                        "more rows on weights dequantized to the activation dtype), so a greedy near tie can flip")
    p.add_argument("--timeout", type=seconds(), default=300,
                   help="seconds a request waits for the server's next bytes (default: %(default)s)")
    p.add_argument("--settle-timeout", type=seconds(zero_ok=True), default=10,
                   help="seconds to wait after the storm for the server to go idle (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="append the run to this file as one JSON line")
    args = p.parse_args(argv)
    n, disconnect, malformed = args.num_requests, args.disconnect_fraction, args.malformed_fraction
    if not (0 <= disconnect <= 1 and 0 <= malformed <= 1) or round(n * disconnect) + round(n * malformed) > n:
        p.error("--disconnect-fraction and --malformed-fraction must be in [0, 1], and their sum <= 1")
    return run_status(lambda: report(args))


if __name__ == "__main__":
    sys.exit(main())
