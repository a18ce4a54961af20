"""End-to-end latency of the whole engine (prefill, TTFT, decode), like llama-bench or vLLM's benchmark_latency.

    python apps/bench_e2e.py [CHECKPOINT] [--batch 1,16,64] [--prompt-len 128] [--gen-len 128] [--json out.jsonl]
    python apps/bench_e2e.py --shape llama-3-8b --batch 1,16,64      # random weights, no download

Each batch size runs Engine.generate (greedy, EOS ignored, random prompt ids) once to warm up, then
--reps times; the medians are reported. --profile then prints where a decode step's GPU time goes: 20 steps
at the mean context under torch.profiler, kernels grouped by name, each with its tail (µs past the kernels that
started before it: overlaps counted once; bench/step_profile.py). The roofline is the bytes one decode step must read (every
weight once, plus the KV cache at the mean context, windowed layers only their window) over the device-to-device copy bandwidth measured
in the same run. Load time and peak GPU memory are the engine's own.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the stdlib, whose `profile` apps/ shadows
from bench.cli import check_json, int_range, sizes  # noqa: E402
from bench.common import copy_bandwidth_gbs  # noqa: E402
from bench.roofline import kv_bytes, weight_bytes  # noqa: E402
from bench.step_profile import print_breakdown, profile_steps  # noqa: E402
from bench.workload import append_json  # noqa: E402

from minfer import shapes  # noqa: E402
from minfer.engine import Engine  # noqa: E402
from minfer.errors import ArgumentParser, MinferError, run_cli  # noqa: E402
from minfer.sampling import SamplingParams  # noqa: E402


def make_engine(args) -> Engine:
    dtype = getattr(torch, args.dtype) if args.dtype else None
    max_context = args.prompt_len + args.gen_len
    if args.shape:
        cfg = shapes.config(args.shape)
        return Engine.from_random_weights(cfg, dtype=dtype, device="cuda", backend=args.backend,
                                          max_context=max_context)
    return Engine(args.checkpoint, dtype=dtype, device="cuda", backend=args.backend, max_context=max_context,
                  dequantize=args.dequantize)


def profile_decode(engine: Engine, batch: int, context: int, steps: int = 20) -> list[dict]:
    """The kernels of `steps` decode steps (the captured step of this batch size) at `context` positions,
    over the KV cache the timed runs left."""
    step = engine.steps[batch]
    with torch.inference_mode():  # the graph's static inputs are inference tensors
        step.ids.zero_()
        step.pos.fill_(context)  # each step advances it by one
        return profile_steps(step.run, steps, cuda=True)


def run_batch(engine: Engine, batch: int, args, copy_gbs: float) -> dict:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(engine.cfg.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=0)
    torch.cuda.reset_peak_memory_stats()
    engine.generate(prompts, params, args.gen_len, ignore_eos=True)  # warm-up: graph capture for this batch
    runs = [engine.generate(prompts, params, args.gen_len, ignore_eos=True)[1] for _ in range(args.reps)]
    median = lambda xs: statistics.median(xs)  # noqa: E731
    step_s = median([s.decode_s / s.steps for s in runs])  # the first token comes from the prefill
    prefill_s = median([s.prefill_s for s in runs])
    mean_context = args.prompt_len + args.gen_len / 2
    floor_bytes = weight_bytes(engine) + batch * kv_bytes(engine, mean_context)
    floor_s = floor_bytes / (copy_gbs * 1e9)
    return dict(
        model=(args.shape or os.path.basename(args.checkpoint or "default")) + (" deq" if args.dequantize else ""),
        dtype=str(engine.dtype).split(".")[-1],
        batch=batch, prompt_len=args.prompt_len, gen_len=args.gen_len,
        prefill_tok_s=batch * args.prompt_len / prefill_s, ttft_ms=1000 * median([s.ttft_s for s in runs]),
        decode_tok_s=batch / step_s, ms_per_step=1000 * step_s, pct_roofline=100 * floor_s / step_s,
        floor_ms=1000 * floor_s, load_s=engine.load_s, peak_gb=torch.cuda.max_memory_allocated() / 1e9,
        copy_gbs=copy_gbs, device=torch.cuda.get_device_name(0),
    )


def run(args) -> None:
    if args.shape:  # its positions are known before the load (a checkpoint's only after it)
        limit = shapes.config(args.shape).max_position_embeddings
        if args.prompt_len + args.gen_len > limit:
            raise MinferError(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} tokens do not fit the "
                              f"{limit} positions of {args.shape}")
    check_json(args.json)
    if not torch.cuda.is_available():
        raise MinferError("bench_e2e needs a CUDA GPU")
    copy_gbs = copy_bandwidth_gbs()
    engine = make_engine(args)
    print(f"# {torch.cuda.get_device_name(0)} | copy {copy_gbs:.0f} GB/s | {args.shape or args.checkpoint or 'default model'}"
          f" | weights {weight_bytes(engine) / 1e9:.2f} GB | load {engine.load_s:.2f} s")
    print(f"{'model':>16} {'dtype':>8} {'batch':>5} {'prefill tok/s':>13} {'TTFT ms':>8} {'decode tok/s':>12} "
          f"{'ms/step':>8} {'%roof':>6} {'load s':>6} {'peak GB':>7}")
    for batch in args.batch:
        row = run_batch(engine, batch, args, copy_gbs)
        print(f"{row['model']:>16} {row['dtype']:>8} {batch:5d} {row['prefill_tok_s']:13.0f} {row['ttft_ms']:8.2f} "
              f"{row['decode_tok_s']:12.1f} {row['ms_per_step']:8.3f} {row['pct_roofline']:6.1f} {row['load_s']:6.2f} "
              f"{row['peak_gb']:7.2f}", flush=True)
        append_json(args.json, row)
        if args.profile:
            context = args.prompt_len + args.gen_len // 2
            print(f"## a decode step at batch {batch}, context {context}")
            print_breakdown(profile_decode(engine, batch, context), row["ms_per_step"])


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="HF folder, hub id or .gguf (default: the default model)")
    p.add_argument("--shape", choices=sorted(shapes.SHAPES), help="random weights of this model's shape")
    p.add_argument("--batch", type=sizes, default=[1, 16, 64], help="comma-separated batch sizes (default: 1,16,64)")
    p.add_argument("--prompt-len", type=int_range(1), default=128)
    p.add_argument("--gen-len", type=int_range(2), default=128,
                   help="at least 2: a decode step after the prefill's token")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], help="default: the engine's (bfloat16)")
    p.add_argument("--backend", choices=["auto", "cuda", "ref"], default="auto")
    p.add_argument("--dequantize", action="store_true", help="expand a GGUF's quantized matrices at load")
    p.add_argument("--reps", type=int_range(1), default=3)
    p.add_argument("--json", help="append one JSON line per batch size to this file")
    p.add_argument("--profile", action="store_true", help="also print a decode step's kernels for each batch size")
    args = p.parse_args(argv)
    if args.shape and args.checkpoint:
        p.error("give a CHECKPOINT or --shape, not both")
    return run_cli(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
