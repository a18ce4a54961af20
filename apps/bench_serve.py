"""Online serving benchmark against a running server (python -m minfer.serve, or any OpenAI-compatible one),
vLLM's benchmark_serving method: requests arrive as a Poisson process at --request-rate (inf: all at once),
each streams from /v1/completions, and the client times every chunk.

    python -m minfer.serve --backend ref --device cpu --max-context 256 &
    python apps/bench_serve.py --num-requests 8 --input-len 16 --output-len 8 --request-rate inf
    python apps/bench_serve.py --num-requests 256 --input-len 100:1024 --output-len 100:1024 --json serve.jsonl

Prompts are random token ids of --input-len tokens (a number or LO:HI, uniform; the same draws as
apps/bench_throughput.py with the same --seed), and EOS is ignored, so each request makes exactly its
--output-len tokens. Reports request and output-token throughput, TTFT, TPOT (per output token after the
first) and ITL (between chunks) at p50/p90/p99, and failed requests; --json appends the run as one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

import httpx

from minfer.errors import ArgumentParser

# appended, not first: apps/profile.py would shadow the standard library's profile module for whoever imports this
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from bench.cli import check_json, int_range, length_spec, run_status, seconds  # noqa: E402
from bench.server import add_server_args, client as server_client, first_model  # noqa: E402
from bench.workload import MAX_REQUESTS, append_json, make_requests, pct  # noqa: E402

# A run's requests arrive within about this many seconds at most (--num-requests / --request-rate): a rate so
# small that they would arrive over years is a typo, not a benchmark.
MAX_ARRIVAL_S = 86400


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Streams one request; returns its timings (seconds) or its error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks, tokens = [], 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"{r.status_code}: {(await r.aread()).decode()[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    return {"error": msg["error"]["message"]}
                if msg.get("usage"):
                    tokens = msg["usage"]["completion_tokens"]
                if any(c.get("text") for c in msg.get("choices", [])):
                    chunks.append(time.perf_counter())
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    if not chunks:
        return {"error": "no tokens"}
    return {"ttft": chunks[0] - t0, "latency": end - t0, "tokens": tokens, "prompt_tokens": len(prompt),
            "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "tpot": (end - chunks[0]) / (tokens - 1) if tokens > 1 else None}


async def run(args) -> dict:
    async with server_client(args, args.timeout) as client:
        info = await first_model(client, args)
        model = args.model or info["id"]
        reqs = make_requests(args.num_requests, args.input_len, args.output_len,
                             args.vocab_size or info.get("vocab_size") or 256, args.seed)
        gate = asyncio.Semaphore(args.max_concurrency or len(reqs))
        rng = random.Random(args.seed + 1)

        async def limited(prompt, n_out):
            async with gate:
                return await one(client, model, prompt, n_out)

        t0 = time.perf_counter()
        tasks = []
        for prompt, n_out in reqs:
            tasks.append(asyncio.create_task(limited(prompt, n_out)))
            if args.request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    out_tokens = sum(r["tokens"] for r in ok)
    row = {"model": model, "num_requests": len(reqs), "completed": len(ok), "failed": len(errors),
           "request_rate": args.request_rate if args.request_rate != math.inf else "inf",
           "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
           "duration_s": round(duration, 3), "request_throughput": round(len(ok) / duration, 3),
           "output_tok_s": round(out_tokens / duration, 1),
           "total_tok_s": round((out_tokens + sum(r["prompt_tokens"] for r in ok)) / duration, 1)}
    for name, values in [("ttft", [r["ttft"] for r in ok]), ("tpot", [r["tpot"] for r in ok if r["tpot"]]),
                         ("itl", [x for r in ok for x in r["itl"]]), ("e2e", [r["latency"] for r in ok])]:
        for q in (50, 90, 99):
            v = pct(values, q)
            row[f"{name}_p{q}_ms"] = None if v is None else round(v, 2)
    if errors:
        row["first_error"] = errors[0]
    return row


def report(args) -> int:
    check_json(args.json)
    row = asyncio.run(run(args))
    pick = lambda k: "-" if row[k] is None else f"{row[k]:.1f}"  # noqa: E731
    print(f"{row['completed']}/{row['num_requests']} requests ({row['failed']} failed) in {row['duration_s']:.2f} s: "
          f"{row['request_throughput']:.2f} req/s, {row['output_tok_s']:.1f} output tok/s | "
          + " | ".join(f"{n.upper()} p50/p90/p99 {pick(n + '_p50_ms')}/{pick(n + '_p90_ms')}/{pick(n + '_p99_ms')} ms"
                       for n in ("ttft", "tpot", "itl")))
    if row.get("first_error"):
        print(f"first error: {row['first_error']}", file=sys.stderr)
    append_json(args.json, row)
    return 1 if row["failed"] else 0


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.add_argument("--num-requests", type=int_range(1, MAX_REQUESTS), default=64)
    p.add_argument("--input-len", type=length_spec, default="128",
                   help="prompt tokens: N or LO:HI (default: %(default)s)")
    p.add_argument("--output-len", type=length_spec, default="128",
                   help="output tokens: N or LO:HI (default: %(default)s)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests a second, Poisson arrivals; inf sends all at once (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int_range(1), help="requests in flight, at most (default: no limit)")
    p.add_argument("--vocab-size", type=int_range(1), help="prompt ids are below it (default: the server's, else 256)")
    p.add_argument("--timeout", type=seconds(), default=300,
                   help="seconds a request waits for the server's next bytes (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="append the run to this file as one JSON line")
    args = p.parse_args(argv)
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf: all at once)")
    if args.num_requests / args.request_rate > MAX_ARRIVAL_S:
        p.error(f"--request-rate {args.request_rate:g}: {args.num_requests} requests would arrive over "
                f"{args.num_requests / args.request_rate:.3g} s; give at least "
                f"{args.num_requests / MAX_ARRIVAL_S:.3g}, for a run of a day at most")
    return run_status(lambda: report(args))


if __name__ == "__main__":
    sys.exit(main())
