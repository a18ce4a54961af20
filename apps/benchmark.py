"""Time a kernel against its reference, on the GPU.

    python apps/benchmark.py --kernel rmsnorm --which both [--dtype bfloat16] [--shape 16384,4096] [--json out.json]

One row per shape: ref µs, minfer µs, speedup, and minfer's GB/s (% of the copy bandwidth measured
in this run) or TFLOP/s. Cases live in apps/bench/<family>.py.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import attention  # noqa: E402
from bench.common import MIN_CALLS, Case, copy_bandwidth_gbs, input_sets, time_many  # noqa: E402
from minfer.engine_args import DEFAULT_PAGE_SIZE  # noqa: E402

FAMILIES = ("memory", "gemm", "attention", "qgemm")


def all_cases() -> dict[str, Case]:
    cases = {}
    for family in FAMILIES:
        try:
            mod = importlib.import_module(f"bench.{family}")
        except ModuleNotFoundError as e:
            if e.name != f"bench.{family}":
                raise
            continue
        cases.update(mod.CASES)
    return cases


def parse_shape(text: str) -> tuple:
    return tuple(int(x) for x in text.split(","))


def main(argv=None) -> int:
    cases = all_cases()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", required=True, choices=sorted(cases) + ["all"])
    p.add_argument("--which", choices=["ref", "minfer", "both"], default="both")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--shape", action="append", type=parse_shape, help="comma-separated; repeatable")
    p.add_argument("--path", help="time one kernel path by itself (e.g. wmma, sm80, sm90, gemv)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--min-calls", type=int, default=MIN_CALLS,
                   help="fewest calls per graph replay, cycling the input sets (1: each set once per replay)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--host-latency", action="store_true",
                   help="leave the host's launch latency inside the timed region (no GPU hold before it)")
    p.add_argument("--block-size", "--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                   help=f"keys a KV page in the paged attention cases (default {DEFAULT_PAGE_SIZE}, the engine's)")
    args = p.parse_args(argv)
    if args.block_size < 1:
        p.error(f"--block-size must be positive, got {args.block_size}")
    attention.PAGE = args.block_size
    if not torch.cuda.is_available():
        print("benchmark: needs a CUDA GPU", file=sys.stderr)
        return 2

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copy_gbs = copy_bandwidth_gbs()
    print(f"# {torch.cuda.get_device_name(0)} | copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    hold = not args.host_latency
    names = sorted(cases) if args.kernel == "all" else [args.kernel]
    rows = []
    for name in names:
        case = cases[name]
        dtypes = [getattr(torch, args.dtype)] if args.dtype else list(case.dtypes)
        mine = case.paths[args.path] if args.path else case.minfer
        if args.path and args.path not in case.paths:
            print(f"{name}: no path {args.path!r} (has {', '.join(case.paths) or 'none'})", file=sys.stderr)
            return 2
        flags = (f" --path {args.path}" if args.path else "") + (" --host-latency" if args.host_latency else "") + \
            (f" --min-calls {args.min_calls}" if args.min_calls != MIN_CALLS else "") + \
            (f" --block-size {args.block_size}" if args.block_size != DEFAULT_PAGE_SIZE else "")
        print(f"\n## {name}{flags}  ({case.shape_names})")
        print(f"{'dtype':>9} {'shape':>22} {'ref us':>10} {'minfer us':>10} {'speedup':>8} {'GB/s':>8} "
              f"{'%copy':>6} {'TFLOP/s':>8} {'%ref':>6}")
        for dtype in dtypes:
            for shape in args.shape or case.shapes:
                sets = input_sets(case, shape, dtype, l2)
                # both: ref and minfer take turns rep by rep (time_many), so neither gets the cooler GPU.
                fns = {"ref": [case.ref], "minfer": [mine], "both": [case.ref, mine]}[args.which]
                us = time_many(fns, sets, args.reps, hold=hold, min_calls=args.min_calls)
                ref_us = us[0] if args.which != "minfer" else float("nan")
                our_us = us[-1] if args.which != "ref" else float("nan")
                best = our_us if args.which != "ref" else ref_us
                gbs = case.bytes(shape, dtype) / (best * 1e-6) / 1e9
                tflops = case.flops(shape) / (best * 1e-6) / 1e12 if case.flops else float("nan")
                row = dict(kernel=name, path=args.path or "auto", dtype=str(dtype).replace("torch.", ""),
                           shape=list(shape), ref_us=ref_us, minfer_us=our_us, speedup=ref_us / our_us,
                           gbs=gbs, pct_copy=100 * gbs / copy_gbs, tflops=tflops, pct_ref=100 * ref_us / our_us,
                           copy_gbs=copy_gbs)
                rows.append(row)
                print(f"{row['dtype']:>9} {'x'.join(map(str, shape)):>22} {ref_us:10.2f} {our_us:10.2f} "
                      f"{row['speedup']:8.2f} {gbs:8.0f} {row['pct_copy']:6.1f} {tflops:8.1f} {row['pct_ref']:6.1f}",
                      flush=True)
                del sets
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
