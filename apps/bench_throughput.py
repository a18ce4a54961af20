"""Offline throughput of the continuous-batching engine, like vLLM's benchmark_throughput: N requests of
random token ids (EOS ignored) all at once, run to completion.

    python apps/bench_throughput.py --num-requests 256 --input-len 100:1024 --output-len 100:1024
    python apps/bench_throughput.py --shape llama-3-8b --num-requests 256 --static     # random weights, + static
    python apps/bench_throughput.py --shared-prefix 2048 --input-len 2100:2200 [--no-enable-prefix-caching]
    python apps/bench_throughput.py --backend ref --device cpu --num-requests 4 --input-len 16 --output-len 8
    python apps/bench_throughput.py --shape llama-3.2-1b --num-requests 16 --input-len 128 --long-prompt-len 32768

Lengths are a number or LO:HI (uniform, inclusive). --shared-prefix N puts the same N tokens at the start of
every prompt (inside its input length). --static runs the same requests through the static engine too, as
padded batches of --max-num-seqs, for comparison in the same run. Prints one line per engine; --json
appends them to a file as JSON lines.

--long-prompt-len N measures instead what a long prompt costs the decodes running beside it: the requests
decode alone for --itl-steps steps, then a prompt of N random ids arrives and is prefilled in chunks of at
most --max-num-batched-tokens tokens a step (less the decodes; --long-prefill-token-threshold at most), mixed
into their decode steps. Each running request's inter-token latency (ITL: the time between the steps that give
it a token) is compared before the prompt and from its arrival to its first token. The scenario runs 1 +
--rounds times: the first pays the chunk shapes' first-call costs, and of the others the round with the median
p50 ratio is reported (with every round's ratio). It prints the mean wall time of a step during the prefill
and the GPU's busy time in it (CUDA events); --profile adds those steps' kernels (up to 16 steps of the first round),
from the prompt's first chunk on, or from chunk --profile-from K on (the attention of a later chunk reads K
chunks more of the prompt's keys).

--ttft times instead each request to its first token, alone (a lone user's prompt) or joining --beside N requests
that decode meanwhile, from the prompt graphs and eagerly (the graphs set aside) on the same requests, in two
alternating rounds: p50 and p90 of the second.

--decode-batch B[,B...] times the engine's decode step instead: B requests of --input-len random ids
are prefilled, then --decode-steps steps of B decodes are timed (wall time a step, GPU time from CUDA events),
against the roofline: every weight and each sequence's K and V at the mean context read once, at the
device-to-device copy bandwidth measured in the same run. --profile adds where such a step's GPU time goes
(as many more steps under torch.profiler, kernels grouped by name).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from minfer import shapes
from minfer.engine import Engine
from minfer.engine.core import EngineCore
from minfer.engine_args import add_engine_args, engine_kwargs
from minfer.errors import ArgumentParser, MinferError, run_cli
from minfer.sampling import SamplingParams
from minfer.structured import StructuredOutputs, renamed

# appended, not first: apps/profile.py would shadow the standard library's profile module for whoever imports this
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
from bench.cli import check_json, int_range, length_spec, sizes  # noqa: E402
from bench.common import copy_bandwidth_gbs  # noqa: E402
from bench.roofline import kv_bytes, weight_bytes  # noqa: E402
from bench.step_profile import print_breakdown, profile_steps  # noqa: E402
from bench.workload import MAX_REQUESTS, append_json, length_range, make_requests, pct  # noqa: E402


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None


def run_continuous(engine: EngineCore, reqs, args) -> dict:
    engine.warmup()
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    bm = engine.block_manager
    hits0, queries0, preempt0 = bm.hit_tokens, bm.query_tokens, engine.scheduler.num_preemptions
    constraint = dict(regex=args.regex) if args.regex is not None else \
        dict(json=args.json_schema) if args.json_schema is not None else None
    if constraint is not None:  # the tokenizer's form for llguidance, built once an engine (~0.4 s), is no step's
        try:
            engine.matchers.check(StructuredOutputs(**constraint))
        except MinferError as e:
            raise renamed(e, "--regex" if args.regex is not None else "--json-schema") from None
    engine._sync()
    engine.timeline = [] if engine.device.type == "cuda" else None
    t0 = time.perf_counter()
    for ids, n_out in reqs:
        engine.add_request(ids, SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=n_out,
                                               ignore_eos=True, structured_outputs=constraint))
    steps = seqs = out_tokens = 0
    while engine.has_unfinished():
        out_tokens += len(engine.step())
        steps += 1
        seqs += engine.last_step[0]
    engine._sync()
    elapsed = time.perf_counter() - t0
    timeline, engine.timeline = engine.timeline, None
    queries = bm.query_tokens - queries0
    return dict(engine="continuous", elapsed_s=elapsed, output_tokens=out_tokens, steps=steps,
                mean_batch=seqs / steps, prefix_hit_rate=(bm.hit_tokens - hits0) / queries if queries else 0.0,
                preemptions=engine.scheduler.num_preemptions - preempt0, peak_gb=peak_gb(engine.device),
                **host_idle(timeline))


def host_idle(timeline) -> dict:
    """The GPU's idle time between steps (host work: scheduling, metadata, sampling's read-back, stop rules), as
    a share of the time from the first step's begin to the last one's end: over all steps, and over the steps
    with at least 16 sequences running (the gap before each such step)."""
    if not timeline:
        return dict(host_idle=None, host_idle_b16=None)
    span = timeline[0][1].elapsed_time(timeline[-1][2])
    gaps = [(n, end.elapsed_time(begin)) for (_, _, end), (n, begin, _) in zip(timeline, timeline[1:])]
    busy16 = [(n, begin.elapsed_time(end)) for n, begin, end in timeline[1:] if n >= 16]
    idle16 = sum(g for n, g in gaps if n >= 16)
    return dict(host_idle=sum(g for _, g in gaps) / span if span > 0 else None,
                host_idle_b16=idle16 / (idle16 + sum(b for _, b in busy16)) if busy16 else None)


def run_long_prompt(engine: EngineCore, reqs, args) -> dict:
    """The running requests' ITL before and while a --long-prompt-len prompt prefills (module docstring)."""
    if args.long_prompt_len >= engine.max_context:
        raise MinferError(f"--long-prompt-len {args.long_prompt_len}: the context holds {engine.max_context} tokens")
    rng, vocab = random.Random(args.seed + 1), engine.cfg.vocab_size
    # tokens enough that no running request finishes during the measurement: twice the steps it should take
    chunk = max(1, engine.max_num_batched_tokens - len(reqs))
    chunk = min(chunk, args.long_prefill_token_threshold or chunk)
    chunk_steps = -(-args.long_prompt_len // chunk)
    if args.profile_from and args.profile_from >= chunk_steps - 1:
        raise MinferError(f"--profile-from {args.profile_from}: the prompt takes {chunk_steps} chunks of {chunk} "
                          f"tokens; give at most {chunk_steps - 2}")
    n_out = args.itl_steps + 16 + 2 * chunk_steps
    longest = max(len(ids) for ids, _ in reqs)
    if longest + n_out > engine.max_context:
        raise MinferError(f"--input-len {args.input_len}: the running requests make {n_out} tokens during the "
                          f"measurement, and {longest} + {n_out} do not fit the {engine.max_context}-token context")
    engine.warmup()
    cuda = engine.device.type == "cuda"
    kernels = None
    # the first round's steps from chunk --profile-from on that cannot reach the prompt's end
    n_profile = min(16, (chunk_steps - args.profile_from) // 2) if args.profile else 0
    rounds = []  # the measured rounds' figures
    for r in range(1 + args.rounds):  # round 0 pays the chunk shapes' first-call costs
        running = {engine.add_request(ids, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n_out)): []
                   for ids, _ in reqs}
        st = dict(before=0, after=0, long_id=None, t_steady=None, t_add=None, t_first=None)

        def step():
            nonlocal kernels
            outs = engine.step()
            t = time.perf_counter()
            for o in outs:
                if o.request_id in running:
                    running[o.request_id].append(t)
                    if o.finished:
                        raise RuntimeError(f"request {o.request_id} finished ({o.finish_reason}) during the "
                                           f"measurement")
                elif o.request_id == st["long_id"]:
                    st["t_first"] = t
            if st["long_id"] is not None:
                st["after"] += 1
                if r == 0 and n_profile and kernels is None and st["after"] == args.profile_from > 0:
                    kernels = (profile_steps(step, n_profile, cuda), n_profile)
            elif min(map(len, running.values())) >= 2:  # every request decodes
                st["t_steady"] = st["t_steady"] or t
                st["before"] += 1
                if st["before"] == args.itl_steps:
                    prompt = [rng.randrange(vocab) for _ in range(args.long_prompt_len)]
                    st["long_id"] = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                                              ignore_eos=True))
                    st["t_add"] = time.perf_counter()
                    if r > 0:  # the GPU's busy time in each step from here (CUDA events)
                        engine.timeline = [] if cuda else None
                    elif n_profile and args.profile_from == 0:  # where a mixed step's time goes, in the first round
                        kernels = (profile_steps(step, n_profile, cuda), n_profile)

        while st["t_first"] is None:
            step()
        timeline, engine.timeline = engine.timeline, None
        if r > 0:
            rounds.append(itl_figures(running, st, timeline))
        for rid in running:
            engine.abort_request(rid)
        while engine.has_unfinished():  # an in-flight step's ids
            engine.step()
        engine.block_manager.reset_prefix_cache()  # the next round's prompts are the same
    median = sorted(rounds, key=lambda f: f["itl_ratio_p50"])[(len(rounds) - 1) // 2]
    return dict(engine="long prompt", long_prompt_len=args.long_prompt_len, running=len(reqs),
                max_num_batched_tokens=engine.max_num_batched_tokens,
                long_prefill_token_threshold=args.long_prefill_token_threshold, **median,
                itl_ratio_p50_rounds=[f["itl_ratio_p50"] for f in rounds],
                kernels=kernels[0] if kernels else None, profiled_steps=kernels[1] if kernels else None,
                profiled_from=args.profile_from if kernels else None)


def itl_figures(running: dict, st: dict, timeline) -> dict:
    """One round of run_long_prompt: the running requests' ITL (each request's gaps between the steps that gave
    it a token, split by where each gap ends) before the prompt arrived and from then to its first token."""
    t_steady, t_add, t_first, after = st["t_steady"], st["t_add"], st["t_first"], st["after"]
    itl_before = [b - a for ts in running.values() for a, b in zip(ts, ts[1:]) if t_steady <= a and b <= t_add]
    itl_during = [b - a for ts in running.values() for a, b in zip(ts, ts[1:]) if t_add < b <= t_first]
    p50_before, p50_during = pct(itl_before, 50), pct(itl_during, 50)
    gpu_ms = sum(b.elapsed_time(e) for _, b, e in timeline) / len(timeline) if timeline else None
    return dict(steps_during=after, long_ttft_ms=1e3 * (t_first - t_add), itl_before_p50_ms=p50_before,
                itl_before_p99_ms=pct(itl_before, 99), itl_during_p50_ms=p50_during,
                itl_during_p99_ms=pct(itl_during, 99), itl_during_max_ms=pct(itl_during, 100),
                itl_ratio_p50=p50_during / p50_before, itl_ratio_max=pct(itl_during, 100) / p50_before,
                step_ms_during=1e3 * (t_first - t_add) / after, gpu_ms_during=gpu_ms)


def decode_tokens(engine: EngineCore, batch: int, args) -> int:
    """The new tokens each of batch requests of --input-len tokens needs to stay running through the timed steps."""
    context = int(args.input_len)
    # The first prompts decode while the last ones prefill: they need that many more tokens to stay running.
    prefill_steps = -(-batch * context // engine.max_num_batched_tokens) + 2
    n_out = 4 + prefill_steps + args.decode_steps * (2 if args.profile else 1)
    if context + n_out > engine.max_context:
        raise MinferError(f"--input-len {context} and {n_out} new tokens (--decode-batch {batch}, --decode-steps "
                          f"{args.decode_steps}) do not fit the {engine.max_context}-token context")
    return n_out


def run_decode_steps(engine: EngineCore, batch: int, args, copy_gbs: float | None) -> dict:
    """batch requests of --input-len tokens decoding together: --decode-steps steps timed (module docstring)."""
    context, steps, n_out = int(args.input_len), args.decode_steps, decode_tokens(engine, batch, args)
    engine.warmup()
    rng, vocab = random.Random(args.seed), engine.cfg.vocab_size
    rids = [engine.add_request([rng.randrange(vocab) for _ in range(context)],
                               SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)) for _ in range(batch)]
    got = dict.fromkeys(rids, 0)
    while min(got.values()) < 3:  # every prompt prefilled and decoding: the steps from here are B decodes
        for o in engine.step():
            got[o.request_id] += 1
    engine._sync()

    def decode_step():
        engine.step()
        if engine.last_step != (batch, batch):  # e.g. a KV cache too small for them all (--num-pages)
            raise MinferError(f"--decode-batch {batch}: a step ran {engine.last_step} (sequences, tokens), not "
                              f"{batch} decodes")

    engine.timeline = [] if engine.device.type == "cuda" else None
    t0 = time.perf_counter()
    for _ in range(steps):
        decode_step()
    engine._sync()
    step_s = (time.perf_counter() - t0) / steps
    timeline, engine.timeline = engine.timeline, None
    gpu_ms = sum(b.elapsed_time(e) for _, b, e in timeline) / steps if timeline else None
    mean_context = context + sum(got.values()) / batch + steps / 2
    floor_bytes = weight_bytes(engine) + batch * kv_bytes(engine, mean_context)
    floor_s = floor_bytes / (copy_gbs * 1e9) if copy_gbs else None
    kernels = profile_steps(decode_step, steps, engine.device.type == "cuda") if args.profile else None
    for rid in rids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    engine.step()  # applies the last step in flight (its sequences aborted)
    return dict(engine="decode step", batch=batch, context=round(mean_context), ms_per_step=1e3 * step_s,
                gpu_ms_per_step=gpu_ms, decode_tok_s=batch / step_s, floor_ms=None if floor_s is None else 1e3 * floor_s,
                pct_roofline=None if floor_s is None else 100 * floor_s / step_s, copy_gbs=copy_gbs,
                gpu_idle=None if gpu_ms is None else 1 - gpu_ms / (1e3 * step_s), kernels=kernels)


def run_ttft(engine: EngineCore, reqs, args) -> dict:
    """Each request to its first token, alone or joining --beside requests that decode meanwhile (32 random ids
    each, EOS ignored, aborted at the end). Two rounds of the requests, each once from the engine's prompt graphs
    and once eagerly (the graphs set aside), alternating; the prefix cache emptied before each pass. The second
    round is reported (the first pays the eager shapes' first-call costs)."""
    engine.warmup()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(args.seed + 1)
    graphs, times = engine.piece_graphs, {}
    for name in ("eager", "graphs") * 2:
        if name == "graphs" and graphs is None:
            continue
        engine.piece_graphs = graphs if name == "graphs" else None
        engine.block_manager.reset_prefix_cache()
        background = [engine.add_request([rng.randrange(engine.cfg.vocab_size) for _ in range(32)],
                                         SamplingParams(temperature=0.0, ignore_eos=True,  # past the pass's steps
                                                        max_tokens=min(engine.max_context - 32, 8 * len(reqs) + 16)))
                      for _ in range(args.beside)]
        for _ in range(3):  # the background's prompts, then decodes only
            engine.step()
        times[name] = []
        for ids, _ in reqs:
            t0 = time.perf_counter()
            rid = engine.add_request(ids, params)
            while not any(o.request_id == rid for o in engine.step()):
                pass
            times[name].append(time.perf_counter() - t0)
        for rid in background:
            engine.abort_request(rid)
        while engine.has_unfinished():
            engine.step()
    engine.piece_graphs = graphs
    buckets = sorted({p for ps in graphs.buckets[True].values() for p in ps}) if graphs is not None else []
    row = dict(mode="ttft", num_requests=len(reqs), input_len=args.input_len, beside=args.beside,
               prompt_graph_buckets=buckets or None)  # a prompt's last piece's token buckets
    for name, ts in times.items():
        row[f"ttft_{name}_p50_ms"], row[f"ttft_{name}_p90_ms"] = pct(ts, 50), pct(ts, 90)
    return row


def run_static(args, reqs, make_kwargs) -> dict:
    """The same requests as padded static batches of --max-num-seqs (each batch runs to its longest output;
    only the tokens each request asked for count)."""
    engine = Engine(**make_kwargs)
    size = args.max_num_seqs
    batches = [reqs[i:i + size] for i in range(0, len(reqs), size)]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    for batch in batches:  # warm-up: graph capture for each batch shape
        engine.warmup(len(batch), max(len(ids) for ids, _ in batch), max(len(ids) + n for ids, n in batch), params)
    engine._sync()
    t0 = time.perf_counter()
    for batch in batches:
        engine.generate([ids for ids, _ in batch], params, max(n for _, n in batch), ignore_eos=True)
    engine._sync()
    return dict(engine="static", elapsed_s=time.perf_counter() - t0, output_tokens=sum(n for _, n in reqs),
                steps=None, mean_batch=None, prefix_hit_rate=None, preemptions=None, peak_gb=peak_gb(engine.device),
                host_idle=None, host_idle_b16=None)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="HF folder, hub id or .gguf (default: the default model)")
    p.add_argument("--shape", choices=sorted(shapes.SHAPES), help="random weights of this model's shape")
    p.add_argument("--num-requests", type=int_range(1, MAX_REQUESTS), default=256)
    p.add_argument("--input-len", type=length_spec, default="100:1024",
                   help="prompt tokens: N or LO:HI (default: %(default)s)")
    p.add_argument("--output-len", type=length_spec, default="100:1024",
                   help="new tokens: N or LO:HI (default: %(default)s)")
    p.add_argument("--shared-prefix", type=int_range(0), default=0, help="the same first N tokens in every prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and token ids")
    p.add_argument("--static", action="store_true", help="also run the static engine on the same requests")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--regex", help="each request's output under this regex (structured outputs' cost; an "
                                            "output may end where the regex does)")
    constraint.add_argument("--json-schema", metavar="SCHEMA",
                            help="each request's output under this JSON schema (its text), as --regex")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the offline runs' sampling (default: %(default)s, greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: the nucleus (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", help="default: cuda when present")
    p.add_argument("--backend", choices=["auto", "cuda", "ref"], default="auto")
    p.add_argument("--dequantize", action="store_true")
    add_engine_args(p)
    p.add_argument("--long-prompt-len", type=int_range(0), default=0,
                   help="measure the requests' decode latency while a prompt of this many tokens prefills")
    p.add_argument("--itl-steps", type=int_range(2), default=32,
                   help="with --long-prompt-len: decode steps before it (an inter-token gap needs two)")
    p.add_argument("--rounds", type=int_range(1), default=1,
                   help="with --long-prompt-len: rounds measured after the first; the median one is reported")
    p.add_argument("--ttft", action="store_true",
                   help="time each request to its first token instead (alone, or among --beside N decoding), from "
                        "the prompt graphs (as the server captures them) and eagerly")
    p.add_argument("--beside", type=int_range(0), default=0, metavar="N",
                   help="with --ttft: N requests decode meanwhile, and each timed one joins them")
    p.add_argument("--decode-batch", type=sizes,
                   help="time the decode step at these batch sizes (comma-separated) instead")
    p.add_argument("--decode-steps", type=int_range(1), default=32,
                   help="with --decode-batch: steps timed (default: %(default)s)")
    p.add_argument("--profile", action="store_true", help="with --decode-batch or --long-prompt-len: also print the steps' kernels")
    p.add_argument("--profile-from", type=int_range(0), default=0, metavar="K",
                   help="with --long-prompt-len --profile: profile from the prompt's chunk K on (default: %(default)s)")
    p.add_argument("--json", help="append one JSON line per engine to this file")
    args = p.parse_args(argv)
    if args.shape and args.checkpoint:
        p.error("give a CHECKPOINT or --shape, not both")
    if args.decode_batch and ":" in args.input_len:
        p.error(f"--decode-batch needs one context length, --input-len N (not {args.input_len!r})")
    if args.profile_from and not (args.profile and args.long_prompt_len):
        p.error("--profile-from K needs --profile and --long-prompt-len")
    if args.beside and not args.ttft:
        p.error("--beside N needs --ttft")
    try:
        SamplingParams(temperature=args.temperature, top_p=args.top_p)
    except MinferError as e:
        p.error(str(e))
    if args.json_schema is not None:
        try:
            json.loads(args.json_schema)
        except ValueError as e:
            p.error(f"--json-schema is not JSON: {e}")
    flag = "--regex" if args.regex is not None else "--json-schema" if args.json_schema is not None else None
    if flag and (args.static or args.decode_batch or args.ttft or args.long_prompt_len):
        p.error(f"{flag} times the continuous engine's offline run alone (not --static, --decode-batch, --ttft or "
                "--long-prompt-len)")
    # A request that finds no free slot in the step waits for one: the mode would time the queue instead.
    if args.decode_batch and max(args.decode_batch) > args.max_num_seqs:
        p.error(f"--decode-batch {max(args.decode_batch)}: a step runs at most --max-num-seqs {args.max_num_seqs}")
    if args.ttft and args.beside + 1 > args.max_num_seqs:
        p.error(f"--ttft --beside {args.beside}: the timed request and the {args.beside} beside it need "
                f"--max-num-seqs >= {args.beside + 1}")
    if args.long_prompt_len and args.num_requests + 1 > args.max_num_seqs:
        p.error(f"--long-prompt-len: the {args.num_requests} requests (--num-requests) and the prompt need "
                f"--max-num-seqs >= {args.num_requests + 1}")
    return args


def run(args) -> None:
    check_json(args.json)
    make_kwargs = dict(dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device,
                       backend=args.backend)
    if args.shape:
        make_kwargs["random_weights"] = shapes.config(args.shape)
    else:
        make_kwargs.update(checkpoint=args.checkpoint, dequantize=args.dequantize)
    core = EngineCore(**engine_kwargs(args), **make_kwargs, prompt_graphs=args.ttft)  # as a server, for --ttft
    dev = core.device
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    if args.decode_batch:
        decode_tokens(core, max(args.decode_batch), args)  # the largest batch needs the most: fits, or fails now
        copy_gbs = copy_bandwidth_gbs() if dev.type == "cuda" else None
        for batch in args.decode_batch:
            row = run_decode_steps(core, batch, args, copy_gbs)
            row.update(model=args.shape or os.path.basename(args.checkpoint or "default"), device=device)
            roof = "" if row["pct_roofline"] is None else (f" | {row['pct_roofline']:.1f}% of the roofline "
                                                           f"({row['floor_ms']:.3f} ms at {copy_gbs:.0f} GB/s)")
            gpu = "" if row["gpu_ms_per_step"] is None else (f" (GPU {row['gpu_ms_per_step']:.3f}, idle "
                                                             f"{100 * row['gpu_idle']:.1f}%)")
            print(f"decode step: batch {batch} at context ~{row['context']}: {row['ms_per_step']:.3f} ms{gpu} | "
                  f"{row['decode_tok_s']:.1f} tok/s{roof}", flush=True)
            if row["kernels"]:
                print_breakdown(row["kernels"], row["ms_per_step"])
            append_json(args.json, row)
        return
    # checked on the lengths' bounds, before any is drawn: each request that --seed could draw fits
    longest = length_range(args.input_len)[1] + length_range(args.output_len)[1]
    if longest > core.max_context:
        raise MinferError(f"--input-len {args.input_len} and --output-len {args.output_len}: a request of up to "
                          f"{longest} tokens does not fit the {core.max_context}-token context")
    reqs = make_requests(args.num_requests, args.input_len, args.output_len, core.cfg.vocab_size, args.seed,
                         args.shared_prefix)
    if args.ttft:
        row = run_ttft(core, reqs, args)
        row.update(model=args.shape or os.path.basename(args.checkpoint or "default"), device=device)
        graphed = ("no prompt graphs" if row["prompt_graph_buckets"] is None else
                   f"from the prompt graphs p50/p90 {row['ttft_graphs_p50_ms']:.2f}/{row['ttft_graphs_p90_ms']:.2f} ms "
                   f"({row['ttft_eager_p50_ms'] / row['ttft_graphs_p50_ms']:.2f}x), buckets up to "
                   f"{row['prompt_graph_buckets'][-1]} tokens")
        among = f"among {args.beside} decoding" if args.beside else "lone"
        print(f"TTFT of {len(reqs)} {among} requests of {args.input_len} tokens: eagerly p50/p90 "
              f"{row['ttft_eager_p50_ms']:.2f}/{row['ttft_eager_p90_ms']:.2f} ms, {graphed}", flush=True)
        append_json(args.json, row)
        return
    if args.long_prompt_len:
        row = run_long_prompt(core, reqs, args)
        row.update(model=args.shape or os.path.basename(args.checkpoint or "default"), device=device)
        cap = args.long_prefill_token_threshold
        print(f"long prompt: {row['long_prompt_len']} tokens among {row['running']} decoding requests, "
              f"{row['max_num_batched_tokens']} tokens a step{f', chunks of {cap} beside decodes' if cap else ''}"
              f" | its first token after {row['long_ttft_ms']:.0f} ms, "
              f"{row['steps_during']} steps | ITL p50/p99 without it {row['itl_before_p50_ms']:.2f}/"
              f"{row['itl_before_p99_ms']:.2f} ms, during its prefill p50/p99/max {row['itl_during_p50_ms']:.2f}/"
              f"{row['itl_during_p99_ms']:.2f}/{row['itl_during_max_ms']:.2f} ms: {row['itl_ratio_p50']:.2f}x "
              f"(p50), {row['itl_ratio_max']:.2f}x (max)", flush=True)
        gpu = "" if row["gpu_ms_during"] is None else f", the GPU busy {row['gpu_ms_during']:.2f} ms of them"
        print(f"  steps during its prefill: {row['step_ms_during']:.2f} ms each{gpu}", flush=True)
        if args.rounds > 1:
            print(f"  the median of {args.rounds} rounds; their p50 ratios: "
                  + ", ".join(f"{x:.2f}x" for x in row["itl_ratio_p50_rounds"]), flush=True)
        if row["kernels"]:
            print(f"  kernels of {row['profiled_steps']} steps of its prefill from chunk {row['profiled_from']} "
                  f"(the first round), per step:")
            print_breakdown(row["kernels"], None)
        append_json(args.json, row)
        return
    rows = [run_continuous(core, reqs, args)]
    prefix_caching = core.block_manager.prefix_caching  # as the engine took --enable-prefix-caching for this model
    if args.static:
        del core  # its KV cache
        rows.append(run_static(args, reqs, make_kwargs))
    in_tokens = sum(len(ids) for ids, _ in reqs)
    for row in rows:
        s = row["elapsed_s"]
        row.update(model=args.shape or os.path.basename(args.checkpoint or "default"), device=device,
                   num_requests=len(reqs), input_len=args.input_len, output_len=args.output_len,
                   shared_prefix=args.shared_prefix, prefix_caching=prefix_caching, regex=args.regex,
                   json_schema=args.json_schema, temperature=args.temperature, top_p=args.top_p,
                   requests_s=len(reqs) / s, output_tok_s=row["output_tokens"] / s,
                   total_tok_s=(in_tokens + row["output_tokens"]) / s)
        extra = "" if row["mean_batch"] is None else (f" | mean batch {row['mean_batch']:.1f} | prefix hits "
                                                      f"{100 * row['prefix_hit_rate']:.1f}% | preempted "
                                                      f"{row['preemptions']}")
        peak = "" if row["peak_gb"] is None else f" | peak {row['peak_gb']:.2f} GB"
        if row["host_idle"] is not None:
            b16 = "-" if row["host_idle_b16"] is None else f"{100 * row['host_idle_b16']:.1f}%"
            peak += f" | GPU idle between steps {100 * row['host_idle']:.1f}% (batch >= 16: {b16})"
        print(f"{row['engine']:>10}: {len(reqs)} requests in {s:.2f} s | {row['requests_s']:.2f} req/s | "
              f"output {row['output_tok_s']:.1f} tok/s | total {row['total_tok_s']:.1f} tok/s{extra}{peak}", flush=True)
        append_json(args.json, row)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
